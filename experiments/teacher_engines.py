"""A delta distilled from vLLM's teacher data against one distilled from the reference engine's: accuracy on
the same test problems.

`slimwise distill --teacher-engine vllm` builds the teacher data (continuations and log-probs) in vLLM. The
test (tests/test_vllm_teacher.py) shows the data equal within 1e-4 and 10 steps' deltas equal within 1e-4;
this runs whole trainings on both and grades them:

    python -m experiments.teacher_engines --out docs/results/teacher-engines

testbed-a in float32 (vLLM's CPU float32 continuations equal the reference's there), REAP 50% from decode
calibration on the calib split (seed 0), distillation prompts from the calib split (seed 1, disjoint problems
from the test split), the default recipe (router + norm + LoRA) for --steps steps, then the test split (seed
0) greedy in mode distilled; paired bootstrap of the accuracy difference. Everything is seeded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from slimwise.calibrate import CalibrationConfig, calibrate
from slimwise.criteria import plan_from_stats
from slimwise.distill import DistillConfig, build_teacher, distill, teacher_from_parts, vllm_teacher
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.evaluation.metrics import paired_difference
from slimwise.evaluation.samples import load_samples, make_grader
from slimwise.hardware import describe
from slimwise.models import load_model, load_tokenizer, resolve_model_dir
from slimwise.testbed import TARGET_DOMAIN, make_split

MODEL = "testbed-a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--per-family", type=int, default=48, help="test problems per family")
    args = parser.parse_args()
    model, tok = load_model(MODEL, dtype="float32"), load_tokenizer(MODEL)
    calib = [s.prompt for s in make_split("calib", 16, seed=0, domain=TARGET_DOMAIN)]
    stats = calibrate(model, calib, tok, CalibrationConfig(max_new_tokens=96), progress=False)
    plan = plan_from_stats(stats, "reap", 0.5)
    prompts = [s.prompt for s in make_split("calib", 32, seed=1, domain=TARGET_DOMAIN)]
    config = DistillConfig(steps=args.steps, progress=False)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    vocab = model.get_output_embeddings().weight.shape[0]
    from_vllm = vllm_teacher(resolve_model_dir(MODEL), ids, config, vocab, tok, dtype="float32")
    teachers = {"hf": build_teacher(model, prompts, tok, config),
                "vllm": teacher_from_parts(model, ids, *from_vllm, config)}
    samples = load_samples(split="test", n_per_family=args.per_family, seed=0, domain=TARGET_DOMAIN)
    grader = make_grader("testbed")
    gen = GenerationConfig(max_new_tokens=160, batch_size=32)
    correct, rows = {}, {}
    for name, teacher in teachers.items():
        delta = distill(model, plan, prompts, tok, config, teacher=teacher)
        with PhaseSplitEngine(model, tok, plan=plan, delta=delta) as engine:
            gens = engine.generate([s.prompt for s in samples], "distilled", gen)
        correct[name] = [bool(grader(s, g)) for s, g in zip(samples, gens, strict=True)]
        rows[name] = {"accuracy": sum(correct[name]) / len(samples),
                      "loss_last": delta.manifest["loss_history"][-1],
                      "teacher_continuations_equal_hf": teacher.continuations == teachers["hf"].continuations}
    diff = paired_difference(correct["vllm"], correct["hf"], seed=0)
    report = {"model": MODEL, "steps": args.steps, "test_problems": len(samples), "rows": rows,
              "vllm_minus_hf": diff, "machine": describe()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "teacher_engines.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
