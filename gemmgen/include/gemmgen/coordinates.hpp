// gemmgen: where each epilogue value is, as a value (gemmgen.row_index, gemmgen.column_index), and
// the random numbers hashed from it (gemmgen.rand).
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

// Callbacks giving each register `value_of` its (m, n, l): the one visit of the coordinate leaves.
template <class CTensor, class ValueOf>
struct PerCoordinate : fusion::detail::EmptyConsumerStoreCallbacks {
  CUTLASS_DEVICE PerCoordinate(CTensor coords, ValueOf value_of) : coords(coords), value_of(value_of) {}

  CTensor coords;  // (CPY, CPY_M, CPY_N, EPI_M, EPI_N): each register's (m, n, l)
  ValueOf value_of;

  template <class ElementAccumulator, int FragmentSize>
  CUTLASS_DEVICE cutlass::Array<float, FragmentSize> visit(
      cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n) {
    auto here = coords(cute::_, cute::_, cute::_, epi_m, epi_n);
    cutlass::Array<float, FragmentSize> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < FragmentSize; ++i) {
      out[i] = value_of(here(epi_v * FragmentSize + i));
    }
    return out;
  }
};

template <bool ReferenceSrc, class Args, class ValueOf>
CUTLASS_DEVICE auto per_coordinate(Args const& args, ValueOf value_of) {
  auto coords = register_coordinates<ReferenceSrc>(args);
  return PerCoordinate<decltype(coords), ValueOf>(coords, value_of);
}

// A register's row (Mode 0) or column (Mode 1), in fp32.
template <int Mode>
struct ModeOf {
  template <class C>
  CUTLASS_DEVICE float operator()(C const& c) const { return static_cast<float>(cute::get<Mode>(c)); }
};

// A register's random_uniform from its tile's stream (Transposed: the kernel's rows are the
// recipe's columns).
template <bool Transposed>
struct UniformAt {
  uint32_t stream;  // the seed's, the stream's and the tile's batch's (random_stream)

  template <class C>
  CUTLASS_DEVICE float operator()(C const& c) const {
    uint32_t m = static_cast<uint32_t>(cute::get<0>(c)), n = static_cast<uint32_t>(cute::get<1>(c));
    return Transposed ? random_uniform(stream, n, m) : random_uniform(stream, m, n);
  }
};

}  // namespace detail

template <int Mode>
struct Coordinate : detail::RegisterNode<detail::NoArguments> {
  static_assert(Mode == 0 || Mode == 1, "a register's row (0) or column (1)");
  using Base = detail::RegisterNode<detail::NoArguments>;
  using Base::Base;

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(detail::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    return detail::per_coordinate<ReferenceSrc>(args, detail::ModeOf<Mode>{});
  }
};

// A seed operand (gemmgen.Seed): its value, or where the kernel reads it at launch.
struct SeedArguments {
  uint64_t seed = 0;
  uint64_t const* seed_ptr = nullptr;
};

// gemmgen.rand(seed, Stream): each register's uniform fp32 in [0, 1), epilogue.hpp's
// random_uniform of its batch, row and column in the recipe's M x N problem (Transposed: a swapped
// kernel's rows are the recipe's columns), so that every kernel of a recipe draws the same numbers.
template <bool Transposed, uint32_t Stream>
struct Random : detail::RegisterNode<SeedArguments> {
  using Base = detail::RegisterNode<SeedArguments>;
  using Base::Base;

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(detail::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    SeedArguments const& p = *this->params_ptr;
    uint64_t seed = p.seed_ptr != nullptr ? *p.seed_ptr : p.seed;
    uint32_t batch = static_cast<uint32_t>(cute::get<3>(args.tile_coord_mnkl));  // every register's l
    detail::UniformAt<Transposed> uniform{random_stream(seed, Stream, batch)};
    return detail::per_coordinate<ReferenceSrc>(args, uniform);
  }
};

}  // namespace gemmgen::epi
