"""SlimWise against classic pruning calibrated as classic pruners calibrate, with exact paired tests
(results: docs/results/fair-baseline.md).

Reads the per-problem outcomes batch_budgets.py committed (docs/results/batch-budgets/batch-budgets.json:
REAP, float32 reference engine, greedy, batch 32, 240 arithmetic problems of test seed 0; static SlimWise =
decode-calibrated plan, uniform = both phases pruned with the plan calibrated on whole sequences, each over
calibration seeds 0, 1, 2; testbed-a-long at 1,024 characters, 150 problems, calibration seed 0, with seeds
1 and 2 from experiments.fair_long_seeds in docs/results/fair-baseline/) and tests, per calibration seed,
SlimWise against uniform with McNemar's exact test, Holm-corrected over every comparison of the table. A
lead counts only where it is significant at every calibration seed (the rule docs/results/protocol.md
pre-registers for the final split; this table is on the test split every earlier decision used).

    python -m experiments.fair_baseline --out docs/results

The analysis is a pure function of the JSON: a rerun writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from slimwise.evaluation.metrics import holm, mcnemar_exact
from slimwise.io import atomic_write_text

SOURCE = Path("docs/results/batch-budgets/batch-budgets.json")
#: more calibration seeds of the long-prompt rows (`experiments.fair_long_seeds`: long-seed{S}.json)
LONG_SEEDS = Path("docs/results/fair-baseline")
MODELS = ("testbed-a", "testbed-b", "testbed-c")
RATIOS = ("0.25", "0.5", "0.75")
SEEDS = ("0", "1", "2")
ALPHA = 0.05


def _cell(static: dict, uniform: dict) -> dict:
    test = mcnemar_exact(static["correct"], uniform["correct"])
    return {"slimwise": static["accuracy"], "uniform": uniform["accuracy"],
            "diff": static["accuracy"] - uniform["accuracy"], **test}


def analyse(results: dict, long_seeds: dict[str, dict] | None = None,
            by_length: dict[str, dict] | None = None) -> dict:
    """Every (model, ratio, calibration seed) comparison on short prompts and the long-prompt ones (seed 0
    from `results`, the others from `long_seeds`: seed -> fair_long_seeds output on the same problems; the
    shorter prompt lengths at 50% from `by_length`: seed -> its --by-length output), with Holm's correction
    over all of them."""
    rows = []
    for model in MODELS:
        full = results["models"][model]["full"]["0"]["accuracy"]
        for ratio in RATIOS:
            grid = results["grid"][model]
            seeds = {s: _cell(grid["static"][ratio][s], grid["uniform"][ratio][s]) for s in SEEDS}
            rows.append({"model": model, "prompt": "short", "ratio": float(ratio), "full": full,
                         "seeds": seeds})
    rows += _length_rows(by_length or {})
    for long in (results["long_ratios"]["0.25"], results["long"], results["long_ratios"]["0.75"]):
        seeds = {"0": _cell(long["static"], long["uniform"])}
        for seed, extra in sorted((long_seeds or {}).items()):
            if extra["full"]["correct"] != long["full"]["correct"]:
                raise ValueError(f"long-prompt seed {seed}: not the problems or the full model of seed 0")
            cells = extra["ratios"][f"{long['ratio']:g}"]
            seeds[seed] = _cell(cells["static"], cells["uniform"])
        rows.append({"model": "testbed-a-long", "prompt": f"{long['length']} chars", "ratio": long["ratio"],
                     "full": long["full"]["accuracy"], "seeds": seeds})
    cells = [c for r in rows for c in r["seeds"].values()]
    for c, p in zip(cells, holm([c["p_exact"] for c in cells]), strict=True):
        c["p_holm"] = p
    for r in rows:
        signs = {c["diff"] > 0 and c["p_holm"] < ALPHA for c in r["seeds"].values()}
        r["lead"] = signs == {True}
    return {"source": str(SOURCE), "machine": results.get("machine"), "alpha": ALPHA,
            "long_seeds": ["0", *sorted(long_seeds or {})], "by_length_seeds": sorted(by_length or {}),
            "comparisons": len(cells), "rows": rows}


def _length_rows(by_length: dict[str, dict]) -> list[dict]:
    """testbed-a-long at 50% at each shorter prompt length, one comparison per calibration seed (the same
    problems and full model at every seed: checked)."""
    rows = []
    seeds = sorted(by_length)
    for length in sorted({int(n) for d in by_length.values() for n in d["lengths"]}):
        cells = {s: by_length[s]["lengths"][str(length)] for s in seeds}
        if len({json.dumps(c["full"]["correct"]) for c in cells.values()}) != 1:
            raise ValueError(f"{length} characters: the seeds did not run the same problems")
        first = cells[seeds[0]]
        rows.append({"model": "testbed-a-long", "prompt": f"{length} chars",
                     "ratio": by_length[seeds[0]]["ratio"], "full": first["full"]["accuracy"],
                     "seeds": {s: _cell(c["static"], c["uniform"]) for s, c in cells.items()}})
    return rows


def _by_length_note(report: dict) -> str:
    seeds = report.get("by_length_seeds")
    return (f"; the shorter lengths at 50%: `python -m experiments.fair_long_seeds --by-length --seeds "
            f"{' '.join(seeds)}`, 150 problems each." if seeds else ".")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def markdown(report: dict) -> str:
    lines = [
        "# SlimWise against classic pruning calibrated on whole sequences, with exact tests",
        "",
        "Generated by `python -m experiments.fair_baseline --out docs/results` from the per-problem "
        f"outcomes in `{report['source']}` (machine: {report['machine']}). REAP; SlimWise = full prefill, "
        "decode pruned with the plan calibrated on decode tokens; uniform = classic pruning of both phases "
        "with the plan calibrated on whole sequences, as classic pruners calibrate. 240 arithmetic problems "
        "of test seed 0 (short prompts), batch 32; testbed-a-long: 150 problems at 1,024 characters, "
        f"calibration seeds {', '.join(report['long_seeds'])} (seeds other than 0: "
        "`python -m experiments.fair_long_seeds`, per-problem outcomes in fair-baseline/)"
        + _by_length_note(report),
        "",
        "Per calibration seed: accuracy SlimWise / uniform, the discordant problems (SlimWise only : "
        f"uniform only) and McNemar's exact p, Holm-adjusted over all {report['comparisons']} comparisons of "
        f"this table. A lead is claimed only where SlimWise is ahead with adjusted p < {report['alpha']} at "
        "every calibration seed.",
        "",
        "| model | prompts | pruned | full | SlimWise (mean over seeds) | uniform (mean) | "
        "per seed: SlimWise / uniform, discordant, Holm p | lead |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        seeds = list(r["seeds"].values())
        per = "; ".join(f"{_pct(c['slimwise'])} / {_pct(c['uniform'])}, {c['a_only']}:{c['b_only']}, "
                        f"p {c['p_holm']:.2g}" for c in seeds)
        means = (_pct(_mean([c[k] for c in seeds])) for k in ("slimwise", "uniform"))
        lines.append(f"| {r['model']} | {r['prompt']} | {100 * r['ratio']:.0f}% | {_pct(r['full'])} | "
                     f"{' | '.join(means)} | {per} | {'yes' if r['lead'] else 'no'} |")
    leads = [f"{r['model']} {r['prompt']} {100 * r['ratio']:.0f}%" for r in report["rows"] if r["lead"]]
    lines += ["", f"Leads that hold at every calibration seed after Holm: {', '.join(leads) or 'none'}.",
              "",
              "Caveats: the test split served every earlier decision (docs/results/protocol.md); the final "
              "tables will come from the reserved final split.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=Path, default=SOURCE)
    parser.add_argument("--long-seeds", type=Path, default=LONG_SEEDS, help="folder of long-seed*.json")
    parser.add_argument("--out", type=Path, required=True, help="folder for fair-baseline.md / .json")
    args = parser.parse_args(argv)
    long_seeds = {p.stem.removeprefix("long-seed"): json.loads(p.read_text())
                  for p in sorted(args.long_seeds.glob("long-seed*.json"))}
    by_length = {p.stem.removeprefix("by-length-seed"): json.loads(p.read_text())
                 for p in sorted(args.long_seeds.glob("by-length-seed*.json"))}
    report = analyse(json.loads(args.source.read_text()), long_seeds, by_length)
    report["source"] = str(SOURCE if args.source.resolve() == SOURCE.resolve() else args.source)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "fair-baseline.json", json.dumps(report, indent=1) + "\n")
    atomic_write_text(args.out / "fair-baseline.md", markdown(report))


if __name__ == "__main__":
    main()
