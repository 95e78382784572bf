"""Expert parallelism and plans: which experts each EP rank holds, how unevenly a plan leaves them, and plans
that keep the same number of experts in every rank's block.

Under EP, vLLM places the global experts on ranks (`determine_expert_map`: "linear" contiguous blocks, or
"round_robin"); every rank computes the router's logits over all global experts, so SlimWise's decode mask (on
the logits, in global ids) needs no mapping. What EP changes is speed: a decode step waits for the rank whose
block keeps the most experts, so a plan keeping 20 experts on one rank and 12 on another runs at the 20-expert
rank's pace. `balanced_plan` keeps the same count in every block.
"""

from __future__ import annotations

import math

import torch

from slimwise.argtypes import option_count, option_value
from slimwise.errors import SlimWiseError
from slimwise.plan import PrunePlan, make_plan

PLACEMENTS = ("linear", "round_robin")  # vLLM's expert placement strategies


def rank_experts(num_experts: int, ep_size: int, placement: str = "linear") -> list[list[int]]:
    """Global expert ids held by each EP rank, as vLLM's `determine_expert_map` places them (the remainder of
    an uneven split goes to the first ranks)."""
    if ep_size < 1:
        raise SlimWiseError(f"EP size must be >= 1, got {ep_size}")
    if placement not in PLACEMENTS:
        raise SlimWiseError(f"unknown expert placement {placement!r}; vLLM has {', '.join(PLACEMENTS)}")
    base, rem = divmod(num_experts, ep_size)
    out = []
    for r in range(ep_size):
        n = base + (1 if r < rem else 0)
        if placement == "linear":
            start = r * base + min(r, rem)
            out.append(list(range(start, start + n)))
        else:
            out.append(list(range(r, num_experts, ep_size)))
    return out


def kept_per_rank(plan: PrunePlan, ep_size: int, placement: str = "linear") -> dict[int, list[int]]:
    """Per MoE layer, how many of the plan's kept experts each EP rank holds."""
    ranks = rank_experts(plan.num_experts, ep_size, placement)
    return {
        layer: [len(set(kept) & set(r)) for r in ranks] for layer, kept in sorted(plan.kept_experts.items())
    }


def imbalance(plan: PrunePlan, ep_size: int, placement: str = "linear") -> dict[str, float]:
    """Busiest rank's kept experts over the mean, per layer: its mean and maximum over layers (1.0 =
    balanced). A decode step's expert time follows the busiest rank of each layer."""
    ratios = [max(c) / (sum(c) / len(c)) for c in kept_per_rank(plan, ep_size, placement).values() if sum(c)]
    return {"mean": sum(ratios) / len(ratios), "max": max(ratios), "ep_size": ep_size, "placement": placement}


def balanced_plan(
    scores: torch.Tensor,
    layers: list[int],
    ratio: float,
    ep_size: int,
    placement: str = "linear",
    *,
    num_groups: int = 1,
    allowed: torch.Tensor | None = None,
    **plan_kwargs,
) -> PrunePlan:
    """`make_plan` with the same number of experts kept in every EP rank's block: the highest-scoring experts
    of each block. Needs experts divisible by the EP size (equal blocks); with routing groups (DeepSeek),
    linear placement and blocks that nest with the groups. The plan records `ep_size` and `ep_placement` in
    its meta."""
    n = scores.shape[1]
    if ep_size < 2:
        raise SlimWiseError(f"an EP-balanced plan needs an EP size of at least 2, got {ep_size}")
    if n % ep_size:
        raise SlimWiseError(
            f"{n} experts do not split evenly over EP size {ep_size}: choose a divisor of {n}"
        )
    ranks = rank_experts(n, ep_size, placement)
    if num_groups > 1 and placement != "linear":
        raise SlimWiseError(
            "routing groups with round_robin placement cut every group across ranks: balance with "
            "linear placement"
        )
    blocks = math.lcm(num_groups, ep_size)
    if n % blocks:
        raise SlimWiseError(f"{num_groups} routing groups and EP size {ep_size} do not nest over {n} experts")
    perm = [e for r in ranks for e in r]
    plan = make_plan(scores[:, perm], layers, ratio, num_groups=blocks,
                     allowed=None if allowed is None else allowed[:, perm], **plan_kwargs)
    kept = {layer: sorted(perm[i] for i in ids) for layer, ids in plan.kept_experts.items()}
    meta = {**plan.meta, "ep_size": ep_size, "ep_placement": placement}
    out = PrunePlan(family=plan.family, num_experts=n, top_k=plan.top_k, kept_experts=kept,
                    criterion=plan.criterion, ratio=plan.ratio, phase=plan.phase, scope=plan.scope,
                    num_groups=num_groups, fingerprint=plan.fingerprint, meta=meta)
    out.validate(plan_kwargs.get("min_kept_per_group", 1))
    return out


def served_ep_size(vllm_args: list[str]) -> int:
    """The EP size a vLLM command line serves with: tensor x data parallel with --enable-expert-parallel, else
    1."""
    if "--enable-expert-parallel" not in vllm_args and "-ep" not in vllm_args:
        return 1
    return option_count(vllm_args, "--tensor-parallel-size", "-tp") * option_count(
        vllm_args, "--data-parallel-size", "-dp"
    )


def ep_mismatch(plan: PrunePlan, vllm_args: list[str]) -> str | None:
    """A warning when a plan balanced for one EP size (or placement) is served with another; None when they
    agree or the plan is not EP-balanced."""
    want = plan.meta.get("ep_size")
    if not want:
        return None
    have = served_ep_size(vllm_args)
    placement = option_value(vllm_args, "--expert-placement-strategy") or "linear"
    if have == want and placement == plan.meta.get("ep_placement", "linear"):
        return None
    return (
        f"the plan keeps equal experts per rank for EP size {want} "
        f"({plan.meta.get('ep_placement', 'linear')} placement) but is served with EP size {have} "
        f"({placement}): ranks may keep unequal expert counts (make the plan with "
        f"`slimwise plan --ep-size {have}`)"
    )
