"""The prepared GPU check: SlimWise's preparation pipeline on a CUDA device, compared with the CPU float32
reference, in one JSON.

    python scripts/gpu_check.py --device cuda --out DIR           # on a GPU: at most 10 minutes on one H200
    python scripts/gpu_check.py --device cpu --smoke --out DIR    # what CI runs (tests/test_gpu_check.py)
    python scripts/gpu_check.py --vllm --out DIR                  # a GPU with vLLM: the serving path
                                                                  # (scripts/gpu_check_vllm.py)

Needs torch, transformers, safetensors, tokenizers and accelerate only (no vLLM, no network): the bare GPU
image runs it from a copy of the repository.

Two models:
- testbed-c, the shipped hybrid (Gated-DeltaNet + attention, top-k + shared expert): decode-phase calibration,
  a REAP 50% plan, and full / uniform / slimwise generation on the device, each compared with the CPU float32
  run (statistics, plan and tokens); 50 distillation steps on the device; the same model spread over two
  placements (`--max-memory`) against the whole, with the layer-streamed passes; the same in bf16 (the GPU
  default) for timings and accuracy.
- a synthetic Qwen3.6-35B-A3B-shaped model (the real widths, 256 experts, top-8, the real vocabulary, 4 of the
  40 layers, random weights): calibration, plan and generation throughput in bf16, and the float32 device
  run's first-token logits and tokens against the CPU's.

Tolerances, and why: CUDA and the CPU sum in other orders, so float32 logits differ by rounding (TF32 is
switched off here) and a greedy argmax between two near-equal logits can flip; after a flip the sequences
diverge. The check therefore asks for >= 90% of testbed sequences identical per mode, plans that keep the same
experts in >= 90% of layers, equal calibration token counts and statistics sums within 1e-3 relative. It
records every figure, so a run is judged by its numbers, not only by the verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slimwise.calibrate import CalibrationConfig, calibrate, continuation_stats  # noqa: E402
from slimwise.criteria import plan_from_stats  # noqa: E402
from slimwise.devices import resolve_device, synchronize  # noqa: E402
from slimwise.distill import DistillConfig, distill  # noqa: E402
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine  # noqa: E402
from slimwise.models import load_model, load_tokenizer  # noqa: E402

SCHEMA = "slimwise-gpu-check/1"
MODES = ("full", "uniform", "slimwise")


# ----- sizes ---------------------------------------------------------------------------------------------
FULL = dict(calib_per_family=8, calib_tokens=48, test_per_family=8, test_tokens=64, batch=32,
            distill_steps=50, distill_prompts=64, distill_tokens=48,
            synth_layers=4, synth_prompts=64, synth_prompt_len=128, synth_tokens=32, synth_cpu_prompts=4,
            synth_cpu_tokens=8, synth_distill_prompts=32, synth_distill_batch=16, synth_distill_steps=4,
            rounds=3, synth_overrides={})
SMOKE = dict(calib_per_family=1, calib_tokens=8, test_per_family=1, test_tokens=8, batch=8,
             distill_steps=2, distill_prompts=4, distill_tokens=6,
             synth_layers=4, synth_prompts=4, synth_prompt_len=8, synth_tokens=4, synth_cpu_prompts=2,
             synth_cpu_tokens=4, synth_distill_prompts=4, synth_distill_batch=2, synth_distill_steps=2,
             rounds=2,
             synth_overrides=dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                  linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                                  linear_num_value_heads=4, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
                                  vocab_size=512,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                                   "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                                                   "mrope_interleaved": True}))
SEQ_AGREEMENT = 0.90
PLAN_AGREEMENT = 0.90
STATS_RTOL = 1e-3


class Clock:
    """Wall time of a block, the device drained at both ends (CUDA runs asynchronously)."""

    def __init__(self, device: str):
        self.device = device

    def __enter__(self):
        synchronize(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        synchronize(self.device)
        self.seconds = round(time.perf_counter() - self.t0, 3)


def environment(device: str) -> dict:
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "device": device, "cpu": _lscpu_model(),
           "cpu_count": os.cpu_count()}
    try:
        import accelerate

        env["accelerate"] = accelerate.__version__
    except ImportError:
        env["accelerate"] = None
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        env["float32_grouped_mm_refused"] = float32_grouped_mm(device)
        env |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                "capability": list(torch.cuda.get_device_capability(device)), "cuda": torch.version.cuda}
    return env


def _lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                platform.processor())


def float32_grouped_mm(device: str) -> str | None:
    """None when torch's grouped_mm (what transformers' default experts forward calls) runs float32 on this
    device; else why not, and float32 models here run transformers' "eager" experts loop instead."""
    if not device.startswith("cuda") or not hasattr(torch.nn.functional, "grouped_mm"):
        return None
    try:
        x = torch.randn(8, 32, device=device)
        w = torch.randn(2, 32, 16, device=device)
        torch.nn.functional.grouped_mm(x, w, offs=torch.tensor([4, 8], device=device, dtype=torch.int32))
        return None
    except (RuntimeError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def load_float32(name: str, device: str):
    model = load_model(name, dtype="float32", device=device)
    return _float32_experts(model, device)


def _float32_experts(model, device: str):
    if float32_grouped_mm(device) is not None and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return model


def strict_float32() -> None:
    """float32 means float32 on CUDA too: no TF32 in matmuls or convolutions (the comparison's premise)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


# ----- comparisons ---------------------------------------------------------------------------------------
def compare_tokens(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Share of identical sequences and where the others first differ."""
    same = sum(a == b for a, b in zip(ref, got, strict=True))
    firsts = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
              for a, b in zip(ref, got, strict=True) if a != b]
    return {"sequences": len(ref), "identical": same, "identical_share": round(same / max(1, len(ref)), 4),
            "first_difference_positions": sorted(firsts)}


