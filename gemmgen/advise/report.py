"""`Advice` as JSON (its schema: docs/advise.md), as a terminal table, and as a PNG plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import InvalidArgument
from .advice import Advice
from .analysis import GemmAnalysis, roof_tflops

#: The JSON's format number: raised when a key changes meaning or goes (docs/advise.md).
ADVISE_FORMAT = 1


#: Plans the table lists (the JSON has every one).
TOP_PLANS = 8


def gemm_json(a: GemmAnalysis) -> dict[str, Any]:
    """One GEMM's JSON object (docs/advise.md)."""
    g, c, w = a.gemm, a.config, a.waves
    return {
        "layer": g.layer, "pass": g.pass_.value, "what": g.what, "m": g.m, "n": g.n, "k": g.k, "groups": g.groups,
        "repeats": a.repeats, "engine": a.engine, "recipe": g.recipe.name if g.recipe else None,
        "config": c.name if c else None, "why": a.why,
        "tile": list(c.tile) if c else None, "cluster": list(c.cluster) if c else None,
        "schedule": c.schedule.value if c else None, "tile_scheduler": c.tile_scheduler.value if c else None,
        "swap_ab": c.swap_ab if c else None,
        "tiles": w.tiles if w else None, "waves": round(w.waves, 4) if w else None,
        "last_wave_use": round(a.last_wave_use, 4) if a.last_wave_use is not None else None,
        "tile_efficiency": round(w.useful, 4) if w else None,
        "wave_efficiency": round(w.quantization, 4) if w else None,
        "flops": a.flops, "bytes": a.bytes, "bound": a.bound, "predicted_us": round(a.predicted_us, 3),
    }


def to_json(advice: Advice) -> dict[str, Any]:
    """The advice as one JSON object (docs/advise.md has the schema)."""
    gpu, s = advice.gpu, advice.spec
    return {
        "format": ADVISE_FORMAT,
        "model": {"name": s.name, "hidden": s.hidden, "layers": s.layers, "heads": s.heads, "kv_heads": s.kv_heads,
                  "intermediate": s.intermediate, "vocab": s.vocab, "activation": s.activation, "experts": s.experts,
                  "experts_per_token": s.experts_per_token, "moe_intermediate": s.moe_intermediate},
        "tokens": advice.tokens, "precision": advice.precision,
        "plan": {"tp": advice.plan.tp, "cp": advice.plan.cp, "ep": advice.plan.ep, "sp": advice.plan.sp},
        "gpu": {"name": gpu.name, "arch": gpu.arch.value, "sm_count": gpu.sm_count,
                "bandwidth_tb_s": gpu.bandwidth_tb_s, "bandwidth_source": gpu.bandwidth_source},
        "model_of_time": {
            "kind": "roofline model, not a measurement",
            "roofs_tflops": {k: round(roof_tflops(gpu, k), 1) for k in gpu.anchors},
            "anchors": {k: {"tflops": v.tflops, "shape": list(v.shape), "source": v.source}
                        for k, v in gpu.anchors.items()}},
        "gemms": [gemm_json(a) for a in advice.gemms],
        "layers_us": {k: round(v, 3) for k, v in advice.layer_us().items()},
        "step_us": round(advice.step_us, 3),
        "findings": [{"rule": f.rule, "where": f.where, "detail": f.detail, "flops_lost": f.flops_lost, "fix": f.fix}
                     for f in advice.findings],
        "cliffs": [{"dimension": c.dimension, "current": c.current, "drop_to": c.drop_to, "fill_to": c.fill_to,
                    "next_cliff": c.next_cliff, "detail": c.detail} for c in advice.cliffs],
        "plans": [{"plan": r.plan.name, "tp": r.plan.tp, "ep": r.plan.ep, "step_us": round(r.step_us, 3),
                   "gpu_us_per_token": round(r.gpu_us_per_token, 6), "broken": list(r.broken)}
                  for r in advice.plans],
    }


