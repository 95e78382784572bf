"""Engines and one run's metrics: the engine factory (reference or vLLM) and the
metrics of a mode's generations."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from slimwise.decode_gates import PLAIN, DecodeGates
from slimwise.engines.reference import Generation, GenerationConfig, PhaseSplitEngine
from slimwise.errors import SlimWiseError
from slimwise.evaluation.metrics import (
    accuracy_metrics,
    fidelity_metrics,
    length_metrics,
    length_ratios,
    teacher_forced_kl,
)
from slimwise.evaluation.reference_traffic import DecodeTrafficMeter
from slimwise.evaluation.samples import GradedSample, Grader
from slimwise.plan import PrunePlan

ENGINES = ("hf", "vllm")


class GenerationEngine(Protocol):
    """What the sweep needs from an engine: generate token ids in a mode (full / uniform / slimwise)."""

    def generate(self, prompts: Sequence[Sequence[int]], mode: str,
                 config: GenerationConfig) -> list[Generation]: ...


def make_engine(kind: str, model: nn.Module, tokenizer, plan: PrunePlan | None, model_dir: str | Path | None,
                delta: Any = None, share: bool = False, gates: DecodeGates = PLAIN) -> GenerationEngine:
    """`hf`: the reference PhaseSplitEngine (with a distilled `delta` for mode distilled); `vllm`:
    `slimwise.serving.VllmEngine(model_dir, tokenizer=, plan=, delta=)` when that plugin is installed
    (generation only: KL and traffic are measured on the HF model); `share`: one vLLM engine for
    full, slimwise and uniform; `gates`: the pruned rows' gate variant and fallback."""
    gates = gates if plan is not None else PLAIN  # the full model has no pruned rows
    if kind == "hf":
        if delta is not None:
            return PhaseSplitEngine(model, tokenizer, plan=plan, delta=delta, gates=gates)
        return PhaseSplitEngine(model, tokenizer, plan=plan, gates=gates)
    if kind == "vllm":
        try:
            from slimwise.engines.vllm_engine import VllmEngine
        except ImportError as exc:
            raise SlimWiseError(f"engine vllm needs vLLM, which does not import here ({exc}); use "
                                "--engine hf") from exc
        # same dtype as the reference model, so greedy tokens can agree exactly
        dtype = str(next(model.parameters()).dtype).replace("torch.", "") if model is not None else "auto"
        delta_dir = getattr(delta, "path", delta) if delta is not None else None
        return VllmEngine(str(model_dir), tokenizer=tokenizer, plan=plan, dtype=dtype,
                          delta=delta_dir, share_engine=share, gates=gates)
    raise SlimWiseError(f"unknown engine {kind!r}; choose one of {', '.join(ENGINES)}")


def close_engine(engine: Any) -> None:
    """Close any one engine that has a `close` (a reference engine takes its mask and delta off the shared
    model, a vLLM engine stops its EngineCore). The sweep's vLLM engine kept across a plan's modes is released
    by `RunCache.release_shared_engine`, which calls this."""
    close = getattr(engine, "close", None)
    if callable(close):
        close()


def run_metrics(samples: Sequence[GradedSample], gens: Sequence[Generation], reference: Sequence[Generation],
                grader: Grader, max_new_tokens: int, kl: Sequence[float] | None = None, seed: int = 0,
                n_boot: int = 2000) -> dict[str, Any]:
    """Every per-run metric, overall and per task family (the per-sample vectors are kept for plots)."""
    correct = [bool(grader(s, g)) for s, g in zip(samples, gens, strict=True)]

    def block(idx: list[int]) -> dict[str, Any]:
        g = [gens[i] for i in idx]
        r = [reference[i] for i in idx]
        m = {**accuracy_metrics([correct[i] for i in idx], seed, n_boot), **length_metrics(g, max_new_tokens),
             **fidelity_metrics(g, r)}
        values = [kl[i] for i in idx] if kl is not None else []
        m["kl_mean"] = float(np.mean(values)) if values else None
        return m

    everything = list(range(len(samples)))
    metrics = block(everything)
    metrics["by_family"] = {fam: block([i for i, s in enumerate(samples) if s.family == fam])
                            for fam in sorted({s.family for s in samples})}
    metrics["correct"] = [int(c) for c in correct]
    metrics["lengths"] = [len(g.token_ids) for g in gens]
    metrics["length_ratios"] = [round(x, 4) for x in length_ratios(gens, reference)]
    if kl is not None:
        metrics["kl"] = [round(float(x), 6) for x in kl]
    return metrics


def evaluate_modes(engine: PhaseSplitEngine, samples: Sequence[GradedSample], modes: Sequence[str],
                   config: GenerationConfig, grader: Grader, seed: int = 0,
                   kl: bool = True) -> dict[str, dict]:
    """Generate every sample in every mode with one engine (and its plan); metrics per mode against full."""
    prompts = engine.encode([s.prompt for s in samples])
    runs: dict[str, list[Generation]] = {}
    seconds: dict[str, float] = {}
    traffic: dict[str, dict] = {}
    for mode in dict.fromkeys(["full", *modes]):
        meter = DecodeTrafficMeter(engine.model, active_experts(engine.plan, mode), config.batch_size)
        t0 = time.perf_counter()
        try:
            runs[mode] = engine.generate(prompts, mode=mode, config=config, observer=meter)
        finally:
            meter.remove()
        seconds[mode] = time.perf_counter() - t0
        traffic[mode] = meter.summary()
    reference: dict[int, torch.Tensor] = {}
    report: dict[str, dict] = {}
    for mode in modes:
        kls = teacher_forced_kl(engine, prompts, [g.token_ids for g in runs["full"]], mode,
                                reference_cache=reference) if kl else None
        report[mode] = {**run_metrics(samples, runs[mode], runs["full"], grader, config.max_new_tokens, kls,
                                      seed), "traffic": traffic[mode], "seconds": seconds[mode]}
    return report


def active_experts(plan: PrunePlan | None, mode: str) -> dict[int, int] | None:
    """Experts decode can choose from per layer: the plan's kept ones in pruned-decode modes."""
    if plan is None or mode == "full":
        return None
    return {layer: len(kept) for layer, kept in plan.kept_experts.items()}
