// gemmgen: what CUTLASS 4.2's sm90 headers need from `std` when compiled by NVRTC.
// Included first, before any CUTLASS header. NVRTC has no host standard library; CUTLASS uses
// cuda::std under __CUDACC_RTC__ but a few epilogue headers still name std:: directly.
#pragma once

#include <cuda/std/cstdint>
#include <cuda/std/type_traits>
#include <cuda/std/utility>

#if defined(__CUDACC_RTC__)
namespace std {
using cuda::std::is_pointer_v;
using cuda::std::void_t;
}  // namespace std
#endif
