"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): biased linear router, top-k on logits, softmax over the top-k values.

Block `layer.mlp` (`GptOssMLP`) holds `router` (`GptOssTopKRouter`: `weight` (E, H) and `bias` (E)) and
`experts` (`GptOssExperts`): transposed fused weights `gate_up_proj` (E, H, 2I) with gate/up columns
interleaved (gate = [..., ::2], up = [..., 1::2]) plus `gate_up_proj_bias` (E, 2I), `down_proj` (E, I, H)
plus `down_proj_bias` (E, H), and a clamped SwiGLU: gate <= limit, |up| <= limit,
out = (up + 1) * gate * sigmoid(alpha * gate). The block returns (hidden, router_scores); we only wrap the
router and read the experts. Count field `num_local_experts` (transformers maps `num_experts` onto it; vLLM
reads `num_local_experts`). Every expert tensor, biases included, has the expert dim first, so the base
slicing covers them; both modules keep the count in `num_experts`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slimwise.adapters.base import MoEAdapter
from slimwise.adapters.registry import register_adapter


@register_adapter
class GptOssAdapter(MoEAdapter):
    family = "gpt_oss"
    model_types = ("gpt_oss",)
    expert_count_fields = ("num_local_experts", "num_experts")
    router_attr = "router"

    def route(self, router: nn.Module, hidden: torch.Tensor, pruned: torch.Tensor):
        """`GptOssTopKRouter.forward` with pruned logits at -inf before the top-k: the softmax runs over the
        top-k values only, so it equals the sliced router's."""
        hidden = hidden.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden, router.weight, router.bias)
        top_value, top_index = torch.topk(logits.masked_fill(pruned, float("-inf")), router.top_k, dim=-1)
        scores = F.softmax(top_value, dim=1, dtype=top_value.dtype)
        return logits, scores, top_index

    def expert_forward(self, experts: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
        return experts._apply_gate(gate_up) @ experts.down_proj[e] + experts.down_proj_bias[e]