def table(advice: Advice) -> str:
    """The advice for a terminal: the GEMMs, then the totals, findings, cliffs and plans."""
    head = (f"{advice.spec.name}: {advice.tokens} tokens per step and rank, {advice.precision}, {advice.plan.name}, "
            f"{advice.gpu.name} ({advice.gpu.arch.value}, {advice.gpu.sm_count} SMs); times are a roofline model")
    rows = [("layer", "pass", "M", "N", "K", "G", "x", "kernel", "waves", "tile%", "wave%", "bound", "us")]
    for a in advice.gemms:
        g, w = a.gemm, a.waves
        rows.append((g.layer, g.pass_.value, str(g.m), str(g.n), str(g.k), str(g.groups), str(a.repeats),
                     a.config.name if a.config else "torch", f"{w.waves:.2f}" if w else "-",
                     f"{w.useful:.0%}" if w else "-", f"{w.quantization:.0%}" if w else "-", a.bound,
                     f"{a.predicted_us:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head, ""] + ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines += ["", f"step: {advice.step_us / 1e3:.2f} ms of GEMMs per rank (x = the layers that repeat a GEMM)"]
    if advice.findings:
        lines += ["", "advice:"]
        lines += [f"  [{f.rule}] {f.where}: {f.detail}"
                  + (f" ({f.flops_lost / 1e9:.1f} GFLOP lost)" if f.flops_lost else "") + f"; fix: {f.fix}"
                  for f in advice.findings]
    if advice.cliffs:
        lines += ["", "cliffs:"] + [f"  {c.dimension} {c.current}: {c.detail}" for c in advice.cliffs]
    if advice.plans:
        lines += ["", "plans (GEMM time per token x TP; communication not modelled):"]
        lines += [f"  {r.plan.name:<10} {r.gpu_us_per_token:9.3f} GPU-us/token  step {r.step_us / 1e3:8.2f} ms"
                  + (f"  breaks: {'; '.join(r.broken)}" if r.broken else "") for r in advice.plans[:TOP_PLANS]]
        if len(advice.plans) > TOP_PLANS:
            lines.append(f"  ... {len(advice.plans) - TOP_PLANS} more in --json")
    return "\n".join(lines)


def plot(advice: Advice, path: str | Path) -> Path:
    """A PNG: each gemmgen GEMM's waves (the last one's use shaded), and the roofline with every
    GEMM at its modelled throughput."""
    try:
        import matplotlib  # optional: gemmgen[advise]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidArgument("plot: needs matplotlib; pip install 'gemmgen[advise]'") from None
    out = Path(path)
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 6))
    launched = [a for a in advice.gemms if a.waves is not None]
    names = [f"{a.gemm.layer} {a.gemm.pass_.value}" for a in launched]
    left.barh(names, [a.waves.waves for a in launched if a.waves], color="#4c72b0")
    left.set_xlabel("waves (tiles / SMs)")
    left.set_title("waves of each gemmgen kernel")
    left.invert_yaxis()
    gpu = advice.gpu
    for kind, style in (("bf16", "-"), ("fp8", "--")):
        roof = roof_tflops(gpu, kind)
        knee = roof * 1e12 / (gpu.bandwidth_tb_s * 1e12)
        right.plot([1, knee, 1e5], [gpu.bandwidth_tb_s, roof, roof], style, color="gray", label=f"{kind} roof")
    for a in advice.gemms:
        right.scatter(a.flops / a.bytes, a.flops / (a.predicted_us * 1e6),
                      color="#4c72b0" if a.config else "#dd8452", s=18)
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("FLOPs per byte (minimum traffic)")
    right.set_ylabel("TFLOP/s (model)")
    right.set_title(f"roofline on {gpu.name}: gemmgen (blue), torch (orange)")
    right.legend()
    fig.suptitle(f"{advice.spec.name}, {advice.tokens} tokens, {advice.precision}, {advice.plan.name}: a model")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
