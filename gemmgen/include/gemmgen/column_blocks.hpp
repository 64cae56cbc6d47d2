// gemmgen: a value stored transposed and quantized per block of rows of each column
// (gemmgen.quantize_columns): the K-major copy that a weight-gradient GEMM reads, whose K is the
// tokens (D's rows).
//
// A pass-through node of the epilogue tree: its value goes on unchanged, as Sm90AuxStore's does.
// Each column's block of `Block` rows takes one scale, its largest |x| over the fp8 type's largest
// value, 1 where that is not above 0, rounded up to a power of two with PowerOfTwo (QuantizeBlock,
// row_blocks.hpp: gg.quantize's rule). The node writes x / scale in ElementQ at Q(n, m, l), an
// (N, M, L) tensor with M contiguous, and the scale at S(n, m / Block, l), at any strides.
//
// A block's rows lie across the accumulator's threads (a WGMMA warp holds 16 rows, its warpgroup 64,
// the cooperative schedule's two warpgroups 128), so the node stages the subtile's values in shared
// memory, transposed, and reads them back by column:
//   visit()  : each value at values[col][row] of the subtile (rows padded by 4 floats, so a warp's
//              store of one register hits 32 different banks);
//   reduce() : a barrier; then each thread takes 16 consecutive rows of one column (an item), the
//              8 items of a block in 8 consecutive lanes of one warp, which combine their maxima
//              (shuffle-xor 1, 2, 4); each stores its 16 values as one 16-byte vector (element by
//              element at the M edge) and the block's first item its scale; a barrier again before
//              the next subtile's values overwrite the buffer.
// Values outside the problem do not enter a maximum and are not written. The kernel's epilogue
// subtile holds whole blocks of rows (sm90.geometry.epilogue_tile: 128 rows under the cooperative
// schedule).
#pragma once

#include <cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp>

#include <gemmgen/epilogue.hpp>
#include <gemmgen/row_blocks.hpp>

namespace gemmgen::epi {

// Where the copy and its scales go.
template <class ElementQ>
struct ColumnBlocksArguments {
  using StrideQ = cute::Stride<int64_t, cute::_1, int64_t>;  // (N, M, L): M contiguous
  using StrideScale = cute::Stride<int64_t, int64_t, int64_t>;  // (N, M / Block, L): any layout

  ElementQ* ptr_q = nullptr;
  StrideQ dQ = {};
  float* ptr_scale = nullptr;  // null: the scales are not written
  StrideScale dScale = {};
};

template <uint32_t QmaxBits, int Block, class ElementQ, class CtaTileShapeMNK, class EpilogueTile,
          bool PowerOfTwo = false>
struct Sm90ColumnBlocksStore : NoLoadNode<ColumnBlocksArguments<ElementQ>> {
  using Base = NoLoadNode<ColumnBlocksArguments<ElementQ>>;
  using typename Base::Arguments;
  using typename Base::Params;
  using Policy = QuantizeBlock<QmaxBits, PowerOfTwo>;
  static constexpr int EpiM = cute::size<0>(EpilogueTile{});
  static constexpr int EpiN = cute::size<1>(EpilogueTile{});
  static constexpr int Chunk = 16;  // a thread's rows of one column: one 16-byte vector of fp8
  static constexpr int ChunksPerBlock = Block / Chunk;
  static constexpr int ChunksPerColumn = EpiM / Chunk;  // of the subtile
  static constexpr int Items = EpiN * ChunksPerColumn;
  static constexpr int RowPitch = EpiM + 4;  // floats per staged column
  static_assert(cute::sizeof_bits_v<ElementQ> == 8, "an fp8 copy");
  static_assert(Block % Chunk == 0 && ChunksPerBlock <= 32 && (ChunksPerBlock & (ChunksPerBlock - 1)) == 0,
                "a block's items are a power-of-two group of lanes of one warp");
  static_assert(EpiM % Block == 0, "the epilogue subtile must hold whole blocks of rows");
  static_assert(cute::size<0>(CtaTileShapeMNK{}) % EpiM == 0, "whole subtiles per tile");

  struct SharedStorage {
    alignas(16) float values[EpiN * RowPitch];
  };

  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {  // 16-byte stores of the copy
    return args.ptr_q != nullptr && reinterpret_cast<uintptr_t>(args.ptr_q) % 16 == 0 &&
           cute::get<0>(args.dQ) % 16 == 0 && cute::get<2>(args.dQ) % 16 == 0;
  }

  CUTLASS_HOST_DEVICE Sm90ColumnBlocksStore() {}
  CUTLASS_HOST_DEVICE Sm90ColumnBlocksStore(Params const& params, SharedStorage const& shared_storage)
      : params(params), staged(const_cast<float*>(shared_storage.values)) {}

  Params params;
  float* staged = nullptr;

