// gemmgen: a 16-bit tensor X (R x C) quantized to fp8 per 1 x 128 block of its rows and, stored
// transposed (C x R), per 128 x 1 block of its columns, from one read of X: the cast-transpose a
// low-precision training step runs on the tensors no gemmgen epilogue writes (a layer's input, the
// gradient arriving from above), so that each GEMM reads its operand along its own K (fp8 WGMMA
// reads K-major only). Both copies follow gg.quantize's rule (QuantizeBlock), the same bits as the
// epilogue's gg.quantize and gg.quantize_columns and as gemmgen.ir.ops.quantize_blocks.
//
// One CTA of 256 threads per 128 x 128 tile of X, so every block lies in one tile. Four steps, a
// barrier between each; threads exchange values through shared memory only (no shuffles), so the
// host build runs the very same functions thread by thread, step by step (`run_on_host`):
//   kLoad:   the tile into shared memory, 16 bytes per access; zeros past X's edges
//   kAmax:   each thread max |x| over half a row of the tile and half a column
//   kScales: each row's and column's scale, into shared memory and to the scale tensors
//   kStore:  each value over its scale, converted to fp8 (saturating), 16 bytes per store, into
//            the rows copy (R x C) and the transposed copy (C x R); a null pointer skips its copy
// TensorAmax, below, is the max |x| of a whole tensor, for one scale per tensor (CastTranspose's
// PerTensor form: Float8Tensorwise's current scaling).
// The host checks what the 16-byte accesses need (gemmgen/runtime/cast_transpose.py): C and X's
// row stride multiples of 8 elements, X 16-byte aligned, each copy's row stride a multiple of 16
// bytes holding its rows rounded up to 16 (the stores past the edge write zeros there).
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>

#if !defined(__CUDACC__)
#include <gemmgen/host_intrinsics.hpp>
#endif
#include <gemmgen/quantize_block.hpp>

#if !defined(__CUDACC__)
#include <cstring>
#include <memory>
#endif

namespace gemmgen::quantize {

// What the kernel is launched with: pointers and 64-bit integers only, so the host packs them in
// this order with no padding (gemmgen.codegen.quantize.PARAMS).
struct CastTransposeParams {
  void const* x;        // R x C, row stride ld_x elements
  void* q;              // the rows copy, R x C fp8, row stride ld_q; null: not written
  float* scale;         // its scales, (R, ceil(C / 128)) at (scale_row_stride, scale_block_stride)
  void* q_t;            // the transposed copy, C x R fp8, row stride ld_q_t; null: not written
  float* scale_t;       // its scales, (C, ceil(R / 128)) at (scale_t_row_stride, scale_t_block_stride)
  float* amax;          // one scale per tensor: its max |x| (read; TensorAmax accumulates it), else null
  int64_t rows;
  int64_t columns;
  int64_t ld_x;
  int64_t ld_q;
  int64_t ld_q_t;
  int64_t scale_row_stride;
  int64_t scale_block_stride;
  int64_t scale_t_row_stride;
  int64_t scale_t_block_stride;
};

// 16 bytes from global to shared memory, and 16 bytes of registers to global memory: one vector
// access each on the device.
CUTLASS_HOST_DEVICE void load16(void* dst, void const* src) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<uint4 const*>(src);
#else
  std::memcpy(dst, src, 16);
#endif
}

CUTLASS_HOST_DEVICE void load16(uint32_t (&words)[4], void const* src) {
#if defined(__CUDA_ARCH__)
  uint4 const v = *reinterpret_cast<uint4 const*>(src);
  words[0] = v.x, words[1] = v.y, words[2] = v.z, words[3] = v.w;
#else
  std::memcpy(words, src, 16);
#endif
}

CUTLASS_HOST_DEVICE void store16(void* dst, uint32_t const (&words)[4]) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
#else
  std::memcpy(dst, words, 16);
#endif
}

// How the copies' scales come about. PerTensor false: each row's and column's block by gg.quantize's
// rule (QuantizeBlock: its max |x| over Qmax, reduced in the tile). PerTensor true (Float8Tensorwise's
// current scaling): one scale for the whole tensor, amax / Qmax (1 where the amax is not above 0),
// the amax read from `Params::amax` (an epilogue's gg.amax, or TensorAmax's); the transposed copy is
// then the rows copy transposed, and the first tile writes the scale, `scale[0]`.
template <class ElementX, class ElementQ, uint32_t QmaxBits, bool PowerOfTwo, bool PerTensor = false>
struct CastTranspose {
  using Params = CastTransposeParams;
  using Policy = epi::QuantizeBlock<QmaxBits, PowerOfTwo>;
  static_assert(sizeof(ElementX) == 2 && sizeof(ElementQ) == 1, "16-bit values in, fp8 out");
  static_assert(!(PerTensor && PowerOfTwo), "a per-tensor scale is amax / Qmax");