def compare_stats(ref, got) -> dict:
    out = {"tokens_equal": bool(torch.equal(ref.tokens, got.tokens)),
           "counts_equal": bool(torch.equal(ref.count, got.count))}
    for name in ("count", "gate_sum", "norm_sum", "gate_norm_sum"):
        a, b = getattr(ref, name), getattr(got, name)
        out[f"{name}_max_rel"] = float(((a - b).abs().sum() / a.abs().sum().clamp_min(1e-30)).item())
    return out


def compare_plans(ref, got) -> dict:
    layers = sorted(ref.kept_experts)
    same = sum(sorted(ref.kept_experts[i]) == sorted(got.kept_experts[i]) for i in layers)
    overlap = [len(set(ref.kept_experts[i]) & set(got.kept_experts[i])) / len(ref.kept_experts[i])
               for i in layers]
    return {"layers": len(layers), "identical_layers": same, "identical_share": round(same / len(layers), 4),
            "mean_overlap": round(sum(overlap) / len(overlap), 4)}


# ----- testbed-c -----------------------------------------------------------------------------------------
def testbed_prompts(size: dict) -> tuple[list[str], list, list[str]]:
    from slimwise.evaluation.samples import load_samples, make_grader
    from slimwise.testbed import TARGET_DOMAIN, make_split

    calib = [s.prompt for s in make_split("calib", size["calib_per_family"], seed=0, domain=TARGET_DOMAIN)]
    tests = load_samples(split="test", n_per_family=size["test_per_family"], seed=0, domain=TARGET_DOMAIN)
    distil = [s.prompt for s in make_split("calib", size["distill_prompts"], seed=1, domain=TARGET_DOMAIN)]
    return calib, (tests, make_grader("testbed")), distil[:size["distill_prompts"]]


def run_modes(model, tokenizer, plan, prompts, size, device) -> dict:
    """Greedy generations of every mode, with wall time and decode tokens/s."""
    engine = PhaseSplitEngine(model, tokenizer, plan=plan)
    config = GenerationConfig(max_new_tokens=size["test_tokens"], batch_size=size["batch"])
    out = {}
    try:
        for mode in MODES:
            with Clock(device) as clock:
                gens = engine.generate(prompts, mode=mode, config=config)
            tokens = sum(len(g.token_ids) for g in gens)
            out[mode] = {"gens": gens, "seconds": clock.seconds, "tokens": tokens,
                         "tokens_per_s": round(tokens / clock.seconds, 1)}
    finally:
        engine.close()
    return out


def accuracy(runs: dict, tests) -> dict:
    samples, grader = tests
    return {mode: round(sum(grader(s, g) for s, g in zip(samples, r["gens"], strict=True)) / len(samples), 4)
            for mode, r in runs.items()}