  template <int Threads, class ArgsTuple>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    static_assert(Threads % 32 == 0 && Items % ChunksPerBlock == 0, "whole blocks per warp");
    CUTLASS_DEVICE ConsumerStoreCallbacks(ArgsTuple&& args_tuple, Params const& params, float* staged, int thread_idx)
        : args_tuple(cute::forward<ArgsTuple>(args_tuple)), params(params), staged(staged), thread_idx(thread_idx) {}
    ArgsTuple args_tuple;
    Params const& params;
    float* staged;
    int thread_idx;

    template <class ElementAccumulator, class ElementInput, int FragmentSize>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n,
                              cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      using namespace cute;
      auto& [tCcD, base, origin, extent] = args_tuple;
      Tensor tCcD_mn = tCcD(_, _, _, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        auto coord = tCcD_mn(epi_v * FragmentSize + i);
        int row = get<0>(base) + get<0>(coord) - epi_m * EpiM;  // in the subtile
        int col = get<1>(base) + get<1>(coord) - epi_n * EpiN;
        staged[col * RowPitch + row] = static_cast<float>(frg_input[i]);
      }
      return frg_input;
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const& sync_fn, int epi_m, int epi_n, bool, VTensor) {
      using namespace cute;
      auto& [tCcD, base, origin, extent] = args_tuple;
      auto [m_tile, n_tile, l] = origin;  // the CTA tile's first row and column, its batch
      auto [M, N] = extent;
      int const m_subtile = m_tile + epi_m * EpiM, n_subtile = n_tile + epi_n * EpiN;
      sync_fn();  // every value of the subtile staged
      CUTLASS_PRAGMA_UNROLL
      for (int first = 0; first < Items; first += Threads) {  // every thread of a warp takes the same turns
        int const item = first + thread_idx;
        bool const active = item < Items;
        int const col = item / ChunksPerColumn, chunk = item % ChunksPerColumn;
        int const m = m_subtile + chunk * Chunk, n = n_subtile + col;
        float v[Chunk];
        float amax = Policy::identity();
        if (active) {
          float4 const* src = reinterpret_cast<float4 const*>(staged + col * RowPitch + chunk * Chunk);
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < Chunk / 4; ++j) {
            float4 x = src[j];
            v[4 * j] = x.x, v[4 * j + 1] = x.y, v[4 * j + 2] = x.z, v[4 * j + 3] = x.w;
          }
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < Chunk; ++i) {
            if (m + i < M && n < N) {
              amax = Policy::combine(amax, Policy::element(v[i]));
            }
          }
        }
        CUTLASS_PRAGMA_UNROLL
        for (int lanes = 1; lanes < ChunksPerBlock; lanes <<= 1) {  // the block's items
          amax = Policy::combine(amax, __shfl_xor_sync(0xFFFFFFFF, amax, lanes));
        }
        float const scale = Policy::factor(amax, Block);
        if (active && n < N && m < M) {
          cutlass::Array<float, Chunk> scaled;
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < Chunk; ++i) {
            scaled[i] = Policy::apply(v[i], scale);
          }
          cutlass::AlignedArray<ElementQ, Chunk, 16> q;
          static_cast<cutlass::Array<ElementQ, Chunk>&>(q) = cutlass::NumericArrayConverter<ElementQ, float, Chunk>{}(scaled);
          ElementQ* dst = params.ptr_q + n * get<0>(params.dQ) + m + l * get<2>(params.dQ);
          if (m + Chunk <= M) {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<uint4 const*>(q.data());
          } else {
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < Chunk; ++i) {  // the M edge: element by element
              if (m + i < M) {
                dst[i] = q[i];
              }
            }
          }
          if (params.ptr_scale != nullptr && chunk % ChunksPerBlock == 0) {
            params.ptr_scale[n * get<0>(params.dScale) + (m / Block) * get<1>(params.dScale) +
                             l * get<2>(params.dScale)] = scale;
          }
        }
      }
      sync_fn();  // the buffer read before the next subtile's values overwrite it
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    using TiledMma = cute::remove_cvref_t<decltype(args.tiled_mma)>;
    constexpr int Threads = cute::size(TiledMma{});
    auto base = args.residue_cD - args.residue_tCcD;  // the thread's first element in the CTA tile
    auto origin = make_tuple(int(m) * int(size<0>(CtaTileShapeMNK{})), int(n) * int(size<1>(CtaTileShapeMNK{})),
                             int(l));
    auto args_tuple = make_tuple(args.tCcD, base, origin, make_tuple(int(M), int(N)));
    return ConsumerStoreCallbacks<Threads, decltype(args_tuple)>(cute::move(args_tuple), params, staged,
                                                                 args.thread_idx % Threads);
  }
};

}  // namespace gemmgen::epi