  static constexpr int kTile = 128;     // a block's values, and a tile's rows and columns
  static constexpr int kThreads = 256;  // two per row (and per column) of the tile
  static constexpr int kPitch = kTile + 8;  // a row of the staged tile, 16 bytes apart from the next
  enum Step { kLoad, kAmax, kScales, kStore, kSteps };

  struct SharedStorage {
    alignas(16) uint16_t tile[kTile][kPitch];  // X's bits (a type with a constructor cannot be __shared__)
    float row_part[kTile][2];      // max |x| over each half of a row
    float column_part[kTile][2];   // and of a column
    float row_scale[kTile];
    float column_scale[kTile];
  };

  CUTLASS_HOST_DEVICE static float value(SharedStorage const& s, int r, int c) {
    return float(ElementX::bitcast(s.tile[r][c]));
  }

  // 16 values, each over its scale in fp8, packed little-endian into 4 words: `at(j)` the j-th value.
  template <class At>
  CUTLASS_HOST_DEVICE static void quantized(At at, float scale, uint32_t (&words)[4]) {
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < 16; ++j) {
      uint32_t const bits = ElementQ(Policy::apply(at(j), scale)).storage;
      words[j / 4] = j % 4 == 0 ? bits : words[j / 4] | bits << (8 * (j % 4));
    }
  }

  CUTLASS_HOST_DEVICE static void step(int step, Params const& p, SharedStorage& s, int tile_m, int tile_n,
                                       int thread) {
    int64_t const row0 = int64_t(tile_m) * kTile, column0 = int64_t(tile_n) * kTile;
    if (step == kLoad) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kTile * kTile / 8 / kThreads; ++i) {  // 8 values per 16 bytes
        int const v = thread + i * kThreads, r = v / (kTile / 8), c = v % (kTile / 8) * 8;
        if (row0 + r < p.rows && column0 + c < p.columns) {
          load16(&s.tile[r][c], static_cast<uint16_t const*>(p.x) + (row0 + r) * p.ld_x + column0 + c);
        } else {
          for (int j = 0; j < 8; ++j) {
            s.tile[r][c + j] = 0;
          }
        }
      }
    } else if (step == kAmax && !PerTensor) {
      int const line = thread / 2, half = thread % 2 * (kTile / 2);
      float row = Policy::identity(), column = Policy::identity();
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kTile / 2; ++j) {
        row = Policy::combine(row, Policy::element(value(s, line, half + j)));
        column = Policy::combine(column, Policy::element(value(s, half + j, line)));
      }
      s.row_part[line][thread % 2] = row;
      s.column_part[line][thread % 2] = column;
    } else if (step == kScales && PerTensor) {
      if (thread < kTile) {
        float const scale = Policy::factor(*p.amax, 0);
        s.row_scale[thread] = s.column_scale[thread] = scale;
        if (thread == 0 && tile_m == 0 && tile_n == 0 && p.scale != nullptr) {
          p.scale[0] = scale;
        }
      }
    } else if (step == kScales) {
      int const line = thread % kTile;
      if (thread < kTile) {
        float const scale = Policy::factor(Policy::combine(s.row_part[line][0], s.row_part[line][1]), kTile);
        s.row_scale[line] = scale;
        if (p.scale != nullptr && row0 + line < p.rows) {
          p.scale[(row0 + line) * p.scale_row_stride + tile_n * p.scale_block_stride] = scale;
        }
      } else {
        float const scale = Policy::factor(Policy::combine(s.column_part[line][0], s.column_part[line][1]), kTile);
        s.column_scale[line] = scale;
        if (p.scale_t != nullptr && column0 + line < p.columns) {
          p.scale_t[(column0 + line) * p.scale_t_row_stride + tile_m * p.scale_t_block_stride] = scale;
        }
      }
    } else if (step == kStore) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kTile * kTile / 16 / kThreads; ++i) {  // 16 values per 16 bytes
        int const v = thread + i * kThreads, line = v / (kTile / 16), at = v % (kTile / 16) * 16;
        uint32_t words[4];
        if (p.q != nullptr && row0 + line < p.rows && column0 + at < p.columns) {
          quantized([&](int j) { return value(s, line, at + j); }, s.row_scale[line], words);
          store16(static_cast<uint8_t*>(p.q) + (row0 + line) * p.ld_q + column0 + at, words);
        }
        if (p.q_t != nullptr && column0 + line < p.columns && row0 + at < p.rows) {
          quantized([&](int j) { return value(s, at + j, line); }, s.column_scale[line], words);
          store16(static_cast<uint8_t*>(p.q_t) + (column0 + line) * p.ld_q_t + row0 + at, words);
        }
      }
    }
  }

  CUTLASS_HOST_DEVICE static int tiles(int64_t extent) { return int((extent + kTile - 1) / kTile); }
};

