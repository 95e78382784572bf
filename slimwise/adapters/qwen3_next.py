"""Hybrid Qwen MoE: Qwen3-Next (Qwen3-Next-80B-A3B) and Qwen3.5/3.6-MoE (Qwen3.5-35B-A3B, Qwen3.6-35B-A3B).

Decoder layers mix Gated DeltaNet linear attention (`linear_attn`, conv + recurrent state per layer in the
cache) with full attention (`self_attn`), per `config.layer_types`. Pruning only touches the MoE block
`layer.mlp`: `gate` (softmax top-k router) + fused `experts`, beside a `shared_expert` with a sigmoid
`shared_expert_gate` (dense: never scored, never pruned). The cache is a plain `DynamicCache` whose
linear-attention layers hold the conv/recurrent states, so a full-model prefill can hand it to a pruned model.

Qwen3-Next: count `num_experts`, `norm_topk_prob` (True), MoE on layers not in `mlp_only_layers` with
(i + 1) % decoder_sparse_step == 0 (others are dense `Qwen3NextMLP`, which have no `gate`).

Qwen3.5-MoE: checkpoints are multimodal (`model_type` "qwen3_5_moe") with the MoE fields in `text_config`
("qwen3_5_moe_text"). AutoModelForCausalLM builds the text-only `Qwen3_5MoeForCausalLM` from either config
(model.config is then the text config, layers at `model.layers`); `Qwen3_5MoeForConditionalGeneration`
keeps them at `model.language_model.layers`. Its router has no `norm_topk_prob` attribute and always
renormalises the top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slimwise.adapters.base import MoEAdapter
from slimwise.adapters.registry import register_adapter
from slimwise.errors import SlimWiseError


@register_adapter
class Qwen3NextAdapter(MoEAdapter):
    family = "qwen3_next"
    model_types = ("qwen3_next",)
    expert_count_fields = ("num_experts",)
    shared_attrs = ("shared_expert", "shared_expert_gate")


@register_adapter
class Qwen3_5MoeAdapter(MoEAdapter):
    family = "qwen3_5_moe"
    model_types = ("qwen3_5_moe", "qwen3_5_moe_text")
    expert_count_fields = ("num_experts",)
    shared_attrs = ("shared_expert", "shared_expert_gate")

    def text_config(self, config):
        sub = getattr(config, "text_config", None)
        return sub if sub is not None else config

    def config_dict_fixups(self, config_dict: dict, n: int) -> dict:
        target = config_dict.get("text_config")
        super().config_dict_fixups(target if isinstance(target, dict) else config_dict, n)
        return config_dict

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        inner = getattr(model, "model", model)
        # Qwen3_5MoeForConditionalGeneration / Qwen3_5MoeModel
        inner = getattr(inner, "language_model", inner)
        layers = getattr(inner, "layers", None)
        if layers is None:
            raise SlimWiseError(f"cannot find decoder layers in {type(model).__name__}")
        return layers

    def route(self, router: nn.Module, hidden: torch.Tensor, pruned: torch.Tensor):
        """`Qwen3_5MoeTopKRouter.forward` (always renormalised) with pruned logits at -inf."""
        hidden = hidden.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden, router.weight)
        probs = F.softmax(logits.masked_fill(pruned, float("-inf")), dtype=torch.float, dim=-1)
        top_value, top_index = torch.topk(probs, router.top_k, dim=-1)
        top_value /= top_value.sum(dim=-1, keepdim=True)
        return logits, top_value.to(logits.dtype), top_index
