// gemmgen: where each epilogue value is, as a value (gemmgen.row_index, gemmgen.column_index).
//
// A mask (vocabulary padding, a causal bound) or a gather (the target logit of a cross-entropy:
// the sum over N of where(column == target, x, 0)) compares a register's coordinate with an
// operand. Coordinate<Mode> gives each register its row (Mode 0) or column (Mode 1) in its
// batch's M x N problem, in fp32 (exact below 2^24: the runtime refuses larger extents), from the
// partition of the problem's coordinates that RegisterLoad and CUTLASS's own broadcasts use
// (pairs.hpp's register_coordinates; the host oracle checks that it covers each tile once).
#pragma once

#include <gemmgen/pairs.hpp>

namespace gemmgen::epi {

namespace detail {

struct NoArguments {};

}  // namespace detail

template <int Mode>
struct Coordinate : detail::RegisterNode<detail::NoArguments> {
  static_assert(Mode == 0 || Mode == 1, "a register's row (0) or column (1)");
  using Base = detail::RegisterNode<detail::NoArguments>;
  using Base::Base;

  template <class CTensor>
  struct ConsumerStoreCallbacks : detail::fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE explicit ConsumerStoreCallbacks(CTensor coords) : coords(coords) {}

    CTensor coords;  // (CPY, CPY_M, CPY_N, EPI_M, EPI_N): each register's (m, n, l)

    template <class ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<float, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n) {
      auto here = coords(cute::_, cute::_, cute::_, epi_m, epi_n);
      cutlass::Array<float, FragmentSize> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        out[i] = static_cast<float>(cute::get<Mode>(here(epi_v * FragmentSize + i)));
      }
      return out;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(detail::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    auto coords = detail::register_coordinates<ReferenceSrc>(args);
    return ConsumerStoreCallbacks<decltype(coords)>(coords);
  }
};

}  // namespace gemmgen::epi