// The max |x| of a whole 16-bit tensor X (R x C), accumulated into `Params::amax` (zero-filled by the
// host): what Float8Tensorwise's current scaling divides by, before CastTranspose<..., true> reads
// it. One CTA per 128 x 128 tile, one atomic max per CTA. A value's |x| bits order as its magnitude
// does, and a NaN's (sign cleared) above infinity's: the unsigned max of those bits is torch's amax,
// a NaN where X holds one.
template <class ElementX>
struct TensorAmax {
  using Params = CastTransposeParams;
  static constexpr int kTile = 128;
  static constexpr int kThreads = 256;
  enum Step { kLoad, kReduce, kSteps };

  struct SharedStorage {
    uint32_t part[kThreads];
  };

  CUTLASS_HOST_DEVICE static uint32_t magnitude_bits(uint16_t bits) {
    return __float_as_uint(float(ElementX::bitcast(bits))) & 0x7fffffffu;
  }

  CUTLASS_HOST_DEVICE static void step(int step, Params const& p, SharedStorage& s, int tile_m, int tile_n,
                                       int thread) {
    int64_t const row0 = int64_t(tile_m) * kTile, column0 = int64_t(tile_n) * kTile;
    if (step == kLoad) {
      uint32_t most = 0;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kTile * kTile / 8 / kThreads; ++i) {  // 8 values per 16 bytes
        int const v = thread + i * kThreads, r = v / (kTile / 8), c = v % (kTile / 8) * 8;
        if (row0 + r < p.rows && column0 + c < p.columns) {
          uint32_t words[4];
          load16(words, static_cast<uint16_t const*>(p.x) + (row0 + r) * p.ld_x + column0 + c);
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < 8; ++j) {
            uint32_t const bits = magnitude_bits(uint16_t(words[j / 2] >> (16 * (j % 2))));
            most = most > bits ? most : bits;
          }
        }
      }
      s.part[thread] = most;
    } else if (step == kReduce && thread == 0) {
      uint32_t most = 0;
      for (int t = 0; t < kThreads; ++t) {
        most = most > s.part[t] ? most : s.part[t];
      }
#if defined(__CUDA_ARCH__)
      atomicMax(reinterpret_cast<unsigned int*>(p.amax), most);
#else
      uint32_t* amax = reinterpret_cast<uint32_t*>(p.amax);
      *amax = *amax > most ? *amax : most;
#endif
    }
  }

  CUTLASS_HOST_DEVICE static int tiles(int64_t extent) { return int((extent + kTile - 1) / kTile); }
};

#if defined(__CUDACC__)
template <class Kernel>
CUTLASS_DEVICE void run_on_device(typename Kernel::Params const& params) {
  __shared__ typename Kernel::SharedStorage shared;
  CUTLASS_PRAGMA_UNROLL
  for (int step = 0; step < Kernel::kSteps; ++step) {
    if (step > 0) {
      __syncthreads();
    }
    Kernel::step(step, params, shared, blockIdx.y, blockIdx.x, threadIdx.x);
  }
}

// The kernel: grid (tiles of C, tiles of R), Kernel::kThreads threads.
#define GG_CAST_TRANSPOSE_ENTRY(NAME, KERNEL)                                                        \
  extern "C" __global__ void __launch_bounds__(KERNEL::kThreads) NAME(KERNEL::Params const params) { \
    gemmgen::quantize::run_on_device<KERNEL>(params);                                                \
  }
#else
// Every CTA of the grid, each step by every thread before the next step: what the barriers order.
template <class Kernel>
void run_on_host(typename Kernel::Params const& params) {
  auto shared = std::make_unique<typename Kernel::SharedStorage>();
  for (int tile_m = 0; tile_m < Kernel::tiles(params.rows); ++tile_m) {
    for (int tile_n = 0; tile_n < Kernel::tiles(params.columns); ++tile_n) {
      for (int step = 0; step < Kernel::kSteps; ++step) {
        for (int thread = 0; thread < Kernel::kThreads; ++thread) {
          Kernel::step(step, params, *shared, tile_m, tile_n, thread);
        }
      }
    }
  }
}

// The host build of the kernel (tests): the same Params, by pointer.
#define GG_CAST_TRANSPOSE_ENTRY(NAME, KERNEL) \
  extern "C" void NAME(KERNEL::Params const* params) { gemmgen::quantize::run_on_host<KERNEL>(*params); }
#endif

}  // namespace gemmgen::quantize
