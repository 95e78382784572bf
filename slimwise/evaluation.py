"""Evaluation of full / uniform / SlimWise decoding: accuracy, generation length, fidelity, decode traffic.

Accuracy alone hides pruning-induced length changes and drift from the full model, so every run reports,
per task family and overall:
  - accuracy with a 95% bootstrap interval (and a paired bootstrap of SlimWise minus uniform);
  - generated length (mean, median, p90), EOS and truncation shares, per-sample length ratio to full;
  - fidelity to the full model: whole-output exact match, first differing position, and teacher-forced
    KL(full || mode) over the full model's own continuations;
  - decode traffic: distinct experts touched per MoE layer per decode step at the eval batch size (router
    hooks), the expert bytes that implies, and the uniform-routing expectation E(1-(1-k/E)^B) beside it.

The metric functions are pure and hand-checkable; `Sweep` drives criterion x ratio x calibration-phase
grids (calibrate once per phase, plans from cached stats, `full` generated once, runs cached on disk so an
interrupted sweep resumes). `slimwise.report` turns the result into Markdown and PNG plots.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from slimwise.adapters import get_adapter
from slimwise.errors import SlimWiseError
from slimwise.generate import Generation, GenerationConfig, PhaseSplitEngine
from slimwise.io import atomic_write_text
from slimwise.plan import PrunePlan, model_fingerprint

SCHEMA = "slimwise-eval/1"
EVAL_MODES = ("full", "uniform", "slimwise", "distilled")
DEFAULT_CRITERIA = ("frequency", "soft", "ean", "reap")
DEFAULT_RATIOS = (0.25, 0.5, 0.75)
DEFAULT_PHASES = ("prompt", "decode")
ENGINES = ("hf", "vllm")
GRADERS = ("testbed", "exact", "contains")
KL_REFERENCE_BYTES = 1 << 30  # cache the full model's teacher-forced log-probs across plans below this size


# ----------------------------------------------------------------------------------------------------------
# Samples and graders


@dataclass
class GradedSample:
    prompt: str
    answer: str
    family: str = "all"
    raw: dict | None = None


Grader = Callable[[GradedSample, Generation], bool]


def make_grader(name: str) -> Grader:
    """`testbed` (final `#### answer` line, exact), `exact` (whole stripped text), `contains`, or
    `module:function` called as fn(sample_dict, text, stopped_by_eos) -> bool (or an object with .correct)."""
    if name == "testbed":
        from slimwise.testbed import grade

        return lambda s, g: grade(s.raw or {"answer": s.answer}, g.text or "", g.finish_reason == "eos").correct
    if name == "exact":
        return lambda s, g: (g.text or "").strip() == s.answer.strip()
    if name == "contains":
        return lambda s, g: s.answer.strip() in (g.text or "")
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise SlimWiseError(f"grader {name!r} cannot be imported ({exc}); give module:function") from exc

        def custom(s: GradedSample, g: Generation) -> bool:
            out = fn(s.raw or {"prompt": s.prompt, "answer": s.answer}, g.text or "", g.finish_reason == "eos")
            return bool(getattr(out, "correct", out))

        return custom
    raise SlimWiseError(f"unknown grader {name!r}; choose one of {', '.join(GRADERS)} or module:function")


def load_samples(data: str | None = None, *, split: str = "test", n_per_family: int = 40, seed: int = 0,
                 domain: str | None = None, families: Sequence[str] = (), max_samples: int | None = None
                 ) -> list[GradedSample]:
    """Graded samples from a JSONL file (`prompt`, `answer`, optional `family`) or from the testbed.

    Testbed: `domain` selects one domain ("all" = every domain); explicit `families` override it.
    """
    if data:
        from slimwise.data import load_records

        samples = []
        for i, r in enumerate(load_records(data)):
            if not isinstance(r.get("prompt"), str) or "answer" not in r:
                raise SlimWiseError(f"record {i} of {data} needs 'prompt' (string) and 'answer' fields")
            samples.append(GradedSample(r["prompt"], str(r["answer"]), str(r.get("family", "all")), r))
    else:
        from slimwise.testbed import DOMAINS, make_split

        if domain not in (None, "all") and domain not in DOMAINS:
            raise SlimWiseError(f"unknown domain {domain!r}; choose one of {', '.join(DOMAINS)} or all")
        try:
            picked = make_split(split, n_per_family, seed=seed, families=list(families) or None,
                                domain=None if families or domain == "all" else domain)
        except ValueError as exc:
            raise SlimWiseError(str(exc)) from exc
        samples = [GradedSample(s.prompt, s.answer, s.family, s.to_dict()) for s in picked]
    if max_samples:
        samples = _stratified(samples, max_samples)
    if not samples:
        raise SlimWiseError("no evaluation samples: check --data / --domain / --families")
    return samples


def _stratified(samples: list[GradedSample], limit: int) -> list[GradedSample]:
    """The first `limit` samples taken round-robin over families (so every family stays represented)."""
    by_family: dict[str, list[GradedSample]] = {}
    for s in samples:
        by_family.setdefault(s.family, []).append(s)
    out: list[GradedSample] = []
    queues = [list(v) for v in by_family.values()]
    while len(out) < limit and any(queues):
        for q in queues:
            if q and len(out) < limit:
                out.append(q.pop(0))
    return out


# ----------------------------------------------------------------------------------------------------------
# Pure metric functions


def bootstrap_ci(values: Sequence[float], n_boot: int = 2000, seed: int = 0, level: float = 0.95
                 ) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean (NaNs for no values)."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = arr[rng.integers(0, arr.size, size=(n_boot, arr.size))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def accuracy_metrics(correct: Sequence[bool], seed: int = 0, n_boot: int = 2000) -> dict[str, float]:
    lo, hi = bootstrap_ci([float(c) for c in correct], n_boot=n_boot, seed=seed)
    return {"accuracy": sum(correct) / max(len(correct), 1), "accuracy_ci_low": lo, "accuracy_ci_high": hi,
            "n": len(correct)}


def paired_difference(a: Sequence[bool], b: Sequence[bool], n_boot: int = 2000, seed: int = 0) -> dict[str, float]:
    """Mean of a - b over the same samples with a paired bootstrap interval (resamples samples, not runs)."""
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    lo, hi = bootstrap_ci(diff, n_boot=n_boot, seed=seed)
    return {"diff": float(diff.mean()) if diff.size else float("nan"), "ci_low": lo, "ci_high": hi}


def length_metrics(generations: Sequence[Generation], max_new_tokens: int) -> dict[str, float]:
    """Generated length (tokens, the final EOS included) and how outputs ended."""
    lengths = [len(g.token_ids) for g in generations]
    if not lengths:
        return {}
    return {
        "length_mean": float(np.mean(lengths)),
        "length_median": float(statistics.median(lengths)),
        "length_p90": float(np.quantile(lengths, 0.9)),
        "eos_share": sum(g.finish_reason == "eos" for g in generations) / len(lengths),
        "truncated_share": sum(g.finish_reason == "length" and len(g.token_ids) >= max_new_tokens
                               for g in generations) / len(lengths),
    }


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the shorter length); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def length_ratios(outputs: Sequence[Generation], reference: Sequence[Generation]) -> list[float]:
    """Per-sample generated length over the full model's length for the same prompt."""
    return [len(o.token_ids) / max(len(r.token_ids), 1) for o, r in zip(outputs, reference, strict=True)]


