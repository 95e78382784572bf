"""`slimwise bench` and the lab's `calib-cost`: structure and invariants, never timings.

Fast tests run the pure parts (pairing, rounds, thresholds, bars, traffic accounting, tables, plot, parser)
and the expert-counting hook of DecodeRouting on a stand-in model; the calibration observers on a tiny HF
model. One vLLM test runs the whole benchmark on the tiny `smoke` preset (1-2 batch sizes, one round).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import GateModel, random_prompts
from transformers import PretrainedConfig

from slimwise.errors import SlimWiseError
from slimwise.perf.bench import (
    BenchConfig,
    _check_config,
    _rounds,
    check_bars,
    compare_roofline,
    format_tables,
    jsonable,
    plot_bench,
    suggest_threshold,
    summarize_runs,
    threshold_report,
)
from slimwise.perf.vllm_traffic import counters_delta, summarize_traffic
from slimwise.plan import PrunePlan
from slimwise.serving.routing import COUNT_EXPERTS_KEY, PLAN_KEY, DecodeRouting

# ----- pure parts -------------------------------------------------------------------------------------------


def _m(tps: float, r: int) -> dict:
    return {"tokens_per_s": tps, "tpot_ms": 1e3 / tps, "prefill_spread_s": 0.0, "round": r}


def _fake_result(tmp_path) -> dict:
    runs = {"full": {8: [_m(100, 0), _m(80, 1)], 32: [_m(200, 0), _m(220, 1)]},
            "slimwise": {8: [_m(110, 0), _m(96, 1)], 32: [_m(260, 0), _m(275, 1)]},
            "pruned": {8: [_m(112, 0), _m(100, 1)], 32: [_m(270, 0), _m(280, 1)]}}
    summary = summarize_runs(runs, [8, 32])
    return {
        "model_name": "fake",
        "config": {"batches": [8, 32], "prompt_len": 4, "output_len": 8, "repetitions": 2},
        "plan": {"ratio": 0.5},
        "summary": summary,
        "engine_start_s": {"full": [1.0], "slimwise": [1.5]},
        "runs": runs,
    }


def test_speedups_are_paired_within_rounds():
    r = _fake_result(None)
    s = r["summary"]
    # round 0: 110/100, round 1: 96/80 -> paired ratios 1.1 and 1.2, not the ratio of medians (103/90)
    assert s["slimwise"][8]["speedup"]["min"] == pytest.approx(1.1)
    assert s["slimwise"][8]["speedup"]["max"] == pytest.approx(1.2)
    assert s["full"][8]["speedup"]["median"] == pytest.approx(1.0)
    assert s["full"][32]["tokens_per_s"] == {"median": 210, "min": 200, "max": 220, "n": 2}


def test_rounds_rotate_and_cover_every_variant():
    rounds = _rounds(["a", "b", "c"], 4)
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_threshold_bars_and_roofline_comparison(tmp_path):
    r = _fake_result(tmp_path)
    s = r["summary"]
    assert suggest_threshold(s, 1.1) == 8
    assert suggest_threshold(s, 1.2) == 32
    assert suggest_threshold(s, 2.0) is None
    noisy = {"slimwise": {1: {"speedup": {"median": 1.3}}, 4: {"speedup": {"median": 1.0}},
                          8: {"speedup": {"median": 1.2}}, 16: {"speedup": {"median": 1.25}}}}
    assert suggest_threshold(noisy, 1.1) == 8  # a lucky batch-1 point below a losing batch 4 does not count
    assert threshold_report(json.loads(json.dumps(r)), 1.2)["measured_batch"] == 32  # string keys from JSON
    bars = check_bars(s, "cpu")
    assert set(bars["colocated_reaches_95pct_of_pruned"]) == {8, 32}
    # by hand: batch 8 paired speedups slimwise 110/100, 96/80 -> 1.15, pruned 112/100, 100/80 -> 1.185
    b8 = bars["colocated_reaches_95pct_of_pruned"][8]
    assert (b8["slimwise"], b8["pruned"]) == pytest.approx((1.15, 1.185)) and b8["met"]
    assert b8["ratio"] == pytest.approx(0.9705, abs=1e-4)
    # with the rounds: slimwise / pruned paired within each round, 110/112 and 96/100 -> median 0.971
    paired = check_bars(s, "cpu", r["runs"])["colocated_reaches_95pct_of_pruned"]
    assert paired[8]["paired"] == pytest.approx({"median": (110 / 112 + 96 / 100) / 2, "min": 0.96,
                                                 "max": 110 / 112, "n": 2})
    assert paired[8]["met"] and paired[8]["ratio"] == b8["ratio"]
    assert paired[32]["paired"]["min"] == pytest.approx(260 / 270)
    r["bars"] = check_bars(s, "cpu", r["runs"])
    assert "| 8 | 0.971 (0.960-0.982) | 0.970 | met |" in format_tables(json.loads(json.dumps(r)))
    slow = {"slimwise": {8: [_m(90, 0), _m(91, 1)]}, "pruned": {8: [_m(100, 0), _m(100, 1)]}}
    assert (
        check_bars(
            {"slimwise": {8: {"speedup": {"median": 1.0}}}, "pruned": {8: {"speedup": {"median": 1.0}}}},
            # paired 0.905 decides
            None,
            slow,
        )["colocated_reaches_95pct_of_pruned"][8]["met"]
        is False
    )
    short = check_bars({"slimwise": {16: {"speedup": {"median": 1.0}}},
                        "pruned": {16: {"speedup": {"median": 1.1}}}}, None)
    assert short["colocated_reaches_95pct_of_pruned"][16]["met"] is False  # 0.909 < 0.95
    assert bars["slimwise_at_32_is_1.25x"]["applies"] and bars["slimwise_at_32_is_1.25x"]["met"]

    class P:  # a StepPrediction stand-in
        batch, speedup, tokens_per_s_full, tokens_per_s_pruned, bound_full = 32, 1.3, 1.0, 1.3, "memory"
        bound_pruned, union_full, union_pruned, time_full_s = "compute", 40.0, 30.0, 0.1

    row = compare_roofline(s, [P()])[0]
    assert row["bound"] == "memory/compute"  # the pruned step on the compute roof is what caps the speedup
    measured = s["slimwise"][32]["speedup"]["median"]
    assert row["predicted_over_measured_slimwise"] == pytest.approx(1.3 / measured)
    assert row["within_15pct_slimwise"] == (abs(1.3 / measured - 1) <= 0.15)


def test_tables_and_plot(tmp_path):
    r = _fake_result(tmp_path)
    r["traffic"] = {"full": {"batches": {8: {"touched_mean": 20.0, "expected_uniform": 21.0,
                                             "expert_bytes_per_step": 2e6}}}}
    md = format_tables(json.loads(json.dumps(r)))
    assert "| 8 | 100.0" not in md  # medians, not the first round
    assert "| 32 | 210.0 (200.0-220.0)" in md and "20.0 / 21.0" in md and "Engine start" in md
    png = plot_bench(json.loads(json.dumps(r)), tmp_path / "b.png")
    assert png.stat().st_size > 1000


def test_kernel_roofline_table_with_no_expert_read_cost(tmp_path):
    """A noisy fit on a tiny model can put no time on expert reads (a = 0): its bandwidth is infinite, None
    once written as JSON, and the table says so instead of failing (it once broke CI's bench smoke test)."""
    from slimwise.perf.kernels import MoEKernelModel

    r = _fake_result(tmp_path)
    row = {
        "batch": 8,
        "union_full": 6.0,
        "union_pruned": 3.0,
        "kernel_share_full": 0.5,
        "pair_share_full": 1.0,
        "pair_share_pruned": 1.0,
        "predicted_speedup": 1.0,
        "applies": True,
        "measured_speedup_slimwise": 1.1,
    }
    for bandwidth_free in (
        MoEKernelModel(0.0, 1e-5, 2e-5, 100, 0.9, 0.1),
        MoEKernelModel(1e-6, 1e-5, 2e-5, 100, 0.9, 0.1),
    ):
        r["kernel_roofline"] = {
            "model": bandwidth_free.as_dict(),
            "unions": "traffic counters",
            "rows": [row],
        }
        md = format_tables(json.loads(json.dumps(jsonable(r))))
        want = "not resolved by the fit" if bandwidth_free.per_expert_s == 0 else "0.1 GB/s"
        assert f"per expert read = {want}" in md and "| 8 | 6.0 → 3.0 | 50% |" in md


def test_config_refusals():
    with pytest.raises(SlimWiseError):
        _check_config(BenchConfig())  # neither model nor synthetic
    with pytest.raises(SlimWiseError):
        _check_config(BenchConfig(synthetic="smoke", variants=("slimwise",)))  # no full baseline
    with pytest.raises(SlimWiseError):
        _check_config(BenchConfig(synthetic="smoke", variants=("full", "masked")))
    with pytest.raises(SlimWiseError):
        _check_config(BenchConfig(synthetic="smoke", output_len=1))
    _check_config(BenchConfig(synthetic="smoke", variants=("full", "slimwise-min16")))


def test_traffic_accounting():
    before = {"experts_touched_sum": {"0": 10, "1": 12}, "experts_counted_steps": {"0": 2, "1": 2},
              "touched_by_batch": {"4": [4, 22]}, "decode_steps": 2}
    after = {"experts_touched_sum": {"0": 40, "1": 42}, "experts_counted_steps": {"0": 5, "1": 5},
             "touched_by_batch": {"4": [10, 82]}, "decode_steps": 5}
    d = counters_delta(before, after)
    assert d["touched"] == {0: 30, 1: 30} and d["steps"] == {0: 3, 1: 3} and d["by_batch"] == {4: (6, 60)}
    t = summarize_traffic(d, batch=4, available_experts=16, top_k=4, expert_bytes=100.0)
    assert t["touched_mean"] == 10.0
    assert t["expected_uniform"] == pytest.approx(16 * (1 - (1 - 4 / 16) ** 4))
    assert t["expert_bytes_per_step"] == pytest.approx(10.0 * 2 * 100.0)


def test_parsers_are_light_and_registered():
    code = ("import argparse, sys; from slimwise.perf.cli import add_bench_parser; "
            "add_bench_parser(argparse.ArgumentParser().add_subparsers()); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
    from slimwise.cli import build_parser

    args = build_parser().parse_args(
        [
            "bench",
            "--synthetic",
            "cpu",
            "--batch",
            "8",
            "32",
            "--variants",
            "full",
            "slimwise-min16",
            "--suggest-threshold",
            "1.1",
        ]
    )
    assert (
        args.batch == [8, 32]
        and args.variants == ["full", "slimwise-min16"]
        and args.suggest_threshold == 1.1
    )
    from lab.perf.cli import build_parser as lab_parser

    assert lab_parser().parse_args(["calib-cost", "--synthetic", "smoke"]).phase == "prompt"


def test_from_json_prints_tables_and_threshold(tmp_path, capsys):
    from slimwise.cli import main

    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_fake_result(tmp_path)))
    assert main(["bench", "--from-json", str(path), "--suggest-threshold", "1.2"]) == 0
    out = capsys.readouterr().out
    assert "measured smallest batch 32" in out and "--min-decode-batch 32" in out


