"""Family adapters against the stock transformers modules, one tiny random float32 model per family.

Every test compares an adapter with what transformers itself computes: the stock router forward, the stock
fused-experts forward, and a stock model whose expert weights were sliced and reloaded from disk.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from tiny import build_tiny_model, tiny_config

from slimwise.adapters import MoEAdapter, get_adapter, supported_families
from slimwise.errors import SlimWiseError

# family -> (model_type of the built model, experts, top-k, MoE layer indices, hybrid linear attention)
EXPECTED = {
    "qwen3_moe": ("qwen3_moe", 16, 4, [0, 1], False),
    "qwen2_moe": ("qwen2_moe", 16, 4, [0, 1], False),
    "mixtral": ("mixtral", 8, 2, [0, 1], False),
    "olmoe": ("olmoe", 16, 4, [0, 1], False),
    "deepseek_v3": ("deepseek_v3", 16, 4, [1, 2], False),
    "gpt_oss": ("gpt_oss", 8, 2, [0, 1], False),
    "qwen3_next": ("qwen3_next", 16, 4, [0, 1, 2, 3], True),
    "qwen3_5_moe": ("qwen3_5_moe_text", 16, 4, [0, 1, 2, 3], True),
}
FAMILIES = list(EXPECTED)
SHARED = {"qwen2_moe": "shared_expert", "deepseek_v3": "shared_experts", "qwen3_next": "shared_expert",
          "qwen3_5_moe": "shared_expert"}

_MODELS: dict[str, torch.nn.Module] = {}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: one intra-op thread is fastest, and spinning pools stall on a shared 2-core box."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny(family: str) -> torch.nn.Module:
    """One model per family for the whole module; tests that change a model work on a deep copy."""
    if family not in _MODELS:
        model = build_tiny_model(family, seed=0)
        if family == "deepseek_v3":  # real checkpoints carry a non-zero selection bias (init leaves zeros)
            gen = torch.Generator().manual_seed(0)
            for layer in get_adapter(model).moe_layers(model):
                bias = layer.router.e_score_correction_bias
                bias.copy_(0.1 * torch.randn(bias.shape, generator=gen))
        _MODELS[family] = model
    return _MODELS[family]


def tokens(batch: int = 3, length: int = 10, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 512, (batch, length), generator=torch.Generator().manual_seed(seed))


def router_inputs(model, adapter: MoEAdapter) -> dict[int, torch.Tensor]:
    """The hidden states each router sees on a batch of random tokens (realistic router inputs)."""
    seen: dict[int, torch.Tensor] = {}
    handles = []
    for layer in adapter.moe_layers(model):
        hidden = layer.router.weight.shape[1]

        def hook(_module, args, index=layer.index, hidden=hidden):
            seen[index] = args[0].detach().reshape(-1, hidden).clone()

        handles.append(layer.router.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(tokens(4, 16, seed=7))
    finally:
        for h in handles:
            h.remove()
    return seen


def make_keep(
    adapter: MoEAdapter, config, layers: list[int], seed: int = 0
) -> tuple[dict[int, torch.Tensor], int]:
    """A random uniform plan keeping half of every group (DeepSeek: of each of the n_group groups)."""
    n, groups = adapter.num_experts(config), adapter.num_groups(config)
    size = n // groups
    per_group = max(size // 2, adapter.min_kept_per_group(config))
    assert per_group * groups >= adapter.top_k(config)
    gen = torch.Generator().manual_seed(seed)
    keep = {}
    for index in layers:
        ids = [g * size + torch.randperm(size, generator=gen)[:per_group] for g in range(groups)]
        keep[index] = torch.cat(ids).sort().values
    return keep, per_group * groups


def pruned_mask(n: int, keep: torch.Tensor) -> torch.Tensor:
    mask = torch.ones(n, dtype=torch.bool)
    mask[keep] = False
    return mask


def install_masks(model, adapter: MoEAdapter, keep: dict[int, torch.Tensor]) -> None:
    n = adapter.num_experts(model.config)
    for layer in adapter.moe_layers(model):
        router, pruned = layer.router, pruned_mask(n, keep[layer.index])
        router.forward = lambda h, *a, _r=router, _p=pruned, **k: adapter.route(_r, h, _p)


def sliced_copy(model, adapter: MoEAdapter, keep: dict[int, torch.Tensor], n_keep: int):
    sliced = copy.deepcopy(model)
    for layer in adapter.moe_layers(sliced):
        adapter.slice_layer(layer, keep[layer.index])
    adapter.set_num_experts(sliced.config, n_keep)
    return sliced


# ----- discovery --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_fields_and_layers(family):
    model_type, n, k, layers, _ = EXPECTED[family]
    model = tiny(family)
    assert model.config.model_type == model_type
    adapter = get_adapter(model)
    assert adapter.family == family
    assert adapter.num_experts(model.config) == n
    assert adapter.top_k(model.config) == k
    found = adapter.moe_layers(model)
    assert [layer.index for layer in found] == layers
    for layer in found:
        assert layer.router.weight.shape[0] == n
        assert layer.router.num_experts == n and layer.experts.num_experts == n
        assert {name for name in adapter.expert_param_names(layer.experts)} == {
            name for name, p in layer.experts.named_parameters(recurse=False)}
        assert adapter.expert_bytes(layer.experts) > 0
        for attr in adapter.shared_attrs:
            assert getattr(layer.block, attr) is not None
    if family in SHARED:
        assert SHARED[family] in adapter.shared_attrs
    if family == "deepseek_v3":
        assert not hasattr(adapter.decoder_layers(model)[0].mlp, "gate")  # first_k_dense_replace layer
        assert adapter.num_groups(model.config) == 4
        assert adapter.min_kept_per_group(model.config) == 2
    else:
        assert adapter.num_groups(model.config) == 1


def test_qwen3_5_moe_nested_config_and_vlm_class():
    """The multimodal checkpoint config (text_config nested) and Qwen3_5MoeForConditionalGeneration."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    config = tiny_config("qwen3_5_moe")
    assert config.model_type == "qwen3_5_moe"
    adapter = get_adapter(config)
    assert (
        adapter.family == "qwen3_5_moe" and adapter.num_experts(config) == 16 and adapter.top_k(config) == 4
    )
    torch.manual_seed(0)
    vlm = Qwen3_5MoeForConditionalGeneration(config).eval()
    assert [layer.index for layer in adapter.moe_layers(vlm)] == [0, 1, 2, 3]
    adapter.set_num_experts(config, 8)
    assert config.text_config.num_experts == 8
    d = adapter.config_dict_fixups({"model_type": "qwen3_5_moe", "text_config": {"num_experts": 16}}, 8)
    assert d == {"model_type": "qwen3_5_moe", "text_config": {"num_experts": 8}}


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "no_such_moe"])
def test_dense_or_unknown_model_is_refused(model_type):
    if model_type == "no_such_moe":
        config = type("Cfg", (), {"model_type": "no_such_moe"})()
    else:
        from transformers import AutoConfig

        config = AutoConfig.for_model(model_type, vocab_size=512, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      head_dim=32)
    with pytest.raises(SlimWiseError) as err:
        get_adapter(config)
    for family in FAMILIES:
        assert family in str(err.value)
    assert set(FAMILIES) <= set(supported_families())