def fidelity_metrics(outputs: Sequence[Generation], reference: Sequence[Generation]) -> dict[str, float | None]:
    """Agreement with the full model's generations for the same prompts.

    `first_diff_mean` averages over the outputs that differ (None when all are identical)."""
    pairs = list(zip(outputs, reference, strict=True))
    if not pairs:
        return {}
    diffs = [first_difference(o.token_ids, r.token_ids) for o, r in pairs]
    differing = [d for d in diffs if d is not None]
    ratios = length_ratios(outputs, reference)
    return {
        "exact_match": sum(d is None for d in diffs) / len(pairs),
        "first_token_agree": sum(bool(o.token_ids[:1] == r.token_ids[:1]) for o, r in pairs) / len(pairs),
        "first_diff_mean": float(np.mean(differing)) if differing else None,
        "first_diff_median": float(statistics.median(differing)) if differing else None,
        "length_ratio_mean": float(np.mean(ratios)),
        "length_ratio_p10": float(np.quantile(ratios, 0.1)),
        "length_ratio_median": float(np.quantile(ratios, 0.5)),
        "length_ratio_p90": float(np.quantile(ratios, 0.9)),
    }


def kl_divergence(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) over the last dim of log-probabilities: sum p_ref (log p_ref - log p_other)."""
    ref = ref_logprobs.float()
    return (ref.exp() * (ref - logprobs.float())).sum(dim=-1).clamp_min(0.0)


def uniform_expected_distinct(num_experts: int, top_k: int, batch: float) -> float:
    """Expected distinct experts touched by `batch` tokens that each pick top_k of num_experts uniformly."""
    if num_experts <= 0 or batch <= 0:
        return 0.0
    return float(num_experts * (1.0 - (1.0 - min(top_k, num_experts) / num_experts) ** batch))


# ----------------------------------------------------------------------------------------------------------
# Teacher-forced KL


@torch.inference_mode()
def continuation_logprobs(engine: PhaseSplitEngine, prompts: Sequence[Sequence[int]],
                          continuations: Sequence[Sequence[int]], mode: str) -> torch.Tensor:
    """Log-probs [B, T, V] of every continuation position, teacher-forced, in `mode`.

    Position t is the distribution of continuation token t given prompt + continuation[:t]: position 0 comes
    from the mode's prefill logits (the full model's for slimwise), the rest from one forward of the
    continuation on that cache with the mode's decode model (mask active for slimwise and uniform).
    """
    cache, first, attention, positions = engine.prefill(prompts, mode)
    width = max(len(c) for c in continuations)
    parts = [first[:, None, :]]
    if width > 1:
        pad = 0
        if engine.tokenizer is not None and engine.tokenizer.pad_token_id is not None:
            pad = engine.tokenizer.pad_token_id
        ids = torch.full((len(prompts), width - 1), pad, dtype=torch.long, device=attention.device)
        for i, c in enumerate(continuations):
            if len(c) > 1:
                ids[i, :len(c) - 1] = torch.tensor(list(c[:-1]), dtype=torch.long)
        attention = torch.cat([attention, torch.ones_like(ids)], dim=1)
        pos = positions[:, -1:] + 1 + torch.arange(width - 1, device=ids.device)[None, :]
        model, ctx = engine._phase(mode, "decode")
        with ctx():
            out = model(input_ids=ids, attention_mask=attention, position_ids=pos, past_key_values=cache,
                        use_cache=True)
        parts.append(out.logits.float())
    return torch.log_softmax(torch.cat(parts, dim=1), dim=-1)


def teacher_forced_kl(engine: PhaseSplitEngine, prompts: Sequence[Sequence[int]],
                      continuations: Sequence[Sequence[int]], mode: str, batch_size: int = 8,
                      reference_cache: dict[int, torch.Tensor] | None = None) -> list[float]:
    """Per sample, mean over the full model's continuation positions of KL(full || mode).

    `reference_cache` (batch start -> full log-probs) avoids recomputing the full model across plans."""
    out: list[float] = []
    for start in range(0, len(prompts), batch_size):
        p, c = prompts[start:start + batch_size], continuations[start:start + batch_size]
        ref = reference_cache.get(start) if reference_cache is not None else None
        if ref is None:
            ref = continuation_logprobs(engine, p, c, "full")
            if reference_cache is not None:
                reference_cache[start] = ref
        got = ref if mode == "full" else continuation_logprobs(engine, p, c, mode)
        kl = kl_divergence(ref, got)
        out += [float(kl[i, :len(ci)].mean()) if len(ci) else 0.0 for i, ci in enumerate(c)]
    return out


# ----------------------------------------------------------------------------------------------------------
# Decode traffic


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
        self._handles = [layer.router.register_forward_hook(self._hook(i)) for i, layer in enumerate(self.layers)]

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
            self.expected[i] += uniform_expected_distinct(self.active[i], self.top_k, live.shape[0])
            self.calls[i] += 1
            if self.batch_size and live.shape[0] == self.batch_size:
                self.full_batch_distinct[i] += torch.unique(live).numel()
                self.full_batch_calls[i] += 1

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

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
                [uniform_expected_distinct(a, self.top_k, self.batch_size) for a in self.active])),
            "active_experts": float(np.mean(self.active)),
            "top_k": self.top_k,
            "batch_size": self.batch_size,
            "live_rows_mean": self.live_rows / max(self.steps, 1),
            "decode_steps": self.steps,
            "expert_bytes_per_layer_step": float(layer_bytes.mean()),
            "expert_bytes_per_step": float(layer_bytes.sum()),
            "per_layer": [round(float(x), 3) for x in per_layer],
        }


# ----------------------------------------------------------------------------------------------------------
# Engines


class GenerationEngine(Protocol):
    """What the sweep needs from an engine: generate token ids in a mode (full / uniform / slimwise)."""

    def generate(self, prompts: Sequence[Sequence[int]], mode: str, config: GenerationConfig) -> list[Generation]: ...


def distillation_available() -> bool:
    """True when `slimwise.distill` exists and the reference engine takes a delta (mode `distilled`)."""
    try:
        importlib.import_module("slimwise.distill")
    except ImportError:
        return False
    return "delta" in inspect.signature(PhaseSplitEngine.__init__).parameters


def load_delta(path: str | Path):
    """A distilled decode-only delta (`slimwise distill` output)."""
    if not distillation_available():
        raise SlimWiseError("distillation is not available yet in this install: drop mode distilled and --distilled")
    from slimwise.distill import Delta

    return Delta.load(path)


def make_engine(kind: str, model: nn.Module, tokenizer, plan: PrunePlan | None, model_dir: str | Path | None,
                delta: Any = None, share: bool = False) -> GenerationEngine:
    """`hf`: the reference PhaseSplitEngine (with a distilled `delta` for mode distilled); `vllm`:
    `slimwise.serving.VllmEngine(model_dir, tokenizer=, plan=, delta=)` when that plugin is installed (generation
    only: KL and traffic are measured on the HF model); `share`: one vLLM engine for full, slimwise and uniform."""
    if kind == "hf":
        if delta is not None:
            return PhaseSplitEngine(model, tokenizer, plan=plan, delta=delta)
        return PhaseSplitEngine(model, tokenizer, plan=plan)
    if kind == "vllm":
        cls = None
        for where in ("slimwise.serving", "slimwise.serving.engine"):
            try:
                cls = getattr(importlib.import_module(where), "VllmEngine", None)
            except ImportError:
                cls = None
            if cls is not None:
                break
        if cls is None:
            raise SlimWiseError("engine vllm needs slimwise.serving.VllmEngine (the vLLM plugin), which is not "
                                "available in this install; use --engine hf")
        # same dtype as the reference model, so greedy tokens can agree exactly
        dtype = str(next(model.parameters()).dtype).replace("torch.", "") if model is not None else "auto"
        delta_dir = getattr(delta, "path", delta) if delta is not None else None
        return cls(str(model_dir), tokenizer=tokenizer, plan=plan, dtype=dtype, delta=delta_dir, share_engine=share)
    raise SlimWiseError(f"unknown engine {kind!r}; choose one of {', '.join(ENGINES)}")


def _close(engine: Any) -> None:
    close = getattr(engine, "close", None)
    if callable(close):
        close()


# ----------------------------------------------------------------------------------------------------------
# One run: metrics of a mode's generations


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
                   config: GenerationConfig, grader: Grader, seed: int = 0, kl: bool = True) -> dict[str, dict]:
    """Generate every sample in every mode with one engine (and its plan); metrics per mode against full."""
    prompts = engine._encode([s.prompt for s in samples])
    runs: dict[str, list[Generation]] = {}
    seconds: dict[str, float] = {}
    traffic: dict[str, dict] = {}
    for mode in dict.fromkeys(["full", *modes]):
        meter = DecodeTrafficMeter(engine.model, _active_experts(engine.plan, mode), config.batch_size)
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
        report[mode] = {**run_metrics(samples, runs[mode], runs["full"], grader, config.max_new_tokens, kls, seed),
                        "traffic": traffic[mode], "seconds": seconds[mode]}
    return report


def _active_experts(plan: PrunePlan | None, mode: str) -> dict[int, int] | None:
    """Experts decode can choose from per layer: the plan's kept ones in pruned-decode modes."""
    if plan is None or mode == "full":
        return None
    return {layer: len(kept) for layer, kept in plan.kept_experts.items()}


