"""Command lines of the testbed: train a backbone (`python -m slimwise.testbed.train`) and write or ship its model
card (`python -m slimwise.testbed.evaluate card`). A thin layer over `train.py` and `evaluate.py`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from slimwise.argtypes import integer
from slimwise.io import atomic_write_text
from slimwise.testbed.backbones import BACKBONES, DEFAULT_FAMILY_WEIGHTS
from slimwise.testbed.evaluate import evaluate_and_write_card, pruning_regime, ship, write_card
from slimwise.testbed.fast_experts import FAST_EXPERTS
from slimwise.testbed.train import TrainConfig, train


def train_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slimwise.testbed.train", description="train a testbed backbone")
    p.add_argument("--backbone", choices=sorted(BACKBONES), required=True)
    p.add_argument("--out", required=True, help="output directory (model, tokenizer, log, resumable state)")
    p.add_argument("--minutes", type=float, default=45.0, help="hard wall-clock budget of the training loop")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt")
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--optimizer", choices=("adamw", "muon"), default=TrainConfig.optimizer,
                   help="muon: Muon on hidden matrices and expert stacks, AdamW on the rest (slimwise/testbed/muon.py)")
    p.add_argument("--samples-per-family", type=int, default=TrainConfig.samples_per_family)
    p.add_argument("--row-groups", type=integer(1), default=TrainConfig.row_groups,
                   help="row packing: length-sorted micro-batches per step (more: less padding, more calls)")
    p.add_argument("--packing", choices=("auto", "packed", "rows"), default="auto",
                   help="auto: one sample per row for hybrid (linear-attention) models, packed rows otherwise; "
                        "packed on a hybrid resets the Gated-DeltaNet state at every sample (packed_linear_attention)")
    p.add_argument("--seq-len", type=integer(1), default=TrainConfig.seq_len,
                   help="packed row length in tokens (at least the longest sample: 140 in the train split)")
    p.add_argument("--family-weights", default=None, help="e.g. gcd=2,base=1.5 (default: DEFAULT_FAMILY_WEIGHTS)")
    p.add_argument("--override", action="append", default=[], help="model config field=value (JSON value)")
    p.add_argument("--experts-impl", default=FAST_EXPERTS, help=f"{FAST_EXPERTS} | grouped_mm | eager | ...")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = auto (1 or 2, re-measured)")
    p.add_argument("--ranks", type=integer(1), default=1,
                   help="data-parallel processes of one thread each (see slimwise/testbed/cpu_parallel.py)")
    p.add_argument("--eval-n", type=int, default=TrainConfig.eval_n_per_family, help="test prompts per family")
    p.add_argument("--heldout-n", type=int, default=TrainConfig.heldout_n_per_family)
    p.add_argument("--no-pair-init", action="store_true", help="random rows for ' word' / 'word' token pairs")
    p.add_argument("--no-spaced-pairs", action="store_true",
                   help="no ' Name' tokens beside 'Name': a qa name is one token in passage and solution alike")
    p.add_argument("--no-eval", action="store_true", help="skip the final evaluation and model card")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    overrides = {}
    for item in args.override:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)
    weights = dict(DEFAULT_FAMILY_WEIGHTS) if args.family_weights is None else {
        k: float(v) for k, v in (kv.split("=") for kv in args.family_weights.split(",") if kv)}
    config = TrainConfig(backbone=args.backbone, out=args.out, minutes=args.minutes, max_steps=args.max_steps,
                         seed=args.seed, resume=args.resume, lr=args.lr, samples_per_family=args.samples_per_family,
                         family_weights=weights, model_overrides=overrides, experts_implementation=args.experts_impl,
                         threads=args.threads, eval_n_per_family=args.eval_n, heldout_n_per_family=args.heldout_n,
                         progress=not args.no_progress, pair_init=not args.no_pair_init, packing=args.packing,
                         spaced_pairs=not args.no_spaced_pairs, ranks=args.ranks,
                         row_groups=args.row_groups, seq_len=args.seq_len,
                         optimizer=args.optimizer)
    out = train(config)
    if not args.no_eval:
        evaluate_and_write_card(out, config)
    print(out)
    return 0


def card_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slimwise.testbed.evaluate",
                                description="model cards of trained testbed backbones")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("card", help="add the pruning regime from a `slimwise eval` report and rewrite README.md")
    c.add_argument("model_dir")
    c.add_argument("--pruning-report", help="report.json of `slimwise eval` on this model (target domain)")
    c.add_argument("--pruning-command", default="slimwise eval", help="the command that wrote the report")
    c.add_argument("--ship", metavar="NAME", help="then copy the model into the package as NAME (testbed-a|b|c)")
    e = sub.add_parser("evaluate", help="evaluate a trained model directory (a run with --no-eval) and write its "
                                        "eval.json and README.md")
    e.add_argument("model_dir")
    e.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="float32 on CPUs without bf16 units (the bf16 weights upcast exactly)")
    args = p.parse_args(argv)
    out = Path(args.model_dir)
    if args.command == "evaluate":
        config = out / "train_config.json"
        if not (config.is_file() and (out / "train_summary.json").is_file()):
            print(f"error: {out} has no train_config.json and train_summary.json: pass the --out directory of a "
                  "finished `python -m slimwise.testbed.train` run", file=sys.stderr)
            return 2
        result = evaluate_and_write_card(out, json.loads(config.read_text()), dtype=args.dtype)
        t = result["test"]
        domains = ", ".join(f"{d} {v['accuracy']:.1%}" for d, v in t["domains"].items())
        weakest = min(t["families"], key=lambda f: t["families"][f]["accuracy"])
        print(f"test: {domains}; weakest family {weakest} {t['families'][weakest]['accuracy']:.1%}")
        print(out / "README.md")
        return 0
    if args.pruning_report:
        ev_path = out / "eval.json"
        ev = json.loads(ev_path.read_text())
        ev["pruning"] = pruning_regime(json.loads(Path(args.pruning_report).read_text()), args.pruning_report,
                                       args.pruning_command)
        atomic_write_text(ev_path, json.dumps(ev, indent=2) + "\n")
        for phase, ph in ev["pruning"]["phases"].items():
            print(f"{phase}: best {ph['best_criterion']}, uniform 50% costs {ph['uniform50_cost_points']:.1f} points, "
                  f"length {ph['uniform50_length_change_pct']:+.1f}% -> {'in' if ph['in_band'] else 'NOT in'} band")
    print(write_card(out))
    if args.ship:
        print(ship(out, args.ship))
    return 0
