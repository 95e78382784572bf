"""Decode traffic on the reference engine: distinct experts touched per MoE layer per decode step, the expert
bytes that implies, and the uniform-routing expectation E(1-(1-k/E)^B) beside it."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from slimwise.adapters import get_adapter
from slimwise.hooks import ForwardWrappers
from slimwise.stats import expected_union


class DecodeTrafficMeter:
    """Counts distinct experts per MoE layer per decode step over the batch's live rows.

    A `StepObserver` for the engine (it says which rows are real before each forward) plus a forward hook on
    every router; the hooks also fire for the masked router forward (an instance attribute called through
    nn.Module.__call__). `active_experts` per layer is what decode can choose from (E, or the plan's kept
    count), used for the uniform-routing expectation.
    """

    def __init__(self, model: nn.Module, active_experts: dict[int, int] | None = None, batch_size: int = 0):
        adapter = get_adapter(model.config)
        self.layers = adapter.moe_layers(model)
        self.top_k = adapter.top_k(model.config)
        e = adapter.num_experts(model.config)
        self.active = [int((active_experts or {}).get(layer.index, e)) for layer in self.layers]
        self.expert_bytes = [int(adapter.expert_bytes(layer.experts)) for layer in self.layers]
        self.batch_size = batch_size
        n = len(self.layers)
        self.distinct = np.zeros(n)
        self.expected = np.zeros(n)
        self.calls = np.zeros(n)
        self.full_batch_distinct = np.zeros(n)
        self.full_batch_calls = np.zeros(n)
        self.steps = 0
        self.live_rows = 0
        self._phase: str | None = None
        self._rows: torch.Tensor | None = None
        self._hooks = ForwardWrappers("traffic meter")
        for i, layer in enumerate(self.layers):
            self._hooks.hook(layer.router, self._hook(i))

    def before_forward(self, phase: str, rows: torch.Tensor) -> None:
        self._phase, self._rows = phase, rows
        if phase == "decode":
            self.steps += 1
            self.live_rows += int(rows.sum())

    def _hook(self, i: int):
        def hook(module, args, output):
            rows = self._rows
            if self._phase != "decode" or rows is None or not isinstance(output, tuple):
                return
            index = output[-1]
            if index.shape[0] != rows.numel():
                return
            live = index[rows.to(index.device)]
            self.distinct[i] += torch.unique(live).numel()
            self.expected[i] += expected_union(self.active[i], self.top_k, live.shape[0])
            self.calls[i] += 1
            if self.batch_size and live.shape[0] == self.batch_size:
                self.full_batch_distinct[i] += torch.unique(live).numel()
                self.full_batch_calls[i] += 1

        return hook

    def remove(self) -> None:
        self._hooks.remove()

    def summary(self) -> dict[str, Any]:
        """Means per layer per decode step; bytes use each layer's per-expert size."""
        if not self.calls.any():
            return {"decode_steps": 0}
        per_layer = self.distinct / np.maximum(self.calls, 1)
        expected = self.expected / np.maximum(self.calls, 1)
        full_batch = None
        if self.full_batch_calls.all():
            full_batch = float((self.full_batch_distinct / self.full_batch_calls).mean())
        layer_bytes = per_layer * np.asarray(self.expert_bytes)
        return {
            "distinct_experts_per_layer_step": float(per_layer.mean()),
            "distinct_experts_per_layer_step_full_batch": full_batch,
            "uniform_expectation": float(expected.mean()),
            "uniform_expectation_at_batch_size": float(np.mean(
                [expected_union(a, self.top_k, self.batch_size) for a in self.active])),
            "active_experts": float(np.mean(self.active)),
            "top_k": self.top_k,
            "batch_size": self.batch_size,
            "live_rows_mean": self.live_rows / max(self.steps, 1),
            "decode_steps": self.steps,
            "expert_bytes_per_layer_step": float(layer_bytes.mean()),
            "expert_bytes_per_step": float(layer_bytes.sum()),
            "per_layer": [round(float(x), 3) for x in per_layer],
        }
