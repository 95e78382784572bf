"""Per-layer kept-expert budgets from measured sensitivity (`slimwise plan --budget sensitivity`).

One ratio for every layer spends the same number of kept experts where pruning hurts and where it does not.
Here the budget of the per-layer plan (the same total number of kept experts) is spread by each layer's
measured damage on calibration decode tokens:

1. `capture_decode_inputs`: the full model generates from the calibration prompts; each MoE block's input is
   kept for the generated tokens fed back (decode rows only, up to `max_tokens` per layer).
2. `layer_errors`: for each layer alone and each kept count n on a grid, the block's output with only the
   criterion's top-n experts routable (the plain masked routing) against the full block's, as a relative
   squared error sum ||y_n - y||^2 / sum ||y||^2 over the captured tokens.
3. `allocate`: starting every layer at top-k, one expert at a time to the layer whose interpolated error falls
   most, until the budget is spent (marginal gains of a convex-ish curve: greedy is what DiEP/EEP-style
   allocations do).
Which experts a layer keeps is still the criterion's ranking; only how many changes. Plans whose layers keep
different counts are served by masking (colocated) and refused by `prune`, as `--global` plans are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from slimwise.adapters import get_adapter
from slimwise.criteria import score_experts
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.errors import SlimWiseError
from slimwise.hooks import ForwardWrappers, first_output
from slimwise.masking import ExpertMask
from slimwise.plan import PrunePlan, keep_count
from slimwise.stats import ExpertStats

GRID_POINTS = 16  # kept counts measured per layer (the rest interpolated)


class _DecodeRows:
    """A StepObserver that remembers which rows of the next forward are generated tokens fed back."""

    def __init__(self):
        self.rows: torch.Tensor | None = None

    def before_forward(self, phase: str, rows: torch.Tensor) -> None:
        self.rows = rows if phase == "decode" else None


@torch.inference_mode()
def capture_decode_inputs(model: nn.Module, prompts: Sequence, tokenizer=None, max_new_tokens: int = 64,
                          batch_size: int = 16, max_tokens: int = 4096) -> dict[int, torch.Tensor]:
    """Per MoE layer, the block inputs of up to `max_tokens` decode tokens of a full-model generation."""
    adapter = get_adapter(model.config)
    observer = _DecodeRows()
    captured: dict[int, list[torch.Tensor]] = {}
    hooks = ForwardWrappers("budget capture")

    def capture(index: int):
        def hook(module, args, output):
            rows = observer.rows
            if rows is None or sum(x.shape[0] for x in captured.get(index, [])) >= max_tokens:
                return
            hidden = args[0].reshape(-1, args[0].shape[-1])
            if rows.numel() == hidden.shape[0]:
                captured.setdefault(index, []).append(hidden[rows.to(hidden.device)].float().cpu())

        return hook

    for layer in adapter.moe_layers(model):
        hooks.hook(layer.block, capture(layer.index))
    try:
        PhaseSplitEngine(model, tokenizer).generate(
            list(prompts), "full", GenerationConfig(max_new_tokens=max_new_tokens, batch_size=batch_size),
            observer=observer)
    finally:
        hooks.remove()
    if not captured:
        raise SlimWiseError("the calibration prompts produced no decode tokens: give longer generations")
    return {index: torch.cat(parts)[:max_tokens] for index, parts in captured.items()}


def grid(num_experts: int, top_k: int, points: int = GRID_POINTS) -> list[int]:
    """Kept counts measured per layer: top-k to every expert, `points` of them (ends included)."""
    counts = {round(top_k + (num_experts - top_k) * i / (points - 1)) for i in range(points)}
    return sorted(c for c in counts if top_k <= c <= num_experts)


@torch.inference_mode()
def layer_errors(model: nn.Module, stats: ExpertStats, criterion: str, inputs: dict[int, torch.Tensor],
                 counts: Sequence[int]) -> dict[int, list[float]]:
    """Per layer, the relative squared output error of its MoE block keeping each count of its top experts
    (by `criterion` on `stats`), the other layers untouched."""
    adapter = get_adapter(model.config)
    scores = score_experts(stats, criterion)
    dtype = next(model.parameters()).dtype
    blocks = {layer.index: layer.block for layer in adapter.moe_layers(model)}
    out: dict[int, list[float]] = {}
    for index, x in inputs.items():
        block, row = blocks[index], stats.row(index)
        order = torch.sort(-scores[row].double(), stable=True).indices
        x = x.to(next(block.parameters()).device, dtype).unsqueeze(0)
        full = first_output(block(x)).float()
        errors = []
        for n in counts:
            if n >= stats.num_experts:
                errors.append(0.0)
                continue
            plan = _one_layer_plan(stats, index, sorted(order[:n].tolist()))
            with ExpertMask(model, plan) as mask, mask.pruned():
                y = first_output(block(x)).float()
            errors.append(float(((y - full).double().pow(2).sum() / full.double().pow(2).sum().clamp_min(
                1e-30)).item()))
        out[index] = errors
    return out


def allocate(errors: dict[int, list[float]], counts: Sequence[int], budget: int,
             top_k: int) -> dict[int, int]:
    """Kept experts per layer summing to `budget`: every layer starts at top-k, then each further expert goes
    to the layer whose error (linear between the measured counts) falls most."""
    layers = sorted(errors)
    if budget < top_k * len(layers):
        raise SlimWiseError(f"a budget of {budget} kept experts cannot give {len(layers)} layers "
                            f"top-k {top_k} each")
    kept = dict.fromkeys(layers, top_k)
    maximum = counts[-1]

    def err(layer: int, n: int) -> float:
        e = errors[layer]
        for i in range(len(counts) - 1):
            if counts[i] <= n <= counts[i + 1]:
                span = counts[i + 1] - counts[i]
                return e[i] + (e[i + 1] - e[i]) * (n - counts[i]) / span if span else e[i]
        return e[-1]

    for _ in range(budget - sum(kept.values())):
        best = max((layer for layer in layers if kept[layer] < maximum),
                   key=lambda layer: (err(layer, kept[layer]) - err(layer, kept[layer] + 1), -layer),
                   default=None)
        if best is None:
            break
        kept[best] += 1
    return kept


def sensitivity_plan(stats: ExpertStats, criterion: str, ratio: float, errors: dict[int, list[float]],
                     counts: Sequence[int]) -> PrunePlan:
    """The per-layer plan's total of kept experts at `ratio`, spread by `allocate`; each layer keeps its
    criterion's top experts. The errors travel in the plan's meta."""
    meta = stats.meta
    if int(meta.get("num_groups", 1)) > 1:
        raise SlimWiseError("--budget sensitivity spreads counts per layer, which grouped routing (DeepSeek "
                            "groups) cannot take: use the per-layer or --global scope")
    top_k = int(meta["top_k"])
    budget = len(stats.layers) * keep_count(stats.num_experts, ratio)
    kept_counts = allocate(errors, counts, budget, top_k)
    scores = score_experts(stats, criterion)
    kept = {layer: sorted(torch.sort(-scores[stats.row(layer)].double(), stable=True).indices[:n].tolist())
            for layer, n in kept_counts.items()}
    plan = PrunePlan(family=meta["family"], num_experts=stats.num_experts, top_k=top_k, kept_experts=kept,
                     criterion=criterion, ratio=ratio, phase=meta.get("config", {}).get("phase"),
                     scope="sensitivity", fingerprint=meta.get("fingerprint"),
                     meta={"stats_tokens": stats.tokens.tolist(), "calibration": meta.get("config"),
                           "budget": {"counts": list(counts),
                                      "errors": {str(k): v for k, v in errors.items()},
                                      "kept": {str(k): v for k, v in kept_counts.items()}}})
    plan.validate(int(meta.get("min_kept_per_group", 1)))
    return plan


def _one_layer_plan(stats: ExpertStats, layer: int, kept: list[int]) -> PrunePlan:
    meta = stats.meta
    everything = list(range(stats.num_experts))
    return PrunePlan(family=meta["family"], num_experts=stats.num_experts, top_k=int(meta["top_k"]),
                     kept_experts={i: kept if i == layer else everything for i in stats.layers},
                     fingerprint=meta.get("fingerprint"))


__all__ = ["allocate", "capture_decode_inputs", "grid", "layer_errors", "sensitivity_plan"]