# ----- the counting hook of DecodeRouting on a stand-in model -----------------------------------------------


def _route(routing: DecodeRouting, model: GateModel, x: torch.Tensor, positions, prompt_lens):
    routing.set_step(np.array(positions), np.array(prompt_lens), torch.tensor(positions))
    return [block.mlp.gate(x) for block in model.layers]


@pytest.mark.parametrize("with_plan", [False, True])
def test_counting_hook_counts_distinct_experts_of_decode_rows(with_plan):
    model = GateModel()
    kept = [0, 2, 4, 6]
    extra = {}
    if with_plan:
        plan = PrunePlan(family="qwen3_moe", num_experts=8, top_k=2, kept_experts={0: kept, 1: kept})
        extra[PLAN_KEY] = plan.to_dict()
    config = PretrainedConfig(num_experts=8, num_experts_per_tok=2, **{COUNT_EXPERTS_KEY: True}, **extra)
    routing = DecodeRouting(model, config, max_tokens=16)
    assert routing.active
    x = torch.randn(5, 16)
    # rows 0, 2, 3 are generated tokens (position >= prompt length); rows 1 and 4 are prompt tokens
    logits = _route(routing, model, x, [5, 1, 7, 9, 0], [5, 4, 7, 3, 2])
    c = routing.counters
    decode = torch.tensor([True, False, True, True, False])
    for layer, out in enumerate(logits):
        picked = out[decode].topk(2, dim=-1).indices.unique()
        assert c.experts_touched_sum[layer] == picked.numel()
        if with_plan:
            assert set(picked.tolist()) <= set(kept)  # counted after the mask
    assert c.decode_steps == 1 and c.touched_by_batch[3][0] == 2
    # a prompt-only step is not counted
    _route(routing, model, x, [0, 1, 2, 3, 4], [8, 8, 8, 8, 8])
    assert c.decode_steps == 1 and sum(c.experts_counted_steps.values()) == 2
    assert c.pruned_tokens == (3 if with_plan else 0)  # counting alone never reports pruned routing


