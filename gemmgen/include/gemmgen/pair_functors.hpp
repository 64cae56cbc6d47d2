// gemmgen: the fragment functors of epilogues over adjacent column pairs (pairs.hpp says why a
// fragment's elements 2i and 2i+1 are a pair). Sm90Compute instantiates each with the fragment,
// cutlass::Array<float, N>; tests/ir/test_ops.py runs them on the host against the op table.
#pragma once

#include <cutlass/array.h>
#include <cutlass/cutlass.h>

#include <gemmgen/epilogue.hpp>

namespace gemmgen::epi {

template <class T>
struct PairEven;

template <class E, int N, bool R>
struct PairEven<cutlass::Array<E, N, R>> {
  static_assert(N % 2 == 0, "an epilogue over column pairs needs fragments of whole pairs");
  CUTLASS_DEVICE cutlass::Array<E, N, R> operator()(cutlass::Array<E, N, R> const& x) const {
    cutlass::Array<E, N, R> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; i += 2) {
      out[i] = out[i + 1] = x[i];
    }
    return out;
  }
};

template <class T>
struct PairOdd;

template <class E, int N, bool R>
struct PairOdd<cutlass::Array<E, N, R>> {
  static_assert(N % 2 == 0, "an epilogue over column pairs needs fragments of whole pairs");
  CUTLASS_DEVICE cutlass::Array<E, N, R> operator()(cutlass::Array<E, N, R> const& x) const {
    cutlass::Array<E, N, R> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; i += 2) {
      out[i] = out[i + 1] = x[i + 1];
    }
    return out;
  }
};

// (even, odd) -> the pair: the even column from `even`'s pair, the odd from `odd`'s.
template <class T>
struct Interleave;

template <class E, int N, bool R>
struct Interleave<cutlass::Array<E, N, R>> {
  static_assert(N % 2 == 0, "an epilogue over column pairs needs fragments of whole pairs");
  CUTLASS_DEVICE cutlass::Array<E, N, R> operator()(cutlass::Array<E, N, R> const& even,
                                                   cutlass::Array<E, N, R> const& odd) const {
    cutlass::Array<E, N, R> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; i += 2) {
      out[i] = even[i];
      out[i + 1] = odd[i + 1];
    }
    return out;
  }
};

// Interleave with one side a compile-time constant (its fp32 bits).
template <uint32_t Bits, bool ConstEven>
struct InterleaveConst {
  template <class T>
  struct Fn;

  template <class E, int N, bool R>
  struct Fn<cutlass::Array<E, N, R>> {
    CUTLASS_DEVICE cutlass::Array<E, N, R> operator()(cutlass::Array<E, N, R> const& x) const {
      cutlass::Array<E, N, R> c;
      c.fill(E(from_bits(Bits)));
      return ConstEven ? Interleave<cutlass::Array<E, N, R>>{}(c, x) : Interleave<cutlass::Array<E, N, R>>{}(x, c);
    }
  };
};

// A pair's half counted once: its even register, the odd one 0 (what a sum over N adds).
template <class T>
struct PairSumMask;

template <class E, int N, bool R>
struct PairSumMask<cutlass::Array<E, N, R>> {
  static_assert(N % 2 == 0, "an epilogue over column pairs needs fragments of whole pairs");
  CUTLASS_DEVICE cutlass::Array<E, N, R> operator()(cutlass::Array<E, N, R> const& x) const {
    cutlass::Array<E, N, R> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; i += 2) {
      out[i] = x[i];
      out[i + 1] = E(0);
    }
    return out;
  }
};

}  // namespace gemmgen::epi