def test_single_expert_config_is_refused_as_dense():
    with pytest.raises(SlimWiseError, match="mixtral") as err:
        get_adapter(tiny_config("mixtral", num_local_experts=1, num_experts_per_tok=1))
    assert "deepseek_v3" in str(err.value) and "dense" in str(err.value)


# ----- routing ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_route_unpruned_is_bit_identical(family, dtype):
    model = tiny(family)
    adapter = get_adapter(model)
    n, k = adapter.num_experts(model.config), adapter.top_k(model.config)
    inputs = router_inputs(model, adapter)
    none = torch.zeros(n, dtype=torch.bool)
    for layer in adapter.moe_layers(model):
        router = copy.deepcopy(layer.router).to(dtype)
        real = inputs[layer.index].to(dtype)
        noise = torch.randn(37, real.shape[1], generator=torch.Generator().manual_seed(layer.index)).to(dtype)
        for hidden in (real, noise, real[:1]):
            with torch.no_grad():
                stock, ours = router(hidden), adapter.route(router, hidden, none)
            assert len(stock) == len(ours) == 3
            for s, o in zip(stock, ours, strict=True):
                assert s.dtype == o.dtype and s.shape == o.shape
                assert torch.equal(s, o)
        # non-degenerate routing on the model's own hidden states: tokens spread over most experts
        used = router(real)[2].unique().numel()
        assert used >= max(k, n // 2), f"layer {layer.index} routes to only {used} of {n} experts"


@pytest.mark.parametrize("family", FAMILIES)
def test_route_never_selects_pruned(family):
    model = tiny(family)
    adapter = get_adapter(model)
    n, k = adapter.num_experts(model.config), adapter.top_k(model.config)
    inputs = router_inputs(model, adapter)
    keep, _ = make_keep(adapter, model.config, [layer.index for layer in adapter.moe_layers(model)], seed=3)
    for layer in adapter.moe_layers(model):
        pruned = pruned_mask(n, keep[layer.index])
        router = copy.deepcopy(layer.router)
        if family == "deepseek_v3":
            # adversarial selection bias: every pruned expert looks far better than any kept one
            router.e_score_correction_bias.copy_(pruned.float() * 10.0)
        hidden = torch.cat([inputs[layer.index], torch.randn(64, inputs[layer.index].shape[1])])
        with torch.no_grad():
            stock_index = router(hidden)[2]
            _, weights, index = adapter.route(router, hidden, pruned)
        assert stock_index.shape == index.shape == (hidden.shape[0], k)
        assert pruned[stock_index].any(), "test is vacuous: the stock router never picks a pruned expert"
        assert not pruned[index].any()
        assert torch.isfinite(weights).all() and (weights > 0).all()
        assert (index.sort(dim=-1).values.diff(dim=-1) > 0).all()  # k distinct experts per token


def test_deepseek_route_uneven_groups_never_selects_pruned():
    """A masking-only plan may keep different numbers per group: min_kept_per_group still guarantees
    safety."""
    model = tiny("deepseek_v3")
    adapter = get_adapter(model)
    layer = adapter.moe_layers(model)[0]
    router = copy.deepcopy(layer.router)
    keep = torch.tensor([0, 1, 4, 5, 8, 9, 10, 12, 13, 14, 15])  # 2, 2, 3, 4 kept in the 4 groups
    pruned = pruned_mask(16, keep)
    router.e_score_correction_bias.copy_(pruned.float() * 10.0 - (~pruned).float() * 0.5)
    hidden = torch.randn(200, router.hidden_dim)
    with torch.no_grad():
        _, weights, index = adapter.route(router, hidden, pruned)
    assert not pruned[index].any() and torch.isfinite(weights).all()


# ----- experts ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_expert_forward_reproduces_experts(family):
    model = tiny(family)
    adapter = get_adapter(model)
    inputs = router_inputs(model, adapter)
    for layer in adapter.moe_layers(model):
        hidden = inputs[layer.index]
        with torch.no_grad():
            _, weights, index = layer.router(hidden)
            stock = layer.experts(hidden, index, weights)
            ours = torch.zeros_like(hidden)
            for e in index.unique().tolist():
                token, slot = torch.where(index == e)
                out = adapter.expert_forward(layer.experts, e, hidden[token]) * weights[token, slot, None]
                ours.index_add_(0, token, out.to(ours.dtype))
        scale = stock.abs().max().item()
        assert scale > 0
        torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-6 * scale)


