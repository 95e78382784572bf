"""Evaluation: metric functions on hand-made cases, teacher-forced KL and decode-traffic counting on a tiny
model, and a small end-to-end `slimwise eval` run whose report and plots must carry every requested metric."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch
from conftest import random_prompts
from tiny import save_tiny_model

from lab.testbed.tokenizer import build_tokenizer
from slimwise.cli import main as cli_main
from slimwise.criteria import plan_from_stats
from slimwise.engines.reference import Generation, GenerationConfig, PhaseSplitEngine
from slimwise.errors import SlimWiseError
from slimwise.evaluation import (
    DecodeTrafficMeter,
    EvalConfig,
    GradedSample,
    PlanSpec,
    Sweep,
    accuracy_metrics,
    bootstrap_ci,
    continuation_logprobs,
    expected_union,
    fidelity_metrics,
    first_difference,
    kl_divergence,
    length_metrics,
    load_samples,
    make_engine,
    make_grader,
    paired_difference,
    run_eval,
    teacher_forced_kl,
)
from slimwise.evaluation.plots import PLOTS
from slimwise.evaluation.report import write_markdown
from slimwise.models import load_model, load_tokenizer
from slimwise.plan import PrunePlan, make_plan


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest single-threaded; on a shared box more threads only contend."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def gen(tokens, reason="eos", text=None) -> Generation:
    return Generation([1], list(tokens), reason, text)


# ----------------------------------------------------------------------------------------------------------
# pure metrics


def test_length_metrics_known_lengths():
    gens = [gen([1, 2, 0]), gen([1, 2, 3, 4, 0]), gen(range(10), "length"), gen([5, 6], "stop")]
    m = length_metrics(gens, max_new_tokens=10)
    assert m["length_mean"] == pytest.approx((3 + 5 + 10 + 2) / 4)
    assert m["length_median"] == pytest.approx(4.0)
    # linear interpolation on the sorted lengths 2, 3, 5, 10: position 0.9 x 3 = 2.7, so 5 + 0.7 x (10 - 5)
    assert m["length_p90"] == pytest.approx(8.5)
    assert m["eos_share"] == pytest.approx(0.5)
    assert m["truncated_share"] == pytest.approx(0.25)  # only the one that hit max_new_tokens


def test_first_difference_cases():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # a prefix differs at the shorter length
    assert first_difference([], [4]) == 0


def test_fidelity_identical_outputs():
    ref = [gen([1, 2, 0]), gen([3, 0]), gen([4, 5, 6], "length")]
    m = fidelity_metrics([gen(g.token_ids, g.finish_reason) for g in ref], ref)
    assert m["exact_match"] == 1.0 and m["first_token_agree"] == 1.0
    assert m["first_diff_mean"] is None
    assert m["length_ratio_mean"] == 1.0 and m["length_ratio_p10"] == 1.0 and m["length_ratio_p90"] == 1.0


def test_fidelity_known_differences():
    ref = [gen([1, 2, 0]), gen([3, 4, 5, 0]), gen([7, 0])]
    out = [gen([1, 2, 0]), gen([3, 9, 0]), gen([8, 8, 8, 0])]
    m = fidelity_metrics(out, ref)
    assert m["exact_match"] == pytest.approx(1 / 3)
    assert m["first_token_agree"] == pytest.approx(2 / 3)
    assert m["first_diff_mean"] == pytest.approx((1 + 0) / 2)
    assert m["length_ratio_mean"] == pytest.approx((1 + 3 / 4 + 2) / 3)
    # sorted ratios 0.75, 1, 2: p10 at position 0.2 -> 0.75 + 0.2 x 0.25; p90 at 1.8 -> 1 + 0.8 x 1
    assert m["length_ratio_p10"] == pytest.approx(0.8) and m["length_ratio_p90"] == pytest.approx(1.8)


def test_accuracy_and_bootstrap():
    assert bootstrap_ci([1.0] * 20) == (1.0, 1.0)
    m = accuracy_metrics([True] * 30 + [False] * 70)
    assert m["accuracy"] == pytest.approx(0.3) and m["n"] == 100
    assert m["accuracy_ci_low"] < 0.3 < m["accuracy_ci_high"]
    assert m["accuracy_ci_high"] - m["accuracy_ci_low"] \
        == pytest.approx(2 * 1.96 * math.sqrt(0.21 / 100), abs=0.04)
    d = paired_difference([1, 1, 1, 0], [0, 1, 1, 0])
    assert d["diff"] == pytest.approx(0.25) and d["ci_low"] <= 0.25 <= d["ci_high"]
    same = paired_difference([1, 0, 1], [1, 0, 1])
    assert same == {"diff": 0.0, "ci_low": 0.0, "ci_high": 0.0, "a_only": 0, "b_only": 0, "p_exact": 1.0}


def test_kl_divergence_known_values():
    p = torch.log_softmax(torch.randn(3, 5, 11), dim=-1)
    assert torch.equal(kl_divergence(p, p), torch.zeros(3, 5))
    a, b = torch.tensor([0.5, 0.5]).log(), torch.tensor([0.9, 0.1]).log()
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert float(kl_divergence(a, b)) == pytest.approx(expected, rel=1e-5)


def test_expected_union():
    assert expected_union(256, 8, 16) == pytest.approx(101, abs=1)  # the paper's note
    assert expected_union(16, 4, 1) == pytest.approx(4)
    assert expected_union(16, 4, 10_000) == pytest.approx(16)
    assert expected_union(8, 4, 0) == 0.0


def test_graders_and_samples(tmp_path):
    s = GradedSample("add 1+2\n", "3", "add", {"answer": "3"})
    assert make_grader("testbed")(s, gen([1], "eos", "1+2+0=3, 3\n#### 3"))
    assert not make_grader("testbed")(s, gen([1], "eos", "#### 4"))
    assert make_grader("exact")(GradedSample("q", "yes"), gen([1], text=" yes "))
    assert make_grader("contains")(GradedSample("q", "42"), gen([1], text="it is 42."))
    with pytest.raises(SlimWiseError, match="grader"):
        make_grader("nope")
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"p{i}", "answer": str(i), "family": f"f{i % 2}"})
                              for i in range(6)) + "\n")
    samples = load_samples(str(data), max_samples=4)
    assert [x.family for x in samples] == ["f0", "f1", "f0", "f1"]  # round-robin keeps families represented
    testbed = load_samples(None, n_per_family=2, domain="lists")
    assert {x.family for x in testbed} == {"sort", "reverse", "dedup", "count"} and len(testbed) == 8


def test_config_refusals(monkeypatch):
    with pytest.raises(SlimWiseError, match="needs --distilled"):
        EvalConfig(modes=("distilled",)).validate()
    with pytest.raises(SlimWiseError, match="unknown modes"):
        EvalConfig(modes=("fast",)).validate()
    with pytest.raises(SlimWiseError, match="outside"):
        EvalConfig(ratios=(1.0,)).validate()
    with pytest.raises(SlimWiseError, match="unknown criteria"):
        EvalConfig(criteria=("magic",)).validate()
    with pytest.raises(SlimWiseError, match="unknown engine"):
        EvalConfig(engine="sglang").validate()
    with pytest.raises(SlimWiseError, match="mode distilled needs --distilled"):
        EvalConfig(modes=("full", "distilled")).validate()


def test_vllm_engine_is_optional(monkeypatch):
    """Without vLLM, --engine vllm is one clear error (the engine is imported lazily)."""
    monkeypatch.setitem(sys.modules, "slimwise.engines.vllm_engine", None)  # makes the import fail
    with pytest.raises(SlimWiseError, match="engine vllm needs vLLM"):
        make_engine("vllm", None, None, None, None)
    with pytest.raises(SlimWiseError, match="unknown engine"):
        make_engine("sglang", None, None, None, None)


# ----------------------------------------------------------------------------------------------------------
# KL and traffic on a tiny model


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    model = load_model(tiny_dirs("qwen3_moe"))
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(len(model.model.layers), 16, generator=g, dtype=torch.float64)
    layers = list(range(len(model.model.layers)))
    kw = dict(family="qwen3_moe", top_k=4)
    return model, make_plan(scores, layers, 0.5, **kw), make_plan(scores, layers, 0.0, **kw)


def test_continuation_logprobs_align_with_generation(tiny):
    """Teacher forcing a mode's own greedy output: argmax at every position is the token it generated."""
    model, plan, _ = tiny
    engine = PhaseSplitEngine(model, plan=plan)
    prompts = random_prompts(4)
    cfg = GenerationConfig(max_new_tokens=6, batch_size=4, eos_token_id=-1)
    for mode in ("full", "slimwise", "uniform"):
        outs = engine.generate(prompts, mode, cfg)
        logp = continuation_logprobs(engine, prompts, [o.token_ids for o in outs], mode)
        assert logp.shape[:2] == (4, 6)
        assert logp.argmax(-1).tolist() == [o.token_ids for o in outs], mode
    engine.close()


