"""The family adapter contract: the only place that knows where a model keeps its MoE parts.

Everything else in SlimWise (calibration, criteria, plans, masking, export, generation) talks to a model
through `MoEAdapter`. The default implementation fits the transformers v5 "fused 3-D experts + bare-weight
top-k router" layout shared by Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE and Qwen3-Next; families that differ
override the few methods concerned in their own file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from slimwise.errors import SlimWiseError


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [S, in] (rows sorted by group) @ weight [G, in, out] per group, groups ending at `offsets` (int32,
    cumulative): torch's grouped matmul where this torch has one for this device and dtype, else one mm per
    group (one host sync for the offsets)."""
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    x = x.to(weight.dtype)
    if fn is not None:
        try:
            return fn(x, weight, offs=offsets)
        except (RuntimeError, NotImplementedError):
            pass  # no kernel for this dtype / device in this torch
    out = torch.zeros(x.shape[0], weight.shape[-1], dtype=x.dtype, device=x.device)
    start = 0
    for g, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(x[start:end], weight[g], out=out[start:end])
        start = end
    return out


@dataclass(frozen=True)
class MoELayer:
    """One sparse MoE block of a model, addressed by its decoder-layer index."""

    index: int
    block: nn.Module
    router: nn.Module
    experts: nn.Module


