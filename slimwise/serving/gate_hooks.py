"""The hooks `DecodeRouting` installs on a vLLM model's MoE gates and routers: the per-plan pruned tables, the
gate output hook (distilled router, -inf logits, the gate variants and the fallback, the batch budget), the
selection mask of grouped / biased routers, the pre-routed `drop` router and the `substitute` block hook.

Invariant (graph safety, `tests/test_graph_safety.py`): a hook reads the step only from the routing's
fixed-address buffers (`decode_mask`, `row_plan`, `budget_on`) and the per-gate tables registered here, never
by a Python branch on per-step state, so one traced graph serves every step.

`routing` is the `DecodeRouting` the hooks serve (`slimwise.serving.routing`, which imports this module: it is
passed in, not imported).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from slimwise.adapters.deepseek_v3 import grouped_topk_ids
from slimwise.decode_gate_ops import (
    budget_allowed,
    decode_prerouted,
    encode_prerouted,
    falls_back,
    substitution,
    within,
)
from slimwise.decode_gates import DecodeGates
from slimwise.errors import SlimWiseError
from slimwise.hooks import first_output, with_first_output

GATE_NAME = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe|feed_forward)\.(?:gate|router)$")


def install_gate(routing, model: nn.Module, name: str, module: nn.Module) -> None:
    """If `name` is an MoE gate that a plan prunes or the delta has a router for: hook it (its layer's
    router taken from `pending_routers`); other modules are left alone."""
    match = GATE_NAME.search(name)
    if match is None or not hasattr(module, "weight"):
        return
    layer = int(match.group(1))
    if all(layer not in p.kept_experts for p in routing.plans.values()):
        return
    pruned = pruned_table(routing.plans, routing.plan.num_experts, layer)
    budget = budget_table(routing.gates, routing.top_k, pruned)
    routers = routing.pending_routers
    masks = bool(pruned.any()) or budget is not None
    if not masks and layer not in routers:
        return
    router = selection_router(model, name)
    runner = getattr(model.get_submodule(name.rsplit(".", 1)[0]), "experts", None)
    full = full_routing(runner, router, name, routing.gates) if masks and not routing.gates.plain else None
    if router is not None:  # sigmoid + correction bias / grouped top-k: -inf logits alone would not do
        mask_hook(routing, module, pruned if masks else None, routers.pop(layer, None), layer, full, budget)
        if masks:
            install_selection(router)
            routing.hooked["selection"].append(name.rsplit(".", 1)[0] + ".experts.router")
    elif getattr(runner, "_fse_fuse_gate", False):
        # the runner computes router + shared-expert-gate logits in one GEMM and never calls the gate; a
        # mask applied inside the runner is not known to survive torch.compile (see install_selection)
        raise SlimWiseError(f"{name}: vLLM fuses this router with the shared-expert gate (ROCm AITER "
                            "fused shared experts), which bypasses the SlimWise gate hook; disable the "
                            "fusion (VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=0)")
    else:
        mask_hook(routing, module, pruned, routers.pop(layer, None), layer, full, budget)
    if full is not None and routing.gates.routes_as_drop:
        install_prerouted(runner.router, full)
    if full is not None and layer in routing.substitutes:
        _install_plan_substitution(routing, name.rsplit(".", 1)[0], model, module, full,
                                   routing.substitutes[layer])
    routing.gates_by_layer[layer] = module
    routing.hooked["gates"].append(name)
    if routing.counted_layer is None and masks:
        from slimwise.serving.row_counts import install_row_counter

        install_row_counter(module, routing)
        routing.counted_layer = layer
        prunes = pruned.any(dim=-1)
        if budget is not None:
            prunes = prunes | (budget[1] < pruned.shape[1])
        routing.counted_prunes = prunes.tolist()


def full_routing(runner, selection, name: str, gates: DecodeGates):
    """The layer's stock routing as a function of (hidden, logits) -> (weights, ids): what the gate
    variants and the fallback start from, computed by vLLM's own router code so that rows left alone stay
    stock."""
    router = getattr(runner, "router", None)
    if selection is not None:
        return lambda hidden, logits: masked_grouped_topk(
            logits, torch.zeros_like(logits, dtype=torch.bool), selection)
    if router is None or not hasattr(router, "_compute_routing"):
        raise SlimWiseError(f"{name}: gates {gates.gates} / fallback need the layer's vLLM router "
                            "(FusedMoE.router), which this model does not have: serve with the default "
                            "gates and no fallback")
    stock = router._compute_routing
    return lambda hidden, logits: stock(hidden, logits, None)


def install_substitution(block: nn.Module, gate: nn.Module, table: torch.Tensor, route) -> None:
    """`substitute`: the MoE block's output gains, per routed row, its pruned slots' weights times their
    experts' vectors (`table`: [experts, hidden], zero rows for kept experts). The block's input is the
    gate's, so the hook recomputes the routing from it: the gate's own forward, without its hooks, then
    `route(hidden, logits) -> (weights, ids, slot_pruned)`, the routing the gate hook decided on, from data
    alone, which torch.compile traces like the gate hook. The colocated plan rows and a pruned checkpoint's
    gates file (`pruned_gates.py`) both install this one hook."""
    block.register_buffer("slimwise_substitutes", table.to(gate.weight.device), persistent=False)
    hidden_size = table.shape[-1]

    def hook(module, args, output):
        hidden = args[0].reshape(-1, hidden_size)
        weights, ids, slot_pruned = route(hidden, first_output(gate.forward(hidden)))
        extra = substitution(weights, ids, slot_pruned, module.slimwise_substitutes)
        out = first_output(output)
        out = out + extra.to(out.dtype).view_as(out)
        return with_first_output(output, out)

    block.register_forward_hook(hook)


def _install_plan_substitution(routing, block_name: str, model: nn.Module, gate: nn.Module, full,
                               vectors: torch.Tensor) -> None:
    """`substitute` on the colocated plan rows: a row's pruned slots are its plan's pruned experts among the
    stock routing's, less the rows that fall back (the gate hook's fallback)."""
    tau = routing.gates.fallback

    def route(hidden, logits):
        weights, ids = full(hidden, logits)
        slot_pruned = gate.slimwise_pruned[routing.row_plan[: hidden.shape[0]]].gather(1, ids.long())
        slot_pruned = slot_pruned & ~falls_back(weights, slot_pruned, tau)[:, None]
        return weights, ids, slot_pruned

    install_substitution(model.get_submodule(block_name), gate, vectors, route)
    routing.hooked["substitution"].append(block_name)


def install_prerouted(router, full) -> None:
    """`drop`: the gate hook writes each routed row's final weights into its logits (`encode_prerouted`);
    the router reads them back, and routes every other row (finite logits) with its stock code."""
    top_k = router.top_k

    def compute_routing(hidden_states, router_logits, indices_type, *, input_ids=None):
        pre = torch.isneginf(router_logits).any(dim=-1, keepdim=True)
        weights, ids = full(hidden_states, router_logits.masked_fill(pre, 0))
        pre_weights, pre_ids = decode_prerouted(router_logits, top_k)
        return (torch.where(pre, pre_weights, weights.float()).contiguous(),
                torch.where(pre, pre_ids, ids.to(torch.int32)).contiguous())

    router._compute_routing = compute_routing


def pruned_table(plans: dict, num_experts: int, layer: int) -> torch.Tensor:
    """(plans + 1, experts) bool: row 0 (every expert) all False, row k plan
    k's pruned experts in `layer`."""
    rows = [torch.zeros(num_experts, dtype=torch.bool)]
    for plan in plans.values():
        rows.append(plan.pruned_mask(layer) if layer in plan.kept_experts
                    else torch.zeros(plan.num_experts, dtype=torch.bool))
    return torch.stack(rows)


