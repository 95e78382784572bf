"""The layer-streamed pass (slimwise.sequential) on models loaded under a `--max-memory` budget that leaves
decoder layers offloaded: the statistics equal the in-memory pass bit for bit on the same loaded model and
the whole model's within float rounding; the teacher-forced log-probs and KL of every mode equal the
in-memory scoring within a stated tolerance; `slimwise calibrate --max-memory` streams and says so."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import ALL_FAMILIES, random_prompts

from slimwise.calibrate import CalibrationConfig, continuation_stats
from slimwise.criteria import plan_from_stats
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.errors import SlimWiseError
from slimwise.models import is_hybrid, load_model
from slimwise.scoring import continuation_logprobs, kl_divergence
from slimwise.sequential import offloaded_share, streamed_logprobs, streamed_statistics
from slimwise.stats import ExpertStats
from slimwise.testbed import export_jsonl, make_split

SLIMWISE = [sys.executable, "-m", "slimwise.cli"]
BUDGET = "cpu=0.05MiB"  # below one decoder layer of every tiny model: layers go to accelerate's disk offload
#: float32 log-probs: the streamed pass runs each position's layers in a whole-sequence forward, the in-memory
#: scoring runs a prefill and then the continuation on its cache (other shapes, other rounding)
LOGPROB_ATOL = 1e-4
#: the hybrid's Gated DeltaNet layers run two algorithms there, not one in two shapes: the chunked delta rule
#: over the whole sequence against its recurrent form token by token on the cache. Their float32 rounding
#: apart reaches 1.3e-4 on an AVX-512 Xeon (docs/reproducibility.md), still 1e-4 on the KL
HYBRID_LOGPROB_ATOL = 5e-4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().sum() / a.abs().sum().clamp_min(1e-30))


@pytest.fixture(scope="module")
def models(tiny_dirs):
    """family -> (whole model, the same checkpoint under BUDGET, prompts, the whole model's continuations)."""
    cache = {}

    def get(family):
        if family not in cache:
            whole = load_model(tiny_dirs(family))
            spread = load_model(tiny_dirs(family), max_memory=BUDGET)
            prompts = random_prompts(6, seed=5)
            engine = PhaseSplitEngine(whole)
            config = GenerationConfig(max_new_tokens=7, batch_size=4)
            conts = [g.token_ids for g in engine.generate(prompts, mode="full", config=config)]
            engine.close()
            cache[family] = (whole, spread, prompts, conts)
        return cache[family]

    return get


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_streamed_statistics_equal_the_in_memory_pass(models, family):
    whole, spread, prompts, conts = models(family)
    offloaded, layers = offloaded_share(spread)
    assert offloaded == layers  # the budget streams every layer
    for phase in ("decode", "all", "prompt"):
        config = CalibrationConfig(phase=phase, batch_size=4)
        given = None if phase == "prompt" else conts
        got = streamed_statistics(spread, prompts, given, config=config, progress=False)
        forced = [[0]] * len(prompts) if given is None else given
        same_model = continuation_stats(spread, prompts, forced, config=config, progress=False)
        reference = continuation_stats(whole, prompts, forced, config=config, progress=False)
        assert got.meta["pass"] == "layer-streamed"
        for name in ("tokens", "count", "gate_sum", "norm_sum", "norm_sq_sum", "gate_norm_sum"):
            assert torch.equal(getattr(got, name), getattr(same_model, name)), (family, phase, name)
            assert rel(getattr(reference, name), getattr(got, name)) <= 1e-5, (family, phase, name)
        assert torch.equal(got.count, reference.count)
        assert plan_from_stats(got, "reap", 0.5).kept_experts == \
            plan_from_stats(reference, "reap", 0.5).kept_experts


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_streamed_logprobs_and_kl_equal_the_in_memory_scoring(models, family):
    whole, spread, prompts, conts = models(family)
    stats = continuation_stats(whole, prompts, conts, config=CalibrationConfig(batch_size=4), progress=False)
    plan = plan_from_stats(stats, "reap", 0.5)
    modes = ("full", "slimwise", "uniform")
    got = streamed_logprobs(spread, prompts, conts, modes=modes, plan=plan, batch_size=4, progress=False)
    engine = PhaseSplitEngine(whole, plan=plan)
    try:
        want = {m: continuation_logprobs(engine, prompts, conts, m) for m in modes}
    finally:
        engine.close()
    atol = HYBRID_LOGPROB_ATOL if is_hybrid(whole.config) else LOGPROB_ATOL
    for mode in modes:
        for i, c in enumerate(conts):
            assert got[mode][i].shape == (len(c), want[mode].shape[-1])
            assert torch.allclose(got[mode][i], want[mode][i, :len(c)].float(), atol=atol, rtol=0), \
                (family, mode, i)
    for mode in ("slimwise", "uniform"):
        for i, c in enumerate(conts):
            kl_got = kl_divergence(got["full"][i], got[mode][i])
            kl_want = kl_divergence(want["full"][i, :len(c)], want[mode][i, :len(c)])
            assert torch.allclose(kl_got, kl_want, atol=LOGPROB_ATOL, rtol=0), (family, mode, i)
    # slimwise decodes pruned from the first fed token on: position 0 (the last prompt position) is the full
    # model's, up to rounding (the pruned rows of the same batch regroup the experts' matmuls)
    assert all(torch.allclose(got["slimwise"][i][0], got["full"][i][0], atol=LOGPROB_ATOL, rtol=0)
               for i in range(len(conts)))


def test_the_hybrid_testbed_streams_like_the_whole_model():
    """testbed-c (Gated-DeltaNet + attention, the paper's design), the shipped checkpoint under a budget that
    keeps 2 of its 4 layers in memory: decode-phase statistics over the whole model's continuations."""
    from slimwise.models import load_tokenizer

    tokenizer = load_tokenizer("testbed-c")
    prompts = [s.prompt for s in make_split("calib", 2, seed=0)][:8]
    whole = load_model("testbed-c", dtype="float32")
    engine = PhaseSplitEngine(whole, tokenizer)
    conts = [g.token_ids for g in engine.generate(prompts, mode="full",
                                                  config=GenerationConfig(max_new_tokens=12, batch_size=4))]
    engine.close()
    spread = load_model("testbed-c", dtype="float32", max_memory="cpu=20MiB")
    assert offloaded_share(spread) == (2, 4)
    config = CalibrationConfig(phase="decode", batch_size=4)
    got = streamed_statistics(spread, prompts, conts, tokenizer, config, progress=False)
    same_model = continuation_stats(spread, prompts, conts, tokenizer, config, progress=False)
    reference = continuation_stats(whole, prompts, conts, tokenizer, config, progress=False)
    assert torch.equal(got.count, same_model.count) and torch.equal(got.norm_sum, same_model.norm_sum)
    assert torch.equal(got.count, reference.count) and rel(reference.norm_sum, got.norm_sum) <= 1e-5


def test_generation_is_refused_by_the_streamed_pass(models):
    _, spread, prompts, _ = models("qwen3_moe")
    with pytest.raises(SlimWiseError, match="generation needs every layer for every token"):
        streamed_statistics(spread, prompts, None, config=CalibrationConfig(phase="decode"), progress=False)
    with pytest.raises(SlimWiseError, match="a pruned mode needs a plan"):
        streamed_logprobs(spread, prompts, [[1, 2]] * len(prompts), modes=("slimwise",), progress=False)


def test_cli_calibrate_streams_under_max_memory(tmp_path):
    """As a user runs it: `slimwise calibrate --max-memory` on testbed-c, prompt phase and over continuations
    from an earlier `slimwise generate --out`: it says it streams, and writes what the whole model counts
    (prompt phase; decode phase while generating). Bad --continuations files: tests/test_bad_inputs.py."""
    from slimwise.calibrate import calibrate
    from slimwise.models import load_tokenizer

    samples = make_split("calib", 1, seed=3)[:6]
    export_jsonl(samples, tmp_path / "calib.jsonl")

    def run(*extra):
        proc = subprocess.run([*SLIMWISE, *extra], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        return proc

    base = ["calibrate", "testbed-c", "--data", str(tmp_path / "calib.jsonl"), "--dtype", "float32",
            "--batch-size", "4", "--max-memory", "cpu=20MiB"]
    proc = run(*base, "--phase", "prompt", "--out", str(tmp_path / "prompt.safetensors"))
    assert "2 of 4 decoder layers do not fit --max-memory: the statistics pass runs one layer at a time" \
        in proc.stderr
    run("generate", "testbed-c", "--dtype", "float32", "--mode", "full", "--prompts",
        str(tmp_path / "calib.jsonl"), "--max-new-tokens", "10", "--batch-size", "4", "--out",
        str(tmp_path / "gen.jsonl"))
    proc = run(*base, "--max-new-tokens", "10", "--continuations", str(tmp_path / "gen.jsonl"), "--out",
               str(tmp_path / "decode.safetensors"))
    assert "one layer at a time" in proc.stderr

    whole, tokenizer = load_model("testbed-c", dtype="float32"), load_tokenizer("testbed-c")
    prompts = [s.prompt for s in samples]
    for phase, tokens in (("prompt", 0), ("decode", 10)):
        want = calibrate(whole, prompts, tokenizer, CalibrationConfig(phase=phase, max_new_tokens=tokens or 1,
                                                                       batch_size=4), progress=False)
        got = ExpertStats.load(tmp_path / f"{phase}.safetensors")
        assert torch.equal(want.count, got.count) and rel(want.norm_sum, got.norm_sum) <= 1e-5, phase
    assert got.meta["engine"] == {"continuations": str(tmp_path / "gen.jsonl")}


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_evaluation_kl_of_a_spread_model_is_streamed(models, family):
    """`teacher_forced_kl` (the evaluation's fidelity metric) on a model with offloaded layers scores it one
    layer at a time; per sample it equals the whole model's in-memory KL."""
    from slimwise.evaluation.metrics import teacher_forced_kl

    whole, spread, prompts, conts = models(family)
    stats = continuation_stats(whole, prompts, conts, config=CalibrationConfig(batch_size=4), progress=False)
    plan = plan_from_stats(stats, "reap", 0.5)
    conts = [*conts[:-1], []]  # a sample with nothing generated scores 0, as in memory
    for mode in ("slimwise", "uniform"):
        values = []
        for model in (whole, spread):
            engine = PhaseSplitEngine(model, plan=plan)
            try:
                values.append(teacher_forced_kl(engine, prompts, conts, mode, batch_size=4))
            finally:
                engine.close()
        assert values[1][-1] == 0.0 and all(v > 0 for v in values[1][:-1])
        assert values[0] == pytest.approx(values[1], abs=LOGPROB_ATOL), (family, mode)
