"""Fail closed on real vLLM engines (CPU, V1 runner): an engine serves a plan only once its start-up
self-check saw the forward route every plan's decode rows with its kept experts, and a forward that no runner
seam prepared raises instead of serving the full model.

The breakages are the ones a GPU install can meet: a model runner that never calls the seam SlimWise wraps
(vLLM's Model Runner V2 before SlimWise gave it a ModelState: the stock `_model_forward` here), and a mask
that is not applied (a kernel that routes from the raw logits: the gate hook removed here).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_prompts

from slimwise.calibrate import CalibrationConfig, calibrate
from slimwise.criteria import plan_from_stats
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.engines.vllm_engine import VllmEngine
from slimwise.errors import SlimWiseError
from slimwise.models import load_model
from slimwise.serving import selfcheck

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.vllm_in_process]

CONFIG = GenerationConfig(max_new_tokens=10, eos_token_id=-1, batch_size=16)
# a 1-token prompt, and 33 = one 32-token chunk + a 1-token last chunk under a 32-token budget
PROMPTS = random_prompts(8, seed=7, lengths=(5, 9, 1, 14, 3, 7, 33, 2))


@pytest.fixture(scope="module")
def plans(tiny_dirs):
    model_dir = tiny_dirs("qwen3_moe")
    model = load_model(model_dir)
    stats = calibrate(model, random_prompts(8, seed=1), config=CalibrationConfig(max_new_tokens=8),
                      progress=False)
    named = {"half": plan_from_stats(stats, "reap", 0.5), "quarter": plan_from_stats(stats, "reap", 0.25)}
    return model_dir, model, named


def rows_seen(engine: VllmEngine) -> np.ndarray:
    return np.array(engine.counters()[0]["rows_seen"])


def test_self_check_and_exact_row_counts_under_chunks_prefix_hits_and_mixed_plans(plans):
    model_dir, model, named = plans
    engine = VllmEngine(model_dir, named, engine_kwargs={
        "max_num_batched_tokens": 32, "max_num_seqs": 8, "enable_prefix_caching": True, "max_model_len": 512})
    choice = ["half", "quarter", "full", None] * 2  # None: the default plan (the first, "half")
    try:
        engine.generate(PROMPTS[:1], "slimwise", CONFIG)  # starts the engine: the self-check runs first
        checked = engine.self_check
        assert checked["rows"] == {"half": 2 * (selfcheck.TOKENS - 1), "quarter": 2 * (selfcheck.TOKENS - 1)}
        assert checked["runner"].startswith("V1")
        names = engine.counters()[0]["plan_names"]
        for round_ in range(2):  # the second round hits the prefix cache for every prompt
            before = rows_seen(engine)
            outs = engine.generate(PROMPTS, "slimwise", CONFIG, plans=choice)
            seen = rows_seen(engine) - before
            want = dict.fromkeys(names, 0)
            for name, out in zip(choice, outs, strict=True):
                want[name or "half"] += len(out.token_ids) - 1
            for k, name in enumerate(names[1:], start=1):
                assert seen[0][k] == want[name], (round_, name)  # rows routed with plan k: its decode rows
                assert seen[1][k] == want[name]  # every one masked in the counted layer
            assert seen[1][0] == 0  # no prompt row, no `full` row masked
            # and the tokens are the reference's, plan by plan
            for name in ("half", "quarter"):
                idx = [i for i, c in enumerate(choice) if (c or "half") == name]
                ref = PhaseSplitEngine(model, plan=named[name]).generate(
                    [PROMPTS[i] for i in idx], "slimwise", CONFIG)
                assert [outs[i].token_ids for i in idx] == [r.token_ids for r in ref]
        steps = engine.counters()[0]["recent"]
        assert any(p and f for _, p, f in steps)  # mixed prompt/decode steps ran
    finally:
        engine.close()


def test_an_engine_whose_mask_is_not_applied_refuses(plans, monkeypatch):
    from slimwise.serving import gate_hooks

    model_dir, _, named = plans
    monkeypatch.setattr(gate_hooks, "mask_hook", lambda routing, gate, *args, **kwargs: None)
    engine = VllmEngine(model_dir, named["half"])
    with pytest.raises(SlimWiseError, match=r"self-check failed .*plan 'default': 0 of its 6 rows masked"):
        engine.generate(PROMPTS[:1], "slimwise", CONFIG)
    assert engine.llm is None  # closed, nothing served


def test_a_runner_that_never_sets_the_step_refuses(plans, monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    model_dir, _, named = plans
    # the stock per-step method: what V2 amounts to for a plugin that only wraps V1's
    monkeypatch.setattr(GPUModelRunner, "_model_forward", GPUModelRunner._slimwise_stock["_model_forward"])
    engine = VllmEngine(model_dir, named["half"])
    with pytest.raises(Exception, match="without SlimWise's per-step state") as caught:
        engine.generate(PROMPTS[:1], "slimwise", CONFIG)
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in str(caught.value)
    engine.close()


def test_verify_names_every_difference():
    names = ["full", "a", "b"]
    info = {"counted_layer": 2, "plan_names": names, "counted_prunes": [False, True, False], "runner": "V9"}
    before = [{**info, "rows_seen": [[0, 0, 0], [0, 0, 0]]}]
    after = [{**info, "rows_seen": [[40, 6, 6], [1, 6, 0]]}]
    with pytest.raises(SlimWiseError, match="1 rows routed with every expert were masked"):
        selfcheck.verify(before, after, {"a": 6, "b": 6})
    after = [{**info, "rows_seen": [[40, 0, 6], [0, 0, 0]]}]
    with pytest.raises(SlimWiseError, match=r"model runner V9: plan 'a' routed 0 rows, expected 6"):
        selfcheck.verify(before, after, {"a": 6, "b": 6})
    # two tensor-parallel ranks see the same rows; a pipeline stage counting a later layer is not added
    after = [{**info, "rows_seen": [[9, 6, 6], [0, 6, 0]]}] * 2 + [{**info, "counted_layer": 7,
                                                                    "rows_seen": [[9, 6, 6], [0, 6, 0]]}]
    assert selfcheck.verify(before * 3, after, {"a": 6, "b": 6}, replicas=2)["rows"] == {"a": 6, "b": 6}
