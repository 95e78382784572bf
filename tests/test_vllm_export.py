"""Exported checkpoints load and generate in stock vLLM (CPU), with the reference engine's greedy tokens."""

from __future__ import annotations

import pytest
from conftest import random_prompts
from stock_vllm import vllm_generate_here

from slimwise.calibrate import CalibrationConfig, calibrate
from slimwise.criteria import plan_from_stats
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.export import export_pruned, load_pruned
from slimwise.models import load_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.vllm_in_process]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_exported_checkpoint_runs_in_vllm(family, tiny_dirs, tmp_path):
    src = tiny_dirs(family)
    model = load_model(src)
    stats = calibrate(
        model, random_prompts(8, seed=1), config=CalibrationConfig(max_new_tokens=8), progress=False
    )
    plan = plan_from_stats(stats, "reap", 0.5)
    out = export_pruned(load_model(src), plan, tmp_path / "pruned")
    pruned, _ = load_pruned(out)
    prompts = random_prompts()
    config = GenerationConfig(max_new_tokens=12, eos_token_id=-1)  # vLLM without a tokenizer ignores EOS too
    reference = [o.token_ids for o in PhaseSplitEngine(pruned).generate(prompts, "full", config)]
    assert vllm_generate_here(out, prompts, max_tokens=12) == reference
