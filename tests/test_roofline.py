"""Roofline model and synthetic presets: formulas against hand values and simulation, byte accounting against
real models, preset shapes against the published configurations. No big model is ever materialised."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from tiny import TINY_CONFIGS, build_tiny_model, tiny_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from lab.perf.cli import add_roofline_parser
from slimwise.adapters import get_adapter
from slimwise.errors import SlimWiseError
from slimwise.perf.bench_config import PRESET_NAMES
from slimwise.perf.presets import (
    PRESETS,
    apply_routing_skew,
    build_synthetic,
    fit_row_scales,
    preset_config,
    router_shares_on_random_inputs,
)
from slimwise.perf.roofline import (
    HARDWARE,
    Hardware,
    RooflineConfig,
    batch_reaching,
    capacity_comparison,
    expected_union,
    expected_union_skewed,
    format_table,
    kept_experts,
    max_batch,
    measure_cpu,
    predict,
    resident_bytes,
    weights_only_limit,
)
from slimwise.stats import ExpertStats


@pytest.fixture(scope="module")
def rc36() -> RooflineConfig:
    return RooflineConfig.from_hf(preset_config("qwen3.6-35b-a3b"), name="qwen3.6-35b-a3b")


@pytest.fixture(scope="module")
def rc30() -> RooflineConfig:
    return RooflineConfig.from_hf(preset_config("qwen3-30b-a3b"), name="qwen3-30b-a3b")


# ----- expected union of touched experts ---------------------------------------------------------------

def test_expected_union_hand_values():
    # paper.md: E=256, k=8 -> about 101 at B=16, 222 at B=64, all 256 at B=256
    assert expected_union(256, 8, 1) == pytest.approx(8.0)
    assert expected_union(256, 8, 16) == pytest.approx(101.97, abs=0.01)
    assert expected_union(256, 8, 64) == pytest.approx(222.45, abs=0.01)
    assert 255.9 < expected_union(256, 8, 256) < 256.0


@pytest.mark.parametrize("num_experts,top_k", [(64, 4), (16, 2)])
def test_expected_union_matches_monte_carlo(num_experts, top_k):
    g = torch.Generator().manual_seed(0)
    trials = 2000
    for batch in (1, 3, 16, 64):
        # each token picks top_k distinct experts uniformly: top-k of iid uniform scores
        picks = torch.rand(trials, batch, num_experts, generator=g).topk(top_k, dim=-1).indices
        touched = torch.zeros(trials, num_experts, dtype=torch.bool)
        touched.scatter_(1, picks.reshape(trials, -1), True)
        union = touched.sum(1).double()
        se = union.std().item() / trials ** 0.5
        assert abs(union.mean().item() - expected_union(num_experts, top_k, batch)) < 4 * se + 0.02


def test_skewed_union_properties():
    uniform = torch.full((64,), 1 / 64)
    assert expected_union_skewed(uniform, 4, 16) == pytest.approx(expected_union(64, 4, 16))
    zipf = 1.0 / torch.arange(1, 65, dtype=torch.float64) ** 0.8
    for b in (2, 8, 32, 128):
        # concentrated routing touches fewer experts than uniform routing at the same batch (concavity)
        assert expected_union_skewed(zipf, 4, b) < expected_union(64, 4, b)
        assert expected_union_skewed(zipf, 4, b, kept=32) <= 32
    assert expected_union_skewed(zipf, 4, 8) < expected_union_skewed(zipf, 4, 16)


def test_kept_experts_rounding_and_refusals():
    assert kept_experts(256, 0.5, 8) == 128
    assert kept_experts(64, 0.25, 4) == 48
    with pytest.raises(SlimWiseError):
        kept_experts(16, 0.9, 4)
    with pytest.raises(SlimWiseError):
        kept_experts(16, 1.0, 4)


# ----- speedup shape -----------------------------------------------------------------------------------

def test_speedup_is_one_at_small_batch_with_big_attention_share():
    rc = RooflineConfig(name="attention-heavy", num_layers=1, moe_layers=1, num_experts=64, top_k=4,
                        hidden_size=64, vocab_size=128, expert_params=1000, router_params_per_expert=0,
                        shared_params=0, dense_params=1_000_000, embed_params=8192, lm_head_params=8192,
                        full_attention_layers=1, kv_elems_per_token_layer=128, attn_flops_per_ctx_layer=512)
    hw = Hardware("test", 1e12, 1e15)
    preds = predict(rc, hw, 0.5, [1, 2, 4, 1024], context_len=128)
    assert preds[0].speedup == pytest.approx(1.0, abs=1e-9)  # B=1: k experts touched either way
    assert all(p.speedup < 1.04 for p in preds)
    assert weights_only_limit(rc, 0.5) < 1.04


def test_speedup_bounded_below_two_and_fading(rc36, rc30):
    for rc in (rc36, rc30):
        limit = weights_only_limit(rc, 0.5)
        assert 1.5 < limit < 2.0
        preds = predict(rc, HARDWARE["h200"], 0.5, [1, 4, 16, 64, 256, 4096], context_len=1024)
        s = [p.speedup for p in preds]
        assert s[0] == pytest.approx(1.0, abs=0.01)
        assert s[0] < s[1] < s[2] < s[3]  # the union of the full model grows faster than the pruned one's
        assert all(x < limit for x in s)
        assert s[-1] < s[3]  # KV/state reads (proportional to B) dilute the gain at huge batch
        assert preds[-1].union_full == pytest.approx(rc.num_experts)


def test_compute_bound_machine_loses_the_gain():
    rc = RooflineConfig.from_hf(preset_config("cpu"), name="cpu")
    slow = Hardware("slow-flops", 20e9, 30e9)  # 2-core-like: FLOPs, which pruning does not cut, dominate
    big = predict(rc, slow, 0.5, [256], context_len=64)[0]
    assert big.bound_full == "compute" and big.speedup == pytest.approx(1.0, abs=0.01)


def test_batch_reaching_and_table(rc36):
    reach = batch_reaching(rc36, HARDWARE["h200"], 0.5, 1.3, context_len=1024, max_batch=512)
    assert reach.first_batch is not None and 16 < reach.first_batch < 64
    assert reach.peak_speedup > 1.3 and reach.weights_limit > reach.peak_speedup
    never = batch_reaching(rc36, HARDWARE["h200"], 0.5, 1.99, max_batch=256)
    assert never.first_batch is None
    table = format_table(predict(rc36, HARDWARE["h100"], 0.5, [1, 64]))
    assert table.count("\n") == 3 and "| 64 |" in table


def test_memory_capacity(rc36):
    assert resident_bytes(rc36) == rc36.total_params * 2
    dropped = rc36.moe_layers * 128 * (rc36.expert_params + rc36.router_params_per_expert) * 2
    assert resident_bytes(rc36, kept=128) == rc36.total_params * 2 - dropped
    per_seq = rc36.kv_bytes_per_seq(1024) + rc36.state_bytes_per_seq()
    b = max_batch(rc36, HARDWARE["h200"], 1024)
    assert b * per_seq <= 0.9 * 141e9 - resident_bytes(rc36) < (b + 1) * per_seq
    assert max_batch(rc36, Hardware("small", 1e12, 1e15, memory=40e9), 1024) == 0  # weights alone don't fit
    cap = capacity_comparison(rc36, HARDWARE["h200"], 0.5, 1024)
    assert 0 < cap.batch_full < cap.batch_pruned and cap.speedup > 1
    preds = predict(rc36, HARDWARE["h200"], 0.5, [b, b + 1], 1024)
    assert [p.fits_memory for p in preds] == [True, False]
    assert capacity_comparison(rc36, Hardware("no-memory-info", 1e12, 1e15), 0.5) is None


# ----- presets -----------------------------------------------------------------------------------------

def test_qwen3_30b_preset_shapes(rc30):
    c = preset_config("qwen3-30b-a3b")
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.moe_intermediate_size) == (
        "qwen3_moe",
        48,
        2048,
        768,
    )
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (32, 4, 128, 151936)
    adapter = get_adapter(c)
    assert (adapter.num_experts(c), adapter.top_k(c)) == (128, 8)
    # published: 30.5B total, 3.3B activated (embedding row included)
    assert rc30.total_params / 1e9 == pytest.approx(30.53, abs=0.02)
    assert (rc30.active_params() + rc30.embed_params) / 1e9 == pytest.approx(3.35, abs=0.05)
    scaled = preset_config("qwen3-30b-a3b", layers=3)
    assert (
        scaled.num_hidden_layers == 3 and scaled.moe_intermediate_size == 768 and scaled.hidden_size == 2048
    )


def test_qwen36_preset_shapes(rc36):
    c = preset_config("qwen3.6-35b-a3b")
    t = c.text_config
    assert c.model_type == "qwen3_5_moe" and t.num_hidden_layers == 40
    assert t.layer_types.count("full_attention") == 10 and t.layer_types[3::4] == ["full_attention"] * 10
    assert (
        t.num_experts,
        t.num_experts_per_tok,
        t.moe_intermediate_size,
        t.shared_expert_intermediate_size,
    ) == (256, 8, 512, 512)
    assert (t.hidden_size, t.vocab_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim) == \
        (2048, 248320, 16, 2, 256)
    assert (rc36.linear_attention_layers, rc36.full_attention_layers, rc36.state_bytes) == (30, 10, 4.0)
    assert rc36.total_params / 1e9 == pytest.approx(34.66, abs=0.05)  # "35B" (text model)
    small = preset_config("qwen3.6-35b-a3b", layers=8).text_config
    assert small.num_hidden_layers == 8 and small.layer_types.count("full_attention") == 2
    assert small.num_experts == 256 and small.moe_intermediate_size == 512
    with pytest.raises(SlimWiseError):
        preset_config("qwen3.6-35b-a3b", layers=6)  # would break the 3:1 linear/full mix
    with pytest.raises(SlimWiseError):
        preset_config("no-such-preset")


def test_cpu_preset_size():
    rc = RooflineConfig.from_hf(preset_config("cpu"), name="cpu")
    gb = rc.total_params * 2 / 1e9
    assert 1.55 < gb < 1.75
    assert rc.routed_params / rc.total_params > 0.9  # expert weights dominate and far exceed any cache
    assert (rc.num_experts, rc.top_k, rc.num_layers, rc.hidden_size) == (64, 4, 8, 1024)


# ----- byte accounting against real models -------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_bytes_equal_real_model_when_all_experts_touched(family):
    model = build_tiny_model(family, dtype=torch.bfloat16)
    real = sum(p.numel() * p.element_size() for p in model.parameters())
    rc = RooflineConfig.from_hf(tiny_config(family))
    assert rc.total_params * 2 == real
    # every expert touched and every embedding row gathered: the step reads each parameter once
    assert rc.weight_bytes_step(batch=rc.vocab_size, union=rc.num_experts) == real
    adapter = get_adapter(model)
    layers = adapter.moe_layers(model)
    assert rc.expert_params * 2 == adapter.expert_bytes(layers[0].experts)
    assert rc.moe_layers == len(layers)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "qwen3_5_moe"])
def test_kv_and_state_sizes_equal_a_real_cache(family):
    model = build_tiny_model(family)
    rc = RooflineConfig.from_hf(tiny_config(family), dtype="float32")
    length = 11
    with torch.no_grad():
        cache = model(torch.randint(3, 400, (1, length)), use_cache=True).past_key_values
    kv = state = conv_channels = 0
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None:
            kv += layer.keys.numel() + layer.values.numel()
        if isinstance(getattr(layer, "recurrent_states", None), dict):
            state += sum(t.numel() for t in layer.recurrent_states.values())
            conv_channels += sum(t.shape[1] for t in layer.conv_states.values())
    assert kv * 4 == rc.kv_bytes_per_seq(length)
    assert state == rc.linear_attention_layers * rc.state_elems_per_seq_layer
    if rc.linear_attention_layers:  # vLLM keeps kernel-1 conv columns, transformers the kernel width
        kernel = tiny_config(family).text_config.linear_conv_kernel_dim
        assert conv_channels * (kernel - 1) == rc.linear_attention_layers * rc.conv_elems_per_seq_layer


# ----- routing skew and the synthetic build ------------------------------------------------------------

def test_row_scaling_reproduces_usage_shares():
    target = 1.0 / torch.arange(1, 33, dtype=torch.float64) ** 0.7
    target /= target.sum()
    weight = torch.randn(32, 256) * 0.02
    fit = apply_routing_skew(weight, target, top_k=4)
    got = router_shares_on_random_inputs(weight, 4, seed=7)
    assert 0.5 * (got - target).abs().sum() < 0.04
    assert fit["total_variation"] < 0.04
    scales = fit_row_scales(target, 4)
    assert scales[0] > scales[-1]  # hotter experts get wider logits


def test_build_synthetic_smoke_with_skew(tmp_path):
    counts = torch.stack([1.0 / torch.arange(1, 17, dtype=torch.float64) ** 0.6,
                          torch.linspace(1, 3, 16, dtype=torch.float64)]) * 1000
    stats = ExpertStats.zeros([0, 1], 16)
    stats.count = counts
    stats.tokens = torch.full((2,), 1000.0, dtype=torch.float64)
    stats_path = stats.save(tmp_path / "stats.safetensors")
    out = build_synthetic(
        "smoke", tmp_path / "model", seed=0, dtype=torch.float32, routing_skew_from=stats_path
    )
    manifest = json.loads((out / "slimwise_synthetic.json").read_text())
    assert manifest["layers"] == 2 and manifest["routing_fit"]["max_total_variation"] < 0.06
    model = AutoModelForCausalLM.from_pretrained(out)
    router = get_adapter(model).moe_layers(model)[0].router.weight.detach()
    got = router_shares_on_random_inputs(router, 4, seed=3)
    want = counts[0] / counts[0].sum()
    assert 0.5 * (got - want).abs().sum() < 0.06
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 512 and tok.eos_token_id == model.config.eos_token_id == 0
    text = "t5 t511 t42"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    with pytest.raises(SlimWiseError):
        build_synthetic("smoke", out)  # not empty
    bad = ExpertStats.zeros([0], 8)
    bad.count += 1
    with pytest.raises(SlimWiseError):
        build_synthetic("smoke", tmp_path / "other", routing_skew_from=bad.save(tmp_path / "bad.safetensors"))


def test_synthetic_top_k_runs_a_plan_that_names_it(tmp_path):
    """`slimwise bench --synthetic P --top-k K`: the preset's sizes with K routed experts per token, so that a
    plan made for a top-K model of the same family and expert count is accepted; the build is reused only for
    the same K."""
    from slimwise.baseline_plans import random_plan
    from slimwise.perf.bench import prepare_model, prepare_plan, synthetic_dir
    from slimwise.perf.bench_config import BenchConfig
    from slimwise.plan import PrunePlan

    out = build_synthetic("smoke", tmp_path / "k2", dtype=torch.float32, top_k=2)
    assert json.loads((out / "slimwise_synthetic.json").read_text())["top_k"] == 2
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_experts_per_tok == 2
    plan = random_plan(model, 0.5, seed=0)
    assert plan.top_k == 2
    plan.check_model(model)
    default = AutoModelForCausalLM.from_pretrained(build_synthetic("smoke", tmp_path / "k4",
                                                                   dtype=torch.float32))
    with pytest.raises(SlimWiseError, match="top-2"):
        plan.check_model(default)
    assert prepare_model(BenchConfig(synthetic="smoke", top_k=2, synthetic_dir=str(out)), log=print) == out
    with pytest.raises(SlimWiseError, match="another synthetic model"):
        prepare_model(BenchConfig(synthetic="smoke", synthetic_dir=str(out)), log=print)
    assert synthetic_dir(BenchConfig(synthetic="cpu", layers=4, top_k=8)).name == "synthetic-cpu-L4-k8"
    # a plan made on other weights of the same shape (a trained model's): its kept sets, no fingerprint
    other = AutoModelForCausalLM.from_pretrained(build_synthetic("smoke", tmp_path / "seed1", seed=1,
                                                                 dtype=torch.float32, top_k=2))
    trained = random_plan(other, 0.5, seed=3)
    config = BenchConfig(synthetic="smoke", top_k=2, synthetic_dir=str(out), variants=("full", "slimwise"),
                         plan=str(trained.save(tmp_path / "trained.json")))
    lines = []
    got, path, _ = prepare_plan(config, out, tmp_path / "bench", log=lines.append)
    assert got.kept_experts == trained.kept_experts and got.fingerprint is None
    assert PrunePlan.load(path).meta["made_for"] == trained.fingerprint and "kept sets" in lines[0]


# ----- CLI and hardware --------------------------------------------------------------------------------

def _run(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="slimwise")
    add_roofline_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.func(args)


def test_cli_prints_paper_reference_and_writes_files(tmp_path, capsys):
    _run(["roofline", "--preset", "qwen3.6-35b-a3b", "--hardware", "h200", "--ratio", "0.5",
          "--batch", "1", "16", "64", "--context", "1024", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "1.81x" in out and ("reaches the paper's" in out) and "| 64 |" in out
    report = json.loads((tmp_path / "roofline_qwen3.6-35b-a3b.json").read_text())
    assert [p["batch"] for p in report["hardware"]["h200"]["predictions"]] == [1, 16, 64]
    assert (tmp_path / "roofline_qwen3.6-35b-a3b.png").stat().st_size > 1000


def test_quantized_linear_layers_count_their_bytes_and_pruning_buys_less(tmp_path, capsys):
    """`--quant`: experts, shared experts and mixer projections at the format's bytes per weight, scales
    included (fp8 block 128: 1 + 4/128^2; w4a16 group 128: 0.5 + 2/128), the rest in bf16; with fewer expert
    bytes per step, 50% pruning buys less (H200, Qwen3.6-35B-A3B): the speedup at batch 64 and 256 and the
    weights-only ceiling fall from bf16 to fp8 to w4a16. (At batch 1 every token's 8 experts are read either
    way and pruning saves only router rows, which stay bf16: a larger share of a quantized step.)"""
    from slimwise.perf.presets import preset_config
    from slimwise.perf.roofline import QUANT_BYTES, RooflineConfig, resident_bytes

    config = preset_config("qwen3.6-35b-a3b")
    plain = RooflineConfig.from_hf(config)
    for quant, per_weight in (("fp8", 1 + 4 / 128**2), ("w4a16", 0.5 + 2 / 128)):
        rc = RooflineConfig.from_hf(config, quant=quant)
        assert rc.expert_bytes == QUANT_BYTES[quant] == per_weight and rc.weight_bytes == 2.0
        quantized = rc.routed_params + rc.shared_params + rc.mixer_params
        assert resident_bytes(rc) == pytest.approx(quantized * per_weight
                                                   + (rc.total_params - quantized) * 2.0, rel=1e-12)
        union = 37.5
        split = rc.bytes_split(64, 1024, union)
        assert split["expert_weights"] == rc.moe_layers * union * rc.expert_params * per_weight
        assert split["other_weights"] == pytest.approx(plain.bytes_split(64, 1024, union)["other_weights"]
                                                       - (rc.shared_params + rc.mixer_params)
                                                       * (2.0 - per_weight), rel=1e-12)
    peaks = {}
    for quant in (None, "fp8", "w4a16"):
        out = tmp_path / (quant or "bf16")
        _run(["roofline", "--preset", "qwen3.6-35b-a3b", "--hardware", "h200", "--ratio", "0.5",
              "--batch", "1", "64", "256", "--out", str(out), *(["--quant", quant] if quant else [])])
        report = json.loads((out / "roofline_qwen3.6-35b-a3b.json").read_text())
        peaks[quant] = [p["speedup"] for p in report["hardware"]["h200"]["predictions"]]
        peaks[quant].append(report["weights_only_limit"])
    printed = capsys.readouterr().out
    assert "GB bfloat16, linear layers fp8)" in printed and "GB bfloat16, linear layers w4a16)" in printed
    for b16, f8, w4 in zip(peaks[None][1:], peaks["fp8"][1:], peaks["w4a16"][1:], strict=True):
        assert b16 > f8 > w4 > 1.0


def test_cli_reads_a_config_json(tmp_path, capsys):
    cfg = tiny_config("qwen3_moe").to_dict()
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    _run(["roofline", "--config", str(tmp_path / "c.json"), "--hardware", "h100", "--batch", "1", "8"])
    out = capsys.readouterr().out
    assert "16 experts top-4" in out and "paper" not in out
    with pytest.raises(SlimWiseError):
        _run(["roofline", "--config", str(tmp_path / "missing.json")])


def test_cli_preset_names_match_and_parser_is_light():
    assert tuple(sorted(PRESETS)) == PRESET_NAMES
    import subprocess
    import sys

    code = ("import argparse, sys; from lab.perf.cli import add_roofline_parser; "
            "add_roofline_parser(argparse.ArgumentParser().add_subparsers()); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout  # the lab imports from the root
    assert out.split() == ["False", "False"]


def test_measure_cpu_is_quick_and_positive():
    hw = measure_cpu(budget_s=1.0, bandwidth_mb=32, matmul_shapes=((16, 256, 256),))
    assert hw.bandwidth > 1e8 and hw.peak_flops > 1e7 and "measured" in hw.note


# ----- sensitivity of the prediction -------------------------------------------------------------------

def test_sensitivity_rows_recompute_from_the_curves(rc36):
    from lab.perf.sensitivity import (
        Scenario,
        batch_floor,
        budget,
        other_bytes,
        run_sensitivity,
        scaled,
    )

    h200 = HARDWARE["h200"]
    scenarios = [Scenario("base", "base"), Scenario("bf16", "bf16", lambda r: scaled(r, state_bytes=2.0)),
                 Scenario("no-cache", "none", lambda r: scaled(r, state_bytes=0.0, kv_bytes=0.0))]
    rows, curves = run_sensitivity(rc36, h200, 0.5, 1.81, 1024, scenarios, max_batch=512)
    base, bf16, none = rows
    # the row's peak is the curve's, and the same curve as roofline.batch_reaching's
    reach = batch_reaching(rc36, h200, 0.5, 1.81, 1024, max_batch=512)
    assert (base.peak_speedup, base.peak_batch) == (reach.peak_speedup, reach.peak_batch)
    assert base.first_batch is None and base.reaches == "no"
    # a bf16 state halves the recurrent-state bytes: the peak moves up, but not to the target
    assert base.peak_speedup < bf16.peak_speedup < 1.81
    assert none.first_batch is not None and none.reaches.startswith("yes")
    # the memory-bound speedup written with the unchanged bytes X equals the roofline's (router rows of the
    # pruned experts aside), so "X <= budget" is the condition for the target
    b = base.peak_batch
    pred = curves["base"][b - 1]
    e = rc36.moe_layers * rc36.expert_params * rc36.weight_bytes
    x = other_bytes(rc36, b, 1024)
    assert (x + e * pred.union_full) / (x + e * pred.union_pruned) == pytest.approx(pred.speedup, rel=2e-3)
    assert x > budget(rc36, 0.5, 1.81, b)
    # below the floor not even zero other bytes reach the target; at the floor the expert unions alone do
    floor = batch_floor(rc36, 0.5, 1.81)
    assert budget(rc36, 0.5, 1.81, floor - 1) < 0 <= budget(rc36, 0.5, 1.81, floor)
    assert expected_union(256, 8, floor) >= 1.81 * expected_union(128, 8, floor)
    # scaled() removes exactly the named bytes
    assert scaled(rc36, shared=0.0).total_params == rc36.total_params - rc36.shared_params
    assert scaled(rc36, mixers=0.5).dense_params == rc36.dense_params - round(0.5 * rc36.mixer_params)
    assert 0 < rc36.mixer_params <= rc36.dense_params


def test_cli_sensitivity_writes_table_and_plot(tmp_path, capsys):
    cfg = tiny_config("qwen3_5_moe").to_dict()
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    _run(["roofline", "--config", str(tmp_path / "c.json"), "--hardware", "h200", "--reference", "1.3",
          "--sensitivity", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "batch floor" in out and "| recurrent state bf16 |" in out
    data = json.loads((tmp_path / "sensitivity_c.json").read_text())
    assert data["target"] == 1.3 and {r["key"] for r in data["rows"]} >= {"base", "state-bf16", "no-cache"}
    assert (tmp_path / "sensitivity_c.png").stat().st_size > 1000
    with pytest.raises(SlimWiseError):
        _run(["roofline", "--config", str(tmp_path / "c.json"), "--sensitivity"])
