// gemmgen: a reduction over the kernel's M (one value per column of D) that keeps its state out of
// local memory.
//
// CUTLASS's Sm90RowReduction holds each thread's values of every column of the CTA tile in
// registers until the tile's last epilogue subtile, indexed by the subtile the runtime loop is
// at: the compiler puts that array on the stack (480-688 bytes in most configs,
// docs/design/measurements.md). This node has its Arguments, Params and workspace (it derives from it:
// the same host code, the same partials and tile counters, the same final reduction), and differs
// in where the state lives while a tile's subtiles go by:
//   visit():  each thread reduces its values of each column of the subtile in registers (one per
//             column it holds, laid out as the accumulator with M broadcast, as CUTLASS's TopK
//             node lays out its per-row state);
//   reduce(): every subtile, the 8 lanes of a warp holding a column (lanes 4 apart in the WGMMA
//             accumulator) combine it with shuffle-xor 4, 8, 16, and lanes 0-3 fold it into their
//             warp's slot of the column in shared memory (one fp32, or one state, per warp and
//             column of the tile: each slot has one writer); at the last subtile the warps' slots
//             are combined in warp order into the tile's partial in the workspace, and the tile
//             counter elects the last tile of a column of tiles to finish, as in CUTLASS.
// Deterministic: every combination runs in a fixed order. sm_90a's WGMMA layout only: a thread
// holds the same columns in each of its rows of a subtile (each column once in its first row).
#pragma once

#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_store_tma_warpspecialized.hpp>

namespace gemmgen::epi {

// A 4- or 8-byte value from the lane `mask` away (an fp32, or a log-sum-exp state).
template <class T>
CUTLASS_DEVICE T shuffle_xor(T value, int mask) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "a shuffled value is one or two words");
  using Word = cute::conditional_t<sizeof(T) == 4, uint32_t, unsigned long long>;
  Word word = reinterpret_cast<Word const&>(value);
  word = __shfl_xor_sync(0xFFFFFFFF, word, mask);
  return reinterpret_cast<T const&>(word);
}

template <template <class> class RegReduceFn, template <class> class ShuffleReduceFn,
          template <class> class GmemReduceFn, class CtaTileShapeMNK, class EpilogueSchedule, class ElementOutput,
          class ElementCompute, cutlass::FloatRoundStyle RoundStyle, class StrideMNL>