def budget_table(gates: DecodeGates, top_k: int,
                 pruned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A batch budget's (forced [plans + 1, experts], size [plans + 1]) for `budget_allowed` in one layer
    (`pruned`: its `pruned_table`): row 0 (every expert) forces all; plan k forces its kept set under `extra`
    (nothing under `budget`), and its size is `DecodeGates.step_experts`. None: no budget."""
    if not gates.budgeted:
        return None
    experts = pruned.shape[1]
    forced = ~pruned if gates.extra is not None else torch.zeros_like(pruned)
    forced[0] = True
    size = torch.tensor([experts] + [gates.step_experts(experts, top_k, int((~row).sum()))
                                     for row in pruned[1:]])
    return forced, size


def mask_hook(routing, gate: nn.Module, pruned: torch.Tensor | None, router: torch.Tensor | None = None,
              layer: int = -1, full=None, budget: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Gate output hook: decode rows get the distilled router (if any) and, with `pruned` (the per-plan
    table), -inf logits for the experts their plan prunes (softmax routers). pruned=None: logits untouched
    (the selection is masked instead). `full` (the layer's stock routing; gates other than plain): rows
    over the fallback threshold keep their logits, and under `drop` each routed row that holds a pruned
    expert carries its final routing in its logits (`encode_prerouted`)."""
    if pruned is not None:
        gate.register_buffer("slimwise_pruned", pruned.to(gate.weight.device), persistent=False)
        first_kept = (~pruned).to(torch.int8).argmax(dim=-1)  # per plan row: a kept expert (drop's fill)
        gate.register_buffer("slimwise_first_kept", first_kept.to(gate.weight.device), persistent=False)
    if budget is not None:  # the batch budget's forced sets and sizes per plan row (`budget_table`)
        gate.register_buffer("slimwise_forced", budget[0].to(gate.weight.device), persistent=False)
        gate.register_buffer("slimwise_size", budget[1].to(gate.weight.device), persistent=False)
    if router is not None:
        gate.register_buffer("slimwise_router",
                             router.to(gate.weight.device, gate.weight.dtype), persistent=False)

    def hook(module, args, output):
        logits = first_output(output)
        n = logits.shape[0]
        if router is not None:  # decode tokens route with the distilled router
            logits = torch.where(routing.decode_mask[:n, None],
                                 F.linear(args[0], module.slimwise_router).to(logits.dtype), logits)
        if pruned is None:
            masked = logits
        elif full is None:
            masked = logits.masked_fill(module.slimwise_pruned[routing.row_plan[:n]], float("-inf"))
        else:
            masked = gated(routing, module, args[0], logits, full, layer)
        return with_first_output(output, masked)

    gate.register_forward_hook(hook)


def gated(routing, gate: nn.Module, hidden: torch.Tensor, logits: torch.Tensor, full, layer: int):
    """The gate variant and the fallback on one layer's logits (see `slimwise.decode_gates`)."""
    n = logits.shape[0]
    row_plan = routing.row_plan[:n]
    rows_pruned = gate.slimwise_pruned[row_plan]
    weights, ids = full(hidden, logits)
    if hasattr(gate, "slimwise_forced"):  # batch budget: the step's S per plan group, its decode rows
        allowed = budget_allowed(weights, ids, row_plan, row_plan > 0, gate.slimwise_forced,
                                 gate.slimwise_size)
        rows_pruned = torch.where(routing.budget_on, ~allowed[row_plan], rows_pruned)
        if routing.gates.fallback is None and not routing.count_experts:  # nothing reads the slots: mask now
            return logits.masked_fill(rows_pruned, float("-inf"))
    slot_pruned = rows_pruned.gather(1, ids.long())
    back = falls_back(weights, slot_pruned, routing.gates.fallback)
    if routing.count_experts and not torch.compiler.is_compiling():
        routed = row_plan > 0
        entry = routing.counters.fallback.setdefault(layer, [0, 0, 0])
        entry[0] += int(routed.sum())
        entry[1] += int((slot_pruned.any(dim=-1) & routed).sum())
        entry[2] += int(back.sum())
    if not routing.gates.routes_as_drop:
        return logits.masked_fill(rows_pruned & ~back[:, None], float("-inf"))
    slot_pruned = slot_pruned & ~back[:, None]
    encoded = encode_prerouted(weights, ids, slot_pruned, gate.slimwise_first_kept[row_plan],
                               logits.shape[-1], logits.dtype)
    return torch.where(slot_pruned.any(dim=-1, keepdim=True), encoded, logits)


def install_selection(router) -> None:
    """Replace a grouped / biased vLLM router's routing with `masked_grouped_topk`, taking the experts a
    row may not select from its -inf logits: the gate hook writes those (decode rows, pruned experts), so
    the mask travels with the logits (a mask read from the decode buffer inside the router was not
    applied under torch.compile -- verified: compiled uniform mode gave other tokens) and a stock
    (finite) row routes as stock."""

    def compute_routing(hidden_states, router_logits, indices_type, *, input_ids=None):
        return masked_grouped_topk(router_logits, torch.isneginf(router_logits), router)

    router._compute_routing = compute_routing


def selection_router(model: nn.Module, gate_name: str):
    """The vLLM router of the MoE block that owns `gate_name` if it selects experts from anything but the
    logits' top-k (a correction bias, grouped top-k, sigmoid scores): masking logits is not enough there."""
    experts = getattr(model.get_submodule(gate_name.rsplit(".", 1)[0]), "experts", None)
    router = getattr(experts, "router", None)
    if router is None:
        return None
    biased = getattr(router, "e_score_correction_bias", None) is not None
    grouped = bool(getattr(router, "use_grouped_topk", getattr(router, "num_expert_group", None) is not None))
    if not (biased or grouped or getattr(router, "scoring_func", "softmax") != "softmax"):
        return None
    if getattr(router, "num_fused_shared_experts", 0):
        raise SlimWiseError(f"{gate_name}: shared experts fused into the routed top-k (ROCm AITER) are not "
                            "supported; disable the fusion (VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=0)")
    if not hasattr(router, "_compute_routing") \
            or getattr(router, "scoring_func", "softmax") not in ("softmax", "sigmoid"):
        raise SlimWiseError(f"{gate_name}: vLLM router {type(router).__name__} "
                            f"({getattr(router, 'scoring_func', '?')}) has no SlimWise selection mask")
    return router


def masked_grouped_topk(router_logits: torch.Tensor, rows_pruned: torch.Tensor, router) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """vLLM's CPU `_grouped_topk` (vllm/model_executor/layers/fused_moe/router/cpu_router.py) with the
    selection scores (scores + e_score_correction_bias) of `rows_pruned` set to -inf before the group scores
    and again after the group mask -- `DeepseekV3Adapter.route`, the reference engine's masking, row by row.
    Weights are the unbiased scores of the selected experts. Rows without a pruned entry give exactly the
    stock result. Tested for DeepSeek-V3 (sigmoid + bias + groups); softmax-scored grouped routers
    (DeepSeek-V2 style) follow the same code, untested.
    """
    scores = router_logits.float()
    # softmax scoring: pruned logits -> -inf first, as in a sliced router (sigmoid: the scores stay unbiased)
    scores = scores.sigmoid() if router.scoring_func == "sigmoid" else scores.masked_fill(rows_pruned, float(
        "-inf")).softmax(dim=-1)
    bias = getattr(router, "e_score_correction_bias", None)
    groups = int(getattr(router, "num_expert_group", None) or 1) \
        if getattr(router, "use_grouped_topk", True) else 1
    topk_group = int(getattr(router, "topk_group", None) or groups) if groups > 1 else 1
    choice = scores + bias.unsqueeze(0) if bias is not None else scores
    topk_ids = grouped_topk_ids(choice, rows_pruned, groups, topk_group, router.top_k,
                                "top2" if bias is not None else "max")
    topk_weights = scores.gather(1, topk_ids)  # biased: the unbiased scores; unbiased: the selection scores
    if router.renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    # a batch budget's S may leave a row fewer than k experts in its best groups: those slots read nothing
    topk_weights, topk_ids = within(topk_weights, topk_ids, rows_pruned)
    if router.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * router.routed_scaling_factor
    return topk_weights.to(torch.float32).contiguous(), topk_ids.to(torch.int32).contiguous()
