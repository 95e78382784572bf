"""Long-prompt task families: problems whose prompt (up to 1,024 tokens) decides the answer.

The families of `slimwise.testbed.tasks` have prompts of 9 to 36 tokens, so decode dominates every measurement
and a full-model prefill has little to protect. These put the information in the prompt:
- `lookup`: N `key=value` facts, then one key to find; the answer is its value.
- `chain`: N `a>b` links over distinct names, then a start to follow twice; the answer is the name two links
  on (the other links are distractors).
- `infer`: worked examples `in: w out: f(w)` of one transformation drawn per prompt (reverse, uppercase, drop
  the vowels, double each letter), then a query; the rule is only in the examples. The solution names the
  rule, then applies it step by step as the short family of the same transformation does.

`length` (the knob of every family) is the prompt's size in characters: items are added while the next would
still fit. The testbed tokenizer spells these prompts letter by letter with a few whole-word tokens, so a
prompt holds between 0.75 x length and length tokens (tests/test_long_tasks.py). Targets are short worked
solutions ending in `#### answer`, graded by `tasks.grade` like every family.

They are a registry of their own (domain "long"), not in `tasks.FAMILIES`: the shipped backbones were trained
without them and their cards' bars are over FAMILIES. Splits use the same hash buckets as `make_split`, so
train, calib and test never share a prompt.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from collections.abc import Callable, Iterable
from typing import NamedTuple

from slimwise.testbed.tasks import (
    SPLIT_BUCKETS,
    SPLITS,
    VOWELS,
    Sample,
    _solution,
    _word,
    novowel_steps,
    split_bucket,
    strrev_steps,
    upper_steps,
)

LONG_DOMAIN = "long"
#: the long final split never draws a problem of these test samples (the seeds any published run or decision
#: used, at the largest size any drew per family and length)
LONG_FINAL_EXCLUDES = {"seeds": (0, 5), "per_family": 150}
#: the prompt lengths the measurement sweeps (characters; about as many tokens)
LENGTHS = (64, 256, 512, 1024)
MIN_LENGTH = 48
LongFn = Callable[[random.Random, int], tuple[str, str, str]]
LONG_FAMILIES: dict[str, LongFn] = {}


def register_long(name: str) -> Callable[[LongFn], LongFn]:
    def deco(fn: LongFn) -> LongFn:
        if name in LONG_FAMILIES:
            raise ValueError(f"long task family {name!r} registered twice")
        LONG_FAMILIES[name] = fn
        return fn

    return deco


def _fill(head: str, items: list[str], tail: str, length: int, keep: int = 1) -> str:
    """head + as many of `items` (one per line) as fit with tail in `length` characters (at least the first
    `keep`: the ones the answer needs)."""
    body, size = [], len(head) + len(tail)
    for item in items:
        if len(body) >= keep and size + len(item) + 1 > length:
            break
        body.append(item)
        size += len(item) + 1
    return head + "".join(line + "\n" for line in body) + tail


def _names(rng: random.Random, n: int, size: int = 3) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        w = _word(rng, size)
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


@register_long("lookup")
def gen_lookup(rng: random.Random, length: int) -> tuple[str, str, str]:
    keys = _names(rng, max(2, length // 6))  # "abc=42" + newline: 7 characters per fact
    facts = [f"{k}={rng.randint(10, 99)}" for k in keys]
    tail_of = lambda k: f"find {k}\n"  # noqa: E731
    prompt = _fill("facts:\n", facts, tail_of(keys[0]), length)  # sizes the prompt with a same-length tail
    shown = prompt.split("\n")[1:-2]
    key, value = rng.choice(shown).split("=")
    prompt = prompt[: -len(tail_of(keys[0]))] + tail_of(key)
    return prompt, _solution([f"{key}={value}"], value), value


@register_long("chain")
def gen_chain(rng: random.Random, length: int) -> tuple[str, str, str]:
    names = _names(rng, max(4, length // 4 + 3))
    a, b, c = names[:3]
    others = names[3:]
    # no distractor link starts at a, b or c, so the two hops from a are unique
    links = [f"{x}>{rng.choice(names)}" for x in others]
    links[:0] = [f"{a}>{b}", f"{b}>{c}"]
    tail = f"follow {a} twice\n"
    kept = _fill("links:\n", links, tail, length, keep=2).split("\n")[1:-2]
    rng.shuffle(kept)
    prompt = "links:\n" + "".join(line + "\n" for line in kept) + tail
    return prompt, _solution([f"{a}>{b}", f"{b}>{c}"], c), c


class _Rule(NamedTuple):
    """One infer rule: what it does to a word, and the worked steps that do it.

    The steps are the short family's steps for the same transformation (double, which no short family does,
    in upper's `c=cc` form). The prompt decides which rule, the steps apply it. Without them the answer had to
    come in one step, and a backbone that named the rule right every time still reversed or devowelled the
    word wrong (the family then measured one-step spelling, not the prompt).
    """

    apply: Callable[[str], str]
    steps: Callable[[str], list[str]]


_RULES: dict[str, _Rule] = {
    "reverse": _Rule(lambda w: w[::-1], strrev_steps),
    "uppercase": _Rule(str.upper, upper_steps),
    "novowel": _Rule(lambda w: "".join(ch for ch in w if ch not in VOWELS) or w, novowel_steps),
    "double": _Rule(lambda w: "".join(ch + ch for ch in w), lambda w: [f"{c}={c + c}" for c in w]),
}


@register_long("infer")
def gen_infer(rng: random.Random, length: int) -> tuple[str, str, str]:
    rule = rng.choice(sorted(_RULES))
    f = _RULES[rule].apply
    while True:  # redrawn until the examples shown fit no other rule (short prompts show one or two)
        words = _names(rng, max(3, length // 12 + 2), size=4)
        query, examples = words[0], [f"in: {w} out: {f(w)}" for w in words[1:]]
        tail = f"in: {query} out:\n"
        prompt = _fill("", examples, tail, length)
        shown = [w for w in words[1:] if f"in: {w} out: {f(w)}\n" in prompt]
        if all(any(g.apply(w) != f(w) for w in shown) for name, g in _RULES.items() if name != rule):
            return prompt, _solution([f"rule: {rule}", *_RULES[rule].steps(query)], f(query)), f(query)


def make_long_split(split: str, n_per_family: int, length: int, seed: int = 0,
                    families: Iterable[str] | None = None) -> list[Sample]:
    """Deterministic, deduplicated samples of one split at one prompt length, grouped by family; the split's
    hash buckets as in `tasks.make_split`. The final split never draws a problem of the test samples at the
    same length in `LONG_FINAL_EXCLUDES` (docs/results/protocol.md)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    names = list(LONG_FAMILIES) if families is None else list(families)
    unknown = [n for n in names if n not in LONG_FAMILIES]
    if unknown:
        raise ValueError(f"unknown long task families {unknown}; known: {sorted(LONG_FAMILIES)}")
    if length < MIN_LENGTH:
        raise ValueError(f"length must be >= {MIN_LENGTH} characters (what a chain's two links need), got "
                         f"{length}")
    lo, hi = SPLIT_BUCKETS[split]
    samples = []
    for name in names:
        excluded = touched_long_prompts(name, length) if split == "final" else frozenset()
        rng = random.Random(f"slimwise-testbed-long:{seed}:{split}:{length}:{name}")
        seen: set[str] = set()
        for _ in range(200 * n_per_family + 1000):
            if len(seen) == n_per_family:
                break
            prompt, target, answer = LONG_FAMILIES[name](rng, length)
            if prompt in seen or prompt in excluded or not lo <= split_bucket(prompt) < hi:
                continue
            samples.append(Sample(f"{split}-long-{name}-{length}-{len(seen):05d}", name, LONG_DOMAIN, prompt,
                                  target, answer, {"length": length}, split, "train"))
            seen.add(prompt)
        else:
            raise RuntimeError(f"{name}: only {len(seen)} distinct {split} problems at length {length}")
    return samples