def test_teacher_forced_kl(tiny):
    model, plan, empty = tiny
    prompts = random_prompts(4)
    engine = PhaseSplitEngine(model, plan=plan)
    full = engine.generate(prompts, "full", GenerationConfig(max_new_tokens=6, eos_token_id=-1))
    conts = [o.token_ids for o in full]
    assert teacher_forced_kl(engine, prompts, conts, "full") == [0.0] * 4
    sw = teacher_forced_kl(engine, prompts, conts, "slimwise", batch_size=3)
    uni = teacher_forced_kl(engine, prompts, conts, "uniform")
    assert all(x > 0 for x in sw) and all(x > 0 for x in uni)
    # SlimWise's first position is the full model's prefill: KL there is exactly 0; uniform's is not
    ref = continuation_logprobs(engine, prompts, conts, "full")
    assert torch.equal(kl_divergence(ref, continuation_logprobs(engine, prompts, conts, "slimwise"))[:, 0],
                       torch.zeros(4))
    assert (kl_divergence(ref, continuation_logprobs(engine, prompts, conts, "uniform"))[:, 0] > 0).all()
    engine.close()
    nothing = PhaseSplitEngine(model, plan=empty)  # ratio 0: identical models
    assert teacher_forced_kl(nothing, prompts, conts, "slimwise") == [0.0] * 4
    nothing.close()


