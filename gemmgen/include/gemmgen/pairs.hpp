// gemmgen: epilogues over adjacent column pairs (gemmgen.pairs, gemmgen.interleave; docs/design/pairs.md).
//
// Each thread of a WGMMA accumulator holds its rows' columns in adjacent pairs (2c, 2c+1), and the
// epilogue visits them in fragments of an even size that start at an even column: the fragment's
// elements 2i and 2i+1 are a pair (the host oracle checks it for every thread of each kernel,
// gemmgen.testing.oracle). A value of N/2 columns (a pair's half) is held in both registers of
// its pair, so every elementwise functor applies unchanged; what sees the pairing is here:
//   PairEven, PairOdd, Interleave,  fragment functors for Sm90Compute (ir.Op.PAIR_EVEN, ...),
//   InterleaveConst, PairSumMask    in pair_functors.hpp
//   PairLoad, PairStore             an N/2-column tensor read or written from the registers,
//                                   element (m, c) at column pair c, as Sm90AuxLoad/Store<0> do
//                                   for a full-width one (no shared memory, no TMA);
//   DoubleLoad, DoubleStore         a 2N-column tensor's even or odd half read, or written from
//                                   two full-width values (a backward GEMM's, of a recipe over pairs).
// Each takes its element as `Element` (one tensor, its batches a stride apart) or, in a grouped
// kernel, as `Element*`: an array of per-group pointers, CUTLASS's form for its broadcasts
// (Sm90RowBroadcast<..., Element*>), each at its group's first row.
#pragma once

#include <cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp>

#include <gemmgen/no_load_node.hpp>
#include <gemmgen/pair_functors.hpp>

namespace gemmgen::epi {

namespace detail {

namespace fusion = cutlass::epilogue::fusion;

// Where accumulator element (m, n) of batch l finds its element of a tensor of another width:
// its pair's, at column n / 2, of an N/2-column tensor...
struct HalfColumns {
  template <class StrideMNL>
  static CUTLASS_DEVICE int64_t at(StrideMNL const& stride, int m, int n, int l) {
    return int64_t(m) * cute::get<0>(stride) + int64_t(n / 2) + int64_t(l) * cute::get<2>(stride);
  }
};

// ... and its pair's even (Parity 0) or odd one, at column 2n + Parity, of a 2N-column tensor.
template <int Parity>
struct DoubleColumns {
  template <class StrideMNL>
  static CUTLASS_DEVICE int64_t at(StrideMNL const& stride, int m, int n, int l) {
    return int64_t(m) * cute::get<0>(stride) + 2 * int64_t(n) + Parity + int64_t(l) * cute::get<2>(stride);
  }
};

// A register visitor's tensor (N/2 or 2N columns): rows `dHalf`'s M stride apart, batches its L
// stride, columns contiguous.
template <class Pointer, class StrideMNL>
struct HalfTensor {
  Pointer ptr = nullptr;
  StrideMNL dHalf = {};
};

// Where a visitor's tensor is: one tensor, batch l at l times the batch stride...
template <class ElementOrPointer>
struct TensorOf {
  using Element = ElementOrPointer;
  template <class StrideMNL>
  using Loaded = HalfTensor<Element const*, StrideMNL>;
  template <class StrideMNL>
  using Stored = HalfTensor<Element*, StrideMNL>;

  template <class Columns, class P, class StrideMNL>
  static CUTLASS_DEVICE auto& at(P ptr, StrideMNL const& stride, int m, int n, int l) {
    return ptr[Columns::at(stride, m, n, l)];
  }
};

// ... or a grouped kernel's group l, from its own pointer (its rows counted from the group's first).
template <class Element_>
struct TensorOf<Element_*> {
  using Element = Element_;
  template <class StrideMNL>
  using Loaded = HalfTensor<Element const* const*, StrideMNL>;
  template <class StrideMNL>
  using Stored = HalfTensor<Element* const*, StrideMNL>;