@functools.lru_cache(maxsize=64)
def touched_long_prompts(family: str, length: int) -> frozenset[str]:
    """The prompts of one long family at one length that the test samples in `LONG_FINAL_EXCLUDES` hold (a
    sample of n is the first n of its seeded stream, so the largest size covers the smaller ones)."""
    n = LONG_FINAL_EXCLUDES["per_family"]
    return frozenset(s.prompt for seed in LONG_FINAL_EXCLUDES["seeds"]
                     for s in make_long_split("test", n, length, seed, [family]))


def draw_long_samples(family: str, n: int, seed: int, max_length: int, split: str = "train",
                      top_share: float = 0.0) -> list[Sample]:
    """`n` samples of one long family for a training step: each at a prompt length drawn log-uniformly from
    [MIN_LENGTH, max_length] characters, in the split's hash buckets. A pure function of its arguments.

    Log-uniform, not uniform: a short prompt teaches the same retrieval as a long one at a fraction of the
    tokens, so most samples are short and cheap, while every octave up to max_length still gets its share
    (retrieval learnt only on short prompts does not reach longer ones). The first round(n * top_share)
    samples are drawn uniformly from the top octave [max_length / 2, max_length] instead: under log-uniform
    lengths the positions next to max_length are the least trained. top_share 0 draws exactly the
    log-uniform stream (the same random calls)."""
    if max_length < MIN_LENGTH:
        raise ValueError(f"max_length must be >= {MIN_LENGTH} characters, got {max_length}")
    if not 0.0 <= top_share <= 1.0:
        raise ValueError(f"top_share must be in [0, 1], got {top_share}")
    rng = random.Random(f"slimwise-testbed-long-draw:{seed}:{split}:{family}")
    top = round(n * top_share)
    out = []
    for j in range(n):
        if j < top:
            length = round(rng.uniform(max(MIN_LENGTH, max_length / 2), max_length))
        else:
            length = round(math.exp(rng.uniform(math.log(MIN_LENGTH), math.log(max_length))))
        sample = make_long_split(split, 1, length, seed=seed * 1_000 + j, families=[family])[0]
        out.append(dataclasses.replace(sample, id=f"{split}-long-{family}-{length}-draw{j}"))
    return out