def test_counting_off_keeps_the_routing_inactive_without_a_plan():
    routing = DecodeRouting(
        GateModel(), PretrainedConfig(num_experts=8, num_experts_per_tok=2), max_tokens=16
    )
    assert not routing.active


# ----- calibration cost -------------------------------------------------------------------------------------


def test_all_experts_observer_gives_the_same_routed_statistics(tiny_dirs):
    from lab.perf.calib_cost import AllExpertsObserver, CalibCostConfig, ReapHookObserver, observe
    from slimwise.calibrate import ExpertObserver
    from slimwise.models import load_model

    model = load_model(tiny_dirs("qwen3_moe"))
    prompts = random_prompts(4, seed=3, lengths=(6, 6, 6, 6))
    for phase in ("prompt", "decode"):
        cfg = CalibCostConfig(model="x", phase=phase, batch_size=2, max_new_tokens=4)
        ours = observe(model, prompts, ExpertObserver, cfg)
        for cls in (AllExpertsObserver, ReapHookObserver):
            every = observe(model, prompts, cls, cfg)
            assert ours["tokens"] == every["tokens"] > 0 and ours["counted"] == every["counted"] > 0
            for f in ("count", "gate_sum", "norm_sum", "gate_norm_sum", "tokens"):
                assert torch.allclose(getattr(ours["stats"], f), getattr(every["stats"], f), rtol=1e-4,
                                      atol=1e-5), (cls.__name__, f)
            # every expert's norm on every counted token: at least the routed ones
            assert (every["stats"].norm_sum <= every["observer"].all_norm_sum + 1e-6).all()


