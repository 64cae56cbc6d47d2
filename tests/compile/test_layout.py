"""Reading the layout probe from PTX, and the checks made before a binary is cached."""

from __future__ import annotations

import pytest

from gemmgen.codegen.fields import ParamField
from gemmgen.compile.layout import check_layout, read_layout_probe
from gemmgen.errors import CompileError

PTX = """
.visible .entry k_layout(
\t.param .u64 k_layout_param_0
)
{
\tld.param.u64 \t%rd1, [k_layout_param_0];
\tcvta.to.global.u64 \t%rd2, %rd1;
\tmov.u64 \t%rd3, 0;
\tst.global.u64 \t[%rd2], %rd3;
\tst.global.u64 \t[%rd2+8], %rd3;
\tmov.u64 \t%rd4, 64;
\tmov.u32 \t%r1, 0;
\tcvt.rn.f16.s32 %rs1, %r1;
\tcvt.u64.u16 \t%rd5, %rs1;
\tst.global.v2.u64 \t[%rd2+16], {%rd4, %rd5};
\tmov.u64 \t%rd6, 192;
\tst.global.u64 \t[%rd2+32], %rd6;
\tmov.u64 \t%rd7, 32768;
\tst.global.u64 \t[%rd2+40], %rd7;
\tret;
}
"""

FIELDS = (ParamField("mode", "{p}.mode", "i32"), ParamField("tma", "x", "desc"), ParamField("bytes", "y", "u32"))


def test_reads_scalar_vector_and_converted_stores():
    assert read_layout_probe(PTX, "k", 3) == [(0, 0), (64, 0), (192, 32768)]


def test_missing_or_unfolded_stores_are_errors():
    with pytest.raises(CompileError, match="expected 8 folded stores, found 6"):
        read_layout_probe(PTX, "k", 4)
    with pytest.raises(CompileError, match="not a constant"):
        read_layout_probe(PTX.replace("mov.u64 \t%rd7, 32768;", "ld.global.u64 \t%rd7, [%rd2];"), "k", 3)
    with pytest.raises(CompileError, match="not found"):
        read_layout_probe(PTX, "other", 3)


def test_check_layout():
    check_layout("k", FIELDS, [(0, 0), (64, 0), (192, 0)], 256)
    with pytest.raises(CompileError, match="overlap"):
        check_layout("k", FIELDS, [(0, 0), (64, 0), (100, 0)], 256)
    with pytest.raises(CompileError, match="exceeds sizeof"):
        check_layout("k", FIELDS, [(0, 0), (64, 0), (254, 0)], 256)
    with pytest.raises(CompileError, match="not 64-byte aligned"):
        check_layout("k", FIELDS, [(0, 0), (32, 0), (192, 0)], 256)
