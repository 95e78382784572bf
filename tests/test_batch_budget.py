"""Batch-aware decode budgets (`slimwise.decode_gates`: budget, budget_share, extra), reference engine.

The dial's ends are today's modes token for token (E = every expert: the full model; M = 0: the static plan),
a step never routes a decode row outside its S, S is what the summed gate weight of the live rows says, and
the settings refuse what makes no sense in one line.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from slimwise.adapters import get_adapter
from slimwise.decode_gate_ops import budget_allowed
from slimwise.decode_gates import PLAIN, DecodeGates
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.errors import SlimWiseError

CONFIG = GenerationConfig(max_new_tokens=10, eos_token_id=-1, batch_size=8)
PROMPTS = random_prompts(8, seed=5, lengths=(5, 9, 1, 14, 3, 7, 33, 2))
FAMILIES = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "gpt_oss", "deepseek_v3"]


def test_hand_computed_budget_sets():
    # two groups over 6 experts, top-2 slots; group 0's rows 0-1, group 1's rows 2-3; row 3 not counted
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1], [0.8, 0.2]])
    ids = torch.tensor([[0, 3], [3, 5], [1, 2], [4, 5]])
    groups = torch.tensor([0, 0, 1, 1])
    counted = torch.tensor([True, True, True, False])
    forced = torch.zeros(2, 6, dtype=torch.bool)
    # group 0 mass: e3 1.1, e0 0.6, e5 0.3; group 1 (row 3 ignored): e1 0.9, e2 0.1
    allowed = budget_allowed(weights, ids, groups, counted, forced, torch.tensor([2, 3]))
    assert allowed.tolist() == [[True, False, False, True, False, False],
                                [True, True, True, False, False, False]]  # ties at 0: lower id (e0)
    # forced experts come first and count against the size: the plan's kept set plus M
    forced[0, [4, 5]] = True
    allowed = budget_allowed(weights, ids, groups, counted, forced, torch.tensor([3, 6]))
    assert allowed[0].tolist() == [False, False, False, True, True, True] and allowed[1].all()
    # size = forced.sum(): exactly the forced set, whatever the mass
    assert budget_allowed(weights, ids, groups, counted, forced, torch.tensor([2, 0]))[0].tolist() == \
        forced[0].tolist()


def test_budget_settings_are_validated():
    for bad in (dict(budget=0), dict(budget_share=0.0), dict(budget_share=1.5), dict(extra=-1),
                dict(budget=4, extra=1), dict(budget=4, budget_share=0.5), dict(gates="drop", budget=4)):
        with pytest.raises(SlimWiseError):
            DecodeGates(**bad)
    assert not DecodeGates(budget=4).plain and DecodeGates(extra=0).budgeted
    assert DecodeGates(extra=2).static == DecodeGates()
    assert DecodeGates(budget_share=0.5).step_experts(64, 4, 32) == 32
    assert DecodeGates(extra=3).step_experts(64, 4, 32) == 35
    assert DecodeGates(extra=99).step_experts(64, 4, 32) == 64
    with pytest.raises(SlimWiseError, match="between top-k"):
        DecodeGates(budget=3).step_experts(64, 4, 32)
    with pytest.raises(SlimWiseError, match="between top-k"):
        DecodeGates(budget=65).step_experts(64, 4, 32)
    # describe() is unchanged without a budget (report and cache keys stay as they were)
    assert DecodeGates().describe() == {"gates": "renorm", "fallback": None}
    assert DecodeGates(extra=2).describe()["extra"] == 2


def tokens(model, plan, mode, gates=PLAIN, config=CONFIG, prompts=PROMPTS):
    with PhaseSplitEngine(model, plan=plan, gates=gates) as engine:
        return [o.token_ids for o in engine.generate(prompts, mode, config)]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_budget_dial_ends_are_todays_modes(family, planned):
    model, plan = planned(family)
    experts = get_adapter(model.config).num_experts(model.config)
    full, static = tokens(model, plan, "full"), tokens(model, plan, "slimwise")
    assert full != static
    assert tokens(model, plan, "slimwise", DecodeGates(budget=experts)) == full
    assert tokens(model, plan, "slimwise", DecodeGates(budget_share=1.0)) == full
    assert tokens(model, plan, "slimwise", DecodeGates(extra=0)) == static
    # uniform pruning keeps the static plan under a budget (a budget is a decode-step choice)
    assert tokens(model, plan, "uniform", DecodeGates(budget=experts)) == tokens(model, plan, "uniform")
    # a smaller budget is something else than both ends
    top_k = get_adapter(model.config).top_k(model.config)
    tight = tokens(model, plan, "slimwise", DecodeGates(budget=top_k))
    assert tight != full


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_step_routes_live_rows_within_its_budget(family, planned):
    """Every budgeted decode forward: the live rows' selected experts number at most E per layer, and S is
    recomputed here from the stock routers' outputs over the live rows."""
    model, plan = planned(family)
    adapter = get_adapter(model.config)
    top_k, experts = adapter.top_k(model.config), adapter.num_experts(model.config)
    budget = top_k + 1
    engine = PhaseSplitEngine(model, plan=plan, gates=DecodeGates(budget=budget))
    seen = []
    layers = adapter.moe_layers(model)

    def record(module, args, output):
        if engine.mask.budgeted:
            seen.append((module, args[0].detach().clone(), output[-1].detach().clone(),
                         engine.mask.budget_rows.clone()))

    handles = [layer.router.register_forward_hook(record) for layer in layers]
    # an EOS that one row emits early, so that later steps carry a finished row
    eos = tokens(model, plan, "slimwise", DecodeGates(budget=budget))[0][2]
    config = GenerationConfig(max_new_tokens=10, eos_token_id=eos, batch_size=8)
    try:
        engine.generate(PROMPTS, "slimwise", config)
    finally:
        for h in handles:
            h.remove()
    assert seen and any(not rows.all() for *_, rows in seen)  # some steps had finished rows
    for router, hidden, ids, rows in seen:
        assert ids[rows].unique().numel() <= budget
        with engine.mask.pruned(False), torch.inference_mode():
            _, w, full_ids = router(hidden)
        allowed = budget_allowed(w, full_ids, torch.zeros(len(rows), dtype=torch.long), rows,
                                 torch.zeros(1, experts, dtype=torch.bool), torch.tensor([budget]))[0]
        assert allowed[ids[rows]].all()
    engine.close()


def test_budget_refusals(planned):
    model, plan = planned("qwen3_moe")
    with pytest.raises(SlimWiseError, match="between top-k"):
        PhaseSplitEngine(model, plan=plan, gates=DecodeGates(budget=1))
    with pytest.raises(SlimWiseError, match="route from the full router"):
        PhaseSplitEngine(model, gates=DecodeGates(budget=4))


def test_batch_of_one_is_the_full_model(planned):
    """One live row picks k <= E experts: a budget never binds at batch 1."""
    model, plan = planned("qwen3_moe")
    top_k = get_adapter(model.config).top_k(model.config)
    one = GenerationConfig(max_new_tokens=10, eos_token_id=-1, batch_size=1)
    assert tokens(model, plan, "slimwise", DecodeGates(budget=top_k), one) == tokens(model, plan, "full",
                                                                                       config=one)
