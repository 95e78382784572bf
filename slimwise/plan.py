"""Prune plans: which original experts each MoE layer keeps, tied to the model they were made for.

A plan is a small JSON file. It is built from criterion scores (`make_plan`), validated against the
family's constraints (top-k, DeepSeek groups) and checked against a model's fingerprint before use.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from slimwise.adapters import MoEAdapter, get_adapter
from slimwise.errors import SlimWiseError
from slimwise.fingerprint import checkpoint_fingerprint, fingerprints_match, model_fingerprint
from slimwise.io import atomic_write_text

PLAN_FORMAT = "slimwise-plan/1"
Scope = Literal["layer", "global", "sensitivity"]  # sensitivity: slimwise.layer_budgets

@dataclass
class PrunePlan:
    """Kept original expert ids per MoE layer (decoder-layer index), plus how they were chosen."""

    family: str
    num_experts: int
    top_k: int
    kept_experts: dict[int, list[int]]
    criterion: str = "manual"
    ratio: float = 0.0
    phase: str | None = None
    scope: Scope = "layer"
    num_groups: int = 1
    fingerprint: dict[str, str] | None = None
    meta: dict = field(default_factory=dict)
    format: str = PLAN_FORMAT

    def __post_init__(self) -> None:
        self.kept_experts = {int(k): sorted(int(e) for e in v) for k, v in self.kept_experts.items()}

    # ----- queries -------------------------------------------------------------------------------------
    def kept(self, layer: int) -> list[int]:
        """Kept ids of a layer; a layer absent from the plan keeps every expert."""
        return self.kept_experts.get(layer, list(range(self.num_experts)))

    @property
    def is_uniform(self) -> bool:
        return len({len(v) for v in self.kept_experts.values()}) <= 1

    @property
    def num_kept(self) -> int:
        if not self.is_uniform:
            raise SlimWiseError(
                "this plan keeps a different number of experts per layer (made with --global); "
                "a stock checkpoint needs one count: serve it by masking instead of exporting"
            )
        return len(next(iter(self.kept_experts.values()))) if self.kept_experts else self.num_experts

    @property
    def is_empty(self) -> bool:
        """True when nothing is pruned (ratio 0)."""
        return all(len(v) == self.num_experts for v in self.kept_experts.values())

    def pruned_mask(self, layer: int, device=None) -> torch.Tensor:
        mask = torch.ones(self.num_experts, dtype=torch.bool, device=device)
        mask[self.kept(layer)] = False
        return mask

    # ----- validation ----------------------------------------------------------------------------------
    def validate(self, min_kept_per_group: int = 1) -> None:
        group = self.num_experts // self.num_groups
        for layer, kept in self.kept_experts.items():
            if any(e < 0 or e >= self.num_experts for e in kept) or len(set(kept)) != len(kept):
                raise SlimWiseError(
                    f"plan layer {layer}: expert ids must be distinct and in [0, {self.num_experts})"
                )
            if len(kept) < self.top_k:
                raise SlimWiseError(
                    f"plan layer {layer} keeps {len(kept)} experts, fewer than top-k={self.top_k}; "
                    "use a smaller ratio"
                )
            if self.num_groups > 1:
                per_group = [sum(1 for e in kept if e // group == g) for g in range(self.num_groups)]
                if min(per_group) < min_kept_per_group:
                    raise SlimWiseError(
                        f"plan layer {layer} keeps {per_group} experts per group; every one of the "
                        f"{self.num_groups} groups needs at least {min_kept_per_group}: use a smaller ratio"
                    )

    def check_model(
        self, model: nn.Module, adapter: MoEAdapter | None = None, check_fingerprint: bool = True
    ) -> None:
        """Refuse a plan made for another model (family, expert count, layers, fingerprint)."""
        adapter = adapter or get_adapter(model.config)
        if adapter.family != self.family or adapter.num_experts(model.config) != self.num_experts:
            raise SlimWiseError(
                f"plan is for a {self.family} model with {self.num_experts} experts, but the model is "
                f"{adapter.family} with {adapter.num_experts(model.config)}: use the plan's source model"
            )
        if adapter.top_k(model.config) != self.top_k:
            raise SlimWiseError(f"plan is for top-{self.top_k} routing but the model routes top-"
                                f"{adapter.top_k(model.config)}: use the plan's source model")
        layers = {layer.index for layer in adapter.moe_layers(model)}
        if not set(self.kept_experts) <= layers:
            raise SlimWiseError(
                f"plan names MoE layers {sorted(set(self.kept_experts) - layers)} that the model "
                "does not have: use the plan's source model"
            )
        if set(self.kept_experts) != layers:
            raise SlimWiseError(
                f"plan has no entry for MoE layers {sorted(layers - set(self.kept_experts))} of the "
                "model: a plan names every MoE layer; make it with `slimwise plan`"
            )
        if check_fingerprint and self.fingerprint is not None:
            actual = getattr(model, "_slimwise_fingerprint", None) or model_fingerprint(model)
            model._slimwise_fingerprint = actual
            if not fingerprints_match(actual, self.fingerprint):
                raise SlimWiseError(
                    f"plan fingerprint {self.fingerprint} does not match the model's {actual}: "
                    "the plan was made for other weights; recalibrate or pass the right model"
                )

    # ----- io ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["kept_experts"] = {str(k): v for k, v in self.kept_experts.items()}
        return d

    def save(self, path: str | Path) -> Path:
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: object, source: str = "plan") -> PrunePlan:
        """The one validated way in from JSON (files, vLLM overrides): types, ranges, distinct ids, no unknown
        or missing keys, then the family-independent constraints of `validate` (ids in range, >= top-k
        kept)."""
        problem = _schema_problem(d)
        if problem:
            raise SlimWiseError(
                f"{source} is not a valid SlimWise plan: {problem}; make one with `slimwise plan`"
            )
        plan = cls(**d)
        plan.validate()
        return plan

    @classmethod
    def load(cls, path: str | Path) -> PrunePlan:
        path = Path(path)
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SlimWiseError(
                f"cannot read plan {path} ({type(exc).__name__}: {str(exc).splitlines()[0]}); pass a "
                "plan JSON written by `slimwise plan`"
            ) from exc
        if not isinstance(d, dict) or d.get("format") != PLAN_FORMAT:
            raise SlimWiseError(
                f"{path} is not a SlimWise plan (format {PLAN_FORMAT}); make one with `slimwise plan`"
            )
        return cls.from_dict(d, f"plan {path}")

    @classmethod
    def full(cls, model: nn.Module) -> PrunePlan:
        """The empty plan: every expert kept (ratio 0)."""
        adapter = get_adapter(model.config)
        n = adapter.num_experts(model.config)
        return cls(family=adapter.family, num_experts=n, top_k=adapter.top_k(model.config),
                   kept_experts={layer.index: list(range(n)) for layer in adapter.moe_layers(model)},
                   num_groups=adapter.num_groups(model.config), fingerprint=model_fingerprint(model))


def check_plan_for_checkpoints(
    plan: PrunePlan, model_dir: str | Path, decode_model: str | Path | None = None
) -> None:
    """Before an engine starts, reading only the weights' headers and a few values per tensor: the plan fits
    the model's structure (family, expert count, top-k, every MoE layer) and was made for these weights (when
    it carries a files checksum), and a pruned decode checkpoint SlimWise exported was exported from this plan
    and model."""
    from slimwise.models import PLAN_FILE, read_manifest, resolve_model_dir, structure_model

    plan.check_model(structure_model(model_dir), check_fingerprint=False)
    files = checkpoint_fingerprint(resolve_model_dir(model_dir))
    made_for = (plan.fingerprint or {}).get("files_sha256")
    if files and made_for and files != made_for:
        raise SlimWiseError(
            f"plan was made for other weights than {model_dir} (same configuration, checkpoint "
            f"checksum {made_for}, this one {files}): make the plan from the served model "
            "(`slimwise plan`) or serve the model it was made from"
        )
    if decode_model is None or not Path(decode_model).is_dir():
        return
    exported = Path(decode_model) / PLAN_FILE
    if exported.is_file() and PrunePlan.load(exported).kept_experts != plan.kept_experts:
        raise SlimWiseError(
            f"decode model {decode_model} was exported from another plan than --plan: pass the plan "
            f"it was exported with ({exported}) or export it again (`slimwise prune`)"
        )
    source = (read_manifest(decode_model) or {}).get("source_fingerprint")
    served = {"files_sha256": files} if files else None
    for fingerprint in (
        plan.fingerprint,
        PrunePlan.load(exported).fingerprint if exported.is_file() else None,
        served,
    ):
        if source and fingerprint and not fingerprints_match(source, fingerprint):
            raise SlimWiseError(
                f"decode model {decode_model} was pruned from other weights than the plan was made "
                "for or than the served model (fingerprint mismatch): export it from the served model"
            )


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_PLAN_TYPES: dict[str, tuple[type, ...]] = {
    "family": (str,), "num_experts": (int,), "top_k": (int,), "kept_experts": (dict,), "criterion": (str,),
    "ratio": (int, float), "phase": (str, type(None)), "scope": (str,), "num_groups": (int,),
    "fingerprint": (dict, type(None)), "meta": (dict,), "format": (str,)}
_PLAN_REQUIRED = ("family", "num_experts", "top_k", "kept_experts")


def _schema_problem(d: object) -> str | None:
    """What is wrong with a plan dictionary (first problem found), or None."""
    if not isinstance(d, dict):
        return f"a JSON object is needed, not {type(d).__name__}"
    unknown = sorted(set(d) - set(_PLAN_TYPES))
    if unknown:
        return f"unknown key(s) {', '.join(map(repr, unknown))}"
    missing = [k for k in _PLAN_REQUIRED if k not in d]
    if missing:
        return f"missing key(s) {', '.join(map(repr, missing))}"
    for key, value in d.items():
        if not isinstance(value, _PLAN_TYPES[key]) or isinstance(value, bool):
            return f"{key!r} must be {' or '.join(t.__name__ for t in _PLAN_TYPES[key])}, not {value!r:.40}"
    problem = _shape_problem(d)
    if problem:
        return problem
    if not d["kept_experts"]:
        return "kept_experts is empty (no MoE layer)"
    for layer, ids in d["kept_experts"].items():
        problem = _layer_problem(layer, ids, d["num_experts"], d["top_k"])
        if problem:
            return problem
    fingerprint = d.get("fingerprint")
    if fingerprint is not None and not all(isinstance(v, str) for v in fingerprint.values()):
        return "fingerprint values must be strings"
    return None


def _shape_problem(d: dict) -> str | None:
    """The plan-wide numbers: expert count, top-k, ratio, scope, groups (types already checked)."""
    n, k = d["num_experts"], d["top_k"]
    if n < 2:
        return f"num_experts {n} must be at least 2"
    if not 1 <= k <= n:
        return f"top_k {k} must be in [1, num_experts={n}]"
    ratio = d.get("ratio", 0.0)
    if not (math.isfinite(ratio) and 0.0 <= ratio < 1.0):
        return f"ratio {ratio} must be a finite number in [0, 1)"
    if d.get("scope", "layer") not in ("layer", "global", "sensitivity"):
        return f"scope {d['scope']!r} must be 'layer', 'global' or 'sensitivity'"
    groups = d.get("num_groups", 1)
    if groups < 1 or n % groups:
        return f"num_groups {groups} must be >= 1 and divide num_experts={n}"
    return None


def _layer_problem(layer: object, ids: object, n: int, k: int) -> str | None:
    """One `kept_experts` entry: a decoder-layer index mapped to at least top-k distinct ids in [0, n)."""
    if not (isinstance(layer, str) and layer.isdigit()) and not _is_int(layer):
        return f"layer key {layer!r} must be a decoder-layer index"
    if not isinstance(ids, list) or not all(_is_int(e) for e in ids):
        return f"layer {layer}: kept experts must be a list of integer ids, not {ids!r:.40}"
    if len(set(ids)) != len(ids):
        return f"layer {layer}: duplicate expert ids {sorted({e for e in ids if ids.count(e) > 1})}"
    if any(e < 0 or e >= n for e in ids):
        return f"layer {layer}: expert ids must be in [0, {n})"
    if len(ids) < k:
        return f"layer {layer} keeps {len(ids)} experts, fewer than top_k={k}"
    return None


def keep_count(n: int, ratio: float) -> int:
    """Experts kept of n at `ratio` (the pruned count rounded half up): every scope's budget."""
    return n - int(math.floor(ratio * n + 0.5))


