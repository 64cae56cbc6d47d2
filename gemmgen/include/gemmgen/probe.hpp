// gemmgen: reading a Params field's offset and value as 64-bit integers, identically in the
// NVRTC layout probe (device) and the nvcc host oracle.
#pragma once

#include <cute/util/type_traits.hpp>

namespace gemmgen::probe {

template <class Struct, class Field>
CUTLASS_HOST_DEVICE unsigned long long offset(Struct const& s, Field const& f) {
  return static_cast<unsigned long long>(reinterpret_cast<char const*>(&f) - reinterpret_cast<char const*>(&s));
}

// The field's bits, zero-extended (signed integers are sign-extended to 64 bits).
template <class T>
CUTLASS_HOST_DEVICE unsigned long long bits(T const& v) {
  if constexpr (cute::is_pointer_v<T>) {
    return reinterpret_cast<unsigned long long>(v);
  } else if constexpr (cute::is_same_v<T, bool>) {
    return v ? 1ull : 0ull;
  } else if constexpr (CUTE_STL_NAMESPACE::is_enum_v<T>) {
    return static_cast<unsigned long long>(static_cast<long long>(v));
  } else if constexpr (cute::is_integral_v<T>) {
    return static_cast<unsigned long long>(v);
  } else if constexpr (sizeof(T) == 8) {
    return *reinterpret_cast<unsigned long long const*>(&v);
  } else if constexpr (sizeof(T) == 4) {
    return *reinterpret_cast<unsigned int const*>(&v);
  } else if constexpr (sizeof(T) == 2) {
    return *reinterpret_cast<unsigned short const*>(&v);
  } else if constexpr (sizeof(T) == 1) {
    return *reinterpret_cast<unsigned char const*>(&v);
  } else {
    return 0ull;  // descriptors: compared by content elsewhere
  }
}

}  // namespace gemmgen::probe