def test_sorted_observer_returns_exactly_the_models_own_experts_output(tiny_dirs):
    """The observer replaces the experts forward: with the sorted loop the logits are bit-identical."""
    from slimwise.calibrate import ExpertObserver
    from slimwise.models import load_model

    for family in ("qwen3_moe", "qwen2_moe"):
        model = load_model(tiny_dirs(family), dtype="bfloat16")
        ids = torch.tensor(random_prompts(3, seed=5, lengths=(12, 12, 12)))
        with torch.inference_mode():
            want = model(ids).logits
            observer = ExpertObserver(model, "prompt")
            observer.before_forward("prompt", torch.ones(ids.numel(), dtype=torch.bool))
            got = model(ids).logits
            observer.remove()
        assert torch.equal(want, got), family


def test_calib_cost_end_to_end_on_tiny_model(tiny_dirs, tmp_path):
    from lab.perf.calib_cost import CalibCostConfig, run_calib_cost

    r = run_calib_cost(
        CalibCostConfig(
            model=str(tiny_dirs("qwen3_moe")),
            num_prompts=4,
            prompt_len=8,
            batch_size=2,
            repetitions=1,
            out=str(tmp_path / "c.json"),
        ),
        log=lambda s: None,
    )
    assert r["same_routed_stats"] and r["bar"]["target"] == (r["num_experts"] / r["top_k"]) / 2
    assert r["bar"]["baseline"] == "reap_hook"
    assert set(r["speedup"]) == {"reap_hook", "all_experts", "expert_loop", "teacher_forced"}
    assert r["tokens_per_s"]["ours"]["median"] > 0 and json.loads((tmp_path / "c.json").read_text())["bar"]


