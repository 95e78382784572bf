"""The SlimWise vLLM plugin on real vLLM engines (CPU): PD-colocated decode-only routing.

Greedy tokens must equal the reference engine's for the same token-id prompts; routing counters prove that
every prompt token (chunked-prefill chunks, a 1-token last chunk, 1-token prompts, prefix-cache recomputes)
used all experts and every generated token fed back used the kept ones.
"""

from __future__ import annotations

import pytest
from conftest import random_prompts

from slimwise.calibrate import CalibrationConfig, calibrate
from slimwise.criteria import plan_from_stats
from slimwise.generate import GenerationConfig, PhaseSplitEngine
from slimwise.models import load_model
from slimwise.serving.engine import VllmEngine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CONFIG = GenerationConfig(max_new_tokens=12, eos_token_id=-1, batch_size=16)
# lengths: a 1-token prompt, short ones, and 33 (= one 32-token chunk + a 1-token last chunk when chunked)
PROMPTS = random_prompts(8, seed=5, lengths=(5, 9, 1, 14, 3, 7, 33, 2))


def totals(counters: list[dict]) -> tuple[int, int]:
    c = counters[0]
    return c.get("pruned_tokens", 0), c.get("full_tokens", 0)


@pytest.fixture(scope="module")
def setup(tiny_dirs):
    """family -> (model dir, plan at 50% REAP, reference tokens per mode)."""
    cache = {}

    def get(family):
        if family not in cache:
            model = load_model(tiny_dirs(family))
            stats = calibrate(model, random_prompts(8, seed=1), config=CalibrationConfig(max_new_tokens=8),
                              progress=False)
            plan = plan_from_stats(stats, "reap", 0.5)
            engine = PhaseSplitEngine(model, plan=plan)
            ref = {m: [o.token_ids for o in engine.generate(PROMPTS, m, CONFIG)] for m in ("full", "slimwise", "uniform")}
            cache[family] = (tiny_dirs(family), plan, ref, stats)
        return cache[family]

    return get


def test_colocated_equals_reference_with_exact_counters(setup):
    model_dir, plan, ref, _ = setup("qwen3_moe")
    assert ref["slimwise"] != ref["full"]
    engine = VllmEngine(model_dir, plan)
    n_prompt = sum(len(p) for p in PROMPTS)
    n_fed_back = sum(len(t) - 1 for t in ref["slimwise"])
    try:
        assert [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG)] == ref["slimwise"]
        assert totals(engine.counters()) == (n_fed_back, n_prompt)  # prompt tokens never pruned
        assert [o.token_ids for o in engine.generate(PROMPTS, "uniform", CONFIG)] == ref["uniform"]
        assert totals(engine.counters()) == (n_prompt + n_fed_back, 0)
        assert [o.token_ids for o in engine.generate(PROMPTS, "full", CONFIG)] == ref["full"]
    finally:
        engine.close()


def test_empty_plan_gives_stock_tokens(setup):
    model_dir, _, ref, stats = setup("qwen3_moe")
    engine = VllmEngine(model_dir, plan_from_stats(stats, "reap", 0.0))
    try:
        assert [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG)] == ref["full"]
        assert engine.counters() == [{}]  # nothing installed: the stock model runs
    finally:
        engine.close()


def test_chunked_prefill_and_prefix_cache_hits_are_never_pruned(setup):
    model_dir, plan, ref, _ = setup("qwen3_moe")
    engine = VllmEngine(model_dir, plan, engine_kwargs={"max_num_batched_tokens": 32, "max_num_seqs": 8,
                                                       "enable_prefix_caching": True, "max_model_len": 512})
    n_fed_back = sum(len(t) - 1 for t in ref["slimwise"])
    try:
        assert [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG)] == ref["slimwise"]
        pruned, full = totals(engine.counters())
        assert (pruned, full) == (n_fed_back, sum(len(p) for p in PROMPTS))
        steps = engine.counters()[0]["recent"]
        assert max(p + f for _, p, f in steps) <= 32 and any(p and f for _, p, f in steps)  # mixed batches ran
        # the same prompts again: prefix-cache hits, the uncached tail recomputed as prompt tokens
        assert [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG)] == ref["slimwise"]
        pruned2, full2 = totals(engine.counters())
        assert pruned2 - pruned == n_fed_back
        assert 0 < full2 - full <= sum(len(p) for p in PROMPTS)
    finally:
        engine.close()


def test_compiled_equals_eager(setup):
    model_dir, plan, ref, _ = setup("qwen3_moe")
    engine = VllmEngine(model_dir, plan, enforce_eager=False)
    try:
        assert [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG)] == ref["slimwise"]
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "olmoe", "gpt_oss"])
def test_other_served_families(family, setup):
    """Every family whose stock vLLM model runs on this CPU (qwen2_moe: routed + shared expert)."""
    model_dir, plan, ref, _ = setup(family)
    engine = VllmEngine(model_dir, plan)
    try:
        assert [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG)] == ref["slimwise"]
    finally:
        engine.close()


def test_distilled_delta_in_vllm_equals_reference(setup, tmp_path):
    """Router + norm delta act on decode tokens only, in vLLM exactly as in the reference engine."""
    from slimwise.distill import DistillConfig, distill

    model_dir, plan, ref, _ = setup("qwen3_moe")
    model = load_model(model_dir)
    delta = distill(model, plan, random_prompts(8, seed=9),
                    config=DistillConfig(params=("router", "norm"), steps=4, batch_size=4, max_new_tokens=8,
                                         lr=5e-2, progress=False))
    delta.save(tmp_path / "delta")
    reference = PhaseSplitEngine(model, plan=plan, delta=tmp_path / "delta")
    want = [o.token_ids for o in reference.generate(PROMPTS, "distilled", CONFIG)]
    assert want != ref["slimwise"], "the delta changed nothing: the test could not tell"
    assert [o.token_ids[0] for o in reference.generate(PROMPTS, "distilled", CONFIG)] == [t[0] for t in ref["full"]]
    engine = VllmEngine(model_dir, plan, delta=tmp_path / "delta")
    try:
        assert [o.token_ids for o in engine.generate(PROMPTS, "distilled", CONFIG)] == want
    finally:
        engine.close()
