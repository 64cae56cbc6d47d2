// gemmgen: gg.quantize's rule for one block of values, in one place for every kernel that quantizes
// (the epilogue's row and column blocks, the cast-transpose kernel): the block's max |x| (NaN
// propagated), its scale = max / Qmax (1 where the max is not above 0: a block of zeros, or one
// holding a NaN), rounded up to a power of two with PowerOfTwo, each value v / scale (then
// converted to the fp8 type, saturating). gemmgen.ir.ops.quantize_blocks is the same rule in torch.
#pragma once

#include <cutlass/cutlass.h>

#include <gemmgen/epilogue.hpp>

namespace gemmgen::epi {

template <uint32_t QmaxBits, bool PowerOfTwo = false>
struct QuantizeBlock {
  CUTLASS_DEVICE static float identity() { return 0.f; }
  CUTLASS_DEVICE static float element(float x) { return fabsf(x); }
  CUTLASS_DEVICE static float combine(float a, float b) { return Max{}(a, b); }
  CUTLASS_DEVICE static float factor(float amax, int) {
    float const scale = amax > 0.f ? amax / from_bits(QmaxBits) : 1.f;
    return PowerOfTwo ? power_of_two_at_least(scale) : scale;
  }
  CUTLASS_DEVICE static float apply(float v, float scale) { return v / scale; }
};

}  // namespace gemmgen::epi
