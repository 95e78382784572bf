"""The vLLM part of the prepared GPU check (`scripts/gpu_check.py --vllm`): what SlimWise's serving path does
on the machine it runs on, for a GPU with vLLM installed (the lent GPU has none: there only the non-vLLM part
runs). One section of gpu_check.json:

- versions, the device's compute capability, and the model runner that sets SlimWise's steps (V1 / V2);
- the start-up self-check (serving/selfcheck.py) with two plans and `full`;
- tokens of the default engine (CUDA graphs on a GPU, torch.compile on a CPU) equal to an eager engine's and
  to the reference engine's (float32), per mode, in one engine switched between calls (full / slimwise /
  uniform);
- two plans and `full` in one batch, each request equal to its own routing's reference;
- a mixed batch under a 32-token step budget whose forward-counted rows are exact;
- per MoE layer, the kernel vLLM chose and whether it is monolithic (routes inside the kernel);
- decode step time of full against a 50% plan at batch 64 on a Qwen3.6-35B-A3B-shaped model (4 layers;
  `slimwise bench`, paired rounds).

    python scripts/gpu_check.py --vllm --out DIR                       # a GPU with vLLM: at most 10 minutes
    python scripts/gpu_check.py --vllm --device cpu --smoke --out DIR  # CI (tests/test_gpu_check_vllm.py)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL = "testbed-a"  # shipped with the package: no download
PLAN = ROOT / "docs" / "results" / "testbed-a" / "plans" / "reap-decode-0.5.json"
SEQ_AGREEMENT = 0.90  # float32 on CUDA and on the CPU sum in other orders: near ties may flip (gpu_check.py)


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / max(1, len(a))


def check_vllm(device: str, size: dict, checks: list) -> dict:
    import vllm

    from slimwise.baseline_plans import random_plan
    from slimwise.embedded import embedded_model_dir
    from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
    from slimwise.engines.vllm_engine import VllmEngine
    from slimwise.models import load_model
    from slimwise.plan import PrunePlan
    from slimwise.testbed import make_split

    def check(name: str, ok: bool, tolerance: str) -> None:
        checks.append({"name": f"vllm: {name}", "ok": bool(ok), "tolerance": tolerance})

    on_gpu = device.startswith("cuda")
    out: dict = {"vllm": vllm.__version__, "torch": torch.__version__,
                 "compute_capability": list(torch.cuda.get_device_capability()) if on_gpu else None,
                 "VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER")}
    model_dir = str(embedded_model_dir(MODEL))
    model = load_model(model_dir, dtype="float32")
    plans = {"math": PrunePlan.load(PLAN), "general": random_plan(model, 0.5, seed=1)}
    n = size["test_per_family"]
    prompts = [s.prompt for s in make_split("test", n) if s.family in ("add", "sub", "mul")][: 4 * n]
    config = GenerationConfig(max_new_tokens=size["test_tokens"], batch_size=size["batch"])
    from slimwise.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    ref = {}
    with PhaseSplitEngine(model, tok, plan=plans["math"]) as engine:
        for mode in ("full", "slimwise", "uniform"):
            ref[mode] = [g.token_ids for g in engine.generate(prompts, mode, config)]
    with PhaseSplitEngine(model, tok, plan=plans["general"]) as engine:
        ref["general"] = [g.token_ids for g in engine.generate(prompts, "slimwise", config)]

    # the default engine of the platform (graphs) and an eager one, both switched between modes in place
    runs = {}
    for label, eager in (("default", False), ("eager", True)):
        engine = VllmEngine(model_dir, plans["math"], tok, dtype="float32", enforce_eager=eager,
                            share_engine=True)
        try:
            got = {mode: [g.token_ids for g in engine.generate(prompts, mode, config)]
                   for mode in ("full", "slimwise", "uniform", "slimwise")}
            runs[label] = {"self_check": engine.self_check, "tokens": got}
        finally:
            engine.close()
    out["self_check"] = runs["default"]["self_check"]
    out["runner"] = (out["self_check"] or {}).get("runner")
    check("self-check passed at start-up (one plan)", out["self_check"] is not None, "exact row counts")
    for mode in ("full", "slimwise", "uniform"):
        graph, eager = runs["default"]["tokens"][mode], runs["eager"]["tokens"][mode]
        out[f"{mode}_default_vs_eager"] = _agreement(graph, eager)
        out[f"{mode}_default_vs_reference"] = _agreement(graph, ref[mode])
        check(f"{mode}: default engine equals eager", graph == eager, "identical tokens")
        check(f"{mode}: default engine vs reference", out[f"{mode}_default_vs_reference"] >= SEQ_AGREEMENT,
              f">= {SEQ_AGREEMENT:.0%} sequences identical")

    out.update(_mixed(model_dir, plans, tok, prompts, config, ref, check))
    out["decode_step"] = _bench(device, size)
    out["VLLM_USE_V2_MODEL_RUNNER"] = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")  # as the plugin left it
    return out


def _mixed(model_dir, plans, tok, prompts, config, ref, check) -> dict:
    """Two plans and full in one chunked batch: the self-check with two plans, forward-counted rows exact,
    tokens against each routing's reference, and the MoE kernel per layer."""
    from slimwise.engines.vllm_engine import VllmEngine

    out: dict = {}
    engine = VllmEngine(model_dir, plans, tok, dtype="float32", enforce_eager=False, engine_kwargs={
        "max_num_batched_tokens": 32, "max_num_seqs": 16, "max_model_len": 512})
    choice = (["math", "general", "full"] * len(prompts))[: len(prompts)]
    try:
        got = engine.generate(prompts[:1], "slimwise", config)  # start: the self-check with two plans
        out["self_check_two_plans"] = engine.self_check
        before = engine.counters()[0]["rows_seen"]
        got = engine.generate(prompts, "slimwise", config, plans=choice)
        after = engine.counters()[0]
        names = after["plan_names"]
        seen = [[a - b for a, b in zip(ra, rb, strict=True)] for ra, rb in zip(after["rows_seen"], before,
                                                                                  strict=True)]
        want = dict.fromkeys(names, 0)
        for name, g in zip(choice, got, strict=True):
            want[name] += len(g.token_ids) - 1
        out["mixed_rows"] = {"seen": seen, "want": want}
        exact = all(seen[0][k] == want[name] and seen[1][k] == want[name]
                    for k, name in enumerate(names) if k) and seen[1][0] == 0
        check("two plans and full in one chunked batch: forward-counted rows exact", exact, "exact")
        expect = [ref["slimwise" if c == "math" else c][i] for i, c in enumerate(choice)]
        out["mixed_vs_reference"] = _agreement([g.token_ids for g in got], expect)
        check("two plans and full in one batch vs reference", out["mixed_vs_reference"] >= SEQ_AGREEMENT,
              f">= {SEQ_AGREEMENT:.0%} sequences identical")
        out["moe_kernels"] = engine.llm.collective_rpc("slimwise_describe")[0].get("moe_kernels")
    finally:
        engine.close()
    return out


def _bench(device: str, size: dict) -> dict:
    """`slimwise bench` full vs a 50% plan at batch 64 on a Qwen3.6-35B-A3B-shaped model (4 layers; the smoke
    preset on a CPU smoke run), paired rounds, in a process of its own."""
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="gpu-check-bench-"))
    smoke = device == "cpu"
    preset = "smoke" if smoke else "qwen3.6-35b-a3b"
    cmd = [sys.executable, "-m", "slimwise.cli", "bench", "--synthetic", preset,
           "--variants", "full", "slimwise", "--batch", "8" if smoke else "64", "--output-len",
           str(size["test_tokens"]), "--repetitions", str(size["rounds"]), "--no-count", "--out", str(work)]
    if not smoke:
        cmd += ["--layers", "4", "--dtype", "bfloat16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"slimwise bench failed ({proc.returncode}): {proc.stderr[-2000:]}")
    found = sorted(work.rglob("bench.json"))
    return {"command": " ".join(cmd[2:]), "report": json.loads(found[0].read_text()) if found else None}
