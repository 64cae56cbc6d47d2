// gemmgen: the atomic combine CUTLASS 4.2 lacks for a signed min over M and N.
//
// Sm90ScalarReduction reduces each thread's part of a tile in registers, then combines it into
// global memory with GmemReduceFn<float>, which must be one of cutlass::is_atomic's. CUTLASS has
// atomic_add and atomic_maximum (a signed max: non-negative floats by their int bits, negative ones
// by their unsigned bits, reversed); AtomicMinimum is its mirror image. fp32 values of one sign
// order as their bits do: non-negative ones as signed ints, negative ones as unsigned ints in
// reverse, and every negative's unsigned bits exceed every non-negative's, so
// min(*ptr, value) is an int min for a non-negative value and an unsigned max for a negative one.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/functional.h>

namespace gemmgen::epi {

template <class T>
struct AtomicMinimum;

template <>
struct AtomicMinimum<float> {
  CUTLASS_DEVICE float operator()(float* ptr, float value) const {
#if defined(__CUDA_ARCH__)
    return !::signbit(value)
               ? __int_as_float(atomicMin(reinterpret_cast<int*>(ptr), __float_as_int(value)))
               : __uint_as_float(atomicMax(reinterpret_cast<unsigned int*>(ptr), __float_as_uint(value)));
#else
    CUTLASS_UNUSED(ptr);
    CUTLASS_UNUSED(value);
    CUTLASS_NOT_IMPLEMENTED();
    return 0;
#endif
  }
};

}  // namespace gemmgen::epi

namespace cutlass {

template <class T>
struct is_atomic<gemmgen::epi::AtomicMinimum<T>> : platform::true_type {};

}  // namespace cutlass
