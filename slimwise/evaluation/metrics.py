"""Pure, hand-checkable metric functions: accuracy with bootstrap intervals, lengths, fidelity to the full
model, and teacher-forced KL(full || mode) over the full model's own continuations."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np
import torch

from slimwise.engines.reference import Generation, PhaseSplitEngine
from slimwise.scoring import continuation_logprobs, kl_divergence


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


def paired_difference(a: Sequence[bool], b: Sequence[bool], n_boot: int = 2000,
                      seed: int = 0) -> dict[str, float]:
    """Mean of a - b over the same samples with a paired bootstrap interval (resamples samples, not runs),
    and McNemar's exact test on the same pairs (`a_only`, `b_only`, `p_exact`: see `mcnemar_exact`)."""
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    lo, hi = bootstrap_ci(diff, n_boot=n_boot, seed=seed)
    return {"diff": float(diff.mean()) if diff.size else float("nan"), "ci_low": lo, "ci_high": hi,
            **mcnemar_exact(a, b)}


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool]) -> dict[str, float]:
    """McNemar's exact test of two paired 0/1 outcomes: only the discordant pairs carry information; under
    equal accuracy the problems a alone solves are Binomial(discordant, 1/2). Two-sided p = twice the smaller
    tail, capped at 1 (1 when no pair is discordant)."""
    if len(a) != len(b):
        raise ValueError(f"paired outcomes differ in length: {len(a)} and {len(b)}")
    a_only = sum(bool(x) and not bool(y) for x, y in zip(a, b, strict=True))
    b_only = sum(bool(y) and not bool(x) for x, y in zip(a, b, strict=True))
    n, k = a_only + b_only, min(a_only, b_only)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return {"a_only": a_only, "b_only": b_only, "p_exact": min(1.0, 2 * tail)}


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of a family's p-values (same order as given): the i-th smallest is
    multiplied by (m - i), never decreasing along the order and capped at 1. Rejecting adjusted p < alpha
    bounds the family-wise error at alpha whatever the dependence between the tests."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted = [0.0] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def significant(d: dict, sign: int) -> bool:
    """Whether a paired difference is significantly above (sign 1) or below (-1) zero: McNemar's exact p,
    Holm-adjusted over its table, below 0.05 where the report has it; else (reports written before it) the
    bootstrap interval excluding 0."""
    if "p_holm" in d:
        return d["p_holm"] < 0.05 and d["diff"] * sign > 0
    return d["ci_low"] > 0 if sign > 0 else d["ci_high"] < 0


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
    """Index of the first differing token (a length difference counts at the
    shorter length); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def length_ratios(outputs: Sequence[Generation], reference: Sequence[Generation]) -> list[float]:
    """Per-sample generated length over the full model's length for the same prompt."""
    return [len(o.token_ids) / max(len(r.token_ids), 1) for o, r in zip(outputs, reference, strict=True)]


def fidelity_metrics(outputs: Sequence[Generation],
                     reference: Sequence[Generation]) -> dict[str, float | None]:
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


def teacher_forced_kl(engine: PhaseSplitEngine, prompts: Sequence[Sequence[int]],
                      continuations: Sequence[Sequence[int]], mode: str, batch_size: int = 8,
                      reference_cache: dict[int, torch.Tensor] | None = None) -> list[float]:
    """Per sample, mean over the full model's continuation positions of KL(full || mode).

    `reference_cache` (batch start -> full log-probs) avoids recomputing the full model across plans. A model
    loaded with decoder layers offloaded (`--max-memory`) is scored one layer at a time instead, the full
    model and the mode in one pass (`slimwise.sequential.streamed_logprobs`; equal within 1e-4 per log-prob).
    """
    from slimwise.sequential import offloaded_share, streamed_logprobs

    if mode != "full" and offloaded_share(engine.model)[0]:
        scored = [i for i, c in enumerate(continuations) if len(c)]
        lp = streamed_logprobs(engine.model, [prompts[i] for i in scored], [continuations[i] for i in scored],
                               modes=("full", mode), plan=engine.plan, tokenizer=engine.tokenizer,
                               batch_size=batch_size, progress=False)
        pairs = zip(scored, lp["full"], lp[mode], strict=True)
        kls = {i: float(kl_divergence(f, m).mean()) for i, f, m in pairs}
        return [kls.get(i, 0.0) for i in range(len(continuations))]
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
