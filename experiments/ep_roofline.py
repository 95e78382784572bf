"""Predicted decode speedup under expert parallelism, free vs EP-balanced plans (docs/results/roofline.md):
Qwen3.6-35B-A3B and Qwen3-30B-A3B at EP 8 on H200 (NVLink 4), 50% pruned, global batch 32-256.

  python -m experiments.ep_roofline --out docs/results
  # table printed, roofline_ep.md + .png written; bit-exact
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lab.perf.ep import INTERCONNECTS, predict_ep, random_plan_imbalance
from slimwise.io import atomic_write_text
from slimwise.perf.presets import preset_config
from slimwise.perf.roofline import HARDWARE, RooflineConfig, kept_experts

PRESETS = ("qwen3.6-35b-a3b", "qwen3-30b-a3b")
BATCHES = [32, 64, 128, 256]
#: busiest / mean kept experts at EP 8 of the testbeds' REAP 50% plans (linear placement, mean over layers;
#: docs/deployment.md): 8 experts per rank there, so an upper scenario for 16-32 per rank
TESTBED_IMBALANCE = 1.6


def scenarios(rc: RooflineConfig, ratio: float, ep: int) -> dict[str, float]:
    kept = kept_experts(rc.num_experts, ratio, rc.top_k)
    return {"balanced": 1.0, "free (random plan)": random_plan_imbalance(rc.num_experts, kept, ep),
            f"free (testbed REAP, {TESTBED_IMBALANCE:g})": TESTBED_IMBALANCE}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.ep_roofline")
    p.add_argument("--out", default="runs/ep-roofline")
    p.add_argument("--ep", type=int, default=8)
    p.add_argument("--ratio", type=float, default=0.5)
    args = p.parse_args(argv)
    hw, link = HARDWARE["h200"], INTERCONNECTS["nvlink4"]
    lines = [
        "| model | plan (busiest / mean kept per rank) | " + " | ".join(f"B={b}" for b in BATCHES) + " |",
        "|---|---|" + "---|" * len(BATCHES),
    ]
    curves = {}
    for preset in PRESETS:
        rc = RooflineConfig.from_hf(preset_config(preset), name=preset)
        for label, imb in scenarios(rc, args.ratio, args.ep).items():
            preds = predict_ep(rc, hw, link, args.ratio, BATCHES, args.ep, imb)
            curves[f"{preset}: {label}"] = preds
            lines.append(f"| {preset} | {label}: {imb:.2f} | " + " | ".join(
                f"{x.speedup:.2f}x" for x in preds) + " |")
        a2a = predict_ep(rc, hw, link, args.ratio, BATCHES, args.ep, 1.0)
        lines.append(f"| {preset} | all-to-all share of the full step | " + " | ".join(
            f"{100 * x.a2a_s / x.time_full_s:.0f}%" for x in a2a) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n"
    atomic_write_text(out / "roofline_ep.md", text)
    print(text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, preds in curves.items():
        ax.plot([x.batch for x in preds], [x.speedup for x in preds], marker="o",
                linestyle="-" if label.startswith(PRESETS[0]) else "--", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global decode batch (sequences over 8 GPUs)")
    ax.set_ylabel(f"predicted decode speedup at {int(args.ratio * 100)}% pruned")
    ax.set_title(f"EP {args.ep} on H200 (NVLink 4): free vs EP-balanced plans")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "roofline_ep.png", dpi=120)
    print(f"wrote {out / 'roofline_ep.md'} and {out / 'roofline_ep.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