def make_plan(
    scores: torch.Tensor,
    layers: list[int],
    ratio: float,
    *,
    family: str,
    top_k: int,
    num_groups: int = 1,
    min_kept_per_group: int = 1,
    scope: Scope = "layer",
    criterion: str = "manual",
    phase: str | None = None,
    fingerprint: dict[str, str] | None = None,
    meta: dict | None = None,
    allowed: torch.Tensor | None = None,
) -> PrunePlan:
    """Prune the lowest-scoring experts. `scores` is [len(layers), E]; higher means more important.

    scope="layer" prunes round(ratio*E) experts in every layer (per group for grouped routing, so a sliced
    checkpoint stays valid). scope="global" spends one budget of round(ratio*L*E) across layers on scores
    normalised per layer (criteria are not comparable across layers otherwise), never below top-k per layer.
    Ties break towards the lower expert id, so plans are deterministic.

    `allowed` (bool, like `scores`): only these experts may be kept; the others are pruned first. Nested plans
    pass the kept set of the plan at the next lower ratio, so every kept set lies inside the previous one.
    """
    if not 0.0 <= ratio < 1.0 or math.isnan(ratio):
        raise SlimWiseError(f"ratio {ratio} is outside [0, 1): pass the share of experts to prune, e.g. 0.5")
    if scores.dim() != 2 or scores.shape[0] != len(layers):
        raise SlimWiseError(f"scores of shape {tuple(scores.shape)} do not match {len(layers)} MoE layers")
    n_layers, n = scores.shape
    scores = torch.nan_to_num(scores.to(torch.float64), nan=0.0)
    allowed = torch.ones(n_layers, n, dtype=torch.bool) if allowed is None else allowed.to(torch.bool).cpu()
    group = n // num_groups
    kept: dict[int, list[int]] = {}
    if scope == "layer":
        keep_per_group = keep_count(group, ratio)
        ranked = scores.masked_fill(~allowed, float("-inf"))  # a disallowed expert ranks below every other
        for row, layer in enumerate(layers):
            ids: list[int] = []
            for g in range(num_groups):
                block = ranked[row, g * group:(g + 1) * group]
                order = torch.sort(-block, stable=True).indices[:keep_per_group]
                ids += (order + g * group).tolist()
            kept[layer] = sorted(ids)
    elif scope == "global":
        norm = scores / scores.sum(dim=1, keepdim=True).clamp_min(1e-30)
        norm = norm.masked_fill(~allowed, float("-inf"))  # pruned first
        budget = n_layers * n - keep_count(n_layers * n, ratio)
        remaining = [n] * n_layers
        per_group = [[group] * num_groups for _ in range(n_layers)]
        pruned = torch.zeros(n_layers, n, dtype=torch.bool)
        flat_order = torch.sort(norm.reshape(-1), stable=True).indices.tolist()
        for flat in flat_order:
            if budget == 0:
                break
            row, e = divmod(flat, n)
            g = e // group
            if remaining[row] - 1 < top_k or per_group[row][g] - 1 < min_kept_per_group:
                continue
            pruned[row, e] = True
            remaining[row] -= 1
            per_group[row][g] -= 1
            budget -= 1
        kept = {layer: (~pruned[row]).nonzero().flatten().tolist() for row, layer in enumerate(layers)}
    else:
        raise SlimWiseError(f"scope {scope!r} is not 'layer' or 'global'")
    outside = [layer for row, layer in enumerate(layers) if not allowed[row, kept[layer]].all()]
    if outside:
        raise SlimWiseError(f"ratio {ratio} keeps experts outside the allowed set in layers {outside}: "
                            "nested plans need ratios that grow (each keeps at most what the previous kept)")
    plan = PrunePlan(family=family, num_experts=n, top_k=top_k, kept_experts=kept, criterion=criterion,
                     ratio=ratio, phase=phase, scope=scope, num_groups=num_groups, fingerprint=fingerprint,
                     meta=meta or {})
    plan.validate(min_kept_per_group)
    return plan
