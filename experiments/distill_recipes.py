"""Recipe probe: several SlimWise distillation recipes for one (backbone, ratio) from one shared teacher, each
scored on the pooled test samples of seeds 0, 1 and 2 (3,000 target-domain problems), with the per-family
length check. Uses the plan of a finished `python -m experiments.distill_bars bars` run.

    python -m experiments.distill_recipes testbed-b --run runs/distill-bars7/testbed-b/testbed-b --ratio 0.5 \
        --variants shared-down shared-mlp all-r4

Writes RUN/recipes-RATIO.json, keeping the variants of earlier runs. docs/results/distillation.md reports it.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from experiments.distill_bars import BarsConfig, evaluate_run, family_length_check, length_drift, pool_runs
from slimwise.distill import DistillConfig, TeacherData, build_teacher, distill
from slimwise.engines.reference import PhaseSplitEngine
from slimwise.io import atomic_write_text
from slimwise.models import load_model, load_tokenizer
from slimwise.plan import PrunePlan
from slimwise.testbed import TARGET_DOMAIN, make_split
from slimwise.testbed.tasks import select_families
from slimwise.trainable import ATTENTION_TARGETS, DENSE_MLP_TARGETS

VARIANTS = {
    # LoRA targets "auto": testbed-b's shared expert gate/up/down (= shared-mlp)
    "default": {},
    # the earlier default, LoRA on attention, and probes around it
    "attention": {"lora_targets": ATTENTION_TARGETS},
    "lr6e-3": {"lora_targets": ATTENTION_TARGETS, "lr": 6e-3},
    "steps1800": {"lora_targets": ATTENTION_TARGETS, "steps": 1800},
    "jsd": {"lora_targets": ATTENTION_TARGETS, "loss": "jsd"},
    # capacity beside the pruned experts: LoRA on the shared expert (Qwen2-MoE's gate/up/down), which every
    # decode token runs, added to the attention LoRA or instead of it
    "shared-down": {"lora_targets": (*ATTENTION_TARGETS, "down_proj")},
    "shared-mlp": {"lora_targets": DENSE_MLP_TARGETS},
    "shared-mlp-1800": {"lora_targets": DENSE_MLP_TARGETS, "steps": 1800},
    "all-r4": {"lora_targets": (*ATTENTION_TARGETS, *DENSE_MLP_TARGETS), "lora_rank": 4, "lora_alpha": 8.0},
    # greedy fidelity: + cross-entropy on the full model's own tokens widens the student's margin for the
    # teacher's argmax where the teacher itself is unsure, which is where greedy outputs flip
    "ce0.5": {"ce_weight": 0.5},
    "ce1": {"ce_weight": 1.0},
}


def calib_prompts(per_family: int) -> list[str]:
    """`per_family` calibration prompts of each target-domain family, or as many as the family has (base
    conversions have about 1,400 distinct ones)."""
    if per_family <= 1000:
        return [s.prompt for s in make_split("calib", per_family, domain=TARGET_DOMAIN)]
    prompts = []
    for family in select_families(None, TARGET_DOMAIN):
        n = per_family
        while True:
            try:
                prompts += [s.prompt for s in make_split("calib", n, families=[family])]
                break
            except RuntimeError:  # the family has fewer distinct problems
                n -= 100
        print(f"{family}: {n} prompts", flush=True)
    return prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--run", required=True, help="a bars output folder holding plan-RATIO.json")
    p.add_argument("--ratio", default="0.5")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--per-family", type=int, default=1000, help="distillation prompts per task family")
    p.add_argument("--teacher", help="teacher data file: loaded if it exists, else built and saved there")
    p.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), default=["attention", "lr6e-3", "steps1800", "jsd"]
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype="float32"), load_tokenizer(args.model)
    plan = PrunePlan.load(Path(args.run) / f"plan-{args.ratio}.json")
    prompts = calib_prompts(args.per_family)
    t0 = time.perf_counter()
    if args.teacher and Path(args.teacher).is_file():
        teacher = TeacherData.load(args.teacher)
    else:
        teacher = build_teacher(model, prompts, tok, DistillConfig(progress=False))
        if args.teacher:
            teacher.save(args.teacher)
    print(f"teacher {time.perf_counter() - t0:.0f}s", flush=True)
    samples = [make_split("test", 200, seed=s, domain=TARGET_DOMAIN) for s in (0, 1, 2)]
    cfg = BarsConfig()
    full = pool_runs([evaluate_run(PhaseSplitEngine(model, tok), s, "full", cfg) for s in samples])
    with PhaseSplitEngine(model, tok, plan=plan) as engine:
        # masks and deltas stack on the model: one at a time
        sw = pool_runs([evaluate_run(engine, s, "slimwise", cfg) for s in samples])
    print(f"full {full['accuracy']:.1f} slimwise {sw['accuracy']:.1f}", flush=True)
    out = {}
    for name in args.variants:
        label = name if args.per_family == 1000 else f"{name}@{args.per_family}"
        extra = VARIANTS[name]
        config = DistillConfig(**(asdict(DistillConfig(progress=False)) | extra))
        delta = distill(model, plan, prompts, tok, config, teacher=teacher)
        with PhaseSplitEngine(model, tok, plan=plan, delta=delta) as engine:
            d = pool_runs([evaluate_run(engine, s, "distilled", cfg) for s in samples])
        check = family_length_check(sw, d, full)
        out[label] = {
            "accuracy": d["accuracy"],
            "trainable_share": delta.manifest["trainable_share"],
            "train_seconds": delta.manifest["train_seconds"],
            "loss_last": delta.manifest["loss_history"][-1],
            "drift": length_drift(d, full),
            "family_halved": check["halved"],
            "new_drift": check["new_drift"],
            "family_drift": {f: round(x["distilled"]["mean_diff"], 3) for f, x in check["families"].items()},
        }
        print(label, json.dumps(out[label]), flush=True)
    path = Path(args.run) / f"recipes-{args.ratio}.json"
    # runs of other variants stay
    earlier = json.loads(path.read_text())["variants"] if path.is_file() else {}
    atomic_write_text(path, json.dumps({"full": full["accuracy"], "slimwise": sw["accuracy"],
                                        "variants": earlier | out}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
