"""Mixtral (Mixtral-8x7B, 8x22B): softmax top-k router that always renormalises, computed in float32.

Config: `num_local_experts` (transformers maps `num_experts` onto it; vLLM reads `num_local_experts`).
The block is `layer.mlp` (`MixtralSparseMoeBlock`: `gate` router + fused `experts`), no shared expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slimwise.adapters.base import MoEAdapter
from slimwise.adapters.registry import register_adapter


@register_adapter
class MixtralAdapter(MoEAdapter):
    family = "mixtral"
    model_types = ("mixtral",)
    expert_count_fields = ("num_local_experts", "num_experts")

    def route(self, router: nn.Module, hidden: torch.Tensor, pruned: torch.Tensor):
        """`MixtralTopKRouter.forward` with pruned logits at -inf: softmax of the float32 logits, top-k,
        always renormalised; the weights stay float32 (the stock router does not cast them back)."""
        hidden = hidden.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden, router.weight)
        probs = F.softmax(logits.masked_fill(pruned, float("-inf")).float(), dim=-1)
        top_value, top_index = torch.topk(probs, router.top_k, dim=-1)
        top_value /= top_value.sum(dim=-1, keepdim=True)
        return logits, top_value, top_index