def test_evaluate_modes_with_one_engine(tiny):
    from slimwise.evaluation import evaluate_modes

    model, plan, _ = tiny
    engine = PhaseSplitEngine(model, plan=plan)
    samples = [GradedSample(p, "x", f"f{i % 2}") for i, p in enumerate(random_prompts(4))]
    report = evaluate_modes(engine, samples, ["full", "slimwise"],
                            GenerationConfig(max_new_tokens=4, batch_size=4), grader=lambda s, g: False)
    engine.close()
    assert report["full"]["exact_match"] == 1.0 and report["full"]["kl_mean"] == 0.0
    assert report["slimwise"]["first_token_agree"] == 1.0 and report["slimwise"]["kl_mean"] > 0
    assert report["slimwise"]["traffic"]["active_experts"] == 8 \
        and set(report["slimwise"]["by_family"]) == {"f0", "f1"}


def test_decode_traffic_meter(tiny):
    model, plan, _ = tiny
    engine = PhaseSplitEngine(model, plan=plan)
    prompts = random_prompts(6)
    # one live row per step: exactly top-k distinct experts per layer per step
    meter = DecodeTrafficMeter(model, batch_size=1)
    engine.generate(prompts[:2], "full", GenerationConfig(max_new_tokens=5, batch_size=1, eos_token_id=-1),
                    observer=meter)
    meter.remove()
    s = meter.summary()
    assert s["distinct_experts_per_layer_step"] == 4.0 and s["decode_steps"] == 2 * 4
    assert s["uniform_expectation"] == pytest.approx(4.0)
    assert s["expert_bytes_per_step"] == pytest.approx(4 * sum(meter.expert_bytes))
    # a batch of 6 under the 50% plan: between k and the 8 kept experts, never more
    kept = {layer: len(v) for layer, v in plan.kept_experts.items()}
    meter = DecodeTrafficMeter(model, kept, batch_size=6)
    engine.generate(prompts, "slimwise", GenerationConfig(max_new_tokens=5, batch_size=6, eos_token_id=-1),
                    observer=meter)
    meter.remove()
    s = meter.summary()
    assert all(4 <= x <= 8 for x in s["per_layer"]) and s["active_experts"] == 8
    assert s["distinct_experts_per_layer_step_full_batch"] \
        == pytest.approx(s["distinct_experts_per_layer_step"])
    assert s["uniform_expectation"] == pytest.approx(expected_union(8, 4, 6))
    full = DecodeTrafficMeter(model, batch_size=6)
    engine.generate(prompts, "full",
                    GenerationConfig(max_new_tokens=5, batch_size=6, eos_token_id=-1), observer=full)
    full.remove()
    assert full.summary()["distinct_experts_per_layer_step"] > 4
    assert not any(layer.router._forward_hooks for layer in meter.layers)  # hooks removed
    engine.close()