  template <class Columns, class P, class StrideMNL>
  static CUTLASS_DEVICE auto& at(P ptrs, StrideMNL const& stride, int m, int n, int l) {
    return ptrs[l][Columns::at(stride, m, n, 0)];
  }
};

// Whether a register's (m, n, l) is in the problem: its row and column. Its l is a batch the
// problem has, or in a grouped kernel the group, whose problem shape has an L of 1.
template <class Coord, class ShapeMNL>
CUTLASS_DEVICE bool inside(Coord const& c, ShapeMNL const& shape) {
  return cute::get<0>(c) < cute::get<0>(shape) && cute::get<1>(c) < cute::get<1>(shape);
}

// (M, N, L): what a register's (m, n, l) must lie within.
template <class Args>
CUTLASS_DEVICE auto problem_shape(Args const& args) {
  auto [M, N, K, L] = args.problem_shape_mnkl;
  return cute::make_shape(M, N, L);
}

// The coordinates of the epilogue's registers, partitioned as the visitors' registers are.
template <bool ReferenceSrc, class Args>
CUTLASS_DEVICE auto register_coordinates(Args const& args) {
  return fusion::sm90_partition_for_epilogue<ReferenceSrc>(cute::make_identity_tensor(problem_shape(args)),
                                                           args.tile_shape_mnk, args.tile_coord_mnkl, args.epi_tile,
                                                           args.tiled_copy, args.thread_idx);
}

// One register of `Element` per epilogue register of a subtile (CPY, CPY_M, CPY_N).
template <class Element, class Coordinates>
CUTLASS_DEVICE auto registers(Coordinates const& coords) {
  return cute::make_tensor<Element>(cute::take<0, 3>(cute::shape(coords)));
}

// A visitor that loads nothing and keeps its Params' address for its consumer callbacks: the host
// side and load phase of every such node (NoLoadNode), an empty shared storage.
template <class Arguments_>
struct RegisterNode : NoLoadNode<Arguments_> {
  using typename NoLoadNode<Arguments_>::Params;
  struct SharedStorage {};

  CUTLASS_HOST_DEVICE RegisterNode() {}
  CUTLASS_HOST_DEVICE RegisterNode(Params const& params, SharedStorage const&) : params_ptr(&params) {}

  Params const* params_ptr = nullptr;
};

}  // namespace detail

// Reads a tensor of another width into the registers: element Columns::at of each accumulator
// element's coordinates (0 outside the problem).
template <class ElementOrPointer, class StrideMNL, class Columns>
struct RegisterLoad : detail::RegisterNode<typename detail::TensorOf<ElementOrPointer>::template Loaded<StrideMNL>> {
  using Storage = detail::TensorOf<ElementOrPointer>;
  using Element = typename Storage::Element;
  using Base = detail::RegisterNode<typename Storage::template Loaded<StrideMNL>>;
  using Base::Base;
  using typename Base::Params;

  template <class CTensor, class RTensor, class ShapeMNL>
  struct ConsumerStoreCallbacks : detail::fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CTensor coords, RTensor regs, ShapeMNL shape, Params const* params)
        : coords(coords), regs(regs), shape(shape), params(params) {}

    CTensor coords;  // (CPY, CPY_M, CPY_N, EPI_M, EPI_N): each register's (m, n, l)
    RTensor regs;    // (CPY, CPY_M, CPY_N)
    ShapeMNL shape;
    Params const* params;

    CUTLASS_DEVICE void begin_loop(int epi_m, int epi_n) {
      auto here = coords(cute::_, cute::_, cute::_, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < cute::size(regs); ++i) {
        auto c = here(i);
        regs(i) = detail::inside(c, shape) ? Storage::template at<Columns>(params->ptr, params->dHalf, cute::get<0>(c),
                                                                         cute::get<1>(c), cute::get<2>(c))
                                           : Element(0);
      }
    }

    template <class ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<Element, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int, int) {
      return cute::recast<cutlass::Array<Element, FragmentSize>>(regs)(epi_v);
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(detail::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    auto coords = detail::register_coordinates<ReferenceSrc>(args);
    auto regs = detail::registers<Element>(coords);
    auto shape = detail::problem_shape(args);
    return ConsumerStoreCallbacks<decltype(coords), decltype(regs), decltype(shape)>(coords, regs, shape,
                                                                                     this->params_ptr);
  }
};

// An N/2-column tensor read into both registers of each pair.
template <class ElementOrPointer, class StrideMNL>
using PairLoad = RegisterLoad<ElementOrPointer, StrideMNL, detail::HalfColumns>;

// One half (Parity 0: even columns, 1: odd) of a 2N-column tensor, element (m, 2n + Parity) for
// accumulator element (m, n): a backward GEMM's saved accumulator of a recipe over pairs.
template <class ElementOrPointer, class StrideMNL, int Parity>
using DoubleLoad = RegisterLoad<ElementOrPointer, StrideMNL, detail::DoubleColumns<Parity>>;

// Writes an N/2-column tensor: each pair's value, from its even register. `ElementAux` names the
// element for a collective whose D is this node's (CUTLASS's void ElementD).
template <class ElementOrPointer, class StrideMNL>
struct PairStore : detail::RegisterNode<typename detail::TensorOf<ElementOrPointer>::template Stored<StrideMNL>> {
  using Storage = detail::TensorOf<ElementOrPointer>;
  using Element = typename Storage::Element;
  using Base = detail::RegisterNode<typename Storage::template Stored<StrideMNL>>;
  using Base::Base;
  using typename Base::Params;
  using ElementAux = Element;