# ----- the whole benchmark in vLLM on the smoke preset ------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.vllm_in_process
def test_bench_smoke_preset_structure_and_invariants(tmp_path):
    from slimwise.perf.bench import run_bench

    config = BenchConfig(
        synthetic="smoke",
        synthetic_dir=str(tmp_path / "model"),
        batches=(1, 4),
        repetitions=1,
        prompt_len=6,
        output_len=5,
        warmup_tokens=2,
        count_output_len=4,
        hardware=None,
        variants=("full", "slimwise", "pruned", "slimwise-min4", "mix-50", "mixfull-75"),
        suggest_threshold=0.0,
        kernel_roofline=True,
        out_dir=str(tmp_path / "bench"),
    )
    level = os.environ.get("VLLM_LOGGING_LEVEL")
    r = run_bench(config, log=lambda s: None)
    assert os.environ.get("VLLM_LOGGING_LEVEL") == level  # quiet engines here, the caller's level restored
    for name in config.variants:
        for b in ("1", "4"):
            e = r["summary"][name][b]
            assert e["tokens_per_s"]["median"] > 0 and e["prefill_spread_s"] == 0  # one prefill step
            assert "speedup" in e
            assert r["runs"][name][b][0]["decode_tokens"] == int(b) * (config.output_len - 1)
    # the masked variants ran on one SlimWise engine (mode switched in place); full and pruned on their own
    assert (
        r["engine_start_s"]["slimwise"] == r["engine_start_s"]["slimwise-min4"] != r["engine_start_s"]["full"]
    )
    assert [v["mode"] for v in r["variants"]] == [None, "slimwise", None, "slimwise", "slimwise", "slimwise"]
    # the mixes ran on one engine holding both plans, each request with its own (counted per plan below)
    assert (
        r["engine_start_s"]["mix-50"] == r["engine_start_s"]["mixfull-75"] != r["engine_start_s"]["slimwise"]
    )
    t = r["traffic"]
    assert t["full"]["engine_start_s"] == t["slimwise"]["engine_start_s"] != t["pruned"]["engine_start_s"]
    k, e_full, kept = r["plan"]["top_k"], r["plan"]["num_experts"], r["plan"]["kept"][0]
    for name in config.variants:
        assert t[name]["batches"]["1"]["touched_mean"] == k  # one token touches exactly k experts per layer
        four = t[name]["batches"]["4"]
        assert k <= four["touched_mean"] <= min(4 * k, four["available_experts"])
    assert t["slimwise"]["batches"]["4"]["available_experts"] == kept < e_full
    assert t["pruned"]["batches"]["4"]["available_experts"] == kept
    assert t["slimwise-min4"]["batches"]["4"]["available_experts"] == kept  # 4 decode tokens >= threshold 4
    plan_a, plan_b = (json.loads((tmp_path / "bench" / f).read_text())["kept_experts"] for f in ("plan.json",
                                                                                             "plan-b.json"))
    assert plan_b != plan_a  # the second plan keeps other experts
    union = max(len(set(plan_a[i]) | set(plan_b[i])) for i in plan_b)
    assert t["mix-50"]["batches"]["4"]["touched_mean"] <= union  # 2 requests per plan: the union of the two
    assert r["threshold"]["measured_batch"] == 1  # every speedup >= 0
    # bytes per step by kind: expert bytes from the counters, no state in an attention-only model
    split = r["bytes_split"]["batches"]["4"]
    assert split["full"]["expert_weights"] == pytest.approx(
        t["full"]["batches"]["4"]["expert_bytes_per_step"]
    )
    assert split["full"]["state"] == 0 and split["full"]["kv"] > 0 and split["pruned"]["union"] <= kept
    # a timing bar: its figures are recomputed from the raw rounds (paired speedups over full), its outcome is
    # only reported (timing is never asserted)
    for b, bar in r["bars"]["colocated_reaches_95pct_of_pruned"].items():
        assert b in ("1", "4")
        for name in ("slimwise", "pruned"):
            base = {m["round"]: m["tokens_per_s"] for m in r["runs"]["full"][b]}
            paired = [m["tokens_per_s"] / base[m["round"]] for m in r["runs"][name][b]]
            assert bar[name] == pytest.approx(statistics.median(paired))
        pruned = {m["round"]: m["tokens_per_s"] for m in r["runs"]["pruned"][b]}
        assert bar["paired"]["median"] == pytest.approx(statistics.median(
            m["tokens_per_s"] / pruned[m["round"]] for m in r["runs"]["slimwise"][b]))
    # the kernel roofline: vLLM's fused-MoE op timed at the smoke model's shapes (16 experts, top-4: 4, 8 or
    # 16 available at each batch), the pruned step predicted from the measured full one with the counted
    # experts
    kr = r["kernel_roofline"]
    assert kr["unions"] == "traffic counters" and len(kr["samples"]) == 2 * 3
    for row in kr["rows"]:
        b = str(row["batch"])
        assert row["union_full"] == t["full"]["batches"][b]["touched_mean"]
        assert row["union_pruned"] == t["slimwise"]["batches"][b]["touched_mean"]
        assert row["full_step_s"] == pytest.approx(r["summary"]["full"][b]["tpot_ms"]["median"] / 1e3)
        assert 0 <= row["pair_share_full"] <= 1 and row["measured_speedup_slimwise"] > 0
    assert "Kernel roofline" in (tmp_path / "bench" / "bench.md").read_text()
    for f in r["files"].values():
        assert (tmp_path / "bench" / f.split("/")[-1]).stat().st_size > 0
    # --dtype auto (the default) resolved for this machine before any engine started, and recorded with it
    from slimwise.hardware import resolve_dtype
    from slimwise.serving.platform import vllm_on_cpu

    assert r["dtype"]["requested"] == "auto" and r["dtype"]["used"] == r["engine"]["dtype"]
    assert r["engine"]["dtype"] == resolve_dtype("auto", r["model_dir"], vllm_on_cpu())[0]
    assert r["machine"]["cpu"]


