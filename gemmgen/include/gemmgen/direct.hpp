// gemmgen: what a direct epilogue's functor reads and writes, one output element at a time.
//
// A direct epilogue (direct_epilogue.hpp) hands each accumulator element, with its (m, n, l), to
// a functor gemmgen generates from the recipe (codegen/direct.py): straight-line code that loads
// the element's operands through these views, applies the op table's functors in fp32 and stores
// each output. The views hold what the host writes (a pointer and strides, in elements) and
// nothing else, so the functor and its arguments can be compiled and run on the host as well
// (tests/codegen/test_direct_epilogue.py).
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/functional.h>
#include <cutlass/numeric_types.h>

#include <gemmgen/atomics.hpp>

namespace gemmgen::direct {

// A scalar operand: `value`, or, where `ptr` is set, one fp32 per batch at ptr[l * batch_stride].
struct Scalar {
  float value = 0.0f;
  float const* ptr = nullptr;
  int64_t batch_stride = 0;

  CUTLASS_HOST_DEVICE float load(int l) const { return ptr != nullptr ? ptr[l * batch_stride] : value; }
};

// A vector along N (a row vector: i is the column) or along M (a column vector: i is the row).
template <class Element>
struct Vector {
  Element const* ptr = nullptr;
  int64_t batch_stride = 0;

  CUTLASS_HOST_DEVICE float load(int i, int l) const { return float(ptr[i + l * batch_stride]); }
};

// An M x N tensor in D's layout: `stride` is the distance between rows (between columns where
// ColumnMajor), the other mode's is 1; `batch_stride` is 0 for one tensor shared by every batch.
template <class Element, bool ColumnMajor>
struct Matrix {
  Element* ptr = nullptr;
  int64_t stride = 0;
  int64_t batch_stride = 0;

  CUTLASS_HOST_DEVICE int64_t offset(int m, int n, int l) const {
    return ColumnMajor ? m + n * stride + l * batch_stride : m * stride + n + l * batch_stride;
  }
  CUTLASS_HOST_DEVICE float load(int m, int n, int l) const { return float(ptr[offset(m, n, l)]); }
  CUTLASS_HOST_DEVICE void store(int m, int n, int l, float x) const {
    ptr[offset(m, n, l)] = static_cast<Element>(x);
  }
};

// An output reduced over M and N into one fp32 per batch, at ptr[l * batch_stride] (gemmgen.amax,
// and max and min over both dims). A thread reduces its elements from `identity` with `Reduce`
// (in the functor's partials); `store` then combines a warp's 32 partials with shuffles (`Combine`)
// and its first lane folds them into memory with `Atomic` (one atomic per warp and tile; the
// runtime fills the output with the identity first). On the host, where one thread runs every
// element, the partial is folded in directly.
template <class Reduce, class Combine, class Atomic>
struct ScalarReduction {
  float* ptr = nullptr;
  float identity = 0.0f;
  int64_t batch_stride = 0;

  CUTLASS_HOST_DEVICE float reduce(float partial, float x) const { return Reduce{}(partial, x); }
  CUTLASS_HOST_DEVICE void store(float partial, int l) const {
#if defined(__CUDA_ARCH__)
    CUTLASS_PRAGMA_UNROLL
    for (int lanes = 16; lanes > 0; lanes /= 2) {
      partial = Combine{}(partial, __shfl_xor_sync(0xffffffff, partial, lanes));
    }
    if (threadIdx.x % 32 == 0) {
      Atomic{}(ptr + l * batch_stride, partial);
    }
#else
    ptr[l * batch_stride] = Combine{}(ptr[l * batch_stride], partial);
#endif
  }
};

// gemmgen.cast: x rounded to Element's nearest value, continuing in fp32. Every conversion here is
// the element type's own from fp32 (round to nearest even; fp8 saturating, as cvt.rn.satfinite),
// as CUTLASS's NumericConverter does for one element.
template <class Element>
struct RoundTo {
  CUTLASS_HOST_DEVICE float operator()(float x) const { return float(static_cast<Element>(x)); }
};

}  // namespace gemmgen::direct
