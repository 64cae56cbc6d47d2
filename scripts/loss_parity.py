"""Loss parity of gemmgen's low-precision recipes against bf16 (docs/design/training.md): trains the
parity model (gemmgen/testing/loss_parity.py) under bf16 and each precision, prints each run's
held-out loss and relative gap, and draws the training curves as an SVG.

    python scripts/loss_parity.py --seeds 3 --svg docs/images/loss_parity.svg
    python scripts/loss_parity.py --argmax      # the separable variant (labels: the teacher's argmax)
"""

from __future__ import annotations

import argparse
import datetime
import platform
from pathlib import Path

import torch

from gemmgen.testing.loss_parity import Run, relative_gap, train
from gemmgen.training import MXFP8, Float8Blockwise, Float8Tensorwise

PRECISIONS = {"Float8Blockwise": Float8Blockwise(), "Float8Tensorwise current": Float8Tensorwise(),
              "Float8Tensorwise delayed": Float8Tensorwise(scaling="delayed"), "MXFP8": MXFP8()}
COLORS = {"bf16": "#1f77b4", "Float8Blockwise": "#d62728", "Float8Tensorwise current": "#ff7f0e",
          "Float8Tensorwise delayed": "#9467bd", "MXFP8": "#2ca02c"}


def _smoothed(curve: tuple[float, ...], window: int = 15) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(curve):
        total += v - (curve[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def svg(runs: dict[str, Run], title: str) -> str:
    """Each run's loss per step (a moving mean of 15), one polyline each, with a legend."""
    width, height, pad = 640, 360, 50
    curves = {name: _smoothed(run.curve) for name, run in runs.items()}
    top = max(max(c) for c in curves.values())
    low = min(min(c) for c in curves.values())
    steps = max(len(c) for c in curves.values())

    def xy(i: int, v: float) -> str:
        x = pad + (width - 2 * pad) * i / (steps - 1)
        return f"{x:.1f},{height - pad - (height - 2 * pad) * (v - low) / (top - low):.1f}"

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             'font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{width / 2}" y="20" text-anchor="middle">{title}</text>',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
             f'<text x="{width / 2}" y="{height - 15}" text-anchor="middle">step</text>',
             f'<text x="{pad - 5}" y="{pad}" text-anchor="end">{top:.2f}</text>',
             f'<text x="{pad - 5}" y="{height - pad}" text-anchor="end">{low:.2f}</text>',
             f'<text x="{width - pad}" y="{height - pad + 15}" text-anchor="end">{steps}</text>']
    for k, (name, curve) in enumerate(curves.items()):
        color = COLORS.get(name.split(" ")[0], "black")
        points = " ".join(xy(i, v) for i, v in enumerate(curve))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}"/>')
        parts.append(f'<text x="{width - pad - 5}" y="{pad + 15 * k}" text-anchor="end" fill="{color}">{name}: '
                     f'held-out {runs[name].held_out:.4f}</text>')
    return "\n".join([*parts, "</svg>", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--activation", default="gelu", help="the FusedMLPs' activation (gated: no biases)")
    parser.add_argument("--argmax", action="store_true", help="labels: the teacher's argmax (separable)")
    parser.add_argument("--svg", type=Path, help="write the first seed's curves here")
    parser.add_argument("--only", action="append", choices=sorted(PRECISIONS),
                        help="train bf16 and this precision only (repeatable; default: every one)")
    args = parser.parse_args()
    print(f"# {datetime.date.today()}, {platform.node()}, torch {torch.__version__}, {args.steps} steps, "
          f"labels {'argmax' if args.argmax else 'sampled'}, activation {args.activation}")
    print("| seed | run | held-out loss | relative gap vs bf16 |\n|---|---|---|---|")
    for seed in range(args.seeds):
        runs = {"bf16": train(None, args.steps, seed, args.activation, sampled=not args.argmax)}
        for name, precision in PRECISIONS.items():
            if args.only and name not in args.only:
                continue
            runs[name] = train(precision, args.steps, seed, args.activation, sampled=not args.argmax)
        for name, run in runs.items():
            gap = "" if name == "bf16" else f"{100 * relative_gap(run, runs['bf16']):+.2f}%"
            print(f"| {seed} | {name} | {run.held_out:.4f} | {gap} |", flush=True)
        if seed == 0 and args.svg:
            args.svg.parent.mkdir(parents=True, exist_ok=True)
            title = f"FusedMLP x 2, {args.activation}: training loss ({args.steps} steps, seed 0)"
            args.svg.write_text(svg(runs, title))


if __name__ == "__main__":
    main()
