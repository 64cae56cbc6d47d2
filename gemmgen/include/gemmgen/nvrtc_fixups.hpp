// gemmgen: fix-ups that must follow the CUTLASS headers under NVRTC.
//
// sm90_visitor_load_tma_warpspecialized.hpp uses structured bindings on `const cute::tuple`
// (`auto const& [a, b, c] = params.dRow;`), which look up std::tuple_size<const E>. CuTe only
// specializes the non-const forms under NVRTC, and there is no <tuple> to forward const.
#pragma once

#include <cute/container/tuple.hpp>

#if defined(__CUDACC_RTC__)
namespace std {
template <class... T>
struct tuple_size<const cute::tuple<T...>> : cuda::std::integral_constant<size_t, sizeof...(T)> {};

template <size_t I, class... T>
struct tuple_element<I, const cute::tuple<T...>> {
  using type = typename cuda::std::tuple_element<I, cuda::std::tuple<T...>>::type const;
};
}  // namespace std
#endif
