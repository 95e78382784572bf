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
from slimwise.errors import SlimWiseError
from slimwise.generate import GenerationConfig, PhaseSplitEngine
from slimwise.plan import model_fingerprint
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
        self.stats = ExpertStats.zeros([layer.index for layer in self.layers], self.adapter.num_experts(model.config))
        self.rows: torch.Tensor | None = None
        self.counted_tokens = 0
        for row, layer in enumerate(self.layers):
            layer.experts.forward = self._make_forward(row, layer)

    def before_forward(self, phase: str, rows: torch.Tensor) -> None:
        """phase is "prompt" or "decode"; rows marks real (non-padding, unfinished) tokens, flattened."""
        counts = self.phase == "all" or self.phase == phase
        self.rows = rows if counts else torch.zeros_like(rows)
        self.counted_tokens += int(self.rows.sum())

    def _make_forward(self, row: int, layer: MoELayer):
        adapter, experts, stats = self.adapter, layer.experts, self.stats

        def forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            out = torch.zeros_like(hidden_states)
            rows = self.rows if self.rows is not None and self.rows.numel() == hidden_states.shape[0] else None
            hit = torch.unique(top_k_index)
            for e in hit.tolist():
                if e < 0 or e >= stats.num_experts:
                    continue
                token_idx, slot = torch.where(top_k_index == e)
                y = adapter.expert_forward(experts, e, hidden_states[token_idx])
                gate = top_k_weights[token_idx, slot]
                out.index_add_(0, token_idx, (y * gate[:, None]).to(out.dtype))
                if rows is None:
                    continue
                keep = rows[token_idx]
                if not keep.any():
                    continue
                norms = y[keep].double().norm(dim=-1)
                g = gate[keep].double()
                stats.count[row, e] += norms.numel()
                stats.gate_sum[row, e] += g.sum()
                stats.norm_sum[row, e] += norms.sum()
                stats.norm_sq_sum[row, e] += (norms * norms).sum()
                stats.gate_norm_sum[row, e] += (g * norms).sum()
            if rows is not None:
                stats.tokens[row] += rows.sum()
            return out

        return forward

    def remove(self) -> None:
        for layer in self.layers:
            if "forward" in layer.experts.__dict__:
                del layer.experts.forward


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
    bar = tqdm(total=len(prompts), desc=f"calibrate[{config.phase}]", unit="seq", disable=not progress)
    try:
        for start in range(0, len(prompts), config.batch_size):
            batch = prompts[start:start + config.batch_size]
            outs = engine.generate(batch, mode="full", config=gen_cfg, observer=observer)
            processed += sum(len(o.prompt_ids) + max(len(o.token_ids) - 1, 0) for o in outs)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{processed / (time.perf_counter() - t0):.0f}", counted=observer.counted_tokens)
    finally:
        bar.close()
        observer.remove()
    if observer.counted_tokens == 0:
        raise SlimWiseError(f"no {config.phase} tokens were counted (max_new_tokens={config.max_new_tokens}); "
                            "use longer continuations or another phase")
    stats = observer.stats
    adapter = observer.adapter
    stats.meta.update({"fingerprint": model_fingerprint(model), "family": adapter.family,
                       "top_k": adapter.top_k(model.config), "num_groups": adapter.num_groups(model.config),
                       "min_kept_per_group": adapter.min_kept_per_group(model.config),
                       "config": asdict(config), "num_prompts": len(prompts), "tokens_processed": processed,
                       "seconds": round(time.perf_counter() - t0, 3)})
    return stats
