"""Calibration statistics: per MoE layer and expert, the sums every criterion needs.

Saved as one safetensors file (tensors [layers, experts], float64) with the metadata in its header, so
criteria can be recomputed and compared without touching the model again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from slimwise.errors import SlimWiseError
from slimwise.io import atomic_path

STATS_FORMAT = "slimwise-stats/1"


def expected_union(num_experts: int, top_k: int, batch: float) -> float:
    """Expected distinct experts touched by `batch` tokens that each pick top_k of num_experts uniformly:
    E(1 - (1 - k/E)^B). What batched decode reads under uniform routing (the roofline, the traffic meter)."""
    if num_experts <= 0 or batch <= 0:
        return 0.0
    return float(num_experts * (1.0 - (1.0 - min(top_k, num_experts) / num_experts) ** batch))
_FIELDS = ("count", "gate_sum", "norm_sum", "norm_sq_sum", "gate_norm_sum")


@dataclass
class ExpertStats:
    """Sums over counted tokens. count: selections; gate_sum: gate weights; norm_*: ||f_j(x)|| (and squares);
    gate_norm_sum: gate x norm; tokens: counted tokens per layer; output_sum (optional, `calibrate
    --output-sums`): the un-gated outputs f_j(x) summed per expert, [layers, experts, hidden]."""

    layers: list[int]
    num_experts: int
    count: torch.Tensor
    gate_sum: torch.Tensor
    norm_sum: torch.Tensor
    norm_sq_sum: torch.Tensor
    gate_norm_sum: torch.Tensor
    tokens: torch.Tensor
    meta: dict = field(default_factory=dict)
    output_sum: torch.Tensor | None = None

    @classmethod
    def zeros(cls, layers: list[int], num_experts: int, meta: dict | None = None) -> ExpertStats:
        z = lambda: torch.zeros(len(layers), num_experts, dtype=torch.float64)  # noqa: E731
        return cls(list(layers), num_experts, z(), z(), z(), z(), z(),
                   torch.zeros(len(layers), dtype=torch.float64), dict(meta or {}))

    def row(self, layer: int) -> int:
        return self.layers.index(layer)

    def norm_mean(self) -> torch.Tensor:
        return torch.where(
            self.count > 0, self.norm_sum / self.count.clamp_min(1), torch.zeros_like(self.count)
        )

    def norm_std(self) -> torch.Tensor:
        n = self.count.clamp_min(1)
        var = (self.norm_sq_sum / n - (self.norm_sum / n) ** 2).clamp_min(0)
        return torch.where(self.count > 0, var.sqrt(), torch.zeros_like(var))

    def output_mean(self) -> torch.Tensor:
        """Each expert's mean un-gated output over its counted tokens ([layers, experts, hidden], float64; 0
        for an expert never selected): what `--gates substitute` adds in place of a pruned expert."""
        if self.output_sum is None:
            raise SlimWiseError("these statistics hold no expert outputs: calibrate with --output-sums")
        n = self.count.clamp_min(1).unsqueeze(-1)
        zero = torch.zeros_like(self.output_sum)
        return torch.where(self.count.unsqueeze(-1) > 0, self.output_sum / n, zero)

    def usage_share(self) -> torch.Tensor:
        """Share of routed selections per expert (rows sum to 1 where any token was counted)."""
        return self.count / self.count.sum(dim=1, keepdim=True).clamp_min(1)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {name: getattr(self, name).contiguous() for name in (*_FIELDS, "tokens")}
        if self.output_sum is not None:
            tensors["output_sum"] = self.output_sum.contiguous()
        header = {
            "format": STATS_FORMAT,
            "layers": json.dumps(self.layers),
            "num_experts": str(self.num_experts),
            "meta": json.dumps(self.meta),
        }
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata=header)
        return path

    @classmethod
    def load(cls, path: str | Path) -> ExpertStats:
        path = Path(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                header = f.metadata() or {}
                if header.get("format") != STATS_FORMAT:
                    raise SlimWiseError(
                        f"{path} is not a SlimWise stats file; make one with `slimwise calibrate`"
                    )
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        except SlimWiseError:
            raise
        except Exception as exc:
            raise SlimWiseError(
                f"cannot read stats {path}: {exc}; make one with `slimwise calibrate`"
            ) from exc
        return cls(
            json.loads(header["layers"]),
            int(header["num_experts"]),
            *(tensors[name] for name in _FIELDS),
            tensors["tokens"],
            json.loads(header.get("meta", "{}")),
            tensors.get("output_sum"),
        )

    def merge(self, other: ExpertStats) -> ExpertStats:
        """Sum two passes over different data (same model)."""
        if self.layers != other.layers or self.num_experts != other.num_experts:
            raise SlimWiseError("cannot merge stats of different models")
        both = self.output_sum is not None and other.output_sum is not None
        return ExpertStats(self.layers, self.num_experts,
                           *(getattr(self, f) + getattr(other, f) for f in _FIELDS),
                           self.tokens + other.tokens, {**self.meta, "merged": True},
                           self.output_sum + other.output_sum if both else None)
