// gemmgen: D computed per block of columns of each row (gemmgen.quantize, gemmgen.rms_norm,
// gemmgen.exp_minus_max).
//
// The root of an epilogue tree. Each block of `Block` columns of a row reduces a statistic of its
// values (or of a second input's: an RMSNorm's x where D's value is x times a weight), the
// block's factor follows from it, each of D's values in the block is rewritten with the factor,
// and the factor is written to an (M, N / Block, L) tensor at any strides where the pointer is
// not null: one fp32 per row and block, as gemmgen.ir.reference computes them. The policies:
//   QuantizeBlock<Qmax, PowerOfTwo> (quantize_block.hpp): max |x| (NaN propagated) -> scale =
//     max / Qmax, 1 where it is not above 0, rounded up to a power of two with PowerOfTwo;
//     D = v / scale (then converted to D's fp8 type)
//   RmsNormBlock<Block, Eps>: sum of x^2 -> rstd = rsqrt(sum / count + Eps) over the block's count
//     of columns inside the problem (Block but in a partial last block); D = v * rstd
//   ExpMinusMaxBlock<Scale>: max x (NaN propagated), the factor itself; D = exp(Scale * (v - max))
// Elements outside the problem do not enter a statistic. Where a block's values live differs by arch:
//   Sm90RowBlocks: CUTLASS's sm90 collective calls a root's reduce() once per epilogue subtile,
//     after every visit and before converting the results to D (its Sm90TopKSoftmaxColReduction
//     works so too), so a block must lie in one subtile: the kernel spells out an EpilogueTile whose
//     N holds whole blocks. In the WGMMA accumulator a row's 8-column atom is held by the 4 lanes of
//     a quad, 2 columns each, so a block's statistic is the thread's over its registers of the
//     block, then the quad's (shuffle-xor 1 and 2).
//   Sm100RowBlocks: the sm100 collective converts the root's values to D before its reduce(), so the
//     node does its work in visit(), and gives D's type itself. Its FragmentSize is all of a
//     thread's values of the subtile, and tensor memory's 32-lane loads (a CTA tile of 128 rows over
//     4 x 1 warps) give a thread one row: its fragment is whole blocks of its row, starting at a
//     block boundary (the kernel's EpilogueTile N is a multiple of the block). No lane exchanges.
#pragma once

#include <cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp>

#include <gemmgen/epilogue.hpp>
#include <gemmgen/no_load_node.hpp>
#include <gemmgen/quantize_block.hpp>

namespace gemmgen::epi {

template <int Block, uint32_t EpsBits>
struct RmsNormBlock {
  CUTLASS_DEVICE static float identity() { return 0.f; }
  CUTLASS_DEVICE static float element(float x) { return x * x; }
  CUTLASS_DEVICE static float combine(float a, float b) { return a + b; }
  CUTLASS_DEVICE static float factor(float sum, int count) { return rsqrtf(sum / count + from_bits(EpsBits)); }
  CUTLASS_DEVICE static float apply(float v, float rstd) { return v * rstd; }
};

template <uint32_t ScaleBits>
struct ExpMinusMaxBlock {
  CUTLASS_DEVICE static float identity() { return -cutlass::platform::numeric_limits<float>::infinity(); }
  CUTLASS_DEVICE static float element(float x) { return x; }
  CUTLASS_DEVICE static float combine(float a, float b) { return Max{}(a, b); }
  CUTLASS_DEVICE static float factor(float max, int) { return max; }
  CUTLASS_DEVICE static float apply(float v, float max) { return expf(from_bits(ScaleBits) * (v - max)); }
};

// Where the factors go, if anywhere.
struct RowBlocksArguments {
  using StrideFactor = cute::Stride<int64_t, int64_t, int64_t>;  // (M, N / Block, L): any layout

  float* ptr_factor = nullptr;  // null: the factors are not written
  StrideFactor dFactor = {};
};

// The node's host side and Params, the same on both arches.
struct RowBlocksParams : NoLoadNode<RowBlocksArguments> {
  struct SharedStorage {};

