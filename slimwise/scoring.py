"""Teacher-forced scoring on a prefill cache: continue a cache with a mode's decoder, and compare
distributions.

Shared by the trainer (`slimwise.distill`: the loss), the evaluation (teacher-forced KL) and the experiments
(fidelity of a bars run). One forward of a whole continuation on the cache gives every position's logits,
which is what both training and measurement need; generation (`PhaseSplitEngine.generate`) runs the same
decode model one token at a time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from slimwise.engines.reference import PhaseSplitEngine

DIVERGENCES = ("fkl", "rkl", "jsd")


def continue_on_cache(
    engine: PhaseSplitEngine,
    mode: str,
    cache,
    attention: torch.Tensor,
    positions: torch.Tensor,
    continuations: Sequence[Sequence[int]],
    width: int,
) -> torch.Tensor:
    """Logits [B, width-1, V] of one teacher-forced forward of continuation[:-1] on a prefill cache, with
    `mode`'s decode model (right padding; causal attention keeps it out of the real positions)."""
    ids = torch.full(
        (len(continuations), width - 1), engine.pad_id, dtype=torch.long, device=attention.device
    )
    for i, c in enumerate(continuations):
        if len(c) > 1:
            ids[i, :len(c) - 1] = torch.tensor(list(c[:-1]), dtype=torch.long)
    attention = torch.cat([attention, torch.ones_like(ids)], dim=1)
    pos = positions[:, -1:] + 1 + torch.arange(width - 1, device=ids.device)[None, :]
    return engine.decode(ids, cache, attention, pos, mode)


@torch.no_grad()
def continuation_logprobs(engine: PhaseSplitEngine, prompts: Sequence[Sequence[int]],
                          continuations: Sequence[Sequence[int]], mode: str = "full") -> torch.Tensor:
    """Log-probs [B, T, V] of every continuation position, teacher-forced, in `mode`.

    Position t is the distribution of continuation token t given prompt + continuation[:t]: position 0 comes
    from the mode's prefill logits (the full model's for slimwise), the rest from one forward of the
    continuation on that cache with the mode's decode model (mask active for slimwise and uniform).
    """
    width = max(len(c) for c in continuations)
    cache, first, attention, positions = engine.prefill(prompts, mode)
    parts = [first[:, None, :]]
    if width > 1:
        parts.append(continue_on_cache(engine, mode, cache, attention, positions, continuations, width))
    return torch.log_softmax(torch.cat(parts, dim=1), dim=-1)


def teacher_logprobs(engine: PhaseSplitEngine, prompts: Sequence[Sequence[int]],
                     continuations: Sequence[Sequence[int]]) -> torch.Tensor:
    """The full model's log-probs [B, W, V] at every continuation position (position 0 from its prefill)."""
    return continuation_logprobs(engine, prompts, continuations, "full")


@torch.no_grad()
def logprobs_along(engine: PhaseSplitEngine, prompts: Sequence[Sequence[int]],
                   continuations: Sequence[Sequence[int]], batch_size: int) -> list[torch.Tensor]:
    """The full model's log-probs [len, V] along each continuation, computed `batch_size` prompts at a
    time."""
    out: list[torch.Tensor] = []
    for start in range(0, len(prompts), batch_size):
        chunk = continuations[start:start + batch_size]
        lp = teacher_logprobs(engine, prompts[start:start + batch_size], chunk)
        # kept on the host: the teacher cache would otherwise hold GPU memory for the whole run
        out += [lp[i, :len(c)].to("cpu", copy=True) for i, c in enumerate(chunk)]
    return out


def _kl(p_lp: torch.Tensor, q_lp: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dim, from log-probabilities."""
    return (p_lp.exp() * (p_lp - q_lp)).sum(-1)


def divergence(teacher_lp: torch.Tensor, student_logits: torch.Tensor, kind: str = "fkl") -> torch.Tensor:
    """Per-position divergence [..., T] between the teacher's log-probs and the student's logits (the training
    loss: fkl = KL(teacher || student), rkl = KL(student || teacher), jsd)."""
    s = torch.log_softmax(student_logits, dim=-1)
    t = teacher_lp
    if kind == "fkl":
        return _kl(t, s)
    if kind == "rkl":
        return _kl(s, t)
    m = torch.logsumexp(torch.stack([t, s]), dim=0) - math.log(2.0)
    return 0.5 * _kl(t, m) + 0.5 * _kl(s, m)


def kl_divergence(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) between two sets of log-probabilities (the evaluation metric), in float32 and clamped
    at 0 against rounding."""
    return _kl(ref_logprobs.float(), logprobs.float()).clamp_min(0.0)


__all__ = ["DIVERGENCES", "continuation_logprobs", "continue_on_cache", "divergence", "kl_divergence",
           "logprobs_along", "teacher_logprobs"]
