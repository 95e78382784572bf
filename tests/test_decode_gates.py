"""Gate variants and the per-token fallback (`slimwise.decode_gates`) in the reference engine.

The dial's ends reduce to today's modes token for token (tau = 1: the variant alone; tau = 0: the full model
wherever the docs say so), and the fallback routes exactly the rows whose pruned share exceeds tau, checked
against the shares recomputed here from the stock routers' outputs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_INIT, random_prompts
from tiny import build_tiny_model

from slimwise.adapters import get_adapter
from slimwise.calibrate import CalibrationConfig, calibrate
from slimwise.criteria import plan_from_stats
from slimwise.decode_gate_ops import decode_prerouted, drop_pruned, encode_prerouted, falls_back, pruned_share
from slimwise.decode_gates import PLAIN, DecodeGates
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.errors import SlimWiseError

CONFIG = GenerationConfig(max_new_tokens=10, eos_token_id=-1, batch_size=8)
PROMPTS = random_prompts(8, seed=5, lengths=(5, 9, 1, 14, 3, 7, 33, 2))
FAMILIES = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "gpt_oss", "deepseek_v3"]
#: routers that renormalize the top-k (or softmax over it): there a token touching no pruned expert gets the
#: full model's weights under renorm too, so tau = 0 is the full model under either variant
RENORMALIZING = {"qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"}


def test_hand_computed_share_drop_and_encoding():
    weights = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.4, 0.0], [0.7, 0.3, 0.0], [0.25, 0.25, 0.5]])
    ids = torch.tensor([[4, 1, 7], [2, 3, 5], [6, 0, 1], [1, 2, 3]])
    pruned = torch.zeros(8, dtype=torch.bool)
    pruned[[1, 3, 6]] = True
    slot_pruned = pruned[ids]
    share = pruned_share(weights, slot_pruned)
    assert share.tolist() == pytest.approx([0.3, 0.4, 0.7, 0.75])
    assert falls_back(weights, slot_pruned, 0.35).tolist() == [False, True, True, True]
    assert falls_back(weights, slot_pruned, None).tolist() == [False] * 4
    # every slot pruned: a share of exactly 1, so tau = 1 never falls back
    all_pruned = torch.ones(1, 3, dtype=torch.bool)
    odd = torch.tensor([[0.1, 0.7, 0.2]])
    assert pruned_share(odd, all_pruned).item() == 1.0 and not falls_back(odd, all_pruned, 1.0).item()

    placeholder = torch.tensor([0, 0, 2, 0])
    w, i = drop_pruned(weights, ids, slot_pruned, placeholder)
    torch.testing.assert_close(w, torch.tensor([[0.5, 0, 0.2], [0.6, 0, 0], [0, 0.3, 0], [0, 0.25, 0]]))
    # pruned slots read the row's heaviest kept expert
    assert i.tolist() == [[4, 4, 7], [2, 2, 5], [0, 0, 0], [2, 2, 2]]
    assert not pruned[i].any()
    # a row whose slots are all pruned takes the placeholder
    w1, i1 = drop_pruned(odd, torch.tensor([[1, 3, 6]]), all_pruned, torch.tensor([5]))
    assert w1.tolist() == [[0.0, 0.0, 0.0]] and i1.tolist() == [[5, 5, 5]]

    # the logits-borne encoding (vLLM) decodes to the same weights per expert, reading no pruned expert
    enc = encode_prerouted(weights, ids, slot_pruned, placeholder, 8, torch.float32)
    dw, di = decode_prerouted(enc, 3)
    for row in range(4):
        got = {}
        for weight, expert in zip(dw[row].tolist(), di[row].tolist(), strict=True):
            got[expert] = got.get(expert, 0.0) + weight
        want = {}
        for weight, expert in zip(w[row].tolist(), i[row].tolist(), strict=True):
            want[expert] = want.get(expert, 0.0) + weight
        assert {e: v for e, v in got.items() if v} == pytest.approx({e: v for e, v in want.items() if v})
        assert not pruned[di[row]].any()
    enc1 = encode_prerouted(odd, torch.tensor([[1, 3, 6]]), all_pruned, torch.tensor([5]), 8, torch.float32)
    assert decode_prerouted(enc1, 3)[1].tolist() == [[5, 5, 5]]


def test_settings_are_validated():
    for bad in (dict(gates="keep"), dict(fallback=1.5), dict(fallback=-0.1), dict(fallback=float("nan"))):
        with pytest.raises(SlimWiseError):
            DecodeGates(**bad)
    assert DecodeGates().plain and not DecodeGates(fallback=1.0).plain and not DecodeGates("drop").plain


def tokens(model, plan, mode, gates=PLAIN):
    with PhaseSplitEngine(model, plan=plan, gates=gates) as engine:
        return [o.token_ids for o in engine.generate(PROMPTS, mode, CONFIG)]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_dial_ends_are_todays_modes(family, planned):
    model, plan = planned(family)
    full, slimwise = tokens(model, plan, "full"), tokens(model, plan, "slimwise")
    assert full != slimwise
    assert tokens(model, plan, "slimwise", DecodeGates("renorm", 1.0)) == slimwise
    assert tokens(model, plan, "slimwise", DecodeGates("drop", 1.0)) == tokens(model, plan, "slimwise",
                                                                                DecodeGates("drop"))
    assert tokens(model, plan, "slimwise", DecodeGates("drop", 0.0)) == full
    if family in RENORMALIZING:
        assert tokens(model, plan, "slimwise", DecodeGates("renorm", 0.0)) == full
    # ratio 0: nothing pruned, every variant is the full model
    empty = plan_from_stats(calibrate(model, random_prompts(4, seed=2), config=CalibrationConfig(
        max_new_tokens=4), progress=False), "reap", 0.0)
    for gates in (DecodeGates("drop"), DecodeGates("renorm", 0.5)):
        assert tokens(model, empty, "slimwise", gates) == full


@pytest.mark.parametrize(("family", "gates"), [("qwen3_moe", DecodeGates("renorm", 0.3)),
                                               ("qwen2_moe", DecodeGates("drop", 0.3)),
                                               ("deepseek_v3", DecodeGates("drop", 0.5))])
def test_fallback_routes_exactly_the_rows_over_tau(family, gates, planned):
    """Each masked router call is recorded; the stock router (mask off) and the masked router are then run on
    the same inputs, the pruned share recomputed here, and every row checked: over tau -> the stock routing,
    else the variant's; the mask's counters equal the rows counted here."""
    model, plan = planned(family)
    adapter = get_adapter(model.config)
    layers = {layer.index: layer for layer in adapter.moe_layers(model)}
    engine = PhaseSplitEngine(model, plan=plan, gates=gates)
    seen: dict[int, list] = {i: [] for i in layers}

    def record(i):
        def hook(module, args, output):
            if engine.mask.active:
                seen[i].append((args[0].detach().clone(), output))

        return hook

    handles = [layers[i].router.register_forward_hook(record(i)) for i in layers]
    try:
        engine.generate(PROMPTS, "slimwise", CONFIG)
        counted = {i: [int(x) for x in c] for i, c in engine.mask.counts.items()}
        over_total = 0
        for i, calls in seen.items():
            pruned = plan.pruned_mask(i)
            rows = hits = over = 0
            for hidden, (_, weights, ids) in calls:
                with engine.mask.pruned(False), torch.inference_mode():
                    _, w_full, i_full = layers[i].router(hidden)
                with torch.inference_mode():
                    w_masked, i_masked = adapter.route(layers[i].router, hidden, pruned)[1:]
                for r in range(w_full.shape[0]):
                    share = sum(float(w) for w, e in zip(w_full[r], i_full[r], strict=True) if pruned[e])
                    share /= float(w_full[r].sum())
                    rows += 1
                    hits += share > 0
                    if share > gates.fallback:
                        over += 1
                        assert torch.equal(ids[r], i_full[r]) and torch.equal(weights[r], w_full[r])
                    elif gates.gates == "renorm":
                        assert torch.equal(ids[r], i_masked[r]) and torch.equal(weights[r], w_masked[r])
                    else:
                        keep = ~pruned[i_full[r]]
                        assert torch.equal(weights[r][keep], w_full[r][keep])
                        assert not weights[r][~keep].any() and not pruned[ids[r]].any()
            assert counted[i] == [rows, hits, over], (i, counted[i], rows, hits, over)
            over_total += over
        summary = engine.mask.fallback_summary()
        assert summary["fell_back"] == over_total and 0 < over_total < summary["routed"]
        assert summary["routed"] == len(layers) * len(PROMPTS) * (CONFIG.max_new_tokens - 1)
    finally:
        for h in handles:
            h.remove()
        engine.close()


def test_non_plain_gates_need_the_masked_view(planned):
    model, plan = planned("qwen3_moe")
    with pytest.raises(SlimWiseError, match="full router"):
        PhaseSplitEngine(model, plan=None, gates=DecodeGates("drop"))


def test_substitution_vectors_are_the_calibration_mean(tmp_path):
    """The output sums a calibration gathers, recomputed by hand: every decode token's router input is
    recorded, each expert it picks is run on it alone, and the outputs averaged per expert."""
    model = build_tiny_model("qwen3_moe", seed=0, initializer_range=TINY_INIT)
    adapter = get_adapter(model.config)
    layer = adapter.moe_layers(model)[1]
    prompts = random_prompts(3, seed=4)
    from slimwise.calibrate import ExpertObserver

    seen = []
    observer = ExpertObserver(model, "decode", output_sums=True)

    def record(module, args, output):  # the router's input and picks where the observer counts (decode rows)
        if observer.rows is not None and observer.rows.any():
            seen.append((args[0].detach().clone(), output[2].clone(), observer.rows))

    handle = layer.router.register_forward_hook(record)
    try:
        PhaseSplitEngine(model).generate(prompts, "full", GenerationConfig(max_new_tokens=4, eos_token_id=-1),
                                         observer=observer)
        stats = observer.stats
    finally:
        handle.remove()
        observer.remove()
    sums = torch.zeros(16, model.config.hidden_size, dtype=torch.float64)
    counts = torch.zeros(16)
    with torch.no_grad():
        for hidden, ids, rows in seen:
            for t in torch.nonzero(rows.reshape(-1)).flatten().tolist():
                for e in ids[t].tolist():
                    sums[e] += adapter.expert_forward(layer.experts, e, hidden[t:t + 1])[0].double()
                    counts[e] += 1
    row = stats.row(layer.index)
    assert torch.equal(stats.count[row].float(), counts)
    torch.testing.assert_close(stats.output_sum[row], sums, rtol=1e-5, atol=1e-6)
    want = torch.where(counts[:, None] > 0, sums / counts.clamp_min(1)[:, None], 0)
    torch.testing.assert_close(stats.output_mean()[row], want, rtol=1e-5, atol=1e-6)
    stats.save(tmp_path / "s.safetensors")
    assert torch.equal(type(stats).load(tmp_path / "s.safetensors").output_sum, stats.output_sum)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "deepseek_v3"])
def test_substitute_ends_and_zero_vectors(family, planned, tmp_path):
    """substitute: tau = 0 is the full model; zero vectors give drop's tokens; real vectors change them."""
    model, plan = planned(family)
    stats = calibrate(model, random_prompts(8, seed=1), config=CalibrationConfig(max_new_tokens=8,
                                                                                output_sums=True),
                      progress=False)
    stats.save(tmp_path / "sums.safetensors")
    zero = type(stats).load(tmp_path / "sums.safetensors")
    zero.output_sum.zero_()
    zero.save(tmp_path / "zero.safetensors")
    sub = DecodeGates("substitute", None, str(tmp_path / "sums.safetensors"))
    drop = tokens(model, plan, "slimwise", DecodeGates("drop"))
    assert tokens(model, plan, "slimwise", DecodeGates("substitute", 0.0, sub.substitutes)) \
        == tokens(model, plan, "full")
    zero_gates = DecodeGates("substitute", None, str(tmp_path / "zero.safetensors"))
    assert tokens(model, plan, "slimwise", zero_gates) == drop
    assert tokens(model, plan, "slimwise", sub) != drop


