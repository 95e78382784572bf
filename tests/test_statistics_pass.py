"""The teacher-forced statistics pass (`continuation_stats`) against the statistics counted while the full
model generates (`calibrate`): on every shipped testbed, in float32, for the same continuations, the counts
are equal, the float sums agree within rounding and the plans are identical. This is what makes
`slimwise calibrate --engine vllm` (vLLM generates, this pass counts) the same calibration."""

from __future__ import annotations

import pytest
import torch

from slimwise.calibrate import CalibrationConfig, calibrate, continuation_stats
from slimwise.criteria import plan_from_stats
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.errors import SlimWiseError
from slimwise.models import load_model, load_tokenizer
from slimwise.testbed import make_split

SUMS = ("gate_sum", "norm_sum", "norm_sq_sum", "gate_norm_sum")


@pytest.fixture(scope="module")
def prompts():
    return [s.prompt for s in make_split("calib", 4, seed=0, domain="arithmetic")]


@pytest.mark.parametrize("name", ["testbed-a", "testbed-b", "testbed-c"])
@pytest.mark.parametrize("phase", ["decode", "all"])
def test_teacher_forced_pass_counts_what_generation_counts(name, phase, prompts):
    model, tok = load_model(name, dtype="float32"), load_tokenizer(name)
    config = CalibrationConfig(phase=phase, max_new_tokens=40, batch_size=8)
    generated = calibrate(model, prompts, tok, config, progress=False)
    with PhaseSplitEngine(model, tok) as engine:
        conts = [g.token_ids for g in engine.generate(prompts, "full", GenerationConfig(max_new_tokens=40,
                                                                                       batch_size=8))]
    forced = continuation_stats(model, prompts, conts, tok, config, progress=False)
    assert torch.equal(generated.count, forced.count)
    assert torch.equal(generated.tokens, forced.tokens)
    assert int(forced.tokens[0]) == sum(len(c) - 1 for c in conts) + (
        sum(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts) if phase == "all" else 0)
    for field in SUMS:
        # float32 activations: a whole-sequence forward rounds differently from token-by-token decoding
        torch.testing.assert_close(getattr(forced, field), getattr(generated, field), rtol=1e-5, atol=1e-9)
    for criterion in ("frequency", "reap", "ean"):
        assert plan_from_stats(forced, criterion, 0.5).kept_experts == \
            plan_from_stats(generated, criterion, 0.5).kept_experts
    assert forced.meta["pass"] == "teacher-forced"
    assert forced.meta["fingerprint"] == generated.meta["fingerprint"]


def test_teacher_forced_pass_refuses_missing_or_empty_continuations(prompts):
    model, tok = load_model("testbed-a", dtype="float32"), load_tokenizer("testbed-a")
    with pytest.raises(SlimWiseError, match="continuations for"):
        continuation_stats(model, prompts, [[1, 2]], tok, progress=False)
    with pytest.raises(SlimWiseError, match="no decode tokens were counted"):
        continuation_stats(model, prompts, [[5]] * len(prompts), tok, progress=False)


def test_observer_leaves_the_model_output_bit_identical():
    """The grouped observer returns what the model's own experts forward returns (so calibration observes
    the served model), on a hybrid and a softmax family."""
    from slimwise.calibrate import ExpertObserver

    for name in ("testbed-a", "testbed-c"):
        model = load_model(name, dtype="float32")
        ids = torch.randint(5, 100, (3, 17), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            stock = model(input_ids=ids).logits
            observer = ExpertObserver(model, "all")
            observer.before_forward("prompt", torch.ones(ids.numel(), dtype=torch.bool))
            observed = model(input_ids=ids).logits
            observer.remove()
        assert torch.equal(stock, observed), name
        assert int(observer.stats.tokens[0]) == ids.numel()
