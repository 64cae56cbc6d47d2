// gemmgen: host stand-ins for the CUDA intrinsics gemmgen's device headers use, for the host builds
// of device code that tests run (a kernel's own functions compiled with g++, run thread by thread).
#pragma once

#if !defined(__CUDACC__)
#include <cmath>
#include <cstdint>
#include <cstring>

inline float __uint_as_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint32_t __float_as_uint(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}
#endif