# ----------------------------------------------------------------------------------------------------------
# end to end


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("eval") / "tiny-eval", initializer_range=0.15)
    build_tokenizer(path)
    return path


SMALL = dict(criteria=("reap",), ratios=(0.5,), phases=("prompt", "decode"), n_per_family=1, max_new_tokens=8,
             batch_size=8, calib_per_family=1, calib_max_new_tokens=4, n_boot=200, progress=False,
             calib_mixes=(), other_domains=False)
# the default sweep's extras, small: every plan also scored on the other domains, and two mixed calibrations
CROSS = dict(calib_mixes=("all", "arithmetic:3,lists:1,text:1"), other_domains=True, other_per_family=1,
             calib_per_family=3)

RUN_METRICS = ("accuracy", "accuracy_ci_low", "accuracy_ci_high", "length_mean", "length_median",
               "length_p90", "eos_share", "truncated_share", "length_ratio_mean", "length_ratio_p10",
               "length_ratio_p90", "exact_match", "first_diff_mean", "kl_mean", "traffic", "by_family",
               "lengths", "length_ratios")
TRAFFIC = ("distinct_experts_per_layer_step", "uniform_expectation", "expert_bytes_per_layer_step",
           "expert_bytes_per_step", "batch_size")


def assert_report_matches_run_cache(sweep: Sweep, report: dict) -> None:
    """Every run's figures in `report` recomputed from the generations in the run cache: the grader on the
    cached texts, lengths, finish reasons and exact match against the cached full run, the cached KL."""
    grade = make_grader(sweep.config.grader)

    def cached(mode, r, other=False):
        spec = None if r is None else PlanSpec(r["label"], PrunePlan.load(r["plan"]), r["criterion"],
                                               r["ratio"], r["phase"], r["plan"])
        key = sweep.run_cache.key(mode, spec, other)
        return json.loads((sweep.cache_dir / f"run-{mode}-{key}.json").read_text())

    def check(m, rec, full, samples):
        gens = [Generation([], g["token_ids"], g["finish_reason"], g["text"]) for g in rec["gens"]]
        correct = [int(grade(s, g)) for s, g in zip(samples, gens, strict=True)]
        lengths = [len(g.token_ids) for g in gens]
        assert m["correct"] == correct and m["accuracy"] == pytest.approx(np.mean(correct))
        assert m["lengths"] == lengths and m["length_mean"] == pytest.approx(np.mean(lengths))
        assert m["eos_share"] == pytest.approx(np.mean([g.finish_reason == "eos" for g in gens]))
        same = [g.token_ids == f["token_ids"] for g, f in zip(gens, full["gens"], strict=True)]
        assert m["exact_match"] == pytest.approx(np.mean(same))
        family = samples[0].family
        rows = [i for i, s in enumerate(samples) if s.family == family]
        assert m["by_family"][family]["exact_match"] == pytest.approx(np.mean([same[i] for i in rows]))
        if "kl" in m:  # main problems only
            assert m["kl"] == [round(x, 6) for x in rec["kl"]]
            assert m["kl_mean"] == pytest.approx(np.mean(rec["kl"])) and m["traffic"] == rec["traffic"]

    full, other_full = cached("full", None), cached("full", None, other=True)
    check(report["full"], full, full, sweep.samples)
    check(report["other_domains"]["full"], other_full, other_full, sweep.other_samples)
    for r in report["runs"]:
        check(r["metrics"], cached(r["mode"], r), full, sweep.samples)
        check(r["other_metrics"], cached(r["mode"], r, other=True), other_full, sweep.other_samples)
    by_label = {(r["label"], r["mode"]): r["metrics"]["correct"] for r in report["runs"]}
    for c in report["comparisons"]:
        sw, uni = by_label[c["label"], "slimwise"], by_label[c["label"], "uniform"]
        assert c["slimwise_minus_uniform"]["diff"] == pytest.approx(np.mean(sw) - np.mean(uni))