def timings(runs: dict) -> dict:
    return {mode: {k: r[k] for k in ("seconds", "tokens", "tokens_per_s")} for mode, r in runs.items()}


def calibrated(model, tokenizer, prompts, size, device):
    config = CalibrationConfig(phase="decode", max_new_tokens=size["calib_tokens"], batch_size=size["batch"])
    with Clock(device) as clock:
        stats = calibrate(model, prompts, tokenizer, config, progress=False)
    return stats, plan_from_stats(stats, "reap", 0.5), clock.seconds


def check_testbed(device: str, size: dict, checks: list) -> dict:
    calib, tests, distil = testbed_prompts(size)
    prompts = [s.prompt for s in tests[0]]
    tokenizer = load_tokenizer("testbed-c")
    section: dict = {"calib_prompts": len(calib), "test_prompts": len(prompts)}

    cpu = load_model("testbed-c", dtype="float32", device="cpu")
    cpu_stats, cpu_plan, section["cpu_calibrate_s"] = calibrated(cpu, tokenizer, calib, size, "cpu")
    cpu_runs = run_modes(cpu, tokenizer, cpu_plan, prompts, size, "cpu")
    section["cpu_float32"] = {"timings": timings(cpu_runs), "accuracy": accuracy(cpu_runs, tests)}
    del cpu

    gpu = load_float32("testbed-c", device)
    stats, plan, seconds = calibrated(gpu, tokenizer, calib, size, device)
    section["device_float32"] = {"calibrate_s": seconds, "stats_vs_cpu": compare_stats(cpu_stats, stats),
                                 "plan_vs_cpu": compare_plans(cpu_plan, plan)}
    runs = run_modes(gpu, tokenizer, cpu_plan, prompts, size, device)  # the same plan: tokens comparable
    section["device_float32"] |= {
        "timings": timings(runs), "accuracy": accuracy(runs, tests),
        "tokens_vs_cpu": {m: compare_tokens([g.token_ids for g in cpu_runs[m]["gens"]],
                                            [g.token_ids for g in runs[m]["gens"]]) for m in MODES}}
    conts = [g.token_ids for g in runs["full"]["gens"]]
    section["device_float32"]["teacher_forced"] = teacher_forced_vs_generation(gpu, tokenizer, prompts, conts,
                                                                               size, device)
    f32 = section["device_float32"]
    checks.append(_check("testbed-c float32: the teacher-forced pass counts what generation counts",
                         f32["teacher_forced"]["counts_equal"] and f32["teacher_forced"]["plans_identical"],
                         "counts exact, plans identical"))
    checks.append(_check("testbed-c float32: calibration token counts equal the CPU's",
                         f32["stats_vs_cpu"]["tokens_equal"], "exact"))
    checks.append(_check("testbed-c float32: statistics sums within tolerance of the CPU's",
                         max(f32["stats_vs_cpu"][f"{n}_max_rel"] for n in ("count", "gate_sum", "norm_sum"))
                         <= STATS_RTOL, f"relative L1 <= {STATS_RTOL}"))
    checks.append(_check("testbed-c float32: plan keeps the CPU plan's experts",
                         f32["plan_vs_cpu"]["identical_share"] >= PLAN_AGREEMENT,
                         f">= {PLAN_AGREEMENT:.0%} of layers identical"))
    for mode in MODES:
        share = f32["tokens_vs_cpu"][mode]["identical_share"]
        checks.append(_check(f"testbed-c float32 {mode}: tokens equal the CPU's", share >= SEQ_AGREEMENT,
                             f">= {SEQ_AGREEMENT:.0%} of sequences identical"))

    with Clock(device) as clock:
        delta = distill(gpu, cpu_plan, distil, tokenizer,
                        DistillConfig(steps=size["distill_steps"], batch_size=8,
                                      max_new_tokens=size["distill_tokens"], progress=False))
    history = delta.manifest["loss_history"]
    section["device_float32"]["distill"] = {
        "steps": delta.manifest["steps"], "seconds": clock.seconds,
        "train_seconds": delta.manifest["train_seconds"],
        "teacher_seconds": delta.manifest["teacher_seconds"],
        "loss_first": history[0], "loss_last": history[-1],
        "trainable_params": delta.manifest["trainable_params"]}
    checks.append(_check("testbed-c float32: distillation runs and its loss is finite",
                         all(v == v for v in history), "no NaN"))
    del gpu
    section["spread"] = spread_vs_whole(device, tokenizer, calib, prompts, size, cpu_plan, stats, runs)
    spread = section["spread"]
    checks.append(_check("testbed-c float32 spread: calibration counts equal the whole model's",
                         spread["placements"] > 1 and spread["stats_vs_whole"]["counts_equal"], "exact"))
    for mode in ("full", "slimwise"):
        share = spread["tokens_vs_whole"][mode]["identical_share"]
        checks.append(_check(f"testbed-c float32 spread {mode}: tokens equal the whole model's",
                             share >= SEQ_AGREEMENT, f">= {SEQ_AGREEMENT:.0%} of sequences identical"))
    streamed = spread["streamed"]
    checks.append(_check("testbed-c float32 spread: layer-streamed statistics equal the in-memory pass",
                         streamed["offloaded_layers"] > 0 and streamed["vs_in_memory"]["counts_equal"]
                         and max(streamed["vs_in_memory"][f"{n}_max_rel"] for n in ("gate_sum", "norm_sum"))
                         <= STATS_RTOL, f"counts exact, sums within {STATS_RTOL}"))
    checks.append(_check("testbed-c float32 spread: layer-streamed log-probs equal the in-memory scoring",
                         streamed["logprobs_max_abs_diff"] <= 1e-3, "max |diff| <= 1e-3"))
    if device != "cpu":
        section["device_bfloat16"] = testbed_bf16(device, tokenizer, calib, prompts, tests, size)
    return section


