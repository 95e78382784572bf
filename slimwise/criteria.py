"""Expert-importance criteria computed from saved calibration statistics (no model needed).

Each criterion maps `ExpertStats` to scores [layers, experts]; higher = more important; experts that never
fired score 0. A new criterion is one decorated function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from slimwise.errors import SlimWiseError
from slimwise.plan import PrunePlan, make_plan
from slimwise.stats import ExpertStats

Criterion = Callable[[ExpertStats], torch.Tensor]
CRITERIA: dict[str, Criterion] = {}


def register_criterion(name: str) -> Callable[[Criterion], Criterion]:
    """Register a criterion under `name`; a name already taken is refused (no silent replacement)."""

    def deco(fn: Criterion) -> Criterion:
        if name in CRITERIA and CRITERIA[name] is not fn:
            raise SlimWiseError(
                f"criterion {name!r} is already registered ({CRITERIA[name].__name__}); choose another name"
            )
        CRITERIA[name] = fn
        return fn

    return deco


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(num))


@register_criterion("frequency")
def frequency(stats: ExpertStats) -> torch.Tensor:
    """F_j: how many tokens selected expert j."""
    return stats.count.clone()


@register_criterion("soft")
def soft(stats: ExpertStats) -> torch.Tensor:
    """W_j: sum of gate weights over tokens routed to j."""
    return stats.gate_sum.clone()


@register_criterion("ean")
def ean(stats: ExpertStats) -> torch.Tensor:
    """Expert activation norm: sum of ||f_j(x)|| over tokens routed to j."""
    return stats.norm_sum.clone()


@register_criterion("reap")
def reap(stats: ExpertStats) -> torch.Tensor:
    """REAP: mean over routed tokens of gate x ||f_j(x)||."""
    return _safe_div(stats.gate_norm_sum, stats.count)


def score_experts(stats: ExpertStats, criterion: str) -> torch.Tensor:
    if criterion not in CRITERIA:
        raise SlimWiseError(f"unknown criterion {criterion!r}; choose one of {', '.join(sorted(CRITERIA))}")
    return CRITERIA[criterion](stats)


def plan_from_stats(stats: ExpertStats, criterion: str, ratio: float, scope: str = "layer", ep_size: int = 1,
                    ep_placement: str = "linear", within: PrunePlan | None = None) -> PrunePlan:
    """Score experts with `criterion` and prune `ratio` of them; the plan inherits the stats' model
    fingerprint. `ep_size` > 1: keep the same number of experts in every expert-parallel rank's block
    (`slimwise.expert_parallel`). `within`: keep only experts that plan keeps (nested plans)."""
    meta = stats.meta
    if "family" not in meta or "top_k" not in meta:
        raise SlimWiseError(
            "stats file lacks model metadata (family, top_k); recalibrate with `slimwise calibrate`"
        )
    kwargs = dict(family=meta["family"], top_k=int(meta["top_k"]), num_groups=int(meta.get("num_groups", 1)),
                  min_kept_per_group=int(meta.get("min_kept_per_group", 1)), scope=scope, criterion=criterion,
                  phase=meta.get("config", {}).get("phase"), fingerprint=meta.get("fingerprint"),
                  meta={"stats_tokens": stats.tokens.tolist(), "calibration": meta.get("config")})
    if within is not None:
        kwargs["allowed"] = torch.stack([~within.pruned_mask(layer) for layer in stats.layers])
    if ep_size > 1:
        from slimwise.expert_parallel import balanced_plan

        if scope != "layer":
            raise SlimWiseError("an EP-balanced plan prunes per layer: drop --global")
        return balanced_plan(
            score_experts(stats, criterion), stats.layers, ratio, ep_size, ep_placement, **kwargs
        )
    return make_plan(score_experts(stats, criterion), stats.layers, ratio, **kwargs)


def nested_plans(stats: ExpertStats, criterion: str, ratios: Sequence[float], **options) -> list[PrunePlan]:
    """One plan per ratio, in increasing ratio, each keeping a subset of the previous plan's experts in every
    layer (the 75% plan's kept set inside the 50% plan's inside the 25% plan's): an engine serving several of
    them reads, in a step that mixes their requests, no more experts than the lowest ratio's plan keeps.
    Plans of one stats file and criterion nest already, in every scope (one ranking cut at fewer experts;
    tests/test_plan_criteria.py): here nesting is a guarantee, and `plan_from_stats(within=)` nests plans
    of other calibrations. `options`: `plan_from_stats`'s."""
    plans: list[PrunePlan] = []
    for ratio in sorted(set(ratios)):
        plan = plan_from_stats(stats, criterion, ratio, within=plans[-1] if plans else None, **options)
        plan.meta["nested_ratios"] = sorted(set(ratios))
        plans.append(plan)
    return plans