def test_end_to_end_eval(model_dir, tmp_path):
    out = tmp_path / "out"
    first = Sweep(model_dir, EvalConfig(out_dir=str(out), **SMALL | CROSS))
    report = first.run()
    assert {"schema", "model", "config", "tasks", "full", "runs", "comparisons", "summary", "timing",
            "plots", "other_domains"} <= set(report)
    # 2 phases + 2 mixed calibrations (headline criterion and phase), each x (uniform, slimwise)
    assert report["tasks"]["n"] == 5 and len(report["runs"]) == 8
    assert [r["phase"] for r in report["runs"]][::2] == ["prompt", "decode", "decode@all",
                                                         "decode@arithmetic3-lists1-text1"]
    # the uniform baseline is calibrated on whole sequences (--uniform-phase all, the default): every uniform
    # run uses the "all" plan of its criterion and ratio, whichever plan it is reported beside
    assert set(report["calibration"]) == {"prompt", "decode", "all", "decode@all",
                                          "decode@arithmetic3-lists1-text1"}
    uniform = [r for r in report["runs"] if r["mode"] == "uniform"]
    assert {(r["calibrated_on"], r["plan"].rsplit("/", 1)[-1]) for r in uniform} == {("all",
                                                                                       "reap-all-0.5.json")}
    assert all("calibrated_on" not in r for r in report["runs"] if r["mode"] == "slimwise")
    mix = report["calibration"]["decode@arithmetic3-lists1-text1"]
    assert "arithmetic 3/family, lists 1/family, text 1/family" in mix["source"] \
        and mix["prompts"] == 5 * 3 + 8
    assert report["calibration"]["decode@all"]["prompts"] == 13 * 3  # 3 per family of every domain
    od = report["other_domains"]
    assert od["domains"] == ["lists", "text"] and od["n"] == 8 and od["full"]["exact_match"] == 1.0
    for r in report["runs"]:  # every plan scored on the other domains too, with per-domain accuracy
        assert set(r["other_metrics"]["by_domain"]) == {"lists", "text"} \
            and len(r["other_metrics"]["correct"]) == 8
    assert {c["label"] for c in od["comparisons"]} == {r["label"] for r in report["runs"]}
    assert all("slimwise_minus_uniform" in c for c in od["comparisons"])
    full = report["full"]
    assert full["exact_match"] == 1.0 and full["kl_mean"] == 0.0 and full["length_ratio_mean"] == 1.0
    for r in report["runs"]:
        m = r["metrics"]
        for key in RUN_METRICS:
            assert key in m, key
        for key in TRAFFIC:
            assert m["traffic"][key] is not None, key
        assert set(m["by_family"]) == {"add", "sub", "mul", "gcd", "base"}
        assert "kl_mean" in m["by_family"]["add"] and "length_ratio_mean" in m["by_family"]["add"]
        assert m["traffic"]["active_experts"] == 8 and m["traffic"]["distinct_experts_per_layer_step"] <= 8
        if r["mode"] == "slimwise":
            assert m["first_token_agree"] == 1.0  # the first token always comes from the full model
    assert all("slimwise_minus_uniform" in c for c in report["comparisons"])
    # files: report.json's figures are those of the cached generations (recomputed here, not read back from
    # the dict it was written from), the Markdown renders again from the reloaded JSON and holds every metric,
    # plots are real PNGs
    on_disk = json.loads((out / "report.json").read_text())
    assert_report_matches_run_cache(first, on_disk)
    md = (out / "report.md").read_text()
    assert write_markdown(on_disk, tmp_path / "again.md").read_text() == md
    for text in ("accuracy [95% CI]", "len mean / med / p90", "EOS", "truncated", "len ratio vs full",
                 "exact match", "first diff pos", "KL(full‖mode)", "experts/layer/step", "expert MiB/step",
                 "slimwise − uniform", "Runtime:", "Sample size:", "## Plots", "## Other domains",
                 "other domains: full / uniform / SlimWise", "decode@all", "Uniform (classic pruning)"):
        assert text in md, text
    assert report["plots"] == list(PLOTS)
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"({name})" in md
    assert len(list((out / "plans").glob("*.json"))) == 5  # the 4 grid plans and the baseline's
    # rerun: everything from the cache, same numbers
    sweep = Sweep(model_dir, EvalConfig(out_dir=str(out), **SMALL | CROSS))
    again = sweep.run()
    # the dtype that ran is in the report and in every cache key: a bf16 sweep
    # never reads float32 runs or stats
    assert report["generation"]["dtype"] == sweep.dtype == "float32"
    bf16 = Sweep(model_dir, EvalConfig(out_dir=str(out), **SMALL | CROSS | {"dtype": "bfloat16"}))
    assert bf16.dtype == "bfloat16" and bf16.run_cache.key("full", None) != sweep.run_cache.key("full", None)
    assert all(r["metrics"]["cached"] and r["other_metrics"]["cached"] for r in again["runs"])
    assert [r["other_metrics"]["correct"] for r in again["runs"]] == [r["other_metrics"]["correct"]
                                                                       for r in report["runs"]]
    assert [r["metrics"]["correct"] for r in again["runs"]] == [r["metrics"]["correct"]
                                                                for r in report["runs"]]
    assert [r["metrics"]["kl"] for r in again["runs"]] == [r["metrics"]["kl"] for r in report["runs"]]


