"""OLMoE (OLMoE-1B-7B): softmax top-k router, `norm_topk_prob` (False in the released checkpoints), no shared
expert.

Config: `num_experts` (transformers maps `num_local_experts` onto it; vLLM reads `num_experts`). The expert
width is `intermediate_size`. The stock router is exactly the base `route` (softmax in float32, optional
renormalisation, weights cast back to the logits' dtype), so only the fields differ.
"""

from slimwise.adapters.base import MoEAdapter
from slimwise.adapters.registry import register_adapter


@register_adapter
class OlmoeAdapter(MoEAdapter):
    family = "olmoe"
    model_types = ("olmoe",)
    expert_count_fields = ("num_experts", "num_local_experts")
