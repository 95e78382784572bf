"""A several-plan engine's decode speed with nested plans against independent ones (`slimwise bench` mix-P).

One engine holds plan a (50%) and plan b (75%); a mixed step reads the union of the experts its
requests' plans keep. Nested (b's kept set inside a's, what `slimwise plan --nested` writes) keeps that
union at a's set; independent plans (the same sizes, chosen apart: here a random 75% plan, seed 1) widen it.
Both benches run the same model, plan a and settings; mix-P speedups pair each round's mix with that round's
full run:

    python -m experiments.nested_mix --work runs/nested-mix --out docs/results/perf --repetitions 5

Plans: a = the bench's random 50% per layer (seed 0); b nested = a random 75% per layer drawn inside a (seed
1); b independent = a random 75% per layer (seed 1). Random plans, because speed depends on how many experts a
step reads, not which (as the bench's other variants).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from slimwise.baseline_plans import random_plan
from slimwise.models import load_model
from slimwise.plan import make_plan


def bench(args, plan_a: Path, plan_b: Path, out: Path) -> None:
    if (out / "bench.json").is_file():
        return
    cmd = [str(Path(sys.executable).parent / "slimwise"), "bench", "--synthetic", args.preset,
           "--synthetic-dir", str(Path(args.work) / "model"), "--plan", str(plan_a), "--plan-b", str(plan_b),
           "--variants", "full", "slimwise", "mix-50", "mix-90", "--batch", str(args.batch),
           "--output-len", "64", "--repetitions", str(args.repetitions), "--hardware", "none",
           "--in-process", "--out", str(out)]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repetitions", type=int, default=3)
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    if not (model_dir / "config.json").is_file():
        from slimwise.perf.presets import build_synthetic

        build_synthetic(args.preset, model_dir)
    model = load_model(str(model_dir), dtype="auto")
    a = random_plan(model, 0.5, 0)
    a.save(work / "a.json")
    layers = sorted(a.kept_experts)
    scores = torch.rand(len(layers), a.num_experts, generator=torch.Generator().manual_seed(1))
    allowed = torch.stack([~a.pruned_mask(layer) for layer in layers])
    common = dict(family=a.family, top_k=a.top_k, num_groups=a.num_groups, criterion="random",
                  fingerprint=a.fingerprint, meta={"seed": 1})
    nested = make_plan(scores, layers, 0.75, allowed=allowed, **common)
    independent = random_plan(model, 0.75, 1)
    del model
    rows = {}
    for name, b in (("nested", nested), ("independent", independent)):
        b.save(work / f"b-{name}.json")
        union = sum(len(set(a.kept(layer)) | set(b.kept(layer))) for layer in layers) / len(layers)
        bench(args, work / "a.json", work / f"b-{name}.json", work / name)
        rows[name] = {"union_kept_per_layer": union,
                      "bench": json.loads((work / name / "bench.json").read_text())}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "nested-mix.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