def test_plans_from_file_and_shared_runs(model_dir, tmp_path, capsys):
    """--plan files replace the grid; two plans with the same kept experts share one run."""
    model = load_model(model_dir)
    from slimwise.calibrate import CalibrationConfig, calibrate

    stats = calibrate(model, random_prompts(4, vocab=100), load_tokenizer(model_dir),
                      CalibrationConfig(phase="prompt"), progress=False)
    a = plan_from_stats(stats, "frequency", 0.5).save(tmp_path / "a.json")
    b = plan_from_stats(stats, "frequency", 0.5).save(tmp_path / "b.json")
    cfg = EvalConfig(**{**SMALL, "plans": (str(a), str(b)), "modes": ("full", "slimwise"), "kl": False,
                        "plots": False}, out_dir=str(tmp_path / "o"))
    report = run_eval([model_dir], cfg)
    assert len(report[0]["runs"]) == 2 and "reusing its run" in capsys.readouterr().out
    assert [r["label"] for r in report[0]["runs"]] == ["frequency-prompt-0.5", "frequency-prompt-0.5-b"]
    assert report[0]["runs"][0]["metrics"] is report[0]["runs"][1]["metrics"]
    # given stats replace calibration: their phase is the only one
    stats.save(tmp_path / "stats.safetensors")
    cfg = EvalConfig(**{**SMALL, "stats": (str(tmp_path / "stats.safetensors"),), "criteria": ("frequency",),
                        "modes": ("full", "slimwise"), "kl": False, "plots": False},
                     out_dir=str(tmp_path / "s"))
    report = run_eval([model_dir], cfg)
    assert [r["label"] for r in report[0]["runs"]] == ["frequency-prompt-0.5"]


def test_cli_eval(model_dir, tmp_path):
    out = tmp_path / "cli"
    other = tmp_path / "other"
    other.symlink_to(model_dir, target_is_directory=True)
    rc = cli_main(["eval", str(model_dir), str(other), "--out", str(out), "--criteria", "soft",
                   "--ratios", "0.25", "--phases", "decode", "--per-family", "1", "--max-new-tokens", "6",
                   "--calib-per-family", "1", "--calib-max-new-tokens", "4", "--no-kl", "--no-plots",
                   "--domain", "text", "--max-samples", "2", "--modes", "full,slimwise",
                   "--other-per-family", "1"])
    assert rc == 0
    name = model_dir.name
    assert (out / name / "report.json").is_file() and (out / "other" / "report.md").is_file()
    assert (out / "index.md").is_file()
    rep = json.loads((out / name / "report.json").read_text())
    assert rep["tasks"]["domain"] == "text" and rep["runs"][0]["metrics"]["kl_mean"] is None
    # capped, never the target
    assert rep["other_domains"]["n"] == 2 and "text" not in rep["other_domains"]["domains"]
    rc = cli_main(["eval", str(model_dir), "--modes", "full,distilled",
                   "--distilled", "d.pt", "--out", str(out)])
    assert rc == 2


