"""Per-layer budgets from measured sensitivity (`slimwise.layer_budgets`, `slimwise plan --budget-model`)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from conftest import TINY_INIT, random_prompts
from tiny import build_tiny_model, save_tiny_model

from slimwise.calibrate import CalibrationConfig, calibrate
from slimwise.criteria import plan_from_stats, score_experts
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.layer_budgets import allocate, capture_decode_inputs, grid, layer_errors, sensitivity_plan
from slimwise.plan import PrunePlan


def test_allocate_by_hand():
    """Two layers, errors measured at 2, 4 and 8 kept: from top-k 2 each, the six further experts go where the
    interpolated error falls most per expert: layer 0 twice (0.35 each), then layer 1 (0.05, 0.05, 0.075,
    0.075) while layer 0 gains 0.025."""
    errors = {0: [0.8, 0.1, 0.0], 1: [0.4, 0.3, 0.0]}
    assert allocate(errors, [2, 4, 8], 10, 2) == {0: 4, 1: 6}
    assert allocate(errors, [2, 4, 8], 4, 2) == {0: 2, 1: 2}
    assert allocate(errors, [2, 4, 8], 100, 2) == {0: 8, 1: 8}  # never past every expert


def test_grid_spans_top_k_to_every_expert():
    assert grid(64, 8)[0] == 8 and grid(64, 8)[-1] == 64 and len(grid(64, 8)) == 16
    assert grid(8, 2) == [2, 3, 4, 5, 6, 7, 8]


def test_sensitivity_plan_spends_the_per_layer_budget():
    model = build_tiny_model("qwen3_moe", seed=0, initializer_range=TINY_INIT)
    stats = calibrate(model, random_prompts(8, seed=1), config=CalibrationConfig(max_new_tokens=8),
                      progress=False)
    inputs = capture_decode_inputs(model, random_prompts(8, seed=2), max_new_tokens=8, max_tokens=40)
    assert all(x.shape[0] == 40 for x in inputs.values())
    counts = grid(16, 4)
    errors = layer_errors(model, stats, "reap", inputs, counts)
    assert sorted(errors) == stats.layers
    for e in errors.values():
        assert e[-1] == 0.0 and e[0] > e[len(e) // 2] > 0  # every expert: exact; fewer: worse
    plan = sensitivity_plan(stats, "reap", 0.5, errors, counts)
    uniform = plan_from_stats(stats, "reap", 0.5)
    assert plan.scope == "sensitivity" and sum(map(len, plan.kept_experts.values())) \
        == sum(map(len, uniform.kept_experts.values()))
    scores = score_experts(stats, "reap")
    for layer, kept in plan.kept_experts.items():
        assert len(kept) >= 4
        order = torch.sort(-scores[stats.row(layer)].double(), stable=True).indices
        assert kept == sorted(order[:len(kept)].tolist())  # the criterion's top experts of that layer
    assert PrunePlan.from_dict(json.loads(json.dumps(plan.to_dict())), "x").kept_experts == plan.kept_experts
    with PhaseSplitEngine(model, plan=plan) as engine:  # served by masking
        assert engine.generate(random_prompts(2), "slimwise", GenerationConfig(max_new_tokens=4))


def test_plan_cli_measures_and_writes(tmp_path):
    """`slimwise plan --budget-model` as a user runs it: a process, text prompts in a JSONL file."""
    from lab.testbed.tokenizer import build_tokenizer
    from slimwise.models import load_model
    from slimwise.testbed import export_jsonl, make_split

    model_dir = save_tiny_model("qwen3_moe", tmp_path / "model", seed=0, initializer_range=0.15)
    tokenizer = build_tokenizer(model_dir)
    export_jsonl(make_split("calib", 1, seed=0), tmp_path / "prompts.jsonl")
    prompts = [s.prompt for s in make_split("calib", 1, seed=0)]
    stats = calibrate(load_model(model_dir), prompts, tokenizer, CalibrationConfig(max_new_tokens=6),
                      progress=False)
    stats.save(tmp_path / "stats.safetensors")
    command = ["plan", "--stats", tmp_path / "stats.safetensors", "--ratio", "0.5",
               "--budget-model", model_dir, "--budget-data", tmp_path / "prompts.jsonl",
               "--budget-tokens", "32", "--out", tmp_path / "plan.json"]
    out = subprocess.run([sys.executable, "-m", "slimwise.cli", *map(str, command)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    plan = PrunePlan.load(tmp_path / "plan.json")
    assert plan.scope == "sensitivity" and sum(map(len, plan.kept_experts.values())) == 8 * len(stats.layers)
    assert set(plan.meta["budget"]["kept"]) == {str(layer) for layer in stats.layers}
