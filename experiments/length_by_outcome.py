"""Length drift of one task family split by outcome: full model right/wrong -> pruned or distilled \
right/wrong.

Why: the per-family length check flags gcd as lengthened by distillation (testbed-b 25%: +1.04 tokens, z 2.6).
Split by outcome, all of it sits in problems the full model gets wrong: where the student gets them right
(W->R) its chains are 8-14 tokens longer, since the full model's wrong Euclid chains stop early. On problems
both get right (R->R) the lengths match. Reads the reports of `python -m experiments.distill_bars bars` and
`replicate`, pooled over their samples (3,000 problems):

    python -m experiments.length_by_outcome runs/distill-bars7/testbed-a/testbed-a \
        runs/distill-bars7/testbed-b/testbed-b
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from experiments.distill_bars import pooled_run


def outcome_drift(full: dict, run: dict, family: str) -> dict[str, tuple[int, float]]:
    """{"R->W": (problems, mean length difference in tokens), ...} for one family; R = right, W = wrong."""
    groups: dict[str, list[int]] = defaultdict(list)
    for fam, fc, rc, fl, rl in zip(
        full["families"], full["correct"], run["correct"], full["lengths"], run["lengths"], strict=True
    ):
        if fam == family:
            groups[f"{'RW'[not fc]}->{'RW'[not rc]}"].append(rl - fl)
    return {k: (len(v), sum(v) / len(v)) for k, v in sorted(groups.items())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="bars output folders holding report.json and replicate.json")
    p.add_argument("--family", default="gcd")
    args = p.parse_args()
    print(f"| backbone | ratio | mode | {args.family} Δ tokens | R->R | R->W | W->R | W->W |")
    print("|---|---|---|---|---|---|---|---|")
    for folder in map(Path, args.runs):
        report = json.loads((folder / "report.json").read_text())
        rep = json.loads((folder / "replicate.json").read_text())
        full = pooled_run(report, rep)
        for ratio in sorted(report["ratios"]):
            for mode in ("slimwise", "distilled"):
                run = pooled_run(report, rep, ratio, mode)
                split = outcome_drift(full, run, args.family)
                n = sum(c for c, _ in split.values())
                total = sum(c * m for c, m in split.values()) / n
                cells = [f"{split[k][0]}: {split[k][1]:+.1f}" if k in split else "0" for k in
                         ("R->R", "R->W", "W->R", "W->W")]
                print(
                    f"| {report['model']} | {float(ratio):.0%} | {mode} | {total:+.2f} | "
                    f"{' | '.join(cells)} |"
                )


if __name__ == "__main__":
    main()
