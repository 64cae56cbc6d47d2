// gemmgen: where a dense sm100 kernel whose registers write D (column pairs: gemmgen/pairs.hpp)
// aims its collective's TMA store of D, which CUTLASS 4.2's one-GEMM sm100 epilogue always
// issues. The host asks the driver for its address (cuModuleGetGlobal, by this unmangled name) and
// encodes a tensor map of one element there: the box at the origin writes that element, and TMA
// drops every other box, which lies outside the map (gemmgen.codegen.fields.sinks_d).
#pragma once

extern "C" {
__device__ alignas(16) unsigned char gemmgen_d_sink[16];
}
