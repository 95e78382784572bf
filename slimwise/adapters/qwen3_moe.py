"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): softmax top-k router with `norm_topk_prob`, no shared
expert."""

from slimwise.adapters.base import MoEAdapter
from slimwise.adapters.registry import register_adapter


@register_adapter
class Qwen3MoeAdapter(MoEAdapter):
    family = "qwen3_moe"
    model_types = ("qwen3_moe",)
    # transformers >= 5 stores the count as num_local_experts behind an attribute map; vLLM reads num_experts.
    expert_count_fields = ("num_experts", "num_local_experts")