  CUTLASS_HOST_DEVICE RowBlocksParams() {}
  CUTLASS_HOST_DEVICE RowBlocksParams(Params const& params, SharedStorage const&) : params(params) {}
  Params params;

  // this tile's factors: its rows, its blocks of columns
  template <int Block, class ProblemShape, class TileCoord, class TileShape>
  CUTLASS_DEVICE auto tile_factors(ProblemShape const& problem_shape_mnkl, TileCoord const& tile_coord_mnkl,
                                   TileShape const& tile_shape_mnk) const {
    using namespace cute;
    auto [M, N, K, L] = problem_shape_mnkl;
    auto [m, n, k, l] = tile_coord_mnkl;
    auto [tile_M, tile_N, tile_K] = tile_shape_mnk;
    Tensor mFactor_mnl = make_tensor(make_gmem_ptr(params.ptr_factor),
                                     make_shape(M, ceil_div(N, Block), L), params.dFactor);
    return local_tile(mFactor_mnl(_, _, l), make_shape(tile_M, tile_N / Int<Block>{}), make_coord(m, n));
  }
};

// Both arches' nodes: the host side, and an epilogue subtile of whole blocks in a tile of whole subtiles.
template <int Block, class CtaTileShapeMNK, class EpilogueTile>
struct RowBlocksNode : RowBlocksParams {
  static_assert(cute::size<1>(EpilogueTile{}) % Block == 0, "the epilogue subtile must hold whole blocks");
  static_assert(cute::size<1>(CtaTileShapeMNK{}) % cute::size<1>(EpilogueTile{}) == 0, "whole subtiles per tile");
  using RowBlocksParams::RowBlocksParams;
};

// Both arches' callbacks: their state, and the visit of D's value alone, whose own statistic the
// block takes (each arch's Callbacks visit D's value and the value the statistic is of).
template <class Callbacks, class ArgsTuple, int FragmentSize>
struct RowBlocksCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
  CUTLASS_DEVICE RowBlocksCallbacks(ArgsTuple&& args_tuple, RowBlocksParams::Params const& params)
      : args_tuple(cute::forward<ArgsTuple>(args_tuple)), params(params) {}
  ArgsTuple args_tuple;
  RowBlocksParams::Params const& params;

  template <class ElementAccumulator, class ElementValue>
  CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const& frg_acc, int epi_v, int epi_m,
                            int epi_n, cutlass::Array<ElementValue, FragmentSize> const& frg_value) {
    return static_cast<Callbacks*>(this)->visit(frg_acc, epi_v, epi_m, epi_n, frg_value, frg_value);
  }
};

template <class Policy, int Block, int FragmentSize, class CtaTileShapeMNK, class EpilogueTile>
struct Sm90RowBlocks : RowBlocksNode<Block, CtaTileShapeMNK, EpilogueTile> {
  static_assert(Block % 8 == 0, "a block spans whole 8-column MMA atoms");
  using Node = RowBlocksNode<Block, CtaTileShapeMNK, EpilogueTile>;
  using Node::Node;
  using Node::params;

  template <class ArgsTuple>
  struct ConsumerStoreCallbacks : RowBlocksCallbacks<ConsumerStoreCallbacks<ArgsTuple>, ArgsTuple, FragmentSize> {
    using Base = RowBlocksCallbacks<ConsumerStoreCallbacks<ArgsTuple>, ArgsTuple, FragmentSize>;
    using Base::Base;
    using Base::visit;

