// gemmgen: everything a generated kernel's fusion types name, beyond CUTLASS's own: the op table's
// functors, the atomic min, the log-sum-exp state, the register nodes of column pairs and of
// coordinates, D's row blocks, a copy's column blocks, the reduction over the kernel's M. Kernels, the nvcc oracle and the
// tests' collective probes include this one header.
#pragma once

#include <gemmgen/epilogue.hpp>
#include <gemmgen/atomics.hpp>
#include <gemmgen/lse.hpp>
#include <gemmgen/pairs.hpp>
#include <gemmgen/coordinates.hpp>
#include <gemmgen/row_blocks.hpp>
#include <gemmgen/column_blocks.hpp>
#include <gemmgen/row_reduction.hpp>