# ----------------------------------------------------------------------------------------------------------
# Sweep configuration and driver


@dataclass
class EvalConfig:
    """Everything `slimwise eval` varies. Defaults are the default sweep (4 criteria x 3 ratios x 2 phases)."""

    # pruning grid (or explicit plans)
    criteria: tuple[str, ...] = DEFAULT_CRITERIA
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    phases: tuple[str, ...] = DEFAULT_PHASES
    plans: tuple[str, ...] = ()  # plan JSON files: replace the grid
    stats: tuple[str, ...] = ()  # calibration stats files (phase read from them): skip calibration
    scope: str = "layer"
    modes: tuple[str, ...] = ("full", "uniform", "slimwise")
    distilled: str | None = None  # a `slimwise distill` delta: adds mode `distilled` on the plan it was made for
    engine: str = "hf"
    # tasks
    data: str | None = None  # JSONL with prompt/answer[/family]; default: the testbed
    grader: str = "testbed"
    domain: str | None = None  # testbed domain (default: the target domain); "all" = every domain
    families: tuple[str, ...] = ()
    split: str = "test"
    n_per_family: int = 48  # 240 target-domain problems: about ±6 pp at 50% accuracy, default sweep < 20 min
    max_samples: int | None = None
    # calibration
    calib_data: str | None = None
    calib_domain: str | None = None  # default: the target domain (also when other domains are evaluated)
    calib_per_family: int = 16
    calib_max_new_tokens: int = 128
    # generation
    max_new_tokens: int = 160
    batch_size: int = 32
    seed: int = 0
    dtype: str = "auto"
    threads: int | None = None  # torch CPU threads (default: torch's); 1 is fastest for tiny models on a busy box
    # metrics
    kl: bool = True
    kl_batch_size: int = 16
    traffic: bool = True
    n_boot: int = 2000
    # output
    out_dir: str = "runs/eval"
    plots: bool = True
    cache: bool = True
    cache_dir: str | None = None  # default: <out>/cache (generations, stats); keep it out of committed reports
    progress: bool = True
    headline: tuple[str, float, str] = ("reap", 0.5, "decode")  # plan the length plot and summary show

    def validate(self) -> None:
        from slimwise.calibrate import PHASES
        from slimwise.criteria import CRITERIA

        bad = [m for m in self.modes if m not in EVAL_MODES]
        if bad:
            raise SlimWiseError(f"unknown modes {bad}; choose among {', '.join(EVAL_MODES)}")
        if "distilled" in self.modes or self.distilled:
            if not self.distilled:
                raise SlimWiseError("mode distilled needs --distilled DELTA (the output of `slimwise distill`)")
            if not distillation_available():
                raise SlimWiseError("distillation is not available yet in this install: drop mode distilled and "
                                    "--distilled")
        if self.engine not in ENGINES:
            raise SlimWiseError(f"unknown engine {self.engine!r}; choose one of {', '.join(ENGINES)}")
        if not self.plans:
            unknown = [c for c in self.criteria if c not in CRITERIA]
            if unknown:
                raise SlimWiseError(f"unknown criteria {unknown}; choose among {', '.join(sorted(CRITERIA))}")
            if not self.criteria or not self.ratios:
                raise SlimWiseError("give at least one criterion and one ratio (or --plan)")
            for r in self.ratios:
                if not 0.0 <= r < 1.0:
                    raise SlimWiseError(f"ratio {r} is outside [0, 1): pass shares of experts to prune")
            for p in self.phases:
                if p not in PHASES:
                    raise SlimWiseError(f"unknown calibration phase {p!r}; choose among {', '.join(PHASES)}")
        if self.grader not in GRADERS and ":" not in self.grader:
            raise SlimWiseError(f"unknown grader {self.grader!r}; choose one of {', '.join(GRADERS)} or module:function")
        if self.batch_size < 1 or self.max_new_tokens < 1:
            raise SlimWiseError("batch size and max new tokens must be at least 1")


