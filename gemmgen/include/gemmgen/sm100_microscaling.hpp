// gemmgen: what a microscaled (MXFP8, NVFP4) sm100 kernel needs beyond gemmgen/sm100.hpp, under
// NVRTC: CUTLASS 4.2's block-scaled mainloop collectives (one GEMM's and the pointer array's) and
// their builder, which it leaves out of
// collective_mma.hpp and collective_builder.hpp when __CUDACC_RTC__ is defined, as it does the
// other sm100 ones. Included only by microscaled kernels: parsing them costs every other kernel.
#pragma once

#include <cutlass/gemm/collective/sm100_blockscaled_mma_warpspecialized.hpp>
#include <cutlass/gemm/collective/sm100_blockscaled_mma_array_warpspecialized.hpp>
#include <cutlass/gemm/collective/builders/sm100_blockscaled_umma_builder.inl>
