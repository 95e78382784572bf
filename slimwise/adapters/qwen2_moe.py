"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): routed experts beside a shared expert with a sigmoid gate.

The shared expert and its gate are dense parts of the block: never scored, never pruned.
"""

from slimwise.adapters.base import MoEAdapter
from slimwise.adapters.registry import register_adapter


@register_adapter
class Qwen2MoeAdapter(MoEAdapter):
    family = "qwen2_moe"
    model_types = ("qwen2_moe",)
    expert_count_fields = ("num_experts",)
    shared_attrs = ("shared_expert", "shared_expert_gate")
