"""The model-card command line, `python -m slimwise.testbed.evaluate card|evaluate ...`: its parser and
what each subcommand does.

It runs on the card functions of the module it is handed (`evaluate_and_write_card`, `pruning_regime`,
`write_card`, `ship`): slimwise.testbed.evaluate hands over itself from its `__main__` block (tests hand over
the imported module). So this module imports neither the evaluation nor the trainer, and the entry point
imports it one way only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from slimwise.io import atomic_write_text


def build_card_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m slimwise.testbed.evaluate",
                                description="model cards of trained testbed backbones")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("card",
                       help="add the pruning regime from a `slimwise eval` report and rewrite README.md")
    c.add_argument("model_dir")
    c.add_argument("--pruning-report", help="report.json of `slimwise eval` on this model (target domain)")
    c.add_argument("--pruning-command", default="slimwise eval", help="the command that wrote the report")
    c.add_argument("--ship", metavar="NAME",
                   help="then copy the model into the package as NAME (testbed-a|b|c)")
    e = sub.add_parser("evaluate", help="evaluate a trained model directory (a run with --no-eval) and write "
                                        "its eval.json and README.md")
    e.add_argument("model_dir")
    e.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="float32 on CPUs without bf16 units (the bf16 weights upcast exactly)")
    return p


def card_command(card: ModuleType, argv: Sequence[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv) on `card`'s functions; the exit code."""
    args = build_card_parser().parse_args(argv)
    out = Path(args.model_dir)
    if args.command == "evaluate":
        return _evaluate_run(card, out, args.dtype)
    if args.pruning_report:
        _add_pruning_regime(card, out, args.pruning_report, args.pruning_command)
    print(card.write_card(out))
    if args.ship:
        print(card.ship(out, args.ship))
    return 0


def _evaluate_run(card: ModuleType, out: Path, dtype: str) -> int:
    """`evaluate RUN`: evaluate a finished `--no-eval` training run and write its eval.json and card."""
    config = out / "train_config.json"
    if not (config.is_file() and (out / "train_summary.json").is_file()):
        print(f"error: {out} has no train_config.json and train_summary.json: pass the --out directory of a "
              "finished `python -m slimwise.testbed.train` run", file=sys.stderr)
        return 2
    result = card.evaluate_and_write_card(out, json.loads(config.read_text()), dtype=dtype)
    t = result["test"]
    domains = ", ".join(f"{d} {v['accuracy']:.1%}" for d, v in t["domains"].items())
    weakest = min(t["families"], key=lambda f: t["families"][f]["accuracy"])
    print(f"test: {domains}; weakest family {weakest} {t['families'][weakest]['accuracy']:.1%}")
    print(out / "README.md")
    return 0


def _add_pruning_regime(card: ModuleType, out: Path, report: str, command: str) -> None:
    """`card --pruning-report`: the pruning regime of a `slimwise eval` report, into the run's eval.json."""
    ev_path = out / "eval.json"
    ev = json.loads(ev_path.read_text())
    ev["pruning"] = card.pruning_regime(json.loads(Path(report).read_text()), report, command)
    atomic_write_text(ev_path, json.dumps(ev, indent=2) + "\n")
    for phase, ph in ev["pruning"]["phases"].items():
        band = "in" if ph["in_band"] else "NOT in"
        print(f"{phase}: best {ph['best_criterion']}, uniform 50% costs {ph['uniform50_cost_points']:.1f} "
              f"points, length {ph['uniform50_length_change_pct']:+.1f}% -> {band} band")
