// gemmgen: the per-group argument arrays of a grouped (MoE) kernel, filled on the GPU from the
// group offsets, one thread per group, so that the host never reads them: no synchronization, and
// the two launches (this one, then the GEMM) can be captured in a CUDA graph. The nvcc host oracle
// runs the same `fill` on the CPU; gemmgen/runtime/grouped.py writes `Setup` and reads the arrays.
// A block-scaled sm100 kernel's setup also writes each group's scale layouts (`fill_scale_layouts`).
#pragma once

#include <cute/layout.hpp>

namespace gemmgen::grouped {

constexpr int MaxColumns = 18;
// A compact K-major blockwise scale layout (Sm1xxBlockwiseScaleConfig's): five int32 extents and strides.
constexpr int ScaleLayoutBytes = 20;

// Group g's rows of A are [first, end): it ends at offsets[g] and starts where the groups before
// it end, each clamped to [0, rows] (reference.group_bounds). Whatever the offsets hold, no row is
// outside A and no row is in two groups. In the masked layout (`masked_rows`, DeepGEMM's: A is
// groups x masked_rows x K) group g's rows start at g * masked_rows and `offsets` holds how many
// there are (masked_m), clamped to [0, masked_rows] (reference.masked_group_bounds); rows past them
// are neither read nor written. A K-grouped kernel's (a weight gradient's) "rows" are the tokens,
// which are K: group g's problem is (m, n, end - first), and an empty group's is K = 1 over `zero`
// // (CUTLASS's grouped main loop leaves the accumulators unset for K = 0, so D_g would be garbage):
// A's and B's pointers, the columns that move with the group's first token, point there.
// Over fp8 copies (`token_align`, GemmSpec.token_align) group g's tokens start at the aligned column
// token_align * (g + ceil(first / token_align)), and an empty group reads its own column there (a
// zero between groups) with zero scales: the scale columns (per_block) point at `zero`.
struct Setup {
  int const* offsets;  // groups entries: where each group's rows end (masked: how many it has)
  int* shapes;         // groups x (M, N, K): cutlass::gemm::GroupProblemShape's problem_shapes
  long long* table;    // columns x groups 64-bit values: per-group pointers, then strides
  int groups;
  int rows;            // of A (and D); K-grouped: the tokens
  int n;
  int k;
  int columns;
  int swapped;         // nonzero: the kernel computes D_g^T = B_g^T A_g^T, its problem is (N, M_g, K)
  int m;               // K-grouped: every group's M (0 otherwise)
  int k_grouped;       // nonzero: the groups split K
  int token_align;     // K-grouped over fp8 copies: each group's tokens start at a multiple of it (else 0)
  int masked_rows;     // nonzero: the masked layout (group g's rows from g * masked_rows on)
  long long zero;      // K-grouped: the address of max(m, n) zero elements (fp8: zero fp32 scales)
  // column c of group g: base[c] + per_row[c] * at + per_block[c] * (first / 128) + per_group[c] * g,
  // first the group's first row, `at` it or its aligned column (token_align) (per_block: a microscaled kernel's scales of A, whose groups each
  // start a block of 128 rows: ir/microscaling.py's grouped blocked order)
  long long base[MaxColumns];
  long long per_row[MaxColumns];
  long long per_block[MaxColumns];
  long long per_group[MaxColumns];
  // where fill_scale_layouts writes each group's scale layouts of A and B (null for `fill`)
  void* scale_layouts[2];
};
static_assert(sizeof(Setup) == 72 + 4 * 8 * MaxColumns + 16, "gemmgen/runtime/grouped.py packs Setup by hand");

CUTLASS_HOST_DEVICE int clamp_row(int offset, int lo, int rows) {
  return offset < lo ? lo : (offset > rows ? rows : offset);
}

CUTLASS_HOST_DEVICE void fill(Setup const& s, int g) {
  int first = 0;
  int end = 0;
  if (s.masked_rows) {
    first = g * s.masked_rows;
    end = first + clamp_row(s.offsets[g], 0, s.masked_rows);
  } else {
    for (int i = 0; i < g; ++i) {
      first = clamp_row(s.offsets[i], first, s.rows);
    }
    end = clamp_row(s.offsets[g], first, s.rows);
  }
  bool const empty_k = s.k_grouped && end == first;
  if (s.k_grouped) {
    s.shapes[3 * g + 0] = s.m;
    s.shapes[3 * g + 1] = s.n;
    s.shapes[3 * g + 2] = empty_k ? 1 : end - first;
  } else {
    s.shapes[3 * g + 0] = s.swapped ? s.n : end - first;
    s.shapes[3 * g + 1] = s.swapped ? end - first : s.n;
    s.shapes[3 * g + 2] = s.k;
  }
  int const align = s.k_grouped ? s.token_align : 0;
  long long const at = align ? align * (g + (first + align - 1) / align) : first;
  for (int c = 0; c < s.columns; ++c) {
    bool const to_zero = empty_k && (align ? s.per_block[c] != 0 : s.per_row[c] != 0 || s.per_block[c] != 0);
    s.table[c * s.groups + g] = to_zero ? s.zero
        : s.base[c] + s.per_row[c] * at + s.per_block[c] * (first / 128) + s.per_group[c] * g;
  }
}

// `fill`, and each group's scale layouts as CUTLASS's scale config (blockwise, or the block-scaled
// MMA's) derives them from the group's (M, N, K): sm100's grouped main loops read them per group
// (sm90's blockwise one derives them).
template <class ScaleConfig, class LayoutSFA, class LayoutSFB>
CUTLASS_HOST_DEVICE void fill_scale_layouts(Setup const& s, int g) {
  static_assert(sizeof(LayoutSFA) == ScaleLayoutBytes && sizeof(LayoutSFB) == ScaleLayoutBytes,
                "gemmgen/runtime/grouped.py sizes the layout arrays by ScaleLayoutBytes");
  fill(s, g);
  auto const shape = cute::make_shape(s.shapes[3 * g + 0], s.shapes[3 * g + 1], s.shapes[3 * g + 2], 1);
  static_cast<LayoutSFA*>(s.scale_layouts[0])[g] = ScaleConfig::tile_atom_to_shape_SFA(shape);
  static_cast<LayoutSFB*>(s.scale_layouts[1])[g] = ScaleConfig::tile_atom_to_shape_SFB(shape);
}

}  // namespace gemmgen::grouped