def spread_vs_whole(device, tokenizer, calib, prompts, size, plan, whole_stats, whole_runs) -> dict:
    """testbed-c under `--max-memory` small enough to spread it (accelerate's device_map): on a GPU, some
    layers there and the rest offloaded to host memory (run on the GPU, weights brought over per module); on
    the CPU, memory and disk. Calibration and generation against the whole model on `device`."""
    budget = "cpu=20MiB" if device == "cpu" else f"{torch.device(device).index or 0}=20MiB,cpu=1GiB"
    model = load_model("testbed-c", dtype="float32", device=device, max_memory=budget)
    _float32_experts(model, device)
    placed = sorted({str(v) for v in model.hf_device_map.values()})
    stats, _, seconds = calibrated(model, tokenizer, calib, size, device)
    runs = run_modes(model, tokenizer, plan, prompts, dict(size), device)
    out = {"max_memory": budget, "device_map": {k: str(v) for k, v in model.hf_device_map.items()},
           "placements": len(placed), "calibrate_s": seconds, "timings": timings(runs),
           "stats_vs_whole": compare_stats(whole_stats, stats),
           "tokens_vs_whole": {m: compare_tokens([g.token_ids for g in whole_runs[m]["gens"]],
                                                 [g.token_ids for g in runs[m]["gens"]]) for m in MODES}}
    conts = [g.token_ids for g in runs["full"]["gens"]]
    out["streamed"] = streamed_vs_in_memory(model, tokenizer, prompts, conts, plan, size, device)
    del model
    return out


def streamed_vs_in_memory(model, tokenizer, prompts, conts, plan, size, device) -> dict:
    """The layer-streamed passes (slimwise.sequential) on the spread model against the in-memory passes on the
    same model: decode-phase statistics over the full model's continuations, and full / SlimWise log-probs."""
    from slimwise.scoring import continuation_logprobs
    from slimwise.sequential import offloaded_share, streamed_logprobs, streamed_statistics

    config = CalibrationConfig(phase="decode", max_new_tokens=size["test_tokens"], batch_size=size["batch"])
    with Clock(device) as clock:
        streamed = streamed_statistics(model, prompts, conts, tokenizer, config, progress=False)
    with Clock(device) as in_clock:
        in_memory = continuation_stats(model, prompts, conts, tokenizer, config, progress=False)
    few, few_conts = prompts[:8], conts[:8]
    engine = PhaseSplitEngine(model, tokenizer, plan=plan)
    try:
        ids = engine.encode(few)
        want = {m: continuation_logprobs(engine, ids, few_conts, m).float().cpu()
                for m in ("full", "slimwise")}
    finally:
        engine.close()
    got = streamed_logprobs(model, few, few_conts, modes=("full", "slimwise"), plan=plan,
                            tokenizer=tokenizer, batch_size=len(few), progress=False)
    diff = max(float((got[m][i] - want[m][i, :len(c)]).abs().max())
               for m in got for i, c in enumerate(few_conts))
    return {"offloaded_layers": offloaded_share(model)[0], "statistics_s": clock.seconds,
            "in_memory_statistics_s": in_clock.seconds, "vs_in_memory": compare_stats(in_memory, streamed),
            "logprobs_max_abs_diff": diff}


