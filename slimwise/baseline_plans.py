"""Plans that do not come from calibration statistics: a seeded random subset, or given usage shares.

The benchmarks use them (decode speed depends on how many experts are kept, not which, so no calibration is
needed). Both need the model itself, for its layers and fingerprint; the criteria in `criteria.py` need only
the saved statistics.
"""

from __future__ import annotations

import torch

from slimwise.adapters import get_adapter
from slimwise.fingerprint import model_fingerprint
from slimwise.plan import PrunePlan, make_plan


def random_plan(model, ratio: float, seed: int) -> PrunePlan:
    """A plan keeping a seeded random subset of experts per layer (the benchmark's default: speed does not
    depend on which experts are kept, and it needs no calibration)."""
    adapter = get_adapter(model.config)
    layers = [layer.index for layer in adapter.moe_layers(model)]
    scores = torch.rand(
        len(layers), adapter.num_experts(model.config), generator=torch.Generator().manual_seed(seed)
    )
    return make_plan(scores, layers, ratio, family=adapter.family, top_k=adapter.top_k(model.config),
                     num_groups=adapter.num_groups(model.config),
                     min_kept_per_group=adapter.min_kept_per_group(model.config), criterion="random",
                     fingerprint=model_fingerprint(model), meta={"seed": seed})


def usage_share_plan(model, shares: list[torch.Tensor], ratio: float, meta: dict | None = None) -> PrunePlan:
    """Keep each layer's most used experts by given usage shares (one row per MoE layer), e.g. measured on
    another model of the same shape (the benchmark's synthetic presets)."""
    adapter = get_adapter(model.config)
    layers = [layer.index for layer in adapter.moe_layers(model)]
    return make_plan(
        torch.stack([r.to(torch.float64) for r in shares]),
        layers,
        ratio,
        family=adapter.family,
        top_k=adapter.top_k(model.config),
        criterion="usage-share",
        fingerprint=model_fingerprint(model),
        meta=meta or {},
    )
