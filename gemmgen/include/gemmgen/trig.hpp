// gemmgen: sin and cos of an fp32 value, reduced correctly over the whole float range, in registers.
//
// CUDA's sinf/cosf keep the reduction of their slow path (|x| > 105615, Payne-Hanek) in a local
// array: every kernel using them gets a stack frame and hundreds of STL/LDL. Here x = q pi/2 + r
// is reduced in double, by Cody-Waite below 2^28 pi/2 (musl's __rem_pio2f) and above it by the
// argument's 24-bit significand times a 128-bit window of 2/pi that selects pick (no array), and
// sin/cos of r in [-pi/4, pi/4] are musl's double minimax kernels (__sindf, __cosdf): under an
// ulp in fp32. tests/ir/test_ops.py runs them on the host against torch.
#pragma once
// Included by epilogue.hpp after <cutlass/cutlass.h> (uint32_t, CUTLASS_DEVICE); NVRTC has no <cstdint>.

namespace gemmgen::epi::trig {

CUTLASS_DEVICE uint32_t float_bits(float x) { return __float_as_uint(x); }

// The j-th 32-bit word of the fraction of 2/pi (j >= 1): 0.A2F9836E 4E441529 FC2757D1 ...
CUTLASS_DEVICE uint32_t two_over_pi(int j) {
  return j == 1 ? 0xA2F9836Eu : j == 2 ? 0x4E441529u : j == 3 ? 0xFC2757D1u : j == 4 ? 0xF534DDC0u
       : j == 5 ? 0xDB629599u : j == 6 ? 0x3C439041u : j == 7 ? 0xFE5163ABu : 0xDEBBC561u;
}

// |x| = q pi/2 + r, |r| <= pi/4 (about); returns q mod 4. x finite.
CUTLASS_DEVICE int reduce(float x, uint32_t bits, double& r) {
  double ax = fabs(double(x));
  if (ax < 0x1.921fb6p+28) {  // Cody-Waite: fn * pio2_hi is exact (25 + 28 bits)
    double fn = rint(ax * 0x1.45f306dc9c883p-1);
    r = (ax - fn * 1.57079631090164184570e+00) - fn * 1.58932547735281966916e-08;
    return int(int64_t(fn) & 3);
  }
  int e = int((bits >> 23) & 0xffu) - 150;  // |x| = m 2^e, e >= 5 here
  uint64_t m = (bits & 0x7fffffu) | 0x800000u;
  int j0 = (e - 2) / 32 + 1;  // the first word whose product is not a multiple of 4
  uint64_t p3 = m * two_over_pi(j0 + 3);
  uint64_t p2 = m * two_over_pi(j0 + 2) + (p3 >> 32);
  uint64_t p1 = m * two_over_pi(j0 + 1) + (p2 >> 32);
  uint64_t p0 = m * two_over_pi(j0) + (p1 >> 32);
  // P = p0 2^96 + lo 2^32 + (p3 low word); |x| 2/pi = P 2^(e - 32 j0 - 96): its binary point is bit
  // 96 + 32 j0 - e of P, in [95, 126]. X: the 2 integer bits that matter and 62 of the fraction.
  int b = 34 + 32 * j0 - e;  // in [33, 64]
  uint64_t lo = ((p1 & 0xffffffffu) << 32) | (p2 & 0xffffffffu);
  uint64_t hi = (lo >> (b - 32)) | (p0 << (96 - b));
  int q = int(hi >> 62);
  int64_t frac = int64_t(hi << 2);  // two's complement: a fraction of 0.5 or more is negative
  if (frac < 0) {
    q += 1;
  }
  r = double(frac) * 0x1.921fb54442d18p-64;  // (frac 2^-64) pi/2
  return q & 3;
}

CUTLASS_DEVICE double sin_kernel(double x) {  // musl __sindf, |x| <= pi/4
  double z = x * x, w = z * z, s = z * x;
  double r = -0x1a00f9e2cae774.0p-65 + z * 0x16cd878c3b46a7.0p-71;
  return (x + s * (-0x15555554cbac77.0p-55 + z * 0x111110896efbb2.0p-59)) + s * w * r;
}

CUTLASS_DEVICE double cos_kernel(double x) {  // musl __cosdf, |x| <= pi/4
  double z = x * x, w = z * z;
  double r = -0x16c087e80f1e27.0p-62 + z * 0x199342e0ee5069.0p-68;
  return ((1.0 + z * -0x1ffffffd0c5e81.0p-54) + w * 0x155553e1053a42.0p-57) + (w * z) * r;
}

// sin (cos = false) or cos of x: the quadrant of |x| picks the kernel and the sign.
CUTLASS_DEVICE float sin_or_cos(float x, bool cos) {
  uint32_t bits = float_bits(x);
  if ((bits & 0x7f800000u) == 0x7f800000u) {
    return x - x;  // NaN for inf and NaN
  }
  double r;
  int q = reduce(x, bits, r);
  bool negative = (bits >> 31) != 0;
  if (cos) {
    q += 1;  // cos(x) = sin(|x| + pi/2), an even function
  } else if (negative) {
    q += 2;  // sin(-|x|) = -sin(|x|) = sin(|x| + pi)
  }
  double v = (q & 1) ? cos_kernel(r) : sin_kernel(r);
  return float((q & 2) ? -v : v);
}

}  // namespace gemmgen::epi::trig
