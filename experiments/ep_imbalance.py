"""How unevenly ordinary (free) plans leave experts across expert-parallel ranks: busiest rank's kept experts
over the mean, per layer (mean and max over layers), for the committed REAP plans of the testbeds.

  python -m experiments.ep_imbalance            # prints the Markdown table of docs/results/roofline.md
"""

from __future__ import annotations

from pathlib import Path

from slimwise.expert_parallel import imbalance
from slimwise.plan import PrunePlan

ROOT = Path(__file__).resolve().parents[1] / "docs" / "results"


def table(backbones=("testbed-a", "testbed-b", "testbed-c"), ratios=(0.25, 0.5), sizes=(2, 4, 8)) -> str:
    lines = [
        "| backbone | experts | plan | " + " | ".join(f"EP {n} linear / round-robin" for n in sizes) + " |",
        "|---|---|---|" + "---|" * len(sizes),
    ]
    for name in backbones:
        for ratio in ratios:
            plan = PrunePlan.load(ROOT / name / "plans" / f"reap-decode-{ratio}.json")
            cells = []
            for n in sizes:
                lin, rr = imbalance(plan, n, "linear"), imbalance(plan, n, "round_robin")
                cells.append(
                    f"{lin['mean']:.2f} (max {lin['max']:.2f}) / {rr['mean']:.2f} (max {rr['max']:.2f})"
                )
            lines.append(
                f"| {name} | {plan.num_experts} | REAP decode {ratio:g} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