def test_partial_results_resume_only_with_the_same_settings(tmp_path):
    from slimwise.perf.bench import Variant, _load_partial, _save_partial, _signature

    config = BenchConfig(synthetic="smoke", out_dir=str(tmp_path), batches=(1, 4), repetitions=1, resume=True)
    variants = [Variant("full", "m", {}, 16, "Qwen3MoeForCausalLM")]
    sig = _signature(config, variants, {"dtype": "bfloat16"})
    _save_partial(config, sig, {"full": {1: [_m(10.0, 0)]}}, {"full": [3.0]})
    runs, starts = _load_partial(config, sig, log=lambda s: None)
    assert runs == {"full": {1: [_m(10.0, 0)]}} and starts == {"full": [3.0]}
    other = _signature(BenchConfig(synthetic="smoke", output_len=64), variants, {"dtype": "bfloat16"})
    assert _load_partial(config, other, log=lambda s: None) == ({}, {})


# ----- the hybrid (Qwen3.6-style) preset --------------------------------------------------------------------

def test_cpu_hybrid_preset_structure_and_byte_split(tmp_path):
    """The cpu-hybrid preset built tiny: Qwen3_5MoeForCausalLM with 3:1 Gated-DeltaNet / full attention, top-8
    routed experts plus a gated shared expert; its byte split per decode step carries the recurrent state."""
    from transformers import AutoModelForCausalLM

    from slimwise.adapters import get_adapter
    from slimwise.perf.bench import bytes_split_table, engine_kwargs
    from slimwise.perf.presets import get_preset, preset_config
    from slimwise.perf.roofline import RooflineConfig
    from slimwise.perf.timing import state_bytes_per_layer as _state_bytes_per_layer

    full = preset_config("cpu-hybrid")
    assert full.model_type == "qwen3_5_moe_text" and get_preset("cpu-hybrid").real_layers == 8
    assert full.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + \
        ["full_attention"]
    assert (
        full.num_experts,
        full.num_experts_per_tok,
        full.linear_key_head_dim,
        full.linear_value_head_dim,
    ) == (64, 8, 64, 64)
    assert all(v % 32 == 0 for v in (full.hidden_size, full.moe_intermediate_size,
                                     full.shared_expert_intermediate_size))
    rc_full = RooflineConfig.from_hf(full)
    assert rc_full.state_bytes == 4.0  # mamba_ssm_dtype float32, as Qwen3.6 (vLLM adopts it)

    tiny = preset_config("cpu-hybrid", layers=4, hidden_size=64, num_attention_heads=2, head_dim=32,
                         moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=16,
                         linear_num_key_heads=1, linear_num_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny).eval()
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    layers = model.model.layers
    assert [hasattr(layer, "linear_attn") for layer in layers] == [True, True, True, False]
    assert hasattr(layers[3], "self_attn")
    adapter = get_adapter(tiny)
    moe = adapter.moe_layers(model)
    assert len(moe) == 4 and adapter.num_experts(tiny) == 16 and adapter.top_k(tiny) == 8
    assert all(hasattr(m.block, "shared_expert") and hasattr(m.block, "shared_expert_gate") for m in moe)

    rc = RooflineConfig.from_hf(tiny)
    assert (rc.linear_attention_layers, rc.full_attention_layers) == (3, 1) and rc.shared_params > 0
    split = rc.bytes_split(8, 40, 10.0)
    assert set(split) == {"expert_weights", "other_weights", "kv", "state"} and split["state"] > 0
    assert sum(split.values()) == pytest.approx(rc.weight_bytes_step(8, 10.0) + rc.cache_bytes_step(8, 40))
    # state read + written per sequence: every linear layer's recurrent (fp32: 2 value heads of 64 x 64) and
    # conv (bf16: q, k of 1 key head and v of 2 value heads, 64 wide, kernel 4 - 1) state, twice
    per_layer = 2 * 64 * 64 * 4 + (2 * 64 + 2 * 64) * 3 * 2
    assert split["state"] == 8 * 2 * 3 * per_layer

    tiny.save_pretrained(tmp_path)
    assert _state_bytes_per_layer(str(tmp_path)) == per_layer
    kw = engine_kwargs(
        BenchConfig(synthetic="cpu-hybrid", batches=(8,), prompt_len=8, output_len=8), str(tmp_path)
    )
    assert kw["kv_cache_memory_bytes"] >= 2 * 8 * 4 * per_layer  # room for the state pages
    traffic = {
        "full": {"batches": {8: {"touched_mean": 12.0}}},
        "slimwise": {"batches": {8: {"touched_mean": 7.5}}},
    }
    table = bytes_split_table(rc, 8, 16, traffic, [8, 16], 40, 8)
    assert (
        table["batches"][8]["pruned"]["union"] == 7.5
        and table["batches"][8]["full"]["union_source"] == "counters"
    )
    assert table["batches"][16]["full"]["union_source"] == "uniform expectation"
    assert table["batches"][8]["full"]["state"] == table["batches"][8]["pruned"]["state"] == split["state"]