  template <class CTensor, class RTensor, class ShapeMNL>
  struct ConsumerStoreCallbacks : detail::fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CTensor coords, RTensor regs, ShapeMNL shape, Params const* params)
        : coords(coords), regs(regs), shape(shape), params(params) {}

    CTensor coords;
    RTensor regs;
    ShapeMNL shape;
    Params const* params;

    template <class ElementAccumulator, class ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementInput, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int, int,
        cutlass::Array<ElementInput, FragmentSize> const& input) {
      using Convert = cutlass::NumericArrayConverter<Element, ElementInput, FragmentSize,
                                                     cutlass::FloatRoundStyle::round_to_nearest>;
      cute::recast<cutlass::Array<Element, FragmentSize>>(regs)(epi_v) = Convert{}(input);
      return input;
    }

    CUTLASS_DEVICE void end_loop(int epi_m, int epi_n) {
      auto here = coords(cute::_, cute::_, cute::_, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < cute::size(regs); ++i) {
        auto c = here(i);
        if (cute::get<1>(c) % 2 == 0 && detail::inside(c, shape)) {
          Storage::template at<detail::HalfColumns>(params->ptr, params->dHalf, cute::get<0>(c), cute::get<1>(c),
                                                   cute::get<2>(c)) = regs(i);
        }
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(detail::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    auto coords = detail::register_coordinates<ReferenceSrc>(args);
    auto regs = detail::registers<Element>(coords);
    auto shape = detail::problem_shape(args);
    return ConsumerStoreCallbacks<decltype(coords), decltype(regs), decltype(shape)>(coords, regs, shape,
                                                                                     this->params_ptr);
  }
};

// Writes a 2N-column tensor from two full-width values: the first at (m, 2n), the second at
// (m, 2n + 1) (an interleave of them: a backward GEMM's dL/dacc of a recipe over pairs).
template <class ElementOrPointer, class StrideMNL>
struct DoubleStore : detail::RegisterNode<typename detail::TensorOf<ElementOrPointer>::template Stored<StrideMNL>> {
  using Storage = detail::TensorOf<ElementOrPointer>;
  using Element = typename Storage::Element;
  using Base = detail::RegisterNode<typename Storage::template Stored<StrideMNL>>;
  using Base::Base;
  using typename Base::Params;
  using ElementAux = Element;

  template <class CTensor, class RTensor, class ShapeMNL>
  struct ConsumerStoreCallbacks : detail::fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CTensor coords, RTensor even, RTensor odd, ShapeMNL shape,
                                          Params const* params)
        : coords(coords), even(even), odd(odd), shape(shape), params(params) {}

    CTensor coords;
    RTensor even;
    RTensor odd;
    ShapeMNL shape;
    Params const* params;

    template <class ElementAccumulator, class ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementInput, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int, int,
        cutlass::Array<ElementInput, FragmentSize> const& first,
        cutlass::Array<ElementInput, FragmentSize> const& second) {
      using Convert = cutlass::NumericArrayConverter<Element, ElementInput, FragmentSize,
                                                     cutlass::FloatRoundStyle::round_to_nearest>;
      cute::recast<cutlass::Array<Element, FragmentSize>>(even)(epi_v) = Convert{}(first);
      cute::recast<cutlass::Array<Element, FragmentSize>>(odd)(epi_v) = Convert{}(second);
      return first;
    }

    CUTLASS_DEVICE void end_loop(int epi_m, int epi_n) {
      auto here = coords(cute::_, cute::_, cute::_, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < cute::size(even); ++i) {
        auto c = here(i);
        if (detail::inside(c, shape)) {
          auto* pair = &Storage::template at<detail::DoubleColumns<0>>(params->ptr, params->dHalf, cute::get<0>(c),
                                                                      cute::get<1>(c), cute::get<2>(c));
          pair[0] = even(i);
          pair[1] = odd(i);
        }
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(detail::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    auto coords = detail::register_coordinates<ReferenceSrc>(args);
    auto even = detail::registers<Element>(coords);
    auto odd = detail::registers<Element>(coords);
    auto shape = detail::problem_shape(args);
    return ConsumerStoreCallbacks<decltype(coords), decltype(even), decltype(shape)>(coords, even, odd, shape,
                                                                                     this->params_ptr);
  }
};

// The collective of a kernel whose D is N/2 or 2N wide stores no D of its own (void ElementD):
// the fusion callbacks name D's element as the PairStore or DoubleStore that writes it does.
template <class Element, class Callbacks>
struct WithElementAux : Callbacks {
  using Callbacks::Callbacks;
  using ElementAux = Element;
};

#if !defined(__CUDACC_RTC__)
// The premise above, checked on the host for one kernel's epilogue (the nvcc oracle runs it):
// every thread's epilogue registers, in the order the visitors index them per subtile, come in
// pairs (m, 2c), (m, 2c + 1), each fragment holds whole pairs, and the threads together cover the
// CTA tile exactly once. The partition is the one the collective hands its visitors
// (ConsumerStoreArgs::tiled_copy, sm90_partition_for_epilogue).
struct PairsProbe {
  long long pairs = 0;      // register pairs checked
  long long broken = 0;     // pairs that are not two adjacent columns of a row, from an even one
  long long uncovered = 0;  // tile elements held by no thread, or by more than one
};

namespace detail {

// The premise over one partition: `coords_of(t)` is thread t's registers' (m, n), (CPY, CPY_M,
// CPY_N, EPI_M, EPI_N) over the Rows x Cols tile divided into epilogue tiles, in the order the
// visitors index them per subtile; `threads` the partition's threads.
template <int Rows, int Cols, int Fragment, class CoordsOf>
PairsProbe probe_partition(int threads, CoordsOf const& coords_of) {
  using namespace cute;
  static int held[Rows * Cols];
  for (int& h : held) h = 0;
  PairsProbe out;
  for (int t = 0; t < threads; ++t) {
    auto coords = coords_of(t);
    for (int em = 0; em < int(size<3>(coords)); ++em) {
      for (int en = 0; en < int(size<4>(coords)); ++en) {
        auto here = coords(_, _, _, em, en);
        int n = int(size(here));
        out.broken += (Fragment % 2 != 0 || n % Fragment != 0) ? 1 : 0;
        for (int i = 0; i + 1 < n; i += 2) {
          auto c0 = here(i);
          auto c1 = here(i + 1);
          ++out.pairs;
          bool pair = get<0>(c0) == get<0>(c1) && get<1>(c0) % 2 == 0 && get<1>(c1) == get<1>(c0) + 1;
          out.broken += pair ? 0 : 1;
        }
        for (int i = 0; i < n; ++i) {
          ++held[get<0>(here(i)) * Cols + get<1>(here(i))];
        }
      }
    }
  }
  for (int h : held) out.uncovered += h == 1 ? 0 : 1;
  return out;
}

}  // namespace detail

template <class CollectiveEpilogue, class TiledMma, class SmemElementD>
PairsProbe probe_pairs() {
  using namespace cute;
  using Tile = typename CollectiveEpilogue::CtaTileMNK;
  constexpr int kRows = size<0>(Tile{});
  constexpr int kCols = size<1>(Tile{});
  TiledMma mma;
  auto copy_c = make_tiled_copy_C_atom(typename CollectiveEpilogue::CopyAtomC{}, mma);
  auto partition = make_tiled_copy_S(Copy_Atom<typename CollectiveEpilogue::CopyOpR2S, SmemElementD>{}, copy_c);
  auto tile = flat_divide(make_identity_tensor(make_shape(Int<kRows>{}, Int<kCols>{})),
                          typename CollectiveEpilogue::EpilogueTile{});
  return detail::probe_partition<kRows, kCols, CollectiveEpilogue::DispatchPolicy::FragmentSize>(
      int(size(mma)), [&](int t) { return partition.get_thread_slice(t).partition_S(tile); });
}

// The same for an sm100 kernel, whose collective hands its visitors the partition of its
// tensor-memory load (ConsumerStoreArgs::tiled_copy: the T2R copy of the CTA's accumulator divided
// into epilogue tiles), built here as CollectiveEpilogue::store builds it.
template <class GemmKernel>
PairsProbe probe_pairs_sm100() {
  using namespace cute;
  using Mainloop = typename GemmKernel::CollectiveMainloop;
  using Epilogue = typename GemmKernel::CollectiveEpilogue;
  using EpilogueTile = typename Epilogue::EpilogueTile;
  typename Mainloop::TiledMma mma;
  auto accumulators = Mainloop::TiledMma::make_fragment_C(
      partition_shape_C(mma, take<0, 2>(typename Mainloop::TileShape{})));  // ((CTA_M, CTA_N), 1, 1)
  // layouts only: host g++ cannot inline tensor-memory pointer arithmetic (cute::rotl and rotr)
  auto acc = accumulators.layout()(make_coord(_, _), _0{}, _0{});  // (CTA_M, CTA_N)
  auto first_subtile = flat_divide(acc, EpilogueTile{})(_, _, _0{}, _0{});
  auto t2r = make_tmem_copy(typename Epilogue::CopyOpT2R{}, make_tensor(accumulators.data(), first_subtile));
  constexpr int kRows = size<0>(decltype(acc){});
  constexpr int kCols = size<1>(decltype(acc){});
  auto tile = flat_divide(make_identity_tensor(make_shape(Int<kRows>{}, Int<kCols>{})), EpilogueTile{});
  return detail::probe_partition<kRows, kCols, Epilogue::DispatchPolicy::FragmentSize>(
      int(size(t2r)), [&](int t) { return t2r.get_slice(t).partition_D(tile); });
}
#endif

}  // namespace gemmgen::epi
