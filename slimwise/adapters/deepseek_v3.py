"""DeepSeek-V3 / R1 (and Kimi-K2, same architecture): sigmoid router with selection bias and group-limited
top-k.

`DeepseekV3TopkRouter` (the block's `gate`):
  scores = sigmoid(logits) in float32; scores_for_choice = scores + e_score_correction_bias (selection only);
  group score = sum of the top-2 scores_for_choice of each of the `n_group` contiguous groups; keep the best
  `topk_group` groups (others -> -inf); top-k over what is left; weights = scores (no bias) at those experts,
  renormalised when `norm_topk_prob`, times `routed_scaling_factor`.

Masking the logits is not enough: sigmoid(-inf) = 0, but the correction bias can still lift a pruned expert
into the top-k (and into the group scores). `route` therefore sets the pruned experts' scores_for_choice to
-inf before the group scores (a group is then scored on its kept experts only, exactly like the sliced
model's group) and again after the group mask, so neither the group stage nor the final top-k can pick them.

Groups: a sliced checkpoint keeps `n_group` and splits its E' experts into n_group contiguous groups of
E'/n_group, so a plan must keep the same number of experts in every group (renumbering keeps kept experts
in order, so sliced group g is exactly original group g's kept experts) -> `num_groups` = n_group.
At least 2 per group: the group score is the sum of the top-2 (topk(2) fails on a 1-expert group of the
sliced model and is -inf in the masked one); and at least ceil(top_k / topk_group) so that the
`topk_group` chosen groups always hold top_k kept experts -- otherwise the final top-k would fill up with
-inf entries, which may be pruned experts. Hence `min_kept_per_group` = max(2, ceil(top_k / topk_group)).

Layers below `first_k_dense_replace` are dense `DeepseekV3MLP`s (no `gate`), not MoE layers. The shared
experts (`shared_experts`) are never pruned. Count fields: `n_routed_experts` (vLLM, transformers) and
`num_local_experts` (transformers attribute map onto `n_routed_experts`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from slimwise.adapters.base import MoEAdapter, MoELayer
from slimwise.adapters.registry import register_adapter


def grouped_topk_ids(choice: torch.Tensor, pruned: torch.Tensor, groups: int, topk_group: int, top_k: int,
                     group_score: str = "top2") -> torch.Tensor:
    """Top-`top_k` expert ids per row of the selection scores `choice` [N, E], limited to the best
    `topk_group` of `groups` contiguous groups, with `pruned` ([E] or [N, E]) unselectable: set to -inf before
    the group scores and again after the group mask (see the module docstring). Group score: sum of the top-2
    (`top2`, biased sigmoid routers) or the max (`max`, DeepSeek-V2-style softmax routers). The reference
    engine (`DeepseekV3Adapter.route`) and the vLLM plugin (`serving.gate_hooks.masked_grouped_topk`) both
    select here."""
    n, experts = choice.shape
    choice = choice.masked_fill(pruned, float("-inf"))
    if groups > 1:
        grouped = choice.view(n, groups, experts // groups)
        scores = (
            grouped.topk(2, dim=-1)[0].sum(dim=-1) if group_score == "top2" else grouped.max(dim=-1).values
        )
        group_idx = torch.topk(scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(n, groups, experts // groups).reshape(n, experts)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        choice = choice.masked_fill(pruned, float("-inf"))  # again after the group mask: never a pruned one
    return torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]


@register_adapter
class DeepseekV3Adapter(MoEAdapter):
    family = "deepseek_v3"
    model_types = ("deepseek_v3",)
    expert_count_fields = ("n_routed_experts", "num_local_experts")
    shared_attrs = ("shared_experts",)

    def num_groups(self, config) -> int:
        return int(getattr(self.text_config(config), "n_group", None) or 1)

    def min_kept_per_group(self, config) -> int:
        cfg = self.text_config(config)
        topk_group = int(getattr(cfg, "topk_group", None) or self.num_groups(config))
        return max(2, math.ceil(self.top_k(config) / topk_group))

    def moe_layers(self, model: nn.Module) -> list[MoELayer]:
        first_sparse = int(getattr(self.text_config(model.config), "first_k_dense_replace", 0) or 0)
        return [layer for layer in super().moe_layers(model) if layer.index >= first_sparse]

    def route(self, router: nn.Module, hidden: torch.Tensor, pruned: torch.Tensor):
        """`DeepseekV3TopkRouter.forward` with pruned experts unselectable (see the module docstring)."""
        groups = router.num_group
        hidden = hidden.view(-1, router.hidden_dim)
        logits = F.linear(hidden.type(torch.float32), router.weight.type(torch.float32))
        scores = logits.sigmoid()
        top_index = grouped_topk_ids(
            scores + router.e_score_correction_bias, pruned, groups, router.topk_group, router.top_k
        )
        top_weight = scores.gather(1, top_index)
        if router.norm_topk_prob:
            denominator = top_weight.sum(dim=-1, keepdim=True) + 1e-20
            top_weight /= denominator
        top_weight = top_weight * router.routed_scaling_factor
        return logits, top_weight, top_index