def teacher_forced_vs_generation(model, tokenizer, prompts, conts, size, device) -> dict:
    """Decode-phase statistics counted while generating `conts` against one teacher-forced pass over them."""
    config = CalibrationConfig(phase="decode", max_new_tokens=size["test_tokens"], batch_size=size["batch"])
    with Clock(device) as gen_clock:
        generated = calibrate(model, prompts, tokenizer, config, progress=False)
    with Clock(device) as tf_clock:
        forced = continuation_stats(model, prompts, conts, tokenizer, config, progress=False)
    out = compare_stats(generated, forced)
    out |= {"plans_identical": plan_from_stats(generated, "reap", 0.5).kept_experts
            == plan_from_stats(forced, "reap", 0.5).kept_experts,
            "counted_tokens": int(forced.tokens[0]),
            "generation_pass_s": gen_clock.seconds, "teacher_forced_pass_s": tf_clock.seconds,
            "generation_pass_tokens_per_s": round(generated.meta["tokens_processed"] / gen_clock.seconds, 1),
            "teacher_forced_tokens_per_s": round(forced.meta["tokens_processed"] / tf_clock.seconds, 1)}
    return out


def testbed_bf16(device, tokenizer, calib, prompts, tests, size) -> dict:
    """The GPU default (bf16): its own calibration and plan, timings and accuracy."""
    model = load_model("testbed-c", dtype="auto", device=device)
    stats, plan, seconds = calibrated(model, tokenizer, calib, size, device)
    runs = run_modes(model, tokenizer, plan, prompts, size, device)
    out = {"dtype": str(model.dtype).removeprefix("torch."), "calibrate_s": seconds,
           "timings": timings(runs), "accuracy": accuracy(runs, tests)}
    del model
    return out


# ----- the synthetic Qwen3.6-shaped model ----------------------------------------------------------------
def synthetic_model(size: dict):
    from transformers import AutoModelForCausalLM

    from slimwise.perf.presets import preset_config

    config = preset_config("qwen3.6-35b-a3b", layers=size["synth_layers"], **size["synth_overrides"])
    text = getattr(config, "text_config", config)
    text.eos_token_id = None  # random weights: every sequence runs its full length
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    params = sum(p.numel() for p in model.parameters())
    return model, config, params


