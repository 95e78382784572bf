"""Evaluation samples and graders: JSONL records or testbed problems, and how an output is judged right."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from slimwise.engines.reference import Generation
from slimwise.errors import SlimWiseError

GRADERS = ("testbed", "exact", "contains")


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

        return lambda s, g: grade(s.raw or {"answer": s.answer}, g.text or "",
                                  g.finish_reason == "eos").correct
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
            out = fn(s.raw or {"prompt": s.prompt, "answer": s.answer}, g.text or "",
                     g.finish_reason == "eos")
            return bool(getattr(out, "correct", out))

        return custom
    raise SlimWiseError(f"unknown grader {name!r}; choose one of {', '.join(GRADERS)} or module:function")


def domain_of(sample: GradedSample) -> str:
    """The sample's testbed domain (from its record), else its family."""
    raw = sample.raw or {}
    return str(raw.get("domain") or sample.family)


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