    // D's value, and the value the block's statistic is of
    template <class ElementAccumulator, class ElementValue, class ElementStat>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n,
                              cutlass::Array<ElementValue, FragmentSize> const& frg_value,
                              cutlass::Array<ElementStat, FragmentSize> const& frg_stat) {
      using namespace cute;
      auto& [tCrStat, tCcD, residue_tCcD, base, mFactor] = this->args_tuple;
      Tensor tCcD_mn = tCcD(_, _, _, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        if (elem_less(tCcD_mn(epi_v * FragmentSize + i), residue_tCcD)) {
          float& stat = tCrStat(epi_v * FragmentSize + i);
          stat = Policy::combine(stat, Policy::element(static_cast<float>(frg_stat[i])));
        }
      }
      return cutlass::NumericArrayConverter<float, ElementValue, FragmentSize>{}(frg_value);
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int epi_m, int epi_n, bool, VTensor visit_results) {
      using namespace cute;
      auto& [tCrStat, tCcD, residue_tCcD, base, mFactor] = this->args_tuple;
      Tensor tCcD_mn = tCcD(_, _, _, epi_m, epi_n);
      auto tCrStat_f = filter(tCrStat);  // one register per (row, block) the thread holds
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tCrStat_f); ++i) {  // the 4 lanes of a row hold its column pairs
        float v = tCrStat_f(i);
        v = Policy::combine(v, __shfl_xor_sync(0xFFFFFFFF, v, 1));
        v = Policy::combine(v, __shfl_xor_sync(0xFFFFFFFF, v, 2));
        tCrStat_f(i) = v;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int epi_v = 0; epi_v < size(visit_results); ++epi_v) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < FragmentSize; ++i) {
          int idx = epi_v * FragmentSize + i;
          auto coord = tCcD_mn(idx);  // from the thread's first element
          int row = get<0>(base) + get<0>(coord), col = get<1>(base) + get<1>(coord);  // in the CTA tile
          int count = cute::min(Block, get<1>(base) + get<1>(residue_tCcD) - (col - col % Block));  // in bounds
          float factor = Policy::factor(tCrStat(idx), count);
          visit_results(epi_v)[i] = Policy::apply(visit_results(epi_v)[i], factor);
          if (this->params.ptr_factor != nullptr && col % Block == 0 && elem_less(coord, residue_tCcD)) {
            mFactor(row, col / Block) = factor;  // by the element at each block's first column
          }
        }
      }
      fill(tCrStat, Policy::identity());
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    auto [tile_M, tile_N, tile_K] = args.tile_shape_mnk;
    // (CTA_M, CTA_N) -> one value per row and block of columns, partitioned as the accumulator
    auto gBlock = make_tensor<float>(make_layout(
        make_shape(tile_M, make_shape(Int<Block>{}, tile_N / Int<Block>{})),
        make_stride(_1{}, make_stride(_0{}, tile_M))));
    auto thr_mma = args.tiled_mma.get_thread_slice(args.thread_idx);
    auto tCrBlock = make_tensor_like<float>(thr_mma.partition_C(gBlock).layout());
    ThrCopy thread_r2s = args.tiled_copy.get_slice(args.thread_idx);
    Tensor tRS_rBlock = thread_r2s.retile_S(tCrBlock);
    auto layout = take<0, 3>(tRS_rBlock.layout()).compose(args.tCrC.layout());
    Tensor tCrStat = make_tensor<float>(layout);
    fill(tCrStat, Policy::identity());
    Tensor mFactor = this->template tile_factors<Block>(args.problem_shape_mnkl, args.tile_coord_mnkl,
                                                        args.tile_shape_mnk);
    auto base = args.residue_cD - args.residue_tCcD;  // the thread's first element in the CTA tile
    auto args_tuple = make_tuple(cute::move(tCrStat), args.tCcD, args.residue_tCcD, base, mFactor);
    return ConsumerStoreCallbacks<decltype(args_tuple)>(cute::move(args_tuple), params);
  }
};

template <class Policy, int Block, int FragmentSize, class ElementOutput, class CtaTileShapeMNK, class EpilogueTile>
struct Sm100RowBlocks : RowBlocksNode<Block, CtaTileShapeMNK, EpilogueTile> {
  static constexpr int Blocks = FragmentSize / Block;  // of a thread's row, per visit
  static_assert(FragmentSize % Block == 0, "a thread's fragment holds whole blocks of its row");
  using Node = RowBlocksNode<Block, CtaTileShapeMNK, EpilogueTile>;
  using Node::Node;
  using Node::params;

  template <class ArgsTuple>
  struct ConsumerStoreCallbacks : RowBlocksCallbacks<ConsumerStoreCallbacks<ArgsTuple>, ArgsTuple, FragmentSize> {
    using Base = RowBlocksCallbacks<ConsumerStoreCallbacks<ArgsTuple>, ArgsTuple, FragmentSize>;
    using Base::Base;
    using Base::visit;

