"""`--gates drop` / `--gates substitute` on a pruned checkpoint's decode instance (PD-disaggregated).

The pruned checkpoint's router has the kept experts' rows only. With the gates file (`slimwise.gate_sidecar`)
each MoE gate's output is widened to the full model's logits, [kept | pruned] in the full model's expert
order; vLLM's own router code routes those (softmax, top-k, renormalization: the layer's stock routing, which
is width-agnostic for the families the file allows), and the result is handed to the pruned router as the
colocated `drop` hands it (`encode_prerouted`, read back with `decode_prerouted`), restricted to the kept
columns: expert j of the pruned checkpoint is the full model's kept[j]. Under `substitute` the MoE block's
output gains each pruned slot's weight times its expert's vector, recomputed from the block input as the
colocated hook does. Every row of a decode instance is routed so: its prompt positions come from the prefill
instance.

Invariant: the tokens equal the colocated engine's with the same plan and gates (and so the reference
engine's in float32), since the logits, routing and vectors are the same numbers.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from slimwise.decode_gate_ops import decode_prerouted, encode_prerouted
from slimwise.errors import SlimWiseError
from slimwise.gate_sidecar import GateSidecar, LayerGates
from slimwise.hooks import first_output, with_first_output
from slimwise.serving.gate_hooks import install_substitution, selection_router

logger = logging.getLogger("vllm.slimwise")  # printed by vLLM's log config, as serving/routing.py


def install_pruned_gates(model: nn.Module, path: str, gate_names: dict[int, str]) -> list[str]:
    """Install the gates file at `path` on `model`'s MoE gates (`gate_names`: layer -> gate module name);
    returns the hooked gate names. Grouped routers (`gate_hooks.selection_router`) are refused."""
    sidecar = GateSidecar.load(path)
    missing = set(sidecar.layers) - set(gate_names)
    if missing:
        raise SlimWiseError(f"{path}: layers {sorted(missing)} have no MoE gate in this model: write the "
                            "gates file for this checkpoint's plan")
    hooked = []
    for layer, name in sorted(gate_names.items()):
        if layer not in sidecar.layers:
            continue
        if selection_router(model, name) is not None:
            raise SlimWiseError(f"{name}: a grouped router cannot decode with --gates {sidecar.gates} on a "
                                "pruned checkpoint; serve colocated")
        block_name = name.rsplit(".", 1)[0]
        runner = getattr(model.get_submodule(block_name), "experts", None)
        router = getattr(runner, "router", None)
        if router is None or not hasattr(router, "_compute_routing"):
            raise SlimWiseError(f"{name}: --gates {sidecar.gates} needs the layer's vLLM router "
                                "(FusedMoE.router), which this model does not have")
        gate = model.get_submodule(name)
        route = _full_route(gate, sidecar.layers[layer], sidecar.num_experts, router._compute_routing, name)
        _install_gate(gate, route, sidecar.layers[layer].kept, sidecar.num_experts)
        _install_router(router)
        if sidecar.gates == "substitute":
            _install_substitution(model.get_submodule(block_name), gate, route, sidecar.layers[layer],
                                  sidecar.num_experts)
        hooked.append(name)
    logger.info("SlimWise: pruned checkpoint decoding with gates %s from %s on %d MoE layers",
                sidecar.gates, path, len(hooked))
    return hooked


def _full_route(gate: nn.Module, lg: LayerGates, num_experts: int, stock, name: str):
    """(hidden, kept-expert logits) -> (weights, full-model ids, slot_pruned): the full router's routing."""
    kept = lg.kept.numel()
    if gate.weight.shape[0] != kept:
        raise SlimWiseError(f"{name}: the gates file keeps {kept} experts in this layer, the checkpoint has "
                            f"{gate.weight.shape[0]}: write the gates file for this checkpoint's plan")
    device, dtype = gate.weight.device, gate.weight.dtype
    gate.register_buffer("slimwise_rows", lg.rows.to(device, dtype), persistent=False)
    gate.register_buffer("slimwise_rows_bias", None if lg.bias is None else lg.bias.to(device, dtype),
                         persistent=False)
    gate.register_buffer("slimwise_kept", lg.kept.to(device), persistent=False)
    gate.register_buffer("slimwise_pruned_ids", lg.pruned.to(device), persistent=False)
    is_pruned = torch.zeros(num_experts, dtype=torch.bool)
    is_pruned[lg.pruned] = True
    gate.register_buffer("slimwise_is_pruned", is_pruned.to(device), persistent=False)

    def route(hidden: torch.Tensor, logits: torch.Tensor):
        extra = F.linear(hidden, gate.slimwise_rows, gate.slimwise_rows_bias).to(logits.dtype)
        full = logits.new_empty(logits.shape[0], num_experts)
        full.index_copy_(1, gate.slimwise_kept, logits)
        full.index_copy_(1, gate.slimwise_pruned_ids, extra)
        weights, ids = stock(hidden, full, None)
        return weights, ids, gate.slimwise_is_pruned[ids.long()]

    return route


def _install_gate(gate: nn.Module, route, kept: torch.Tensor, num_experts: int) -> None:
    """The gate's output becomes each row's final routing, encoded in its kept columns."""
    first = int(kept[0])  # the full model's id of the checkpoint's expert 0: a row with no kept slot's filler

    def hook(module, args, output):
        logits = first_output(output)
        weights, ids, slot_pruned = route(args[0], logits)
        placeholder = torch.full_like(ids[:, 0], first)
        encoded = encode_prerouted(weights, ids, slot_pruned, placeholder, num_experts, logits.dtype)
        out = encoded.index_select(1, module.slimwise_kept)
        return with_first_output(output, out)

    gate.register_forward_hook(hook)


def _install_router(router) -> None:
    """Every row arrives pre-routed (a kept set as small as top-k can leave no -inf to mark it)."""
    top_k = router.top_k

    def compute_routing(hidden_states, router_logits, indices_type, *, input_ids=None):
        return decode_prerouted(router_logits, top_k)

    router._compute_routing = compute_routing


def _install_substitution(block: nn.Module, gate: nn.Module, route, lg: LayerGates, num_experts: int) -> None:
    """`substitute`: the block output gains sum over pruned slots of weight x vector, the routing recomputed
    from the block's input (`gate_hooks.install_substitution`, the colocated hook)."""
    table = torch.zeros(num_experts, lg.vectors.shape[-1], dtype=torch.float32)
    table[lg.pruned] = lg.vectors.float()
    install_substitution(block, gate, table, route)
