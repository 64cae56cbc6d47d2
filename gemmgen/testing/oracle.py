"""CUTLASS's own host code as an oracle for gemmgen's argument building (needs nvcc; tests only).

For a generated kernel, `OracleProgram` renders its part of templates/oracle_host.cu.j2
(the kernel's very types plus a function that runs CUTLASS's host code on argv), and runs it per
problem. `build_oracles` compiles several kernels' parts of one arch into one program with the pip
wheel's nvcc (CUTLASS's headers are parsed once: a program of eight kernels takes about as long as
two of one); `OracleProgram.build` compiles one alone. The program swaps cuTensorMapEncodeTiled for a
recording stand-in, so no GPU or driver is needed, and prints every encode call, every named Params
field and the launch shape as JSON lines.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import subprocess
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..codegen import GeneratedKernel, emitter, template_environment
from ..codegen.evt import ParamBinding
from ..codegen.fields import PAIR_BINDINGS, PAIR_LOADS
from ..codegen.visitor_types import HALF_STRIDE
from ..compile.toolchain import toolchain
from ..config import Arch, TileScheduler
from ..errors import ToolchainError
from ..ir import Reduction
from ..runtime.problem import Problem, TensorArg
from ..types import OperandKind


def field_bits(kind: str, value: int | float | bytes) -> int:
    """A Params field's value as the oracle prints it: an fp32's bits, else the integer as 64 bits
    (not a tensor map's bytes: the oracle compares those by their encode calls)."""
    assert not isinstance(value, bytes), "a tensor map has no bits to compare"
    if kind == "f32":
        return struct.unpack("<I", struct.pack("<f", value))[0]
    return int(value) & (2**64 - 1)


def nvcc_path() -> Path:
    tc = toolchain()
    cuda = tc.include_dirs[-1].parent
    nvcc = cuda / "bin" / "nvcc"
    if not os.access(nvcc, os.X_OK):
        raise ToolchainError("nvcc not found; the oracle needs `pip install nvidia-cuda-nvcc==13.0.88`")
    if shutil.which("g++") is None:
        raise ToolchainError("the oracle needs a host C++ compiler (g++) on PATH")
    return nvcc


@dataclass(frozen=True)
class OracleResult:
    encodes: list[dict]
    fields: dict[str, dict]  # name -> {"bits": int} or {"desc": call number}
    aux_params_bytes: dict[str, int]
    launch: dict
    can_implement: bool
    workspace_size: int
    pairs: dict | None = None  # an epilogue over column pairs: pairs.hpp's probe_pairs of the kernel

    def confined(self, sink: int) -> OracleResult:
        """CUTLASS's encode of D at `sink` (a kernel whose registers write D: `codegen.fields.sinks_d`)
        confined to one element, as gemmgen encodes it (`TmaTemplate.sink`): CUTLASS's host code
        takes D's extents from the problem, the rest of the map (type, box, swizzle) is what the
        collective's store needs."""
        encodes = [{**e, "dims": [1, 1, 1]} if e["addr"] == sink else e for e in self.encodes]
        return replace(self, encodes=encodes)


class _Slots:
    """Positions of the problem's numbers in the oracle's argv."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def add(self, name: str) -> int:
        self.names.append(name)
        return len(self.names) - 1


class OracleProgram:
    def __init__(self, kernel: GeneratedKernel, build_dir: Path) -> None:
        self.kernel = kernel
        self.slots = _Slots()
        if kernel.kernel_recipe.gemm.grouped:
            self._init_grouped(kernel, build_dir)
            return
        for n in ("m", "n", "k", "l"):
            self.slots.add(n)
        epi = kernel.epilogue

        def tensor(name: str) -> list[int]:
            return [self.slots.add(f"{name}.{part}") for part in ("ptr", "s0", "s1", "s2")]

        a, b = tensor("a"), tensor("b")
        scales = ""
        if kernel.kernel_recipe.gemm.block_scale is not None:
            # (blocks, K blocks, L) from the problem and the granularity, strides from the scale tensors
            sa, sb = tensor("operand.scale_a"), tensor("operand.scale_b")
            scales = "".join(
                f", reinterpret_cast<float const*>(V[{s[0]}]), oracle::scale_layout<typename "
                f"CollectiveMainloop::LayoutSF{x}>(cute::ceil_div(int(V[{mn}]), CollectiveMainloop::"
                f"ScaleGranularity{g}), cute::ceil_div(int(V[2]), CollectiveMainloop::ScaleGranularityK), "
                f"int(V[3]), V[{s[2]}], V[{s[3]}])"
                for x, s, mn, g in (("A", sa, 0, "M"), ("B", sb, 1, "N")))
        if kernel.kernel_recipe.gemm.microscaling is not None:
            # the scales' addresses; their layouts from the problem, as CUTLASS's examples build them
            sa, sb = tensor("operand.scale_a"), tensor("operand.scale_b")
            shape = "cute::make_shape(int(V[0]), int(V[1]), int(V[2]), int(V[3]))"
            scales = "".join(
                f", reinterpret_cast<typename CollectiveMainloop::ElementSF const*>(V[{s[0]}]), "
                f"ScaleConfig::tile_atom_to_shape_SF{x}({shape})" for x, s in (("A", sa), ("B", sb)))
        # (a microscaled kernel's ElementA is CUTLASS's pair of element and scale type)
        mx = kernel.kernel_recipe.gemm.microscaling is not None
        element_a, element_b = (f"typename CollectiveMainloop::ArrayElement{x}" if mx else f"Element{x}" for x in "AB")
        mainloop = (f"{{reinterpret_cast<{element_a} const*>(V[{a[0]}]), "
                    f"oracle::stride3<typename CollectiveMainloop::StrideA>(V[{a[1]}], V[{a[2]}], V[{a[3]}]), "
                    f"reinterpret_cast<{element_b} const*>(V[{b[0]}]), "
                    f"oracle::stride3<typename CollectiveMainloop::StrideB>(V[{b[1]}], V[{b[2]}], V[{b[3]}])"
                    f"{scales}}}")
        thread = self._arguments(epi.arguments)
        if epi.source is not None:
            c = tensor(f"operand.{epi.source}")
            c_ptr = f"reinterpret_cast<ElementC const*>(V[{c[0]}])"
            c_stride = f"oracle::stride3<typename CollectiveEpilogue::StrideC>(V[{c[1]}], V[{c[2]}], V[{c[3]}])"
        else:
            c_ptr, c_stride = "nullptr", "{}"
        atoms = [("mainloop.tma_a", "p.mainloop.tma_load_a.aux_params_"),
                 ("mainloop.tma_b", "p.mainloop.tma_load_b.aux_params_")]
        if epi.stores_d:
            d = tensor("d")
            d_args = (f"reinterpret_cast<ElementD*>(V[{d[0]}]), "
                      f"oracle::stride3<typename CollectiveEpilogue::StrideD>(V[{d[1]}], V[{d[2]}], V[{d[3]}])")
            atoms.append(("epilogue.tma_d", "p.epilogue.tma_store_d.aux_params_"))
        elif epi.d_sink:  # a PairStore writes D, the collective's store goes to the sink (16-byte strides)
            sink, stride = self.slots.add("d_sink.ptr"), self.slots.add("d_sink.stride")
            d_args = (f"reinterpret_cast<ElementD*>(V[{sink}]), "
                      f"oracle::stride3<typename CollectiveEpilogue::StrideD>(V[{stride}], 1, V[{stride}])")
            atoms.append(("epilogue.tma_d", "p.epilogue.tma_store_d.aux_params_"))
        else:  # void D: a PairStore in the callbacks writes it
            d_args = "nullptr, {}"
        epilogue = f"{{{thread}, {c_ptr}, {c_stride}, {d_args}}}"
        hw = {n: self.slots.add(f"hw.{n}") for n in ("device_id", "sm_count", "max_active_clusters")}
        mode = ("int(V[3]) > 1 ? cutlass::gemm::GemmUniversalMode::kBatched : "
                "cutlass::gemm::GemmUniversalMode::kGemm")
        # vector reductions keep their partials and tile counters in the workspace, a stream-K
        # scheduler its partial sums and tile barriers
        reductions = any(b.kind in ("row_reduction", "col_reduction") for b in epi.bindings)
        stream_k = kernel.config.tile_scheduler is TileScheduler.STREAM_K
        workspace = f"reinterpret_cast<void*>(V[{self.slots.add('workspace')}])" if reductions or stream_k \
            else "nullptr"
        # the stream-K scheduler's split count and reduction mode, arguments (one oracle serves all)
        scheduler = [f"args.scheduler.splits = int(V[{self.slots.add('scheduler.splits')}]);",
                     "args.scheduler.reduction_mode = decltype(args.scheduler.reduction_mode)("
                     f"int(V[{self.slots.add('scheduler.reduction_mode')}]));"] if stream_k else []
        self._render(kernel, build_dir, mode, "{int(V[0]), int(V[1]), int(V[2]), int(V[3])}", mainloop, epilogue,
                     workspace, hw, atoms, scheduler)

    def _render(self, kernel: GeneratedKernel, build_dir: Path, mode: str, problem: str, mainloop: str,
                epilogue: str, workspace: str, hw: dict[str, int], atoms: list[tuple[str, str]],
                scheduler: list[str] | None = None) -> None:
        code = kernel.config.binary()
        types = emitter(code.arch).type_context(kernel.kernel_recipe, code, kernel.epilogue)
        self.context = dict(
            recipe_name=kernel.recipe.name, config_name=code.name, namespace=types["namespace"],
            types=template_environment().get_template(types["types_template"]).render(**types),
            n_slots=len(self.slots.names), n_args=len(self.slots.names) + 1, slot=hw, mode=mode,
            problem_args=problem, mainloop_args=mainloop, epilogue_args=epilogue, workspace=workspace,
            scheduler_args=scheduler or [], fields=[(f.name, f.lvalue("p")) for f in kernel.fields], aux_sizes=atoms,
            # an epilogue over column pairs: the probe of its registers' pairing (sm90's with D's element)
            pairs_probes=[_pairs_probe(kernel)] if kernel.kernel_recipe.epilogue.pairs else [])
        self._build_dir = build_dir
        # the kernel part, whatever recipe named it: two recipes of the same kernel (an MLP's fc2
        # fprop and fc1 dgrad, say) share one namespace, so one program holds it once
        self.key = _digest([{**self.context, "recipe_name": ""}])
        # a program built with others serves every OracleProgram of the same kernel part
        self.exe, self.index = _BUILT.get(self.key) or (build_dir / f"oracle-{kernel.recipe.name}-{self.key}", 0)

    def _init_grouped(self, kernel: GeneratedKernel, build_dir: Path) -> None:
        """A grouped kernel's Arguments: the group count, and device addresses of the per-group
        shapes, pointer and stride arrays (never read on the host), and the workspace."""
        epi = kernel.epilogue

        def array(name: str, ctype: str) -> str:
            return f"reinterpret_cast<{ctype}>(V[{self.slots.add(name)}])"

        groups = self.slots.add("groups")
        shapes = array("shapes", "typename GemmKernel::ProblemShape::UnderlyingProblemShape*")
        problem = f"{{int(V[{groups}]), {shapes}, nullptr}}"
        # (a microscaled kernel's ElementA is CUTLASS's pair of element and scale type)
        element_a, element_b = (f"typename CollectiveMainloop::ArrayElement{x}"
                                if kernel.kernel_recipe.gemm.microscaling else f"Element{x}" for x in "AB")
        mainloop = (f"{array('a.array', f'{element_a} const**')}, "
                    f"{array('a.strides', 'typename GemmKernel::StrideA')}, "
                    f"{array('b.array', f'{element_b} const**')}, {array('b.strides', 'typename GemmKernel::StrideB')}")
        if kernel.kernel_recipe.gemm.scaled:  # per-group scale pointers and layouts
            scales = "decltype(typename CollectiveMainloop::Arguments{}.ptr_SFA)"  # sm90's and sm100's element
            mainloop += (f", {array('sfa.array', scales)}, {array('sfa.layouts', 'LayoutSFA*')}, "
                         f"{array('sfb.array', scales)}, {array('sfb.layouts', 'LayoutSFB*')}")
        mainloop = f"{{{mainloop}}}"
        thread = self._arguments(epi.arguments)
        if epi.source is not None:
            c = (f"{array('c.array', 'ElementC const**')}, "
                 f"{array('c.strides', 'typename CollectiveEpilogue::StrideC')}")
        else:
            c = "nullptr, {}"
        if epi.stores_d:
            d = f"{array('d.array', 'ElementD**')}, {array('d.strides', 'typename CollectiveEpilogue::StrideD')}"
        else:  # void D: a PairStore or DoubleStore writes it (its binding's arguments)
            d = "nullptr, nullptr"
        epilogue = f"{{{thread}, {c}, {d}}}"
        hw = {n: self.slots.add(f"hw.{n}") for n in ("device_id", "sm_count", "max_active_clusters")}
        workspace = array("workspace", "void*")
        atoms = [("mainloop.tma_a", "p.mainloop.tma_load_a.aux_params_"),
                 ("mainloop.tma_b", "p.mainloop.tma_load_b.aux_params_"),
                 *([("epilogue.tma_d", "p.epilogue.tma_store_d.aux_params_")] if epi.stores_d else [])]
        self._render(kernel, build_dir, "cutlass::gemm::GemmUniversalMode::kGrouped", problem, mainloop, epilogue,
                     workspace, hw, atoms)

    def _identity(self, b: ParamBinding) -> str:
        """The C++ value of a reduction's identity (`Reduction.identity`: 0, -inf or +inf)."""
        reduce = next(o.reduce for o in self.kernel.kernel_recipe.epilogue.outputs if o.name == b.name)
        assert reduce is not None
        inf = "std::numeric_limits<float>::infinity()"
        if reduce is Reduction.LSE:  # its state's pair {max, sum}
            return f"gemmgen::epi::LseState{{-{inf}, 0.0f}}"
        return {math.inf: inf, -math.inf: f"-{inf}"}.get(reduce.identity, f"{reduce.identity}f")

    def _arguments(self, tree: Any) -> str:
        if tree is None:
            return "{}"
        if isinstance(tree, tuple):
            return "{" + ", ".join(self._arguments(t) for t in tree) + "}"
        b: ParamBinding = tree
        e = b.dtype.cutlass
        if b.kind in ("row", "col"):
            i = self.slots.add(f"operand.{b.name}.ptr")
            pointer = f"{e} const* const*" if self.kernel.kernel_recipe.gemm.grouped else f"{e} const*"
            stride = "{}"
            if b.per_batch:  # a vector per batch: (0, 1, batch stride) / (1, 0, batch stride)
                modes = "cute::_0{}, cute::_1{}" if b.kind == "row" else "cute::_1{}, cute::_0{}"
                stride = f"{{{modes}, static_cast<int64_t>(V[{self.slots.add(f'operand.{b.name}.s2')}])}}"
            return f"{{reinterpret_cast<{pointer}>(V[{i}]), {e}(0), {stride}}}"
        if b.kind == "scalar" and b.per_batch:  # read per batch through its pointer
            ptr, batch_stride = (self.slots.add(f"operand.{b.name}.{part}") for part in ("ptr", "s2"))
            return (f"{{{{}}, {{reinterpret_cast<{e} const*>(V[{ptr}])}}, "
                    f"{{{{cute::_0{{}}, cute::_0{{}}, static_cast<int64_t>(V[{batch_stride}])}}}}}}")
        if b.kind == "seed":  # coordinates.hpp's SeedArguments {seed, seed_ptr}
            value, ptr = (self.slots.add(f"operand.{b.name}.{part}") for part in ("value", "ptr"))
            return f"{{static_cast<uint64_t>(V[{value}]), reinterpret_cast<uint64_t const*>(V[{ptr}])}}"
        if b.kind == "scalar":
            i = self.slots.add(f"operand.{b.name}.value")
            return f"{{{{F({i})}}, {{}}, {{}}}}"
        if b.kind in ("row_reduction", "col_reduction"):
            ptr, batch_stride = (self.slots.add(f"aux.{b.name}.{part}") for part in ("ptr", "s2"))
            modes = "cute::_0{}, cute::_1{}" if b.kind == "row_reduction" else "cute::_1{}, cute::_0{}"
            return (f"{{reinterpret_cast<void*>(V[{ptr}]), {self._identity(b)}, "
                    f"{{{modes}, static_cast<int64_t>(V[{batch_stride}])}}}}")
        if b.kind == "amax":  # any reduction over M and N: max |x|, max, min
            ptr, batch_stride = (self.slots.add(f"aux.{b.name}.{part}") for part in ("ptr", "s2"))
            return (f"{{reinterpret_cast<{e}*>(V[{ptr}]), {self._identity(b)}, "
                    f"{{cute::_0{{}}, cute::_0{{}}, static_cast<int64_t>(V[{batch_stride}])}}}}")
        if b.kind in PAIR_BINDINGS:  # pairs.hpp's HalfTensor {ptr, dHalf}
            load = b.kind in PAIR_LOADS
            tensor_of = f"operand.{b.name}" if load else "d" if b.name == "d" else f"aux.{b.name}"
            s = [self.slots.add(f"{tensor_of}.{part}") for part in ("ptr", "s0", "s1", "s2")]
            const = " const" if load else ""
            # a grouped kernel's: an array of per-group pointers (pairs.hpp's TensorOf<Element*>)
            pointer = f"{e}{const}* const*" if self.kernel.kernel_recipe.gemm.grouped else f"{e}{const}*"
            return (f"{{reinterpret_cast<{pointer}>(V[{s[0]}]), "
                    f"oracle::stride3<{HALF_STRIDE}>(V[{s[1]}], V[{s[2]}], V[{s[3]}])}}")
        if b.kind == "row_blocks":  # row_blocks.hpp's {ptr_factor, dFactor}: (M, N / block, L) strides
            s = [self.slots.add(f"aux.{b.name}.{part}") for part in ("ptr", "s0", "s1", "s2")]
            return (f"{{reinterpret_cast<float*>(V[{s[0]}]), "
                    f"oracle::stride3<cute::Stride<int64_t, int64_t, int64_t>>(V[{s[1]}], V[{s[2]}], V[{s[3]}])}}")
        if b.kind == "column_blocks":  # column_blocks.hpp's {ptr_q, dQ (N, M, L), ptr_scale, dScale}
            scales = next(o.name for o in self.kernel.kernel_recipe.outputs
                          if o.column_blocks and o.reduce is not None)
            q = [self.slots.add(f"aux.{b.name}.{part}") for part in ("ptr", "s0", "s1", "s2")]
            f = [self.slots.add(f"aux.{scales}.{part}") for part in ("ptr", "s0", "s1", "s2")]
            return (f"{{reinterpret_cast<{e}*>(V[{q[0]}]), "
                    f"oracle::stride3<cute::Stride<int64_t, cute::_1, int64_t>>(V[{q[1]}], V[{q[2]}], V[{q[3]}]), "
                    f"reinterpret_cast<float*>(V[{f[0]}]), "
                    f"oracle::stride3<cute::Stride<int64_t, int64_t, int64_t>>(V[{f[1]}], V[{f[2]}], V[{f[3]}])}}")
        if b.kind == "shared_load":  # Sm90AuxLoad<0>: {ptr_aux, null_default, dAux}, the batch stride static 0
            s = [self.slots.add(f"operand.{b.name}.{part}") for part in ("ptr", "s0", "s1")]
            modes = "cute::_1, int64_t" if b.column_major else "int64_t, cute::_1"
            return (f"{{reinterpret_cast<{e} const*>(V[{s[0]}]), {e}(0), "
                    f"oracle::stride3<cute::Stride<{modes}, cute::_0>>(V[{s[1]}], V[{s[2]}], 0)}}")
        prefix = "operand" if b.kind == "aux_load" else "aux"
        s = [self.slots.add(f"{prefix}.{b.name}.{part}") for part in ("ptr", "s0", "s1", "s2")]
        stride = f"oracle::stride3<AuxStride>(V[{s[1]}], V[{s[2]}], V[{s[3]}])"
        if b.kind == "aux_load":
            return f"{{reinterpret_cast<{e} const*>(V[{s[0]}]), {e}(0), {stride}}}"
        return f"{{reinterpret_cast<{e}*>(V[{s[0]}]), {stride}}}"

    def build(self) -> Path:
        """This kernel's program (built alone unless `build_oracles` built it with others)."""
        if self.key in _PENDING or not self.exe.is_file():
            build_all([self], self._build_dir)
        return self.exe

    def argv(self, problem: Problem, workspace: int = 0) -> list[str]:
        values: dict[str, int] = {"m": problem.m, "n": problem.n, "k": problem.k, "l": problem.l,
                                  "hw.device_id": problem.device_id, "hw.sm_count": problem.sm_count,
                                  "hw.max_active_clusters": problem.max_active_clusters, "workspace": workspace,
                                  "scheduler.splits": self.kernel.config.splits,
                                  "scheduler.reduction_mode": int(not self.kernel.config.deterministic),
                                  "d_sink.ptr": problem.d_sink,
                                  "d_sink.stride": 16 // self.kernel.kernel_recipe.gemm.d.nbytes}

        def put(prefix: str, t: TensorArg) -> None:
            values[f"{prefix}.ptr"] = t.ptr
            for i, s in enumerate(t.strides):
                values[f"{prefix}.s{i}"] = s

        put("a", problem.a)
        put("b", problem.b)
        put("d", problem.d)
        seeds = {o.name for o in self.kernel.kernel_recipe.operands if o.kind is OperandKind.SEED}
        for name, v in problem.operands.items():
            if name in seeds:  # a value, or a pointer to the int64 the kernel reads
                ptr = v.ptr if isinstance(v, TensorArg) else 0
                values[f"operand.{name}.value"], values[f"operand.{name}.ptr"] = 0 if ptr else int(v), ptr  # type: ignore[arg-type]
            elif isinstance(v, TensorArg):
                put(f"operand.{name}", v)
            else:
                values[f"operand.{name}.value"] = struct.unpack("<I", struct.pack("<f", v))[0]
        for name, t in problem.aux.items():
            put(f"aux.{name}", t)
        return [str(values[n] & (2**64 - 1)) for n in self.slots.names]

    def run(self, problem: Problem, workspace: int = 0) -> OracleResult:
        result = self.run_argv(self.argv(problem, workspace))
        return result.confined(problem.d_sink) if self.kernel.epilogue.d_sink else result

    def grouped_argv(self, values: dict[str, int]) -> list[str]:
        """A grouped kernel's argv from its slot values by name (see `_init_grouped`)."""
        return [str(values[n] & (2**64 - 1)) for n in self.slots.names]

    def run_argv(self, argv: list[str]) -> OracleResult:
        proc = subprocess.run([str(self.build()), str(self.index), *argv], capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise ToolchainError(f"oracle failed ({proc.returncode}): {proc.stderr[-2000:]}")
        encodes, fields, aux, launch, can, workspace, pairs = [], {}, {}, {}, False, -1, None
        for line in proc.stdout.splitlines():
            obj = json.loads(line)
            if "encode" in obj:
                encodes.append(obj)
            elif "field" in obj:
                fields[obj.pop("field")] = obj
            elif "aux_params_size" in obj:
                aux[obj["aux_params_size"]] = obj["bytes"]
            elif "grid" in obj:
                launch = obj
            elif "can_implement" in obj:
                can = bool(obj["can_implement"])
            elif "workspace_size" in obj:
                workspace = obj["workspace_size"]
            elif "pairs" in obj:
                pairs = obj
        return OracleResult(encodes, fields, aux, launch, can, workspace, pairs)


def _pairs_probe(kernel: GeneratedKernel) -> str:
    """The C++ call of pairs.hpp's host probe of an epilogue over column pairs, for the kernel's arch."""
    if kernel.config.arch is Arch.SM100A:
        return "gemmgen::epi::probe_pairs_sm100<GemmKernel>()"
    return f"gemmgen::epi::probe_pairs<CollectiveEpilogue, TiledMma, {kernel.kernel_recipe.gemm.d.cutlass}>()"


def _source(contexts: list[dict[str, Any]]) -> str:
    return template_environment().get_template("oracle_host.cu.j2").render(kernels=contexts)


def _digest(contexts: list[dict[str, Any]]) -> str:
    return hashlib.sha256(_source(contexts).encode()).hexdigest()[:16]


#: kernel part's digest -> (program, index) of each kernel `build_oracles` compiled in this process
_BUILT: dict[str, tuple[Path, int]] = {}
#: kernel part's digest -> the background build (`start_all`) that will put it in `_BUILT`
_PENDING: dict[str, Future] = {}
#: nvcc processes of background builds still running (`stop_background` ends them)
_RUNNING: set[subprocess.Popen] = set()
_BACKGROUND: ThreadPoolExecutor | None = None


def build_oracles(programs: list[OracleProgram], build_dir: Path, nice: bool = False) -> Path:
    """Compile `programs` (kernels of one arch) into one executable in `build_dir`; each program
    then runs it with its own index. `nice`: nvcc at the lowest CPU priority."""
    arches = {p.kernel.arch for p in programs}
    if len(arches) != 1:
        raise ValueError(f"one oracle program builds kernels of one arch, got {sorted(a.value for a in arches)}")
    parts = list({p.key: p for p in programs}.values())  # each kernel once
    contexts = [p.context for p in parts]
    name = parts[0].kernel.recipe.name if len(parts) == 1 else f"{len(parts)}-kernels"
    key = parts[0].key if len(parts) == 1 else hashlib.sha256(" ".join(p.key for p in parts).encode()).hexdigest()[:16]
    exe = build_dir / f"oracle-{name}-{key}"  # a single kernel's: where OracleProgram looks first
    if not exe.is_file():
        build_dir.mkdir(parents=True, exist_ok=True)
        src = exe.with_suffix(".cu")
        src.write_text(_source(contexts))
        tc = toolchain()
        # The host compiler is over half of the build; collecting its heap less often (2 GiB before
        # the first collection) saves about a tenth of its CPU for half a GB more memory (measured:
        # docs/design/testing.md).
        cmd = [str(nvcc_path()), "-std=c++17", f"-arch={arches.pop().value}", "-O0", "-w",
               "-Xcompiler=--param=ggc-min-expand=100,--param=ggc-min-heapsize=2097152",
               "-DCUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL=1",
               *(f"-I{d}" for d in tc.include_dirs), f"-L{nvcc_path().parent.parent / 'lib'}",
               "-o", str(exe) + ".tmp", str(src)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                preexec_fn=(lambda: os.nice(19)) if nice else None)
        _RUNNING.add(proc)
        try:
            _, stderr = proc.communicate()
        finally:
            _RUNNING.discard(proc)
        if proc.returncode != 0:
            raise ToolchainError(f"nvcc failed to build the oracle {src} (exit {proc.returncode}):\n{stderr[-4000:]}")
        os.replace(str(exe) + ".tmp", exe)
    index = {p.key: i for i, p in enumerate(parts)}
    for p in programs:
        p.exe, p.index = exe, index[p.key]
        _BUILT[p.key] = (exe, index[p.key])
    return exe


def _shares(programs: list[OracleProgram], workers: int) -> list[list[OracleProgram]]:
    """`programs` split per arch into `workers` shares, each compiled as one program."""
    by_arch: dict[str, list[OracleProgram]] = {}
    for p in programs:
        by_arch.setdefault(p.kernel.arch.value, []).append(p)
    return [group[i::workers] for group in by_arch.values() for i in range(workers) if group[i::workers]]


def oracle_by_hand(compiled: Any, prefix: str) -> OracleProgram:
    """A compiled kernel's oracle program built in a fresh temporary folder, for the scripts that
    check a kernel by hand (scripts/*_oracle.py): prints the kernel's report line and the build's
    seconds."""
    r = compiled.report
    print(f"{r.name} {r.config}: {r.registers} registers, {r.local_bytes} local, {r.stack_bytes} stack, SASS {r.sass}")
    build = Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
    start = time.perf_counter()
    oracle = OracleProgram(compiled.generated, build)
    build_all([oracle], build)
    print(f"oracle built in {time.perf_counter() - start:.1f} s")
    return oracle


def build_all(programs: list[OracleProgram], build_dir: Path, workers: int = 2) -> None:
    """Every program built, in `workers` nvcc processes at once, each compiling its share of the
    kernels (per arch) as one program; a kernel a background build (`start_all`) holds is waited
    for, not built again."""
    rest = []
    for p in programs:
        pending = _PENDING.get(p.key)
        if pending is not None:
            pending.result()
        if p.key in _BUILT:
            p.exe, p.index = _BUILT[p.key]
        else:
            rest.append(p)
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda share: build_oracles(share, build_dir), _shares(rest, workers)))


def start_all(programs: list[OracleProgram], build_dir: Path, workers: int = 2) -> None:
    """`build_all` in the background, nvcc at the lowest CPU priority: the oracles a test session
    will need, built while its other work leaves a core idle; `build_all` and `OracleProgram.build`
    of the same kernels wait for them. Each call's kernels of one arch are one program, since in
    the background the CPU a program costs counts, not its wall time (CUTLASS's headers are parsed
    once per program: docs/design/testing.md); `workers` programs build at once. `stop_background` ends
    what is still running."""
    global _BACKGROUND
    if _BACKGROUND is None:
        _BACKGROUND = ThreadPoolExecutor(workers)
    for share in _shares([p for p in programs if p.key not in _BUILT and p.key not in _PENDING], 1):
        future = _BACKGROUND.submit(build_oracles, share, build_dir, True)
        _PENDING.update({p.key: future for p in share})


def stop_background() -> None:
    """End the background builds: those not started are dropped, running nvcc processes killed."""
    global _BACKGROUND
    if _BACKGROUND is not None:
        _BACKGROUND.shutdown(wait=False, cancel_futures=True)
        _BACKGROUND = None
    for proc in list(_RUNNING):
        proc.kill()
    _PENDING.clear()
