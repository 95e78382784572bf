"""End to end on a tiny random model of every family: calibrate -> plan -> masked view / exported checkpoint
-> phase-split generation. Tokens are compared exactly."""

from __future__ import annotations

import pytest
import torch
from conftest import ALL_FAMILIES, random_prompts

from slimwise.calibrate import CalibrationConfig, ExpertObserver, calibrate
from slimwise.criteria import plan_from_stats
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.export import export_pruned, load_pruned
from slimwise.models import load_model
from slimwise.plan import PrunePlan

GREEDY = GenerationConfig(max_new_tokens=12, batch_size=4)
SAMPLED = GenerationConfig(max_new_tokens=12, batch_size=4, temperature=0.8, top_p=0.9, top_k=50, seed=7)


def tokens(engine, prompts, mode, config=GREEDY):
    return [o.token_ids for o in engine.generate(prompts, mode=mode, config=config)]


def cache_tensors(cache) -> list[torch.Tensor]:
    """Every tensor a cache object holds (KV, and conv/recurrent state for hybrid models), in a fixed
    order."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(obj, depth=0):
        if depth > 4 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                walk(x, depth + 1)
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(obj[k], depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            for k in sorted(vars(obj)):
                walk(vars(obj)[k], depth + 1)

    walk(cache)
    return found


@pytest.fixture(scope="module")
def calibrated(tiny_dirs):
    """family -> (model, stats, plan at 50% REAP, decode-phase calibration)."""
    out = {}

    def get(family):
        if family not in out:
            model = load_model(tiny_dirs(family))
            stats = calibrate(
                model,
                random_prompts(8, seed=1),
                config=CalibrationConfig(max_new_tokens=8, batch_size=4),
                progress=False,
            )
            out[family] = (model, stats, plan_from_stats(stats, "reap", 0.5))
        return out[family]

    return get


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_ratio0_slimwise_equals_full(family, calibrated):
    model, stats, _ = calibrated(family)
    engine = PhaseSplitEngine(model, plan=plan_from_stats(stats, "reap", 0.0))
    prompts = random_prompts()
    assert tokens(engine, prompts, "slimwise") == tokens(engine, prompts, "full")
    assert tokens(engine, prompts, "uniform") == tokens(engine, prompts, "full")
    assert tokens(engine, prompts, "slimwise", SAMPLED) == tokens(engine, prompts, "full", SAMPLED)
    engine.close()


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_prefill_is_the_full_model(family, calibrated):
    """SlimWise's prompt-position cache (KV and any linear-attention state) and first token are the full
    model's."""
    model, _, plan = calibrated(family)
    engine = PhaseSplitEngine(model, plan=plan)
    prompts = random_prompts()
    full_cache, full_logits, *_ = engine.prefill(prompts, "full")
    sw_cache, sw_logits, *_ = engine.prefill(prompts, "slimwise")
    uni_cache, uni_logits, *_ = engine.prefill(prompts, "uniform")
    assert torch.equal(full_logits, sw_logits)
    a, b, c = cache_tensors(full_cache), cache_tensors(sw_cache), cache_tensors(uni_cache)
    assert len(a) == len(b) > 0
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True)), "uniform prefill should differ"
    full = engine.generate(prompts, "full", GREEDY, keep_first_logits=True)
    sw = engine.generate(prompts, "slimwise", GREEDY, keep_first_logits=True)
    assert [o.token_ids[0] for o in full] == [o.token_ids[0] for o in sw]
    assert tokens(engine, prompts, "slimwise") != tokens(engine, prompts, "full"), (
        "50% pruning changed nothing"
    )
    engine.close()


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_masked_view_equals_exported_checkpoint(family, calibrated, tmp_path):
    model, _, plan = calibrated(family)
    out = export_pruned(load_model(model.slimwise_source_dir), plan, tmp_path / "pruned")
    pruned, saved_plan = load_pruned(out)
    assert saved_plan == plan
    masked = PhaseSplitEngine(model, plan=plan)
    sliced = PhaseSplitEngine(model, plan=plan, decode_model=pruned)
    prompts = random_prompts()
    for mode in ("slimwise", "uniform"):
        assert tokens(masked, prompts, mode) == tokens(sliced, prompts, mode), mode
    assert tokens(masked, prompts, "slimwise", SAMPLED) == tokens(sliced, prompts, "slimwise", SAMPLED)
    # the exported checkpoint alone, as a plain transformers model, is the uniform-pruned model
    alone = PhaseSplitEngine(pruned)
    assert tokens(alone, prompts, "full") == tokens(masked, prompts, "uniform")
    masked.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_calibration_counts(family, tiny_dirs):
    model = load_model(tiny_dirs(family))
    prompts = random_prompts(6, seed=3)
    top_k = model.config.num_experts_per_tok
    prompt_stats = calibrate(
        model, prompts, config=CalibrationConfig(phase="prompt", batch_size=3), progress=False
    )
    n_prompt = sum(len(p) for p in prompts)
    assert prompt_stats.tokens.tolist() == [n_prompt] * len(prompt_stats.layers)  # padding never counts
    assert prompt_stats.count.sum(1).tolist() == [n_prompt * top_k] * len(prompt_stats.layers)

    cfg = CalibrationConfig(phase="decode", max_new_tokens=6, batch_size=6)
    decode_stats = calibrate(model, prompts, config=cfg, progress=False)
    outs = PhaseSplitEngine(model).generate(prompts, "full", GenerationConfig(max_new_tokens=6))
    n_decode = sum(len(o.token_ids) - 1 for o in outs)  # the last token is never fed back
    assert decode_stats.tokens.tolist() == [n_decode] * len(decode_stats.layers)
    all_stats = calibrate(
        model, prompts, config=CalibrationConfig(phase="all", max_new_tokens=6), progress=False
    )
    assert torch.allclose(all_stats.count, prompt_stats.count + decode_stats.count)

    # batching does not change what is counted
    one_by_one = calibrate(
        model, prompts, config=CalibrationConfig(phase="prompt", batch_size=1), progress=False
    )
    assert torch.equal(one_by_one.count, prompt_stats.count)
    assert torch.allclose(one_by_one.gate_norm_sum, prompt_stats.gate_norm_sum, rtol=1e-4)
    assert prompt_stats.meta["fingerprint"] and prompt_stats.meta["family"] == family


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_observer_does_not_change_the_model(family, tiny_dirs):
    model = load_model(tiny_dirs(family))
    ids = torch.tensor(random_prompts(2, lengths=(8, 8)))
    with torch.no_grad():
        want = model(ids).logits
        observer = ExpertObserver(model, "all")
        observer.before_forward("prompt", torch.ones(ids.numel(), dtype=torch.bool))
        got = model(ids).logits
        observer.remove()
        again = model(ids).logits
    assert torch.allclose(want, got, atol=1e-5)
    assert torch.equal(want, again)
    assert observer.stats.count.sum() > 0
    # norms are measured only on routed tokens: total selections = tokens x top-k
    top_k = observer.adapter.top_k(model.config)
    assert observer.stats.count.sum(1).tolist() == [ids.numel() * top_k] * len(observer.stats.layers)


