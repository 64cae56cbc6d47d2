// gemmgen: the elementwise functors that epilogue compute nodes (Sm90Compute) apply.
//
// Each scalar functor implements the fp32 formula of its op's row in the op table
// (gemmgen/ir/ops.py, `Op.functor` names it); tests/ir/test_ops.py runs each on the host against it.
// Map<F>::Fn<T> adapts a scalar functor to the `template <class> class ComputeFn` that
// Sm90Compute instantiates with cutlass::Array<float, N>. Compile-time constants are carried
// as the bit pattern of their fp32 value (C++17 has no float template arguments).
#pragma once

#include <cutlass/array.h>
#include <cutlass/cutlass.h>

#include <gemmgen/trig.hpp>

namespace gemmgen::epi {

CUTLASS_DEVICE float from_bits(uint32_t bits) { return __uint_as_float(bits); }

CUTLASS_DEVICE float nan_or(float a, float b, float r) { return (a != a || b != b) ? a + b : r; }

// The smallest power of two not below s >= 0, s itself where it is one: a block scale rounded as
// ir.ops.quantize_blocks rounds it with power_of_two (torch.frexp's m * 2^e gives 2^e, or s where
// m is 0.5). 0 and infinity give 1, frexp's exponent of both being 0.
CUTLASS_DEVICE float power_of_two_at_least(float s) {
  uint32_t bits = __float_as_uint(s);
  if (bits == 0u || bits >= 0x7f800000u) {
    return 1.0f;
  }
  if (bits >= 0x00800000u) {  // normal: the exponent one up where any mantissa bit is set
    return __uint_as_float((bits + 0x007fffffu) & 0xff800000u);
  }
  bits -= 1u;  // subnormal: the next power of two of its bits (2^-126 at most, a normal)
  bits |= bits >> 1;
  bits |= bits >> 2;
  bits |= bits >> 4;
  bits |= bits >> 8;
  bits |= bits >> 16;
  return __uint_as_float(bits + 1u);
}

struct Identity { CUTLASS_DEVICE float operator()(float x) const { return x; } };
struct Add { CUTLASS_DEVICE float operator()(float x, float y) const { return x + y; } };
struct Sub { CUTLASS_DEVICE float operator()(float x, float y) const { return x - y; } };
struct Mul { CUTLASS_DEVICE float operator()(float x, float y) const { return x * y; } };
struct Div { CUTLASS_DEVICE float operator()(float x, float y) const { return x / y; } };
struct Min { CUTLASS_DEVICE float operator()(float x, float y) const { return nan_or(x, y, fminf(x, y)); } };
struct Max { CUTLASS_DEVICE float operator()(float x, float y) const { return nan_or(x, y, fmaxf(x, y)); } };
// Comparisons give 1.0 or 0.0; every comparison with NaN is false but !=, as in C++ and torch.
struct Less { CUTLASS_DEVICE float operator()(float x, float y) const { return x < y ? 1.0f : 0.0f; } };
struct LessEqual { CUTLASS_DEVICE float operator()(float x, float y) const { return x <= y ? 1.0f : 0.0f; } };
struct Greater { CUTLASS_DEVICE float operator()(float x, float y) const { return x > y ? 1.0f : 0.0f; } };
struct GreaterEqual { CUTLASS_DEVICE float operator()(float x, float y) const { return x >= y ? 1.0f : 0.0f; } };
struct Equal { CUTLASS_DEVICE float operator()(float x, float y) const { return x == y ? 1.0f : 0.0f; } };
struct NotEqual { CUTLASS_DEVICE float operator()(float x, float y) const { return x != y ? 1.0f : 0.0f; } };

// where(c, x, y): x where c is non-zero (NaN included), else y; the untaken side never reaches the
// result (no NaN * 0). SelectConst*: the same with the branches the IR holds as constants built in.
struct Select {
  CUTLASS_DEVICE float operator()(float c, float x, float y) const { return c != 0.0f ? x : y; }
};

struct Neg { CUTLASS_DEVICE float operator()(float x) const { return -x; } };
struct Abs { CUTLASS_DEVICE float operator()(float x) const { return fabsf(x); } };
struct Exp { CUTLASS_DEVICE float operator()(float x) const { return expf(x); } };
struct Erf { CUTLASS_DEVICE float operator()(float x) const { return erff(x); } };
struct Sin { CUTLASS_DEVICE float operator()(float x) const { return trig::sin_or_cos(x, false); } };  // trig.hpp
struct Cos { CUTLASS_DEVICE float operator()(float x) const { return trig::sin_or_cos(x, true); } };
struct Tanh { CUTLASS_DEVICE float operator()(float x) const { return tanhf(x); } };
struct Sigmoid { CUTLASS_DEVICE float operator()(float x) const { return 1.0f / (1.0f + expf(-x)); } };
struct Relu { CUTLASS_DEVICE float operator()(float x) const { return x < 0.0f ? 0.0f : x; } };
struct Silu { CUTLASS_DEVICE float operator()(float x) const { return x / (1.0f + expf(-x)); } };

struct Gelu {  // erf form: 0.5 x (1 + erf(x / sqrt 2))
  CUTLASS_DEVICE float operator()(float x) const { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
};

struct GeluTanh {  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  CUTLASS_DEVICE float operator()(float x) const {
    return 0.5f * x * (1.0f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
  }
};

// x's bits plus floor(u * 2^16), the low 16 bits cut: a bf16 neighbour of x, the farther with
// probability its nearness when u is uniform in [0, 1) (ir.ops.stochastic_round_bf16).
struct StochasticRoundBf16 {
  CUTLASS_DEVICE float operator()(float x, float u) const {
    if (x != x) {
      return x;
    }
    float scaled = u * 65536.0f;
    uint32_t r = !(scaled > 0.0f) ? 0u : scaled >= 65535.0f ? 65535u : static_cast<uint32_t>(scaled);
    return __uint_as_float((__float_as_uint(x) + r) & 0xffff0000u);
  }
};

// gemmgen.rand's numbers (ir.ops.random_uniform): lowbias32 (Chris Wellons' hash prospector), a
// bijection of 32 bits, chained over the seed's halves and the stream once per tile
// (random_stream), then over the row and the column per element (random_uniform).
CUTLASS_DEVICE uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

CUTLASS_DEVICE uint32_t random_stream(uint64_t seed, uint32_t stream, uint32_t batch) {
  uint32_t start = mix32(mix32(mix32(static_cast<uint32_t>(seed)) ^ static_cast<uint32_t>(seed >> 32)) ^ stream);
  return mix32(start ^ batch);
}

CUTLASS_DEVICE float random_uniform(uint32_t stream, uint32_t row, uint32_t column) {
  return static_cast<float>(mix32(mix32(stream ^ row) ^ column) >> 8) * (1.0f / 16777216.0f);
}

template <uint32_t SlopeBits>
struct LeakyRelu {
  CUTLASS_DEVICE float operator()(float x) const { return x < 0.0f ? x * from_bits(SlopeBits) : x; }
};

// x op c
template <class Op, uint32_t Bits>
struct WithRhs { CUTLASS_DEVICE float operator()(float x) const { return Op{}(x, from_bits(Bits)); } };

// c op x
template <class Op, uint32_t Bits>
struct WithLhs { CUTLASS_DEVICE float operator()(float x) const { return Op{}(from_bits(Bits), x); } };

template <uint32_t XBits>
struct SelectConstX {
  CUTLASS_DEVICE float operator()(float c, float y) const { return Select{}(c, from_bits(XBits), y); }
};

template <uint32_t YBits>
struct SelectConstY {
  CUTLASS_DEVICE float operator()(float c, float x) const { return Select{}(c, x, from_bits(YBits)); }
};

template <uint32_t XBits, uint32_t YBits>
struct SelectConstXY {
  CUTLASS_DEVICE float operator()(float c) const { return Select{}(c, from_bits(XBits), from_bits(YBits)); }
};

template <class ScalarFn>
struct Map {
  template <class T>
  struct Fn {
    template <class... Args>
    CUTLASS_DEVICE T operator()(Args const&... args) const { return ScalarFn{}(args...); }
  };

  template <class E, int N, bool R>
  struct Fn<cutlass::Array<E, N, R>> {
    template <class... Args>
    CUTLASS_DEVICE cutlass::Array<E, N, R> operator()(Args const&... args) const {
      cutlass::Array<E, N, R> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < N; ++i) {
        out[i] = ScalarFn{}(args[i]...);
      }
      return out;
    }
  };
};

}  // namespace gemmgen::epi