def test_gates_file_holds_the_pruned_router_rows_and_means(tmp_path):
    """`slimwise.gate_sidecar`: what a pruned checkpoint's decode instance reads under drop / substitute. Per
    MoE layer: the plan's kept and pruned ids, the full checkpoint's router rows of the pruned experts (bit
    for bit, read from its files) and their calibration means; refused for a fallback, for the plain gates,
    for a grouped router and for a statistics file of another model."""
    from slimwise.gate_sidecar import GateSidecar, write_gate_sidecar
    from slimwise.stats import ExpertStats

    model = build_tiny_model("qwen2_moe", seed=0, initializer_range=TINY_INIT)
    model.save_pretrained(tmp_path / "full")
    stats = calibrate(model, random_prompts(6, seed=2), config=CalibrationConfig(
        max_new_tokens=6, output_sums=True), progress=False)
    stats_path = stats.save(tmp_path / "stats.safetensors")
    plan = plan_from_stats(stats, "reap", 0.5)
    gates = DecodeGates("substitute", None, str(stats_path))
    path = write_gate_sidecar(tmp_path / "full", plan, gates, tmp_path / "gates.safetensors")
    side = GateSidecar.load(path)
    adapter = get_adapter(model.config)
    means = ExpertStats.load(stats_path).output_mean()
    assert side.gates == "substitute" and side.num_experts == plan.num_experts and side.top_k == plan.top_k
    assert sorted(side.layers) == sorted(plan.kept_experts)
    for layer in adapter.moe_layers(model):
        lg = side.layers[layer.index]
        assert lg.kept.tolist() == sorted(plan.kept(layer.index))
        assert lg.pruned.tolist() == plan.pruned_mask(layer.index).nonzero().flatten().tolist()
        assert torch.equal(lg.rows, layer.router.weight.detach()[lg.pruned])
        assert lg.bias is None
        assert torch.equal(lg.vectors, means[stats.row(layer.index)][lg.pruned].float())
    drop = GateSidecar.load(write_gate_sidecar(tmp_path / "full", plan, DecodeGates("drop"),
                                               tmp_path / "drop.safetensors"))
    assert drop.gates == "drop" and all(lg.vectors is None for lg in drop.layers.values())
    for bad in (DecodeGates("drop", 0.5), PLAIN):
        with pytest.raises(SlimWiseError, match="no --fallback"):
            write_gate_sidecar(tmp_path / "full", plan, bad, tmp_path / "x.safetensors")
    other = build_tiny_model("qwen3_moe", seed=0, initializer_range=TINY_INIT, hidden_size=48)
    other_stats = calibrate(other, random_prompts(2, seed=2), config=CalibrationConfig(
        max_new_tokens=2, output_sums=True), progress=False).save(tmp_path / "other.safetensors")
    with pytest.raises(SlimWiseError, match="calibrate this model"):
        write_gate_sidecar(tmp_path / "full", plan, DecodeGates("substitute", None, str(other_stats)),
                           tmp_path / "x.safetensors")
    deepseek = build_tiny_model("deepseek_v3", seed=0, initializer_range=TINY_INIT)
    deepseek.save_pretrained(tmp_path / "ds")
    ds_plan = plan_from_stats(calibrate(deepseek, random_prompts(2, seed=2), config=CalibrationConfig(
        max_new_tokens=2), progress=False), "reap", 0.5)
    with pytest.raises(SlimWiseError, match="expert groups"):
        write_gate_sidecar(tmp_path / "ds", ds_plan, DecodeGates("drop"), tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
    (tmp_path / "garbage.safetensors").write_bytes(b"not a file")
    with pytest.raises(SlimWiseError, match="not a SlimWise gates file"):
        GateSidecar.load(tmp_path / "garbage.safetensors")
