"""One recipe with llm-compressor: quantize testbed-a to W4A16 with `oneshot` (GPTQ), then SlimWise calibrate,
plan and prune the quantized checkpoint; and the other order (prune the bf16 model, then quantize the pruned
checkpoint). Accuracy of every model on the same test problems, in the reference engine:

    bash scripts/llmcompressor_env.sh            # llm-compressor's own environment, .venv-llmcompressor
    python -m experiments.llmcompressor_recipe --work /tmp/llmc --out docs/results/llmcompressor

Quantize then prune (the recipe): Q = oneshot(testbed-a); stats = calibrate(Q, decode phase); plan = REAP
50%; `slimwise prune Q --plan plan` slices the packed int4 weights and their scales from the files (nothing
is dequantized). Rows: Q full, Q uniform (masked), Q SlimWise (masked), and the pruned checkpoint alone
(= uniform) and as the decode model after Q's prefill (= SlimWise), which must give the masked rows' tokens
exactly.

Prune then quantize: plan' = REAP 50% from calibrating the bf16 model; P = `slimwise prune testbed-a --plan
plan'`; QP = oneshot(P) with the same calibration texts and seed. Rows: QP alone (uniform) and QP as the
decode model after Q's prefill (SlimWise; the two instances' attention weights then come from two GPTQ runs,
so the decode instance does not read exactly the cache its own weights would write).

Calibration texts for GPTQ: the testbed calib split (seed 3), prompt + reference answer; SlimWise
calibration: calib split of the target domain (seed 0), greedy continuations of 96 tokens; test: the test
split (seed 0), --per-family problems per family, greedy, float32 (the quantized experts dequantized on
load). Paired bootstrap intervals (2,000 resamples, seed 0) for every difference. Everything is seeded;
llm-compressor's GPTQ is deterministic on the CPU for a fixed input order.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from slimwise.calibrate import CalibrationConfig, calibrate
from slimwise.criteria import plan_from_stats
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.evaluation.metrics import paired_difference
from slimwise.evaluation.samples import load_samples, make_grader
from slimwise.hardware import describe
from slimwise.models import load_model, load_tokenizer, resolve_model_dir
from slimwise.testbed import TARGET_DOMAIN, make_split

MODEL = "testbed-a"
ROOT = Path(__file__).resolve().parents[1]
LLMC_PYTHON = ROOT / ".venv-llmcompressor" / "bin" / "python"


def run(cmd: list[str]) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True)


def quantize(src: Path, out: Path, texts: Path) -> None:
    if not (out / "config.json").is_file():
        run([LLMC_PYTHON, ROOT / "experiments" / "llmcompressor_quantize.py", src, out, "--texts", texts])


def prune(src: Path, plan: Path, out: Path) -> None:
    if not (out / "config.json").is_file():
        run([Path(sys.executable).parent / "slimwise", "prune", src, "--plan", plan, "--out", out])


def checkpoint_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def main() -> None:  # noqa: PLR0915 -- one recipe, top to bottom
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, help="checkpoints and plans (kept: reruns reuse them)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--per-family", type=int, default=48, help="test problems per family")
    args = parser.parse_args()
    if not LLMC_PYTHON.is_file():
        sys.exit(f"{LLMC_PYTHON} is missing: run `bash scripts/llmcompressor_env.sh` first")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    source = resolve_model_dir(MODEL)
    texts = work / "gptq-calib.jsonl"
    texts.write_text("".join(json.dumps({"text": s.prompt + s.target + "\n"}) + "\n"
                             for s in make_split("calib", 8, seed=3)))
    timings = {}

    t0 = time.perf_counter()
    quantize(source, work / "q", texts)
    timings["quantize_full_s"] = time.perf_counter() - t0
    calib = [s.prompt for s in make_split("calib", 16, seed=0, domain=TARGET_DOMAIN)]
    ccfg = CalibrationConfig(max_new_tokens=96)
    tok = load_tokenizer(source)
    base = load_model(source, dtype="float32")
    q = load_model(work / "q", dtype="float32")
    plans = {}
    for name, model in (("q", q), ("bf16", base)):
        plans[name] = plan_from_stats(calibrate(model, calib, tok, ccfg, progress=False), "reap", 0.5)
        plans[name].save(work / f"plan-{name}.json")
    prune(work / "q", work / "plan-q.json", work / "q-pruned")
    prune(source, work / "plan-bf16.json", work / "pruned")
    t0 = time.perf_counter()
    quantize(work / "pruned", work / "pruned-q", texts)
    timings["quantize_pruned_s"] = time.perf_counter() - t0

    samples = load_samples(split="test", n_per_family=args.per_family, seed=0, domain=TARGET_DOMAIN)
    prompts = [s.prompt for s in samples]
    grader = make_grader("testbed")
    gen = GenerationConfig(max_new_tokens=160, batch_size=32)
    q_pruned = load_model(work / "q-pruned", dtype="float32")
    pruned_q = load_model(work / "pruned-q", dtype="float32")
    runs = {
        "bf16 full": (PhaseSplitEngine(base, tok), "full"),
        "W4A16 full": (PhaseSplitEngine(q, tok), "full"),
        "W4A16 uniform 50% (masked)": (PhaseSplitEngine(q, tok, plan=plans["q"]), "uniform"),
        "W4A16 SlimWise 50% (masked)": (PhaseSplitEngine(q, tok, plan=plans["q"]), "slimwise"),
        "quantize -> prune: pruned checkpoint alone": (PhaseSplitEngine(q_pruned, tok), "full"),
        "quantize -> prune: W4A16 prefill + pruned decode": (
            PhaseSplitEngine(q, tok, plan=plans["q"], decode_model=q_pruned), "slimwise"),
        "prune -> quantize: pruned checkpoint alone": (PhaseSplitEngine(pruned_q, tok), "full"),
        "prune -> quantize: W4A16 prefill + pruned decode": (
            PhaseSplitEngine(q, tok, decode_model=pruned_q), "slimwise"),  # plan': made on other weights
    }
    correct, tokens, rows = {}, {}, {}
    for name, (engine, mode) in runs.items():
        t0 = time.perf_counter()
        gens = engine.generate(prompts, mode, gen)
        correct[name] = [bool(grader(s, g)) for s, g in zip(samples, gens, strict=True)]
        tokens[name] = [g.token_ids for g in gens]
        rows[name] = {"accuracy": sum(correct[name]) / len(samples), "correct": sum(correct[name]),
                      "mean_tokens": sum(map(len, tokens[name])) / len(samples),
                      "seconds": round(time.perf_counter() - t0, 1)}
        print(name, rows[name], flush=True)

    def diff(a: str, b: str) -> dict:
        return paired_difference(correct[a], correct[b], seed=0)

    kept = {n: {layer: set(v) for layer, v in p.kept_experts.items()} for n, p in plans.items()}
    overlap = sum(len(kept["q"][layer] & kept["bf16"][layer]) for layer in kept["q"]) / sum(
        len(v) for v in kept["q"].values())
    report = {
        "model": MODEL, "scheme": "W4A16 (int4 symmetric, group 32, GPTQ; routers and LM head unquantized)",
        "test_problems": len(samples), "rows": rows,
        "differences": {
            "W4A16 full - bf16 full": diff("W4A16 full", "bf16 full"),
            "W4A16 SlimWise - W4A16 uniform": diff("W4A16 SlimWise 50% (masked)",
                                                   "W4A16 uniform 50% (masked)"),
            "uniform: prune->quantize - quantize->prune": diff(
                "prune -> quantize: pruned checkpoint alone", "quantize -> prune: pruned checkpoint alone"),
            "SlimWise: prune->quantize - quantize->prune": diff(
                "prune -> quantize: W4A16 prefill + pruned decode",
                "quantize -> prune: W4A16 prefill + pruned decode"),
        },
        "pruned_checkpoint_equals_masked_tokens": {
            "uniform": tokens["quantize -> prune: pruned checkpoint alone"]
            == tokens["W4A16 uniform 50% (masked)"],
            "slimwise": tokens["quantize -> prune: W4A16 prefill + pruned decode"]
            == tokens["W4A16 SlimWise 50% (masked)"],
        },
        "plans_kept_overlap": overlap,
        "checkpoint_bytes": {n: checkpoint_bytes(p) for n, p in (
            ("bf16", Path(source)), ("W4A16", work / "q"),
            ("W4A16 pruned (quantize -> prune)", work / "q-pruned"),
            ("pruned W4A16 (prune -> quantize)", work / "pruned-q"))},
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "machine": describe(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "llmcompressor_recipe.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
