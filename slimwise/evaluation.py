"""Quality metrics that compare full / uniform / SlimWise generations: accuracy, length, fidelity.

Pure functions over generations (hand-checkable), plus `evaluate_modes`, which runs an engine over graded
samples in several modes and returns one metrics dict per mode. Accuracy alone hides pruning-induced
length changes, so length and stopping behaviour are reported next to it, per sample against the full model.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from slimwise.generate import Generation, GenerationConfig, PhaseSplitEngine


@dataclass
class GradedSample:
    prompt: str
    answer: str
    family: str = "all"
    raw: dict | None = None


def bootstrap_ci(values: Sequence[float], n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = arr[rng.integers(0, arr.size, size=(n_boot, arr.size))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def length_metrics(generations: Sequence[Generation], max_new_tokens: int) -> dict[str, float]:
    """Generated length (tokens, EOS included) and how outputs ended."""
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


def fidelity_metrics(outputs: Sequence[Generation], reference: Sequence[Generation]) -> dict[str, float | None]:
    """Agreement with the full model's generations for the same prompts."""
    pairs = list(zip(outputs, reference, strict=True))
    diffs = [first_difference(o.token_ids, r.token_ids) for o, r in pairs]
    differing = [d for d in diffs if d is not None]
    ratios = [len(o.token_ids) / max(len(r.token_ids), 1) for o, r in pairs]
    return {
        "exact_match": sum(d is None for d in diffs) / len(pairs),
        "first_token_agree": sum(bool(o.token_ids[:1] == r.token_ids[:1]) for o, r in pairs) / len(pairs),
        "first_diff_mean": float(np.mean(differing)) if differing else None,
        "length_ratio_mean": float(np.mean(ratios)),
        "length_ratio_p10": float(np.quantile(ratios, 0.1)),
        "length_ratio_p90": float(np.quantile(ratios, 0.9)),
    }


def accuracy_metrics(correct: Sequence[bool], seed: int = 0) -> dict[str, float]:
    lo, hi = bootstrap_ci([float(c) for c in correct], seed=seed)
    return {"accuracy": sum(correct) / max(len(correct), 1), "accuracy_ci_low": lo, "accuracy_ci_high": hi,
            "n": len(correct)}


Grader = Callable[[GradedSample, Generation], bool]


def evaluate_modes(engine: PhaseSplitEngine, samples: Sequence[GradedSample], modes: Sequence[str],
                   config: GenerationConfig, grader: Grader, seed: int = 0) -> dict[str, dict]:
    """Generate every sample in every mode; metrics per mode (and per task family), fidelity against full."""
    prompts = [s.prompt for s in samples]
    runs: dict[str, list[Generation]] = {}
    seconds: dict[str, float] = {}
    for mode in dict.fromkeys(["full", *modes]):
        t0 = time.perf_counter()
        runs[mode] = engine.generate(prompts, mode=mode, config=config)
        seconds[mode] = time.perf_counter() - t0
    report: dict[str, dict] = {}
    for mode in modes:
        gens = runs[mode]
        correct = [grader(s, g) for s, g in zip(samples, gens, strict=True)]
        metrics = {**accuracy_metrics(correct, seed), **length_metrics(gens, config.max_new_tokens),
                   **fidelity_metrics(gens, runs["full"]), "seconds": seconds[mode]}
        by_family = {}
        for fam in sorted({s.family for s in samples}):
            idx = [i for i, s in enumerate(samples) if s.family == fam]
            by_family[fam] = {**accuracy_metrics([correct[i] for i in idx], seed),
                              **length_metrics([gens[i] for i in idx], config.max_new_tokens)}
        metrics["by_family"] = by_family
        metrics["lengths"] = [len(g.token_ids) for g in gens]
        report[mode] = metrics
    return report