@dataclass
class PlanSpec:
    """One pruned configuration of the sweep."""

    label: str
    plan: PrunePlan
    criterion: str
    ratio: float
    phase: str | None
    path: str | None = None

    @property
    def kept_key(self) -> str:
        """Identical kept sets give identical outputs: runs are shared between them."""
        blob = json.dumps(sorted((k, v) for k, v in self.plan.kept_experts.items()))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _gen_to_json(g: Generation) -> dict:
    return {"token_ids": g.token_ids, "finish_reason": g.finish_reason, "text": g.text}


def _gen_from_json(d: dict, prompt_ids: list[int]) -> Generation:
    return Generation(prompt_ids, list(d["token_ids"]), d["finish_reason"], d.get("text"))


def model_label(model: str | Path) -> str:
    """A short directory-safe name: the embedded name as given, else the directory name."""
    return Path(str(model)).name or str(model)


class Sweep:
    """One model through the grid: samples, calibration per phase, plans, full once, then every plan's runs.

    Runs are cached under out_dir/cache keyed by model fingerprint, prompts, generation settings, mode and
    kept-expert sets, so a rerun (or an interrupted sweep) only computes what is missing.
    """

    def __init__(self, model: str | Path, config: EvalConfig, out_dir: str | Path | None = None, console=None):
        from rich.console import Console

        from slimwise.models import load_model, load_tokenizer, resolve_model_dir

        config.validate()
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        self.console = console or Console()
        self.out_dir = Path(out_dir or config.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.cache_dir = Path(config.cache_dir) / model_label(model) if config.cache_dir else self.out_dir / "cache"
        self.model_name = model_label(model)
        self.model_dir = resolve_model_dir(model)
        t0 = time.perf_counter()
        self.model = load_model(self.model_dir, dtype=config.dtype)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.adapter = get_adapter(self.model.config)
        self.fingerprint = model_fingerprint(self.model)
        self.timing: dict[str, float] = {"load_s": time.perf_counter() - t0}
        self.samples = load_samples(config.data, split=config.split, n_per_family=config.n_per_family,
                                    seed=config.seed, domain=self._domain(), families=config.families,
                                    max_samples=config.max_samples)
        self.grader = make_grader(config.grader)
        self.ref_engine = PhaseSplitEngine(self.model, self.tokenizer)
        self.prompt_ids = self.ref_engine._encode([s.prompt for s in self.samples])
        self.gen_config = GenerationConfig(max_new_tokens=config.max_new_tokens, batch_size=config.batch_size,
                                           seed=config.seed, progress=config.progress)
        self.calibration: dict[str, dict] = {}
        self._kl_reference: dict[int, torch.Tensor] = {}
        self._full: list[Generation] | None = None
        # vLLM: one engine per plan serves full, slimwise and uniform (mode switched in place): (kept_key, engine)
        self._vllm: tuple[str | None, Any] | None = None
        self._first_spec: PlanSpec | None = None  # the plan whose engine also runs mode full
        self.delta = load_delta(config.distilled) if config.distilled else None
        self.modes = [m for m in dict.fromkeys([*config.modes, *(["distilled"] if self.delta else [])]) if m != "full"]

    def _delta_fits(self, spec: PlanSpec) -> bool:
        """A delta belongs to one plan (same kept experts on the same weights): mode distilled runs only there."""
        from slimwise.distill import plan_hash

        return self.delta is not None and self.delta.manifest.get("plan_hash") == plan_hash(spec.plan)

    def _domain(self) -> str | None:
        from slimwise.testbed import TARGET_DOMAIN

        return self.config.domain or TARGET_DOMAIN

    # ----- calibration and plans -------------------------------------------------------------------------
    def _calibration_prompts(self) -> tuple[list[str], str]:
        cfg = self.config
        if cfg.calib_data:
            from slimwise.data import load_prompts

            return load_prompts(cfg.calib_data), str(cfg.calib_data)
        from slimwise.testbed import TARGET_DOMAIN, make_split

        domain = cfg.calib_domain or TARGET_DOMAIN  # the deployment's domain, whatever is evaluated
        calib = make_split("calib", cfg.calib_per_family, seed=cfg.seed, domain=None if domain == "all" else domain)
        return [s.prompt for s in calib], f"testbed calib split, {domain}, {cfg.calib_per_family}/family"

    def calibrate(self, phase: str):
        """Stats for `phase`, from out_dir/cache when they match this model and calibration setup."""
        from slimwise.calibrate import CalibrationConfig, calibrate
        from slimwise.stats import ExpertStats

        prompts, source = self._calibration_prompts()
        ccfg = CalibrationConfig(phase=phase, max_new_tokens=self.config.calib_max_new_tokens, seed=self.config.seed,
                                 batch_size=self.config.batch_size)
        key = _digest({"fp": self.fingerprint, "prompts": prompts, "config": asdict(ccfg)})
        path = self.cache_dir / f"stats-{phase}-{key}.safetensors"
        if self.config.cache and path.is_file():
            stats = ExpertStats.load(path)
            cached = True
        else:
            stats = calibrate(self.model, prompts, self.tokenizer, ccfg, progress=self.config.progress)
            stats.meta["data"] = source
            stats.save(path)
            cached = False
        self.calibration[phase] = {"stats": str(path), "cached": cached, "prompts": len(prompts), "source": source,
                                   "tokens_counted": float(stats.tokens[0]) if len(stats.tokens) else 0.0,
                                   "seconds": 0.0 if cached else float(stats.meta.get("seconds", 0.0)),
                                   "original_seconds": float(stats.meta.get("seconds", 0.0))}
        return stats

    def build_plans(self) -> list[PlanSpec]:
        """Explicit plans, or criterion x ratio for each calibration phase (stats computed or cached once)."""
        from slimwise.criteria import plan_from_stats
        from slimwise.stats import ExpertStats

        cfg = self.config
        specs: list[PlanSpec] = []
        if cfg.plans:
            for p in cfg.plans:
                plan = PrunePlan.load(p)
                plan.check_model(self.model, self.adapter)
                label = f"{plan.criterion}-{plan.phase or 'na'}-{plan.ratio:g}"
                if any(sp.label == label for sp in specs):
                    label = f"{label}-{Path(p).stem}"
                specs.append(PlanSpec(label, plan, plan.criterion, plan.ratio, plan.phase, str(p)))
            return specs
        t0 = time.perf_counter()
        stats_by_phase = {}
        for s in cfg.stats:
            stats = ExpertStats.load(s)
            phase = stats.meta.get("config", {}).get("phase", "unknown")
            stats_by_phase[phase] = stats
            self.calibration[phase] = {"stats": str(s), "cached": True, "source": stats.meta.get("data"),
                                       "tokens_counted": float(stats.tokens[0]), "seconds": 0.0}
        for phase in cfg.phases if not cfg.stats else ():  # given stats replace calibration
            self.console.print(f"[bold]calibrating[/] ({phase} phase)")
            stats_by_phase[phase] = self.calibrate(phase)
        plan_dir = self.out_dir / "plans"
        for phase in stats_by_phase:
            for criterion in cfg.criteria:
                for ratio in cfg.ratios:
                    plan = plan_from_stats(stats_by_phase[phase], criterion, ratio, scope=cfg.scope)
                    plan.check_model(self.model, self.adapter)
                    label = f"{criterion}-{phase}-{ratio:g}"
                    path = plan.save(plan_dir / f"{label}.json")
                    specs.append(PlanSpec(label, plan, criterion, ratio, phase, str(path)))
        self.timing["calibration_s"] = time.perf_counter() - t0
        return specs

    # ----- runs ------------------------------------------------------------------------------------------
    def _run_key(self, mode: str, spec: PlanSpec | None) -> str:
        g = self.gen_config
        delta = _digest(self.delta.manifest) if mode == "distilled" and self.delta is not None else None
        return _digest({"fp": self.fingerprint, "prompts": self.prompt_ids, "mode": mode, "engine": self.config.engine,
                        "delta": delta,
                        "kept": spec.kept_key if spec else None, "max_new": g.max_new_tokens, "bs": g.batch_size,
                        "t": g.temperature, "seed": g.seed, "kl": self.config.kl, "traffic": self.config.traffic})

    def _generate(self, mode: str, spec: PlanSpec | None) -> dict[str, Any]:
        """Generations (+ traffic, KL, seconds) of one mode and plan, from the run cache when present."""
        key = self._run_key(mode, spec)
        path = self.cache_dir / f"run-{mode}-{key}.json"
        if self.config.cache and path.is_file():
            rec = json.loads(path.read_text())
            rec["gens"] = [_gen_from_json(d, p) for d, p in zip(rec["gens"], self.prompt_ids, strict=True)]
            rec["cached"] = True
            return rec
        plan = spec.plan if spec else None
        engine, owned = self._engine(mode, spec)
        hf = isinstance(engine, PhaseSplitEngine)
        meter = DecodeTrafficMeter(self.model, _active_experts(plan, mode), self.config.batch_size) \
            if self.config.traffic and hf else None
        try:
            t0 = time.perf_counter()
            if hf:
                gens = engine.generate(self.prompt_ids, mode=mode, config=self.gen_config, observer=meter)
            else:
                gens = engine.generate(self.prompt_ids, mode, self.gen_config)
            seconds = time.perf_counter() - t0
        finally:
            if meter is not None:
                meter.remove()
            if owned:
                _close(engine)
        if self.tokenizer is not None:
            for g in gens:
                if g.text is None:
                    g.text = self.tokenizer.decode(g.token_ids[:-1] if g.finish_reason == "eos" else g.token_ids)
        rec = {"gens": gens, "seconds": seconds, "traffic": meter.summary() if meter else None, "kl": None}
        rec["kl_seconds"] = 0.0
        if self.config.kl and mode != "full":
            t0 = time.perf_counter()
            rec["kl"] = self._kl(mode, plan)
            rec["kl_seconds"] = time.perf_counter() - t0
        elif self.config.kl:
            rec["kl"] = [0.0] * len(gens)
        if self.config.cache:
            atomic_write_text(path, json.dumps({**rec, "gens": [_gen_to_json(g) for g in gens]}))
        rec["cached"] = False
        return rec

    def _kl(self, mode: str, plan: PrunePlan | None) -> list[float]:
        engine = make_engine("hf", self.model, self.tokenizer, plan, None, self.delta if mode == "distilled" else None)
        conts = [g.token_ids for g in self.full()]
        vocab = int(getattr(self.adapter.text_config(self.model.config), "vocab_size", 0) or 0)
        # keep the full model's log-probs across plans only while they are small (testbed vocabularies)
        reference = self._kl_reference if vocab * sum(map(len, conts)) * 4 <= KL_REFERENCE_BYTES else None
        try:
            return teacher_forced_kl(engine, self.prompt_ids, conts, mode, self.config.kl_batch_size, reference)
        finally:
            engine.close()

    def _engine(self, mode: str, spec: PlanSpec | None) -> tuple[Any, bool]:
        """The engine for one run and whether the caller closes it. vLLM engines are kept across the modes of a
        plan (full runs on the first plan's engine): one engine start per plan instead of one per run."""
        delta = self.delta if mode == "distilled" else None
        if self.config.engine != "vllm" or delta is not None:
            return make_engine(self.config.engine, self.model, self.tokenizer, spec.plan if spec else None,
                               self.model_dir, delta), True
        spec = spec or self._first_spec
        key = spec.kept_key if spec else None
        if self._vllm is None or self._vllm[0] != key:
            self._close_engine()
            self._vllm = (key, make_engine("vllm", self.model, self.tokenizer, spec.plan if spec else None,
                                           self.model_dir, share=True))
        return self._vllm[1], False

    def _close_engine(self) -> None:
        """Stop a kept vLLM engine (its EngineCore process holds the weights and the KV cache)."""
        if self._vllm is not None:
            _close(self._vllm[1])
            self._vllm = None

    def full(self) -> list[Generation]:
        if self._full is None:
            self._full_rec = self._generate("full", None)
            self._full = self._full_rec["gens"]
        return self._full

    def _metrics(self, rec: dict[str, Any]) -> dict[str, Any]:
        m = run_metrics(self.samples, rec["gens"], self.full(), self.grader, self.gen_config.max_new_tokens,
                        rec.get("kl"), self.config.seed, self.config.n_boot)
        m["traffic"] = rec.get("traffic")
        m["seconds"] = rec["seconds"]
        m["kl_seconds"] = rec.get("kl_seconds", 0.0)
        m["cached"] = rec.get("cached", False)
        return m

    def run(self, specs: list[PlanSpec] | None = None) -> dict[str, Any]:
        """The whole sweep for this model; writes report.json (+ report.md and plots) to out_dir."""
        t_start, cpu_start = time.perf_counter(), time.process_time()
        cfg = self.config
        specs = self.build_plans() if specs is None else specs
        modes = self.modes
        if self.delta is not None and not any(self._delta_fits(sp) for sp in specs):
            raise SlimWiseError(f"the delta {cfg.distilled} was distilled for another plan than any evaluated here: "
                                "pass --plan PLAN, the plan given to `slimwise distill`")
        todo = [(sp, m) for sp in specs for m in modes if m != "distilled" or self._delta_fits(sp)]
        total = 1 + len(todo)
        self.console.print(f"[bold]{self.model_name}[/]: {len(self.samples)} samples, {len(specs)} plans, modes "
                           f"{', '.join(modes)}: {total} runs with full ({len({s.kept_key for s in specs})} distinct "
                           "kept sets)", soft_wrap=True)
        self._first_spec = specs[0] if specs else None
        try:
            return self._run(specs, modes, todo, total, t_start, cpu_start)
        finally:
            self._close_engine()

    def _run(self, specs: list[PlanSpec], modes: list[str], todo: list, total: int, t_start: float,
             cpu_start: float) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.full()
        full_metrics = self._metrics(self._full_rec)
        self.timing["full_s"] = time.perf_counter() - t0
        self._say(1, total, "full", None, full_metrics)
        runs: list[dict[str, Any]] = []
        shared: dict[tuple[str, str], dict] = {}
        done = 1
        t0 = time.perf_counter()
        for spec, mode in todo:
            done += 1
            key = (mode, spec.kept_key)
            if key not in shared:
                shared[key] = self._metrics(self._generate(mode, spec))
                elapsed = time.perf_counter() - t0
                eta = elapsed / (done - 1) * (total - done)
                self._say(done, total, mode, spec, shared[key], f"elapsed {elapsed / 60:.1f} min, ETA "
                          f"{eta / 60:.1f} min")
            else:
                self.console.print(f"[{done}/{total}] {mode:8s} {spec.label}: same kept experts as an earlier "
                                   "plan, reusing its run")
            runs.append({"mode": mode, "criterion": spec.criterion, "ratio": spec.ratio, "phase": spec.phase,
                         "label": spec.label, "plan": spec.path, "kept_key": spec.kept_key,
                         "kept_per_layer": spec.plan.num_kept if spec.plan.is_uniform else None,
                         "metrics": shared[key]})
        self.timing["pruned_runs_s"] = time.perf_counter() - t0
        self.timing["total_s"] = time.perf_counter() - t_start + self.timing.get("load_s", 0.0)
        self.timing["process_cpu_s"] = time.process_time() - cpu_start  # > wall when threads run in parallel
        # what the work costs without the cache: original seconds of every distinct run and calibration
        self.timing["uncached_estimate_s"] = (
            sum(m["seconds"] + m.get("kl_seconds", 0.0) for m in [full_metrics, *shared.values()])
            + sum(c.get("original_seconds", c.get("seconds", 0.0)) for c in self.calibration.values())
            + self.timing.get("load_s", 0.0))
        report = self._assemble(full_metrics, runs)
        self.write(report)
        return report

    def _say(self, done: int, total: int, mode: str, spec: PlanSpec | None, m: dict[str, Any],
             extra: str = "") -> None:
        kl = m.get("kl_mean")
        tr = (m.get("traffic") or {}).get("distinct_experts_per_layer_step")
        took = "cached" if m.get("cached") else f"{m['seconds'] + m.get('kl_seconds', 0):.1f}s"
        self.console.print(
            f"[{done}/{total}] {mode:8s} {spec.label if spec else '-':22s} acc {m['accuracy']:.1%} "
            f"[{m['accuracy_ci_low']:.0%}, {m['accuracy_ci_high']:.0%}]  len {m['length_mean']:.1f}  "
            f"EM {m['exact_match']:.0%}  KL {'-' if kl is None else f'{kl:.3f}'}  "
            f"experts/step {'-' if tr is None else f'{tr:.1f}'}  "
            f"({took}{'; ' + extra if extra else ''})", soft_wrap=True)

    # ----- report ----------------------------------------------------------------------------------------
    def _comparisons(self, full_metrics: dict, runs: list[dict]) -> list[dict]:
        """Paired accuracy differences per plan: slimwise - uniform and each pruned mode - full."""
        by_plan: dict[str, dict[str, dict]] = {}
        for r in runs:
            by_plan.setdefault(r["label"], {})[r["mode"]] = r
        out = []
        for label, modes in by_plan.items():
            any_run = next(iter(modes.values()))
            row = {"label": label, "criterion": any_run["criterion"], "ratio": any_run["ratio"],
                   "phase": any_run["phase"]}
            for mode, r in modes.items():
                row[f"{mode}_minus_full"] = paired_difference(r["metrics"]["correct"], full_metrics["correct"],
                                                              self.config.n_boot, self.config.seed)
            for a, b in (("slimwise", "uniform"), ("distilled", "slimwise"), ("distilled", "uniform")):
                if a in modes and b in modes:
                    row[f"{a}_minus_{b}"] = paired_difference(modes[a]["metrics"]["correct"],
                                                              modes[b]["metrics"]["correct"],
                                                              self.config.n_boot, self.config.seed)
            out.append(row)
        return out

    def _assemble(self, full_metrics: dict, runs: list[dict]) -> dict[str, Any]:
        cfg = self.config
        params = sum(p.numel() for p in self.model.parameters())
        layers = self.adapter.moe_layers(self.model)
        comparisons = self._comparisons(full_metrics, runs)
        sw = [c["slimwise_minus_uniform"] for c in comparisons if "slimwise_minus_uniform" in c]
        families = sorted({s.family for s in self.samples})
        return {
            "schema": SCHEMA,
            "model": {"name": self.model_name, "path": str(self.model_dir), "family": self.adapter.family,
                      "parameters": params, "num_experts": self.adapter.num_experts(self.model.config),
                      "top_k": self.adapter.top_k(self.model.config), "moe_layers": len(layers),
                      "expert_bytes": int(self.adapter.expert_bytes(layers[0].experts)) if layers else 0,
                      "fingerprint": self.fingerprint},
            "config": {**asdict(cfg), "headline": list(cfg.headline)},
            "tasks": {"source": cfg.data or "testbed", "split": None if cfg.data else cfg.split,
                      "domain": None if cfg.data or cfg.families else self._domain(), "grader": cfg.grader,
                      "n": len(self.samples), "families": families,
                      "per_family": {f: sum(s.family == f for s in self.samples) for f in families}},
            "generation": {"max_new_tokens": self.gen_config.max_new_tokens, "batch_size": self.gen_config.batch_size,
                           "temperature": self.gen_config.temperature, "engine": cfg.engine},
            "environment": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "torch": torch.__version__, "python": platform.python_version(),
                            "platform": platform.platform()},
            "calibration": self.calibration,
            "distilled": None if self.delta is None else {
                "path": str(self.config.distilled),
                **{k: self.delta.manifest.get(k) for k in ("mode", "params", "plan_hash", "steps", "trainable_params",
                                                           "trainable_share", "seconds")}},
            "timing": {k: round(v, 2) for k, v in self.timing.items()},
            "full": full_metrics,
            "runs": runs,
            "comparisons": comparisons,
            "summary": {
                "plans": len(comparisons),
                "slimwise_better": sum(c["ci_low"] > 0 for c in sw),
                "slimwise_worse": sum(c["ci_high"] < 0 for c in sw),
                "no_significant_difference": sum(c["ci_low"] <= 0 <= c["ci_high"] for c in sw),
                "slimwise_higher_point_estimate": sum(c["diff"] > 0 for c in sw),
                "slimwise_lower_point_estimate": sum(c["diff"] < 0 for c in sw),
                "full_accuracy": full_metrics["accuracy"],
                "accuracy_ci_halfwidth_at_half": 1.96 * math.sqrt(0.25 / max(len(self.samples), 1)),
            },
            "plots": [],
        }

    def write(self, report: dict[str, Any]) -> None:
        from slimwise.report import write_markdown, write_plots

        if self.config.plots:
            report["plots"] = write_plots(report, self.out_dir)
        (self.out_dir / "report.json").write_text(dumps_compact(report) + "\n")
        write_markdown(report, self.out_dir / "report.md")
        self.console.print(f"report: {self.out_dir / 'report.md'}, {self.out_dir / 'report.json'}"
                           + (f", {len(report['plots'])} plots" if report["plots"] else "")
                           + f"  (total {report['timing']['total_s']:.0f}s on {torch.get_num_threads()} threads)",
                           soft_wrap=True)

    def close(self) -> None:
        self._close_engine()
        self._kl_reference.clear()