class MoEAdapter:
    """Family-specific knowledge. Subclasses set the class variables and override what differs."""

    family: ClassVar[str] = ""
    model_types: ClassVar[tuple[str, ...]] = ()
    #: config fields that hold the routed-expert count; all are written on export.
    expert_count_fields: ClassVar[tuple[str, ...]] = ("num_experts",)
    top_k_field: ClassVar[str] = "num_experts_per_tok"
    block_attr: ClassVar[str] = "mlp"
    router_attr: ClassVar[str] = "gate"
    experts_attr: ClassVar[str] = "experts"
    #: modules inside the MoE block that are never pruned (shared experts and their gates).
    shared_attrs: ClassVar[tuple[str, ...]] = ()

    # ----- configuration -------------------------------------------------------------------------------
    def text_config(self, config):
        """The config that holds the MoE fields (multimodal wrappers nest it)."""
        return config

    def num_experts(self, config) -> int:
        cfg = self.text_config(config)
        for name in self.expert_count_fields:
            value = getattr(cfg, name, None)
            if value:
                return int(value)
        raise SlimWiseError(f"config of family {self.family} has none of {self.expert_count_fields}")

    def top_k(self, config) -> int:
        return int(getattr(self.text_config(config), self.top_k_field))

    def num_groups(self, config) -> int:
        """Expert groups for group-limited routing (DeepSeek); 1 means no groups."""
        return 1

    def min_kept_per_group(self, config) -> int:
        return 1

    def set_num_experts(self, config, n: int) -> None:
        """Write the new expert count into every field the family's loaders (transformers, vLLM) read."""
        cfg = self.text_config(config)
        for name in self.expert_count_fields:
            setattr(cfg, name, n)

    def config_dict_fixups(self, config_dict: dict, n: int) -> dict:
        """Patch a saved config.json so every reader sees n experts (some keys hide behind attribute maps)."""
        for name in self.expert_count_fields:
            config_dict[name] = n
        return config_dict

    # ----- locating the MoE blocks ---------------------------------------------------------------------
    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        inner = getattr(model, "model", model)
        layers = getattr(inner, "layers", None)
        if layers is None:
            raise SlimWiseError(f"cannot find decoder layers in {type(model).__name__}")
        return layers

    def moe_layers(self, model: nn.Module) -> list[MoELayer]:
        out = []
        for i, layer in enumerate(self.decoder_layers(model)):
            block = getattr(layer, self.block_attr, None)
            router = getattr(block, self.router_attr, None) if block is not None else None
            experts = getattr(block, self.experts_attr, None) if block is not None else None
            if router is not None and experts is not None and hasattr(router, "weight"):
                out.append(MoELayer(i, block, router, experts))
        return out

    # ----- routing -------------------------------------------------------------------------------------
    def route(self, router: nn.Module, hidden: torch.Tensor, pruned: torch.Tensor):
        """The router's forward with `pruned` experts (bool, [E]) made unselectable.

        Default: softmax over logits then top-k (optionally renormalised). Setting the pruned logits to
        -inf before the softmax gives exactly the probabilities of a router whose rows were sliced away.
        """
        hidden = hidden.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden, router.weight)
        masked = logits.masked_fill(pruned, float("-inf"))
        probs = F.softmax(masked, dtype=torch.float, dim=-1)
        top_value, top_index = torch.topk(probs, router.top_k, dim=-1)
        if getattr(router, "norm_topk_prob", False):
            top_value /= top_value.sum(dim=-1, keepdim=True)
        return logits, top_value.to(logits.dtype), top_index

    # ----- experts -------------------------------------------------------------------------------------
    def expert_forward(self, experts: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's un-gated output f_e(x) for the rows of x (tokens routed to it)."""
        gate, up = F.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(experts.act_fn(gate) * up, experts.down_proj[e])

    def grouped_expert_outputs(self, experts: nn.Module, x: torch.Tensor,
                               counts: torch.Tensor) -> torch.Tensor:
        """f_e(x) for rows sorted by expert, `counts[e]` rows of expert e in turn: one grouped matmul per
        projection, as transformers' default ("grouped_mm") experts forward computes them, so an observer that
        returns these outputs changes nothing the model computes (bit-identical to `expert_forward` per expert
        on the CPU too). Rows past the last group are left undefined. Families whose experts differ from the
        fused gate/up + down layout run `expert_forward` per hit expert instead (one host sync)."""
        fused = (type(self).expert_forward is MoEAdapter.expert_forward
                 and not getattr(experts, "is_transposed", False))
        if fused and getattr(experts, "gate_up_proj", None) is not None and experts.gate_up_proj.dim() == 3:
            offsets = counts.cumsum(0).to(torch.int32)
            gate, up = grouped_mm(x, experts.gate_up_proj.transpose(-2, -1), offsets).chunk(2, dim=-1)
            return grouped_mm(experts.act_fn(gate) * up, experts.down_proj.transpose(-2, -1), offsets)
        y = torch.empty(x.shape[0], x.shape[-1], dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                y[start:start + n] = self.expert_forward(experts, e, x[start:start + n])
                start += n
        return y

    def expert_param_names(self, experts: nn.Module) -> list[str]:
        """Per-expert tensors (leading dim E) of the fused experts module."""
        n = experts.num_experts
        return [name for name, p in experts.named_parameters(recurse=False) if p.shape[0] == n]

    def expert_bytes(self, experts: nn.Module) -> int:
        """Bytes of one routed expert's weights (what a decode step reads per touched expert)."""
        n = experts.num_experts
        return sum(p.numel() * p.element_size() for p in experts.parameters(recurse=False)) // n

    # ----- slicing (export) ----------------------------------------------------------------------------
    def slice_layer(self, layer: MoELayer, keep: torch.Tensor) -> None:
        """Keep only experts `keep` (original ids, ascending) in place, renumbered 0..N'-1."""
        keep = keep.to(torch.long)
        for module in (layer.experts, layer.router):
            n = module.num_experts
            for name, p in list(module.named_parameters(recurse=False)):
                if p.shape[0] == n:
                    setattr(module, name, nn.Parameter(p.data.index_select(0, keep).clone(), p.requires_grad))
            for name, b in list(module.named_buffers(recurse=False)):
                if b is not None and b.dim() > 0 and b.shape[0] == n:
                    module.register_buffer(name, b.index_select(0, keep).clone())
            module.num_experts = int(keep.numel())