def test_empty_plan_is_full_model(calibrated):
    model, _, _ = calibrated("qwen3_moe")
    plan = PrunePlan.full(model)
    assert plan.is_empty
    engine = PhaseSplitEngine(model, plan=plan)
    assert engine.mask is not None and len(engine.mask._wrappers) == 0  # nothing wrapped
    assert tokens(engine, random_prompts(), "uniform") == tokens(engine, random_prompts(), "full")


def test_stop_strings_eos_and_length(tmp_path):
    """Text prompts: stop strings cut the output (not included), EOS ends a row, max_new_tokens truncates."""
    from tiny import save_tiny_model

    from lab.testbed.tokenizer import build_tokenizer

    tok = build_tokenizer(tmp_path / "m")
    save_tiny_model("qwen3_moe", tmp_path / "m", initializer_range=0.15, vocab_size=len(tok),
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    from slimwise.models import load_tokenizer

    model, tok = load_model(tmp_path / "m"), load_tokenizer(tmp_path / "m")
    engine = PhaseSplitEngine(model, tok)
    prompts = ["add 12+34\n", "sort 3 1 2\n", "upper abc\n"]
    free = engine.generate(prompts, "full", GenerationConfig(max_new_tokens=16, eos_token_id=-1))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 16 for o in free)
    stop = free[0].text[3:6]
    cut = engine.generate(prompts, "full", GenerationConfig(max_new_tokens=16, eos_token_id=-1, stop=(stop,)))
    assert cut[0].finish_reason == "stop" and cut[0].text == free[0].text[: free[0].text.index(stop)]
    assert stop not in cut[0].text and len(cut[0].token_ids) < 16
    # an EOS id that the model emits: the row ends there and the EOS is not part of the text
    eos = free[1].token_ids[2]
    ended = engine.generate(prompts, "full", GenerationConfig(max_new_tokens=16, eos_token_id=eos))
    assert ended[1].finish_reason == "eos" and ended[1].token_ids[-1] == eos
    assert len(ended[1].token_ids) == free[1].token_ids.index(eos) + 1


def test_positions_past_the_trained_range_are_warned_about():
    """The reference engine runs past max_position_embeddings (transformers computes RoPE on the fly) where
    vLLM refuses: a long-prompt user hears about it once per call; within the range nothing is said."""
    import warnings

    from tiny import build_tiny_model

    model = build_tiny_model("qwen3_moe", seed=0, max_position_embeddings=24)
    engine = PhaseSplitEngine(model)
    past = r"reach 26 positions, past the model's max_position_embeddings \(24\)"
    with pytest.warns(UserWarning, match=past):
        engine.generate([list(range(3, 19))], "full", GenerationConfig(max_new_tokens=10, eos_token_id=-1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.generate([list(range(3, 13))], "full", GenerationConfig(max_new_tokens=10, eos_token_id=-1))
