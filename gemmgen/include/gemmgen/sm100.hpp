// gemmgen: what an sm100 kernel needs beyond the headers every kernel includes, under NVRTC.
//
// CUTLASS 4.2 leaves its sm100 mainloop builders and collectives out of collective_builder.hpp
// and collective_mma.hpp when __CUDACC_RTC__ is defined (the sm100 epilogue is not excluded), and
// hides make_tma_atom_{A,B}_sm100, which the mainloop's Params name in decltype, from NVRTC.
// gemmgen/generated/sm100_tma_atoms.hpp is that block of cute/atom/copy_traits_sm100_tma.hpp,
// generated from the installed header at compile time with CUTE_HOST made CUTE_HOST_RTC (what the
// sm90 TMA makers use): gemmgen.compile.rtc_headers.
#pragma once

#include <cute/atom/copy_traits_sm100_tma.hpp>
#include <gemmgen/generated/sm100_tma_atoms.hpp>

#include <cutlass/gemm/collective/sm100_mma_warpspecialized.hpp>
#include <cutlass/gemm/collective/sm100_mma_array_warpspecialized.hpp>  // grouped (pointer-array) kernels
#include <cutlass/gemm/collective/sm100_mma_warpspecialized_blockwise_scaling.hpp>  // block-scaled fp8
#include <cutlass/gemm/collective/sm100_mma_array_warpspecialized_blockwise_scaling.hpp>  // ...grouped
#include <cutlass/gemm/collective/builders/sm100_umma_builder.inl>
#include <cutlass/gemm/collective/builders/sm100_blockwise_umma_builder.inl>