    // D's value, and the value the block's statistic is of
    template <class ElementAccumulator, class ElementValue, class ElementStat>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n,
                              cutlass::Array<ElementValue, FragmentSize> const& frg_value,
                              cutlass::Array<ElementStat, FragmentSize> const& frg_stat) {
      using namespace cute;
      auto& [tCcD, residue_tCcD, base, mFactor] = this->args_tuple;
      Tensor tCcD_v = tCcD(_, _, _, epi_m, epi_n);
      int const first = epi_v * FragmentSize;
      int const first_col = get<1>(tCcD_v(first));  // a block boundary: the fragment's blocks follow it
      float stat[Blocks];
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < Blocks; ++b) {
        stat[b] = Policy::identity();
      }
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        auto coord = tCcD_v(first + i);
        if (elem_less(coord, residue_tCcD)) {
          float& s = stat[(get<1>(coord) - first_col) / Block];
          s = Policy::combine(s, Policy::element(static_cast<float>(frg_stat[i])));
        }
      }
      float factor[Blocks];
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < Blocks; ++b) {  // the block's columns inside the problem
        int count = cute::min(Block, get<1>(residue_tCcD) - (first_col + b * Block));
        factor[b] = Policy::factor(stat[b], count);
      }
      cutlass::Array<float, FragmentSize> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        auto coord = tCcD_v(first + i);
        int block = (get<1>(coord) - first_col) / Block;
        out[i] = Policy::apply(static_cast<float>(frg_value[i]), factor[block]);
        int col = get<1>(base) + get<1>(coord);  // in the CTA tile
        if (this->params.ptr_factor != nullptr && col % Block == 0 && elem_less(coord, residue_tCcD)) {
          mFactor(get<0>(base) + get<0>(coord), col / Block) = factor[block];  // by each block's first column
        }
      }
      return cutlass::NumericArrayConverter<ElementOutput, float, FragmentSize>{}(out);
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    Tensor mFactor = this->template tile_factors<Block>(args.problem_shape_mnkl, args.tile_coord_mnkl,
                                                        args.tile_shape_mnk);
    auto base = args.residue_cD - args.residue_tCcD;  // the thread's first element in the CTA tile
    auto args_tuple = make_tuple(args.tCcD, args.residue_tCcD, base, mFactor);
    return ConsumerStoreCallbacks<decltype(args_tuple)>(cute::move(args_tuple), params);
  }
};

// A row vector's broadcast (CUTLASS's Sm90RowBroadcast, whose tile of the vector is in shared
// memory) read where its values are used, not copied into registers before the accumulator's: in
// an sm_100a kernel with D's row blocks, where each thread holds a 128-column row of the subtile,
// the vector's row in registers beside the accumulator's spills. The same values, the same Params.
template <class RowBroadcast>
struct Sm100RowBroadcastInPlace : RowBroadcast {
  using RowBroadcast::RowBroadcast;

  template <class Callbacks>
  struct ConsumerStoreCallbacks : Callbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(Callbacks&& callbacks) : Callbacks(cute::move(callbacks)) {}

    CUTLASS_DEVICE void begin_loop(int, int) {}  // nothing copied to registers

    template <class ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n) {
      using namespace cute;
      using ElementCompute = typename decltype(this->tSR_rRow)::value_type;
      Tensor tSR_sRow_mn = this->tSR_sRow(_, _, _, epi_m, epi_n);  // indexed as the registers would be
      cutlass::Array<ElementCompute, FragmentSize> frg_row;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        frg_row[i] = static_cast<ElementCompute>(tSR_sRow_mn(epi_v * FragmentSize + i));
      }
      return frg_row;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    auto callbacks = RowBroadcast::template get_consumer_store_callbacks<ReferenceSrc>(args);
    return ConsumerStoreCallbacks<decltype(callbacks)>(cute::move(callbacks));
  }
};

}  // namespace gemmgen::epi