struct Sm90RowReduction
    : cutlass::epilogue::fusion::Sm90RowReduction<RegReduceFn, ShuffleReduceFn, GmemReduceFn, 0, CtaTileShapeMNK,
                                                  ElementOutput, ElementCompute, RoundStyle, StrideMNL> {
  using Base = cutlass::epilogue::fusion::Sm90RowReduction<RegReduceFn, ShuffleReduceFn, GmemReduceFn, 0,
                                                           CtaTileShapeMNK, ElementOutput, ElementCompute,
                                                           RoundStyle, StrideMNL>;
  using typename Base::Arguments;
  using typename Base::Params;
  static_assert(!cutlass::is_atomic<GmemReduceFn<ElementCompute>>::value, "the workspace path, deterministic");

  // the consumer warps sharing an epilogue: two warpgroups (cooperative) or one (ping-pong)
  static constexpr int Warps =
      cutlass::epilogue::collective::detail::sm90_is_cooperative_v<EpilogueSchedule> ? 8 : 4;
  static constexpr int TileN = cute::size<1>(CtaTileShapeMNK{});

  struct SharedStorage {
    alignas(16) ElementCompute partials[Warps * TileN];  // [warp][column of the tile]
    int tile_count;  // the tile counter's value before this tile, for every thread to read
  };

  CUTLASS_HOST_DEVICE Sm90RowReduction() {}
  CUTLASS_HOST_DEVICE Sm90RowReduction(Params const& params, SharedStorage const& shared_storage)
      : Base(params, typename Base::SharedStorage{}), smem(const_cast<SharedStorage*>(&shared_storage)) {}
  SharedStorage* smem = nullptr;

  template <class ArgsTuple>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(ArgsTuple&& args_tuple, Params const& params, SharedStorage& smem)
        : args_tuple(cute::forward<ArgsTuple>(args_tuple)), params(params), smem(smem) {}
    ArgsTuple args_tuple;
    Params const& params;
    SharedStorage& smem;
    bool do_final_reduction = false;

    CUTLASS_DEVICE bool begin_sync_needed() const { return true; }

    CUTLASS_DEVICE void begin() {  // every slot to the identity; the collective syncs after begin()
      if (params.ptr_row == nullptr) {
        return;
      }
      int thread_idx = cute::get<8>(args_tuple);
      CUTLASS_PRAGMA_NO_UNROLL
      for (int i = thread_idx; i < Warps * TileN; i += Warps * cutlass::NumThreadsPerWarp) {
        smem.partials[i] = params.reduction_identity;
      }
    }

    template <class ElementAccumulator, class ElementInput, int FragmentSize>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n,
                              cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      using namespace cute;
      if (params.ptr_row == nullptr) {
        return frg_input;
      }
      auto& [tCrCol, tCcD, residue_tCcD, cD, residue_cD, base, gBuf_ml, gRow_l, thread_idx, tile] = args_tuple;
      Tensor tCcD_mn = tCcD(_, _, _, epi_m, epi_n);
      RegReduceFn<ElementCompute> reduce_input{};
      cutlass::NumericConverter<ElementCompute, ElementInput, RoundStyle> convert{};
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        if (elem_less(tCcD_mn(epi_v * FragmentSize + i), residue_tCcD)) {
          ElementCompute& state = tCrCol(epi_v * FragmentSize + i);
          state = reduce_input(state, convert(frg_input[i]));
        }
      }
      return frg_input;
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const& sync_fn, int epi_m, int epi_n, bool is_last_iteration,
                               VTensor) {
      using namespace cute;
      if (params.ptr_row == nullptr) {
        return;
      }
      auto& [tCrCol, tCcD, residue_tCcD, cD, residue_cD, base, gBuf_ml, gRow_l, thread_idx, tile] = args_tuple;
      if (not elem_less(cD(_0{}, _0{}), residue_cD)) {  // a CTA wholly outside the problem
        return;
      }
      // 1. The warp's value of each column the thread holds: its 8 lanes are 4 apart.
      ShuffleReduceFn<ElementCompute> reduce_lanes{};
      auto tCrCol_f = filter(tCrCol);  // one register per column the thread holds
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tCrCol_f); ++i) {
        ElementCompute v = tCrCol_f(i);
        CUTLASS_PRAGMA_UNROLL
        for (int mask = 4; mask < cutlass::NumThreadsPerWarp; mask *= 2) {
          v = reduce_lanes(v, shuffle_xor(v, mask));
        }
        tCrCol_f(i) = v;
      }
      // 2. Folded into the warp's slot of the column by lanes 0-3, each column once: from the
      //    thread's first row of the subtile.
      int warp = thread_idx / cutlass::NumThreadsPerWarp, lane = thread_idx % cutlass::NumThreadsPerWarp;
      Tensor tCcD_mn = tCcD(_, _, _, epi_m, epi_n);
      if (lane < 4) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tCrCol); ++i) {
          auto coord = tCcD_mn(i);
          if (get<0>(coord) == get<0>(tCcD_mn(0))) {
            ElementCompute& slot = smem.partials[warp * TileN + get<1>(base) + get<1>(coord)];
            slot = reduce_lanes(slot, tCrCol(i));
          }
        }
      }
      fill(tCrCol, params.reduction_identity);
      if (not is_last_iteration) {
        return;
      }
      // 3. The tile's partial of each column, the warps' slots in warp order, into the workspace.
      sync_fn();
      auto [m, n, k, l] = tile;
      GmemReduceFn<ElementCompute> reduce_warps{};
      CUTLASS_PRAGMA_NO_UNROLL
      for (int c = thread_idx; c < TileN; c += Warps * cutlass::NumThreadsPerWarp) {
        ElementCompute v = smem.partials[c];
        CUTLASS_PRAGMA_UNROLL
        for (int w = 1; w < Warps; ++w) {
          v = reduce_warps(v, smem.partials[w * TileN + c]);
        }
        ElementCompute volatile& partial = gBuf_ml(_0{}, c, m, l);
        partial = v;
      }
      // 4. The tile counter: the last tile of this column of tiles (over M and L) finishes in end().
      __threadfence();
      sync_fn();
      if (thread_idx == 0) {
        smem.tile_count = atomicAdd(&params.tile_counters[n], 1);
      }
      sync_fn();
      do_final_reduction = smem.tile_count == size<2>(gBuf_ml) * size<3>(gBuf_ml) - 1;
      sync_fn();
    }

    CUTLASS_DEVICE void end() {  // CUTLASS's final reduction of the tiles' partials, in M order
      using namespace cute;
      if (not do_final_reduction) {
        return;
      }
      auto& [tCrCol, tCcD, residue_tCcD, cD, residue_cD, base, gBuf_ml, gRow_l, thread_idx, tile] = args_tuple;
      GmemReduceFn<ElementCompute> reduce_tiles{};
      cutlass::NumericConverter<ElementOutput, ElementCompute, RoundStyle> convert{};
      CUTLASS_PRAGMA_NO_UNROLL
      for (int c = thread_idx; c < size<1>(gBuf_ml); c += Warps * cutlass::NumThreadsPerWarp) {
        bool store = elem_less(cD(_0{}, c), residue_cD);
        if (size<2>(stride(gRow_l)) == 0) {  // one vector for all batches
          Tensor partials = gBuf_ml(_0{}, c, _, _);
          ElementCompute v = partials(0);
          CUTLASS_PRAGMA_NO_UNROLL
          for (int t = 1; t < size(partials); ++t) {
            v = reduce_tiles(v, partials(t));
          }
          if (store) {
            gRow_l(_0{}, c, _0{}) = convert(v);
          }
          continue;
        }
        CUTLASS_PRAGMA_NO_UNROLL
        for (int l = 0; l < size<3>(gBuf_ml); ++l) {
          Tensor partials = gBuf_ml(_0{}, c, _, l);
          ElementCompute v = partials(0);
          CUTLASS_PRAGMA_NO_UNROLL
          for (int t = 1; t < size(partials); ++t) {
            v = reduce_tiles(v, partials(t));
          }
          if (store) {
            gRow_l(_0{}, c, l) = convert(v);
          }
        }
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    static_assert(decltype(args.tiled_copy)::TiledNumThr::value == Warps * cutlass::NumThreadsPerWarp,
                  "the epilogue's threads are the schedule's consumer warps");
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    Params const& params = this->params;
    // (CTA_M, CTA_N) -> one value per column, partitioned as the accumulator, for one subtile
    auto gCol = make_tensor<ElementCompute>(make_layout(take<0, 2>(args.tile_shape_mnk), make_stride(_0{}, _1{})));
    auto thr_mma = args.tiled_mma.get_thread_slice(args.thread_idx);
    auto tCrCol_tile = make_tensor_like<ElementCompute>(thr_mma.partition_C(gCol).layout());
    Tensor tRS_rCol = args.tiled_copy.get_slice(args.thread_idx).retile_S(tCrCol_tile);
    Tensor tCrCol = make_tensor<ElementCompute>(take<0, 3>(tRS_rCol.layout()).compose(args.tCrC.layout()));
    fill(tCrCol, params.reduction_identity);
    // CUTLASS's workspace: each tile's partial of its columns, (CTA_M (stride 0), CTA_N, tiles of M, L)
    Layout gBuf_layout = make_layout(take<0, 2>(args.tile_shape_mnk), make_stride(_0{}, _1{}));
    auto block_shape = ceil_div(make_shape(M, N, L), shape(gBuf_layout));
    Layout block_layout = make_layout(block_shape, make_stride(get<1>(block_shape), _1{},
                                                               get<0>(block_shape) * get<1>(block_shape)));
    Tensor mBuf = make_tensor(make_gmem_ptr(params.reduction_buffer), blocked_product(gBuf_layout, block_layout));
    Tensor gBuf_ml = local_tile(mBuf, take<0, 2>(args.tile_shape_mnk), make_coord(_, n, _));
    // the output vector: (CTA_M (stride 0), CTA_N, L)
    Tensor mRow = make_tensor(make_gmem_ptr<ElementOutput>(params.ptr_row), make_shape(M, N, L), params.dRow);
    Tensor gRow_l = local_tile(mRow, take<0, 2>(args.tile_shape_mnk), make_coord(m, n, _));
    auto base = args.residue_cD - args.residue_tCcD;  // the thread's first element in the CTA tile
    auto args_tuple = make_tuple(cute::move(tCrCol), args.tCcD, args.residue_tCcD, args.cD, args.residue_cD, base,
                                 gBuf_ml, gRow_l, args.thread_idx, args.tile_coord_mnkl);
    return ConsumerStoreCallbacks<decltype(args_tuple)>(cute::move(args_tuple), params, *smem);
  }
};

}  // namespace gemmgen::epi
