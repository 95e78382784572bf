"""What EP balancing costs in accuracy: REAP plans free vs EP-balanced (same ratio, decode calibration on the
target domain), SlimWise mode, on the testbeds' arithmetic test split, with paired bootstrap intervals.

  python -m experiments.ep_balance_quality --out runs/ep-balance      # writes ep_balance.json / .md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from slimwise.calibrate import CalibrationConfig, calibrate
from slimwise.criteria import plan_from_stats
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.evaluation.metrics import paired_difference
from slimwise.expert_parallel import imbalance
from slimwise.io import atomic_write_text
from slimwise.models import load_model, load_tokenizer
from slimwise.testbed import TARGET_DOMAIN, grade, make_split


def accuracy(engine: PhaseSplitEngine, samples, mode: str, gen: GenerationConfig) -> list[int]:
    outs = engine.generate(engine.encode([s.prompt for s in samples]), mode, gen)
    return [
        int(grade(s, o.text or "", o.finish_reason == "eos").correct)
        for s, o in zip(samples, outs, strict=True)
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.ep_balance_quality")
    p.add_argument("models", nargs="*", default=["testbed-a", "testbed-b", "testbed-c"])
    p.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5])
    p.add_argument("--ep-size", type=int, default=8)
    p.add_argument("--per-family", type=int, default=100)
    p.add_argument("--seed", type=int, default=0, help="test sample and bootstrap seed")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/ep-balance")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = GenerationConfig(max_new_tokens=160, batch_size=32)
    rows, lines = (
        [],
        [
            f"| backbone | ratio | full % | free % | EP-{args.ep_size}-balanced % | balanced - free, points "
            f"(95% CI) | free plan's imbalance at EP {args.ep_size} (mean / max) |",
            "|---|---|---|---|---|---|---|",
        ],
    )
    for name in args.models:
        model, tok = load_model(name, dtype="float32"), load_tokenizer(name)
        calib = make_split("calib", 16, domain=TARGET_DOMAIN)
        stats = calibrate(model, [s.prompt for s in calib], tok,
                          CalibrationConfig(phase="decode", max_new_tokens=128), progress=False)
        samples = make_split("test", args.per_family, seed=args.seed, domain=TARGET_DOMAIN)
        full = accuracy(PhaseSplitEngine(model, tok), samples, "full", gen)
        for ratio in args.ratios:
            free = plan_from_stats(stats, "reap", ratio)
            bal = plan_from_stats(stats, "reap", ratio, ep_size=args.ep_size)
            a = accuracy(PhaseSplitEngine(model, tok, plan=free), samples, "slimwise", gen)
            b = accuracy(PhaseSplitEngine(model, tok, plan=bal), samples, "slimwise", gen)
            d = paired_difference(b, a, seed=args.seed)
            imb = imbalance(free, args.ep_size)
            overlap = sum(
                len(set(free.kept_experts[k]) & set(bal.kept_experts[k])) for k in free.kept_experts
            ) / sum(len(v) for v in free.kept_experts.values())
            row = {"model": name, "ratio": ratio, "n": len(samples), "full": 100 * sum(full) / len(full),
                   "free": 100 * sum(a) / len(a), "balanced": 100 * sum(b) / len(b),
                   "diff": {k: 100 * v for k, v in d.items()}, "imbalance": imb, "kept_overlap": overlap}
            rows.append(row)
            lines.append(
                f"| {name} | {ratio:g} | {row['full']:.1f} | {row['free']:.1f} | {row['balanced']:.1f} | "
                f"{row['diff']['diff']:+.1f} ({row['diff']['ci_low']:+.1f} to {row['diff']['ci_high']:+.1f}) "
                f"| {imb['mean']:.2f} / {imb['max']:.2f} |"
            )
            print(lines[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(
        out / "ep_balance.json", json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n"
    )
    atomic_write_text(out / "ep_balance.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
