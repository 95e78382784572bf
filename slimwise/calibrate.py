"""Calibration: one pass of the full model over calibration prompts that records per-expert statistics.

The observer replaces each MoE layer's experts forward with an equivalent loop that also measures
||f_j(x)|| — only for the tokens routed to j, so it costs what the model's own forward costs (REAP's
observer runs every expert on every token: E/k times the work).

Phases: `prompt` counts prompt positions; `decode` lets the full model generate continuations and counts
only the tokens the decoder processes (the generated tokens fed back, i.e. what SlimWise prunes);
`all` counts both. Padding and finished rows never count.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import nn
from tqdm.auto import tqdm

from slimwise.adapters import MoEAdapter, MoELayer, get_adapter
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.errors import SlimWiseError
from slimwise.fingerprint import model_fingerprint
from slimwise.hooks import ForwardWrappers
from slimwise.stats import ExpertStats

Phase = Literal["prompt", "decode", "all"]
PHASES = ("prompt", "decode", "all")


@dataclass
class CalibrationConfig:
    phase: Phase = "decode"
    max_new_tokens: int = 96  # continuation length for decode-aware calibration
    batch_size: int = 16
    max_samples: int | None = None
    seed: int = 0
    temperature: float = 0.0  # greedy continuations by default


class ExpertObserver:
    """Accumulates ExpertStats while installed; counts only rows the engine marks for the chosen phase."""

    def __init__(self, model: nn.Module, phase: Phase, adapter: MoEAdapter | None = None):
        if phase not in PHASES:
            raise SlimWiseError(f"phase {phase!r} is not one of {', '.join(PHASES)}")
        self.adapter = adapter or get_adapter(model.config)
        self.phase = phase
        self.layers = self.adapter.moe_layers(model)
        self._stats = ExpertStats.zeros(
            [layer.index for layer in self.layers], self.adapter.num_experts(model.config)
        )
        # per-layer sums kept on the layer's own device while the model runs (no host copy per token);
        # `stats` folds them into the float64 ExpertStats on the host
        self._pending: dict[int, torch.Tensor] = {}
        self.rows: torch.Tensor | None = None
        self._rows_on: dict[torch.device, torch.Tensor] = {}
        self._counted: torch.Tensor | int = 0
        self._wrappers = ForwardWrappers("calibration observer")
        for row, layer in enumerate(self.layers):
            # replaces the experts forward (an equivalent loop that measures)
            self._wrappers.wrap(
                layer.experts, lambda _stock, row=row, layer=layer: self._make_forward(row, layer)
            )

    def before_forward(self, phase: str, rows: torch.Tensor) -> None:
        """phase is "prompt" or "decode"; rows marks real (non-padding, unfinished) tokens, flattened."""
        counts = self.phase == "all" or self.phase == phase
        self.rows = rows if counts else torch.zeros_like(rows)
        self._rows_on = {self.rows.device: self.rows}
        self._counted = self._counted + self.rows.sum()

    @property
    def counted_tokens(self) -> int:
        """Tokens counted so far (reading it waits for the device)."""
        return int(self._counted)

    @property
    def stats(self) -> ExpertStats:
        """The statistics so far, on the host (folds in what the layers' devices hold)."""
        fields = ("count", "gate_sum", "norm_sum", "norm_sq_sum", "gate_norm_sum")
        for row, sums in self._pending.items():
            sums = sums.cpu()
            for i, name in enumerate(fields):
                getattr(self._stats, name)[row] += sums[i]
            self._stats.tokens[row] += sums[len(fields), 0]
        self._pending.clear()
        return self._stats

    def _rows_for(self, device: torch.device) -> torch.Tensor | None:
        """The counted-rows mask on a layer's device (a spread model's layers sit on several)."""
        if self.rows is None:
            return None
        if device not in self._rows_on:
            self._rows_on[device] = self.rows.to(device)
        return self._rows_on[device]

    def _make_forward(self, row: int, layer: MoELayer):
        experts = layer.experts
        num_experts = self._stats.num_experts

        def forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            # Sorted by expert: one gather, one contiguous slice per hit expert, one scatter, and the
            # statistics of all experts from a handful of bincounts (no per-expert Python work beyond the
            # matmuls).
            top_k = top_k_index.shape[-1]
            flat = top_k_index.reshape(-1)
            # EP/padding sentinels drop out
            valid = ((flat >= 0) & (flat < num_experts)).nonzero().squeeze(-1)
            order = valid[torch.argsort(flat[valid], stable=True)]
            expert_of = flat[order]
            token_of = order // top_k
            counts = torch.bincount(expert_of, minlength=num_experts)
            rows = self._rows_for(hidden_states.device)
            if rows is not None and rows.numel() != hidden_states.shape[0]:
                rows = None
            y, norms = self._expert_outputs(row, experts, hidden_states, token_of, counts.tolist(), rows)
            gate = top_k_weights.reshape(-1)[order]
            out = torch.zeros_like(hidden_states)
            out.index_add_(0, token_of, (y * gate[:, None]).to(out.dtype))
            if rows is not None:
                self._accumulate(row, expert_of, rows, token_of, gate, norms, num_experts)
            return out

        return forward

    def _accumulate(self, row: int, expert_of: torch.Tensor, rows: torch.Tensor, token_of: torch.Tensor,
                    gate: torch.Tensor, norms: torch.Tensor, num_experts: int) -> None:
        """Add one forward's counted assignments to layer `row`'s sums, on the layer's device (float64)."""
        keep = rows[token_of].double()
        g = gate.double()
        sums = torch.stack([torch.bincount(expert_of, weights=w, minlength=num_experts)
                            for w in (keep, g * keep, norms * keep, norms * norms * keep, g * norms * keep)])
        tokens = rows.sum().double().expand(1, num_experts)
        update = torch.cat([sums, tokens])
        pending = self._pending.get(row)
        self._pending[row] = update if pending is None else pending + update

    def _expert_outputs(
        self,
        row: int,
        experts: nn.Module,
        hidden_states: torch.Tensor,
        token_of: torch.Tensor,
        counts: list[int],
        rows: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """f_e(x) and ||f_e(x)|| (float64) for every (token, expert) assignment, sorted by expert: each hit
        expert on its routed rows. The norm is taken per expert while its output is in cache (one float64 copy
        of all outputs at once costs more than the expert matmuls at long prompts)."""
        x = hidden_states[token_of]
        y = torch.empty_like(x)
        norms = torch.empty(token_of.numel(), dtype=torch.float64, device=hidden_states.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                y_e = self.adapter.expert_forward(experts, e, x[start:start + n])
                y[start:start + n] = y_e
                norms[start:start + n] = torch.linalg.vector_norm(y_e, dim=-1, dtype=torch.float64)
                start += n
        return y, norms

    def remove(self) -> None:
        self._wrappers.remove()


def calibrate(model: nn.Module, prompts: Sequence[str] | Sequence[Sequence[int]], tokenizer=None,
              config: CalibrationConfig | None = None, progress: bool = True) -> ExpertStats:
    """Run the full model over `prompts` and return expert statistics for `config.phase`."""
    config = config or CalibrationConfig()
    prompts = list(prompts)[: config.max_samples] if config.max_samples else list(prompts)
    if not prompts:
        raise SlimWiseError("calibration data is empty: pass a JSONL file (or directory) with prompts")
    observer = ExpertObserver(model, config.phase)
    engine = PhaseSplitEngine(model, tokenizer)
    new_tokens = 0 if config.phase == "prompt" else config.max_new_tokens
    gen_cfg = GenerationConfig(max_new_tokens=new_tokens, temperature=config.temperature, seed=config.seed,
                               batch_size=config.batch_size)
    t0 = time.perf_counter()
    processed = 0
    bar = tqdm(total=len(prompts), desc=f"calibrate[{config.phase}]", unit="seq",
               disable=None if progress else True)  # None: a terminal only (an error stays one line in logs)
    try:
        for start in range(0, len(prompts), config.batch_size):
            batch = prompts[start:start + config.batch_size]
            outs = engine.generate(batch, mode="full", config=gen_cfg, observer=observer)
            processed += sum(len(o.prompt_ids) + max(len(o.token_ids) - 1, 0) for o in outs)
            bar.update(len(batch))
            bar.set_postfix(
                tok_s=f"{processed / (time.perf_counter() - t0):.0f}", counted=observer.counted_tokens
            )
    finally:
        bar.close()
        observer.remove()
    if observer.counted_tokens == 0:
        raise SlimWiseError(
            f"no {config.phase} tokens were counted (max_new_tokens={config.max_new_tokens}); "
            "use longer continuations or another phase"
        )
    stats = observer.stats
    adapter = observer.adapter
    stats.meta.update({"fingerprint": model_fingerprint(model), "family": adapter.family,
                       "top_k": adapter.top_k(model.config), "num_groups": adapter.num_groups(model.config),
                       "min_kept_per_group": adapter.min_kept_per_group(model.config),
                       "config": asdict(config), "num_prompts": len(prompts), "tokens_processed": processed,
                       "seconds": round(time.perf_counter() - t0, 3)})
    return stats