def test_demo_on_a_given_model(model_dir, tmp_path):
    from slimwise.demo import run_demo

    report = run_demo(out_dir=tmp_path / "demo", samples=5, model=model_dir, max_new_tokens=6, batch_size=8,
                      calib_per_family=1, calib_max_new_tokens=4, n_boot=200)
    assert [r["mode"] for r in report["runs"]] == ["uniform", "slimwise"]
    assert report["runs"][0]["criterion"] == "reap" and report["runs"][0]["ratio"] == 0.5
    assert report["runs"][0]["phase"] == "decode" and report["tasks"]["n"] == 5
    # the demo's uniform baseline is classic pruning as practitioners calibrate it: on whole sequences
    assert report["runs"][0]["calibrated_on"] == "all" and "calibrated_on" not in report["runs"][1]
    assert report["other_domains"]["n"] == 5  # the demo scores the other domains too (capped like the target)
    for name in ("report.json", "report.md", "pruned/config.json", *PLOTS):
        assert (tmp_path / "demo" / name).is_file(), name


def test_distilled_mode_on_its_plan(model_dir, tmp_path):
    """--distilled adds mode distilled on the plan the delta was made for (and only there)."""
    from slimwise.calibrate import CalibrationConfig, calibrate
    from slimwise.distill import DistillConfig, distill

    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    stats = calibrate(model, random_prompts(6, vocab=150), tok,
                      CalibrationConfig(max_new_tokens=6), progress=False)
    plan = plan_from_stats(stats, "reap", 0.5)
    plan_path = plan.save(tmp_path / "plan.json")
    other = plan_from_stats(stats, "frequency", 0.25).save(tmp_path / "other.json")
    delta = distill(model, plan, random_prompts(8, vocab=150, seed=3), tok,
                    DistillConfig(steps=3, batch_size=8, max_new_tokens=6, progress=False))
    delta.save(tmp_path / "delta")
    cfg = dict(SMALL, plots=False, out_dir=str(tmp_path / "o"), distilled=str(tmp_path / "delta"))
    report = Sweep(model_dir, EvalConfig(**cfg, plans=(str(plan_path), str(other)))).run()
    modes = [(r["mode"], r["label"]) for r in report["runs"]]
    assert modes == [("uniform", "reap-decode-0.5"), ("slimwise", "reap-decode-0.5"),
                     ("distilled", "reap-decode-0.5"), ("uniform", "frequency-decode-0.25"),
                     ("slimwise", "frequency-decode-0.25")]
    dist, sw = report["runs"][2]["metrics"], report["runs"][1]["metrics"]
    assert dist["first_token_agree"] == 1.0  # a slimwise delta never touches prefill
    assert dist["kl"] != sw["kl"] and dist["kl_mean"] >= 0
    assert "distilled_minus_slimwise" in report["comparisons"][0] and report["distilled"]["steps"] == 3
    with pytest.raises(SlimWiseError, match="another plan"):
        Sweep(model_dir, EvalConfig(**cfg | {"out_dir": str(tmp_path / "p")}, plans=(str(other),))).run()


def test_test_seed_and_calibration_seed_are_apart():
    """`slimwise eval --seed N` draws another test sample but keeps the plan: the calibration split follows
    `calib_seed` only (before, one seed drew both, so a new test seed silently changed the plans)."""
    from slimwise.evaluation import EvalConfig
    from slimwise.evaluation.calibration_cache import calibration_prompts

    def calib(**kw):
        return calibration_prompts(EvalConfig(**kw))[0]

    assert calib(seed=1) == calib(seed=0) != calib(calib_seed=1)
