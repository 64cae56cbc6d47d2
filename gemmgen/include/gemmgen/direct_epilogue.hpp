// gemmgen: a direct epilogue collective for sm90 warp-specialized GEMMs.
//
// CUTLASS's TMA warp-specialized epilogue with a visitor tree stages each subtile through shared
// memory and stores it with TMA; instantiating it is most of a kernel's compile
// (docs/design/measurements.md). This collective instead hands every accumulator element,
// with its coordinates, to a functor generated from the recipe (direct.hpp), which reads its
// operands and writes its outputs straight from registers to global memory, as CUTLASS's
// DefaultEpilogue does for alpha * acc + beta * C. It uses no shared memory, so the main loop
// gets every byte; CUTLASS's Sm90TmaWarpSpecializedAdapter fits it to the warp-specialized kernels.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/detail.hpp>

#include <gemmgen/direct.hpp>

namespace gemmgen::direct {

// `Functor`: a struct with `Arguments` (the operand views), `Partials` (a thread's values of the
// outputs it reduces, direct.hpp's ScalarReduction), `Partials start(Arguments const&)`,
// `void operator()(Arguments const&, Partials&, float acc, int m, int n, int l)` (one element)
// and `void finish(Arguments const&, Partials const&, int l)` (the tile's reductions, from every
// thread of a warp together).
template <class Functor, class ElementD_>
class Sm90DirectEpilogue {
 public:
  using EpilogueSchedule = void;
  using DispatchPolicy = void;
  using ElementC = void;
  using ElementD = ElementD_;
  using StrideC = cute::Stride<int64_t, cute::_1, int64_t>;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  struct SharedStorage {};
  using TensorStorage = SharedStorage;
  using Arguments = typename Functor::Arguments;
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }

  CUTLASS_HOST_DEVICE explicit Sm90DirectEpilogue(Params const& params, SharedStorage const& = SharedStorage())
      : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  // Each of this thread's accumulators at its place in the problem: the MMA's partition of the
  // tile's coordinates, offset to the tile; elements past M or N (a partial tile) are skipped, and
  // the reductions are finished by every thread, whatever its elements were.
  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_mnk,
                                 TileCoordMNKL tile_coord_mnkl, cute::Tensor<AccEngine, AccLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    int const M = get<0>(problem_shape_mnkl);
    int const N = get<1>(problem_shape_mnkl);
    int const m0 = int(get<0>(tile_coord_mnkl)) * int(size<0>(tile_shape_mnk));
    int const n0 = int(get<1>(tile_coord_mnkl)) * int(size<1>(tile_shape_mnk));
    int const l = int(get<3>(tile_coord_mnkl));
    Tensor coords = tiled_mma.get_thread_slice(thread_idx).partition_C(make_identity_tensor(take<0, 2>(tile_shape_mnk)));
    static_assert(decltype(size(coords))::value == decltype(size(accumulators))::value,
                  "one coordinate per accumulator");
    Functor const functor{};
    typename Functor::Partials partials = functor.start(params_);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accumulators); ++i) {
      int const m = m0 + int(get<0>(coords(i)));
      int const n = n0 + int(get<1>(coords(i)));
      if (m < M && n < N) {
        functor(params_, partials, accumulators(i), m, n, l);
      }
    }
    functor.finish(params_, partials, l);
  }

 private:
  Params params_;
};

// The collective as the warp-specialized kernels take it.
template <class Functor, class ElementD>
using Sm90Direct = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<Sm90DirectEpilogue<Functor, ElementD>>;

}  // namespace gemmgen::direct