# ----- masked == sliced, and the sliced checkpoint reloads -------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_masked_equals_sliced_and_reloads(family, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny(family)
    adapter = get_adapter(model)
    n = adapter.num_experts(model.config)
    layers = [layer.index for layer in adapter.moe_layers(model)]
    keep, n_keep = make_keep(adapter, model.config, layers, seed=5)
    assert n_keep < n
    ids = tokens(3, 10)

    masked = copy.deepcopy(model)
    install_masks(masked, adapter, keep)
    sliced = sliced_copy(model, adapter, keep, n_keep)
    assert adapter.num_experts(sliced.config) == n_keep
    for layer in adapter.moe_layers(sliced):
        assert layer.router.num_experts == layer.experts.num_experts == n_keep
        for p in list(layer.experts.parameters(recurse=False)) + list(layer.router.parameters(recurse=False)):
            assert p.shape[0] == n_keep
    with torch.no_grad():
        full = model(ids).logits
        want = masked(ids).logits
        got = sliced(ids).logits
    assert not torch.allclose(full, want, atol=1e-3), "pruning changed nothing: the plan is not exercised"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, -1].argmax(-1), want[:, -1].argmax(-1))

    # the sliced model as a checkpoint: config fixed by config_dict_fixups, stock loader, same logits
    sliced.save_pretrained(tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(adapter.config_dict_fixups(json.loads(cfg_path.read_text()), n_keep)))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert adapter.num_experts(reloaded.config) == n_keep
    assert [layer.index for layer in adapter.moe_layers(reloaded)] == layers
    for layer in adapter.moe_layers(reloaded):
        assert layer.router.num_experts == layer.experts.num_experts == n_keep
    with torch.no_grad():
        again = reloaded(ids).logits
    torch.testing.assert_close(again, got, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_config_dict_fixups_write_every_count(family, tmp_path):
    """Fixups alone (on the unsliced config) must make every reader see the new count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = tiny_config(family)
    adapter = get_adapter(config)
    config.save_pretrained(tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(adapter.config_dict_fixups(json.loads(cfg_path.read_text()), 6)))
    loaded = AutoConfig.from_pretrained(tmp_path)
    text = adapter.text_config(loaded)
    for name in adapter.expert_count_fields:
        assert getattr(text, name) == 6, name
    model = AutoModelForCausalLM.from_config(loaded)
    for layer in adapter.moe_layers(model):
        assert layer.router.num_experts == layer.experts.num_experts == layer.router.weight.shape[0] == 6


# ----- cache handoff (prefill on the full model, decode on the pruned one) ----------------------------------
def _linear_states(cache) -> list[torch.Tensor]:
    states = []
    for layer in getattr(cache, "layers", []):
        for d in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            if isinstance(d, dict):
                states += [t for t in d.values() if t is not None]
    return states


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_handoff_to_sliced_model(family):
    model = tiny(family)
    adapter = get_adapter(model)
    layers = [layer.index for layer in adapter.moe_layers(model)]
    keep, n_keep = make_keep(adapter, model.config, layers, seed=11)
    masked = copy.deepcopy(model)
    install_masks(masked, adapter, keep)
    sliced = sliced_copy(model, adapter, keep, n_keep)
    prompt = tokens(2, 9, seed=2)
    with torch.no_grad():
        cache = model(prompt, use_cache=True).past_key_values  # full-model prefill
        states = _linear_states(cache)
        if EXPECTED[family][4]:
            n_linear = model.config.layer_types.count("linear_attention")
            assert len(states) == 2 * n_linear and all(s.abs().sum() > 0 for s in states)
        reference = copy.deepcopy(cache)
        step = tokens(2, 1, seed=3)
        for _ in range(2):  # two decode steps: masked full model vs sliced model on the prefill cache object
            want = masked(step, past_key_values=reference, use_cache=True).logits
            got = sliced(step, past_key_values=cache, use_cache=True).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
            step = got[:, -1:].argmax(-1)
        if states:
            # the linear-attention state is really carried: dropping it changes the next token's logits
            blank = copy.deepcopy(reference)
            for s in _linear_states(blank):
                s.zero_()
            fresh = masked(step, past_key_values=blank, use_cache=True).logits
            kept = masked(step, past_key_values=reference, use_cache=True).logits
            assert not torch.allclose(fresh, kept, atol=1e-4)


def _cache_tensors(cache) -> list[torch.Tensor]:
    out = []
    for layer in cache.layers:
        for name in ("keys", "values", "conv_states", "recurrent_states"):
            v = getattr(layer, name, None)
            out += (
                [t for t in v.values() if t is not None]
                if isinstance(v, dict)
                else [v]
                if torch.is_tensor(v)
                else []
            )
    return out


@pytest.mark.parametrize("family", [f for f in FAMILIES if EXPECTED[f][4]])
def test_slimwise_prompt_state_is_the_full_models_bit_for_bit(family):
    """What the README guarantees for hybrids too: SlimWise's prefill writes exactly the full model's cache,
    the attention KV and every Gated DeltaNet layer's conv and recurrent state (uniform pruning writes another
    one)."""
    from slimwise.baseline_plans import random_plan
    from slimwise.engines.reference import PhaseSplitEngine

    model = tiny(family)
    engine = PhaseSplitEngine(model, plan=random_plan(model, 0.5, seed=0))
    prompts = [tokens(1, 9, seed=2)[0].tolist(), tokens(1, 4, seed=4)[0].tolist()]
    with torch.no_grad():
        full, slim, uniform = (
            _cache_tensors(engine.prefill(prompts, mode)[0]) for mode in ("full", "slimwise", "uniform")
        )
    n_linear = model.config.layer_types.count("linear_attention")
    assert len(full) == len(slim) >= 2 * n_linear + 2
    assert all(torch.equal(a, b) for a, b in zip(full, slim, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(full, uniform, strict=True))
