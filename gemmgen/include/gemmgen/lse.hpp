// gemmgen: an online log-sum-exp for CUTLASS's vector reductions (gemmgen.logsumexp).
//
// Sm90ColReduction / Sm90RowReduction reduce in ElementCompute with three combine functors: per
// element in registers, across lanes (shuffled as 64-bit words), and across warps and tiles (in
// shared memory and the workspace, in a fixed order), then convert to ElementOutput once. With
// ElementCompute the pair LseState {max, sum of exp(x - max)}, all three are LseCombine, and each
// row's log(sum exp x) comes out deterministic and safe from overflow: an element x enters as
// {x, 1}, two states combine by rescaling to the larger max, and the result is max + log(sum).
// The identity {-inf, 0} gives -inf where there is nothing to reduce, as torch.logsumexp does; a
// NaN makes the sum NaN; an infinite max is taken as it is (exp(inf - inf) is never formed).
#pragma once

#include <cutlass/array.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_conversion.h>

namespace gemmgen::epi {

struct alignas(8) LseState {
  float max;
  float sum;

  LseState() = default;
  // ElementCompute(0), CUTLASS's default reduction_identity: the state of nothing reduced (the
  // runtime writes the identity into the Params anyway).
  CUTLASS_HOST_DEVICE explicit LseState(int)
      : max(-cutlass::platform::numeric_limits<float>::infinity()), sum(0.0f) {}
  CUTLASS_HOST_DEVICE constexpr LseState(float max_, float sum_) : max(max_), sum(sum_) {}
  CUTLASS_HOST_DEVICE LseState(LseState const&) = default;
  CUTLASS_HOST_DEVICE LseState(LseState const volatile& s) : max(s.max), sum(s.sum) {}
  CUTLASS_HOST_DEVICE LseState& operator=(LseState const&) = default;
  // the workspace partials of a final reduction are volatile (CUTLASS's ElementGmem)
  CUTLASS_HOST_DEVICE void operator=(LseState const& s) volatile {
    max = s.max;
    sum = s.sum;
  }
};

CUTLASS_HOST_DEVICE float lse_rescaled(LseState s, float max) {
  return s.max == max ? s.sum : s.sum * expf(s.max - max);
}

CUTLASS_HOST_DEVICE LseState lse_combine(LseState a, LseState b) {
  float max = fmaxf(a.max, b.max);  // NaN maxima are not taken: their sums' rescale makes the sum NaN
  return {max, lse_rescaled(a, max) + lse_rescaled(b, max)};
}

// The reductions' functor: on a state, and on the arrays of states they shuffle and combine.
template <class T>
struct LseCombine;

template <>
struct LseCombine<LseState> {
  CUTLASS_HOST_DEVICE LseState operator()(LseState a, LseState b) const { return lse_combine(a, b); }
};

template <int N>
struct LseCombine<cutlass::Array<LseState, N>> {
  CUTLASS_HOST_DEVICE cutlass::Array<LseState, N> operator()(cutlass::Array<LseState, N> const& a,
                                                             cutlass::Array<LseState, N> const& b) const {
    cutlass::Array<LseState, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) {
      out[i] = lse_combine(a[i], b[i]);
    }
    return out;
  }
};

}  // namespace gemmgen::epi

namespace cutlass {

// An element entering the reduction, and the reduced state leaving it as fp32.
template <FloatRoundStyle Round>
struct NumericConverter<gemmgen::epi::LseState, float, Round> {
  using result_type = gemmgen::epi::LseState;
  using source_type = float;
  CUTLASS_HOST_DEVICE static result_type convert(source_type const& x) { return {x, 1.0f}; }
  CUTLASS_HOST_DEVICE result_type operator()(source_type const& x) const { return convert(x); }
};

template <FloatRoundStyle Round>
struct NumericConverter<float, gemmgen::epi::LseState, Round> {
  using result_type = float;
  using source_type = gemmgen::epi::LseState;
  CUTLASS_HOST_DEVICE static result_type convert(source_type const& s) { return s.max + logf(s.sum); }
  CUTLASS_HOST_DEVICE result_type operator()(source_type const& s) const { return convert(s); }
};

}  // namespace cutlass