def check_synthetic(device: str, size: dict, checks: list) -> dict:
    model, config, params = synthetic_model(size)
    text = getattr(config, "text_config", config)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, text.vocab_size, (size["synth_prompts"], size["synth_prompt_len"]),
                            generator=gen).tolist()
    section: dict = {"layers": text.num_hidden_layers, "experts": text.num_experts,
                     "top_k": text.num_experts_per_tok, "hidden": text.hidden_size, "vocab": text.vocab_size,
                     "parameters": params}
    few = prompts[:size["synth_cpu_prompts"]]
    config_few = GenerationConfig(max_new_tokens=size["synth_cpu_tokens"], batch_size=len(few))
    cpu_stats = calibrate(model, few, None, CalibrationConfig(max_new_tokens=size["synth_cpu_tokens"],
                                                              batch_size=len(few)), progress=False)
    plan = plan_from_stats(cpu_stats, "reap", 0.5)
    cpu_logits, cpu_tokens = _first_logits_and_tokens(model, plan, few, config_few)

    _float32_experts(model.to(device), device)
    dev_logits, dev_tokens = _first_logits_and_tokens(model, plan, few, config_few)
    diff = (cpu_logits - dev_logits.cpu()).abs()
    section["float32_vs_cpu"] = {
        "first_logits_max_abs": float(diff.max()), "logit_std": float(cpu_logits.std()),
        "first_token_equal": bool(torch.equal(cpu_logits.argmax(-1), dev_logits.cpu().argmax(-1))),
        "tokens": {m: compare_tokens(cpu_tokens[m], dev_tokens[m]) for m in MODES}}
    checks.append(_check("synthetic float32: first-token logits match the CPU's",
                         float(diff.max()) <= 1e-3 * max(1.0, float(cpu_logits.abs().max())),
                         "max |diff| <= 1e-3 x max |logit|"))

    model.to(torch.bfloat16)
    model.__dict__.pop("_slimwise_fingerprint", None)  # the float32 weights' fingerprint, cached by the plan
    ccfg = CalibrationConfig(max_new_tokens=size["synth_tokens"], batch_size=size["synth_prompts"])
    with Clock(device) as clock:
        stats = calibrate(model, prompts, None, ccfg, progress=False)
    counted = int(stats.tokens[0])
    section["bfloat16"] = {"calibrate_s": clock.seconds, "calibrate_counted_tokens": counted,
                           "calibrate_tokens_per_s": round(stats.meta["tokens_processed"] / clock.seconds, 1)}
    plan = plan_from_stats(stats, "reap", 0.5)
    synth_size = dict(size, test_tokens=size["synth_tokens"], batch=size["synth_prompts"])
    runs = run_modes(model, None, plan, prompts, synth_size, device)
    section["bfloat16"]["timings"] = timings(runs)
    conts = [g.token_ids for g in runs["full"]["gens"]]
    section["bfloat16"]["teacher_forced"] = teacher_forced_vs_generation(model, None, prompts, conts,
                                                                         synth_size, device)
    section["bfloat16"]["statistics_rounds"] = statistics_rounds(model, prompts, conts, size, device)
    if device.startswith("cuda"):
        section["bfloat16"]["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    checks.append(_check("synthetic bf16: calibrate, plan and generate all modes", counted > 0, "runs"))
    section["bfloat16"]["distill"] = distill_memory(model, plan, prompts[:size["synth_distill_prompts"]],
                                                    size, device)
    dist = section["bfloat16"]["distill"]
    checks.append(_check("synthetic bf16: activation checkpointing trains the same delta",
                         dist["first_loss_equal"] and dist["loss_max_rel_diff"] <= 0.05,
                         "first loss equal, later losses within 5% (CUDA's atomic gradient sums are not "
                         "deterministic)"))
    del model
    return section


def distill_memory(model, plan, prompts, size, device) -> dict:
    """Distillation steps with and without activation checkpointing of the MoE blocks (one shared teacher),
    in `rounds` rounds of alternating order: peak device memory above the weights, seconds per step, and the
    loss histories."""
    from slimwise.distill import build_teacher

    base = dict(steps=size["synth_distill_steps"], batch_size=size["synth_distill_batch"],
                teacher_batch_size=size["synth_distill_batch"], max_new_tokens=size["synth_tokens"],
                progress=False)
    teacher = build_teacher(model, prompts, None, DistillConfig(**base))
    out: dict = {"prompts": len(prompts), "steps": base["steps"], "batch": base["batch_size"],
                 "new_tokens": base["max_new_tokens"], "rounds": size["rounds"]}
    cuda = device.startswith("cuda")
    histories: dict[bool, list] = {False: [], True: []}
    for r in range(size["rounds"]):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            resident = torch.cuda.memory_allocated(device) if cuda else 0
            delta = distill(model, plan, prompts, None, DistillConfig(**base, activation_checkpointing=on),
                            teacher=teacher)
            row = out.setdefault("checkpointing" if on else "plain", {"seconds_per_step": []})
            row["seconds_per_step"].append(round(delta.manifest["train_seconds"] / base["steps"], 3))
            row["peak_gib_above_weights"] = round((torch.cuda.max_memory_allocated(device) - resident)
                                                  / 2**30, 3) if cuda else None
            row["loss_history"] = delta.manifest["loss_history"]
            histories[on].append(delta.manifest["loss_history"])
    first = [h[0] for h in histories[False] + histories[True]]
    out["first_loss_equal"] = len(set(first)) == 1
    out["loss_max_rel_diff"] = max(abs(a - b) / max(abs(a), 1e-12)
                                   for h in histories[True] + histories[False][1:]
                                   for a, b in zip(histories[False][0], h, strict=True))
    return out


def statistics_rounds(model, prompts, conts, size, device) -> dict:
    """The decode-phase statistics pass counted while generating against the teacher-forced pass over the
    same continuations, `rounds` rounds in alternating order (the first call of a shape pays for kernel
    selection), and on CUDA a profile of one teacher-forced pass (top operations by device time)."""
    config = CalibrationConfig(phase="decode", max_new_tokens=size["synth_tokens"], batch_size=len(prompts))
    passes = {"generation": lambda: calibrate(model, prompts, None, config, progress=False),
              "teacher_forced": lambda: continuation_stats(model, prompts, conts, None, config,
                                                           progress=False)}
    out: dict = {name: {"seconds": [], "tokens_per_s": []} for name in passes}
    for r in range(size["rounds"]):
        for name in (passes if r % 2 == 0 else reversed(list(passes))):
            with Clock(device) as clock:
                stats = passes[name]()
            out[name]["seconds"].append(clock.seconds)
            out[name]["tokens_per_s"].append(round(stats.meta["tokens_processed"] / clock.seconds, 1))
    if device.startswith("cuda"):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            passes["teacher_forced"]()
            synchronize(device)
        table = prof.key_averages().table
        out["teacher_forced_profile"] = table(sort_by="self_cuda_time_total", row_limit=15)
        out["teacher_forced_profile_cpu"] = table(sort_by="self_cpu_time_total", row_limit=15)
    return out


def _first_logits_and_tokens(model, plan, prompts, config):
    engine = PhaseSplitEngine(model, None, plan=plan)
    try:
        with torch.no_grad():
            _, logits, _, _ = engine.prefill(prompts, "full")
        tokens = {m: [g.token_ids for g in engine.generate(prompts, mode=m, config=config)] for m in MODES}
    finally:
        engine.close()
    return logits.float().cpu(), tokens


# ----- driver --------------------------------------------------------------------------------------------
def _check(name: str, ok: bool, tolerance: str) -> dict:
    return {"name": name, "ok": bool(ok), "tolerance": tolerance}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--out", required=True, help="directory for gpu_check.json")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI runs it with --device cpu)")
    parser.add_argument("--only", choices=["testbed", "synthetic"], help="run one section")
    parser.add_argument("--vllm", action="store_true",
                        help="run the vLLM serving section instead (scripts/gpu_check_vllm.py; needs vLLM)")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    size = SMOKE if args.smoke else FULL
    strict_float32()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"schema": SCHEMA, "smoke": args.smoke, "env": environment(device),
                    "commit": os.environ.get("SLIMWISE_COMMIT") or _git_commit(), "sizes": size,
                    "sections": {}, "checks": [], "errors": {}}
    t0 = time.perf_counter()
    sections = (("testbed", check_testbed), ("synthetic", check_synthetic))
    if args.vllm:
        from gpu_check_vllm import check_vllm

        if device == "cpu":  # the CPU smoke: engine cores in this process (no spawn per engine)
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        sections = (("vllm", check_vllm),)
    for name, run in sections:
        if args.only and args.only != name:
            continue
        started = time.perf_counter()
        try:
            report["sections"][name] = run(device, size, report["checks"])
        except Exception:  # noqa: BLE001 - one section's failure is recorded; the other still runs
            report["errors"][name] = traceback.format_exc()
            print(report["errors"][name], file=sys.stderr)
        report["sections"].setdefault(name, {})["seconds"] = round(time.perf_counter() - started, 1)
        print(f"gpu_check: {name} done in {report['sections'][name]['seconds']}s", flush=True)
        _write(out, report, t0)
    report["ok"] = not report["errors"] and all(c["ok"] for c in report["checks"])
    _write(out, report, t0)
    for c in report["checks"]:
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {c['name']} ({c['tolerance']})")
    print(f"gpu_check: {'passed' if report['ok'] else 'FAILED'}; wrote {out / 'gpu_check.json'}")
    return 0 if report["ok"] else 1


def _write(out: Path, report: dict, t0: float) -> None:
    report["seconds"] = round(time.perf_counter() - t0, 1)
    tmp = out / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(out / "gpu_check.json")


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