_NUMBER_LIST = re.compile(r"\[\s*(?:-?[\d.eE+-]+|null)(?:,\s*(?:-?[\d.eE+-]+|null))*\s*\]")


def dumps_compact(obj: Any) -> str:
    """Indented JSON with every list of numbers on one line (per-sample vectors stay readable and small)."""
    text = json.dumps(obj, indent=1, default=_json_default)
    return _NUMBER_LIST.sub(lambda m: re.sub(r"\s+", "", m.group(0)).replace(",", ", "), text)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def run_eval(models: Sequence[str | Path], config: EvalConfig, console=None) -> list[dict[str, Any]]:
    """The sweep for every model; with several models each gets out_dir/<name>/ plus an index.md."""
    from rich.console import Console

    from slimwise.report import write_index

    config.validate()
    console = console or Console()
    labels = [model_label(m) for m in models]
    if len(set(labels)) != len(labels):
        raise SlimWiseError(f"models {labels} share a directory name; their reports would overwrite each other")
    out = Path(config.out_dir)
    reports = []
    t0 = time.perf_counter()
    for model in models:
        target = out / model_label(model) if len(models) > 1 else out
        sweep = Sweep(model, config, target, console)
        try:
            reports.append(sweep.run())
        finally:
            sweep.close()
    if len(models) > 1:
        write_index(reports, out, [model_label(m) for m in models])
    console.print(f"eval done in {time.perf_counter() - t0:.0f}s on {os.cpu_count()} CPUs "
                  f"({torch.get_num_threads()} torch threads)")
    return reports


__all__ = [
    "DEFAULT_CRITERIA", "DEFAULT_PHASES", "DEFAULT_RATIOS", "EVAL_MODES", "SCHEMA", "DecodeTrafficMeter",
    "EvalConfig", "GenerationEngine", "GradedSample", "PlanSpec", "Sweep", "accuracy_metrics", "bootstrap_ci",
    "continuation_logprobs", "evaluate_modes", "fidelity_metrics", "first_difference", "kl_divergence",
    "length_metrics", "length_ratios", "load_samples", "make_engine", "make_grader", "paired_difference",
    "run_eval", "run_metrics", "teacher_forced_kl", "uniform_expected_distinct",
]
