"""Task suite of the embedded testbed: small, exactly verifiable problems with worked solutions.

A tiny MoE model (5-10M parameters, trained on a laptop CPU) must be able to learn these, so every sample is
short (30-150 tokens at the training difficulty), its worked solution grows with the instance (digits, list
length, facts), and its last line is the parseable final answer `#### ANSWER`. Families are spread over
several domains so that expert pruning calibrated on one domain can be evaluated on the others.

Splits are disjoint by construction: each problem is assigned to a split by hashing its prompt into 100
buckets (train 0-79, calib 80-89, test 90-99); the held-out split reuses the test buckets but draws from a
harder difficulty range that lies beyond the training range. The final split (docs/results/protocol.md) draws
trained sizes from the test buckets too, and never a problem of the test or edge samples any earlier run drew
(`FINAL_EXCLUDES`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import re
import string
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from slimwise.io import atomic_path

TARGET_DOMAIN = "arithmetic"
DOMAINS = ("arithmetic", "lists", "text")
ANSWER_MARKER = "#### "
EOS_TOKEN = "<|endoftext|>"
LEVELS = ("train", "heldout", "edge")
SPLITS = ("train", "calib", "test", "heldout", "edge", "final")
# Half-open bucket ranges of sha256(prompt) % 100; "heldout" and "edge" share the
# test buckets (other difficulty); "final" shares them and excludes what earlier samples drew.
SPLIT_BUCKETS: dict[str, tuple[int, int]] = {
    "train": (0, 80),
    "calib": (80, 90),
    "test": (90, 100),
    "heldout": (90, 100),
    "edge": (90, 100),
    "final": (90, 100),
}
#: the final split never draws a problem of these samples: the test and edge splits at every seed any decision
#: or published table used, at the largest size any drew (200 per family), and the replication samples drawn
#: disjoint from test seed 0 (`replicates`: seeds 1 and 2 in turn, each excluding what came before)
FINAL_EXCLUDES = {"splits": ("test", "edge"), "seeds": (0, 1, 2, 5), "replicates": (1, 2), "per_family": 200}

Difficulty = dict[str, int]
Ranges = dict[str, tuple[int, int]]
GenerateFn = Callable[[random.Random, Difficulty], tuple[str, str, str]]


# --------------------------------------------------------------------------------------------------------
# Registry


@dataclass(frozen=True)
class TaskFamily:
    """A problem generator plus its difficulty knobs: inclusive (lo, hi) ranges for train and held-out."""

    name: str
    domain: str
    fn: GenerateFn
    train: Ranges
    heldout: Ranges

    def generate(self, rng: random.Random, difficulty: Difficulty) -> tuple[str, str, str]:
        """One problem at concrete knob values -> (prompt, target, answer)."""
        return self.fn(rng, difficulty)

    @property
    def edge(self) -> Ranges:
        """The hardest trained difficulty: every knob the held-out level changes at its training maximum
        (knobs it keeps, like a conversion's base, keep their range). One step beyond it (the held-out level's
        first step) the trained testbeds score 0% on add, sub, mul and base: length extrapolation fails, so
        harder-than-test problems that a model can still solve sit here."""
        return {k: (hi, hi) if self.heldout[k] != (lo, hi) else (lo, hi)
                for k, (lo, hi) in self.train.items()}

    def ranges(self, level: str = "train") -> Ranges:
        if level not in LEVELS:
            raise ValueError(f"unknown difficulty level {level!r}; expected one of {LEVELS}")
        return {"train": self.train, "heldout": self.heldout, "edge": self.edge}[level]

    def sample_difficulty(self, rng: random.Random, level: str = "train") -> Difficulty:
        return {k: rng.randint(lo, hi) for k, (lo, hi) in sorted(self.ranges(level).items())}


FAMILIES: dict[str, TaskFamily] = {}


def register_family(
    name: str, domain: str, train: Ranges, heldout: Ranges
) -> Callable[[GenerateFn], GenerateFn]:
    """Decorator adding a generator `fn(rng, difficulty) -> (prompt, target, answer)` to FAMILIES."""

    def deco(fn: GenerateFn) -> GenerateFn:
        if name in FAMILIES:
            raise ValueError(f"task family {name!r} registered twice")
        if domain not in DOMAINS:
            raise ValueError(f"unknown domain {domain!r}; expected one of {DOMAINS}")
        if set(train) != set(heldout):
            raise ValueError(f"{name}: train and heldout must have the same knobs")
        FAMILIES[name] = TaskFamily(name, domain, fn, dict(train), dict(heldout))
        return fn

    return deco


def families_in_domain(domain: str) -> list[str]:
    """Names of the registered families of one domain, in registration order."""
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; expected one of {DOMAINS}")
    return [name for name, fam in FAMILIES.items() if fam.domain == domain]


def select_families(families: Iterable[str] | None = None, domain: str | None = None) -> list[str]:
    """Family names to generate: the given ones (default all), optionally restricted to a domain."""
    names = list(FAMILIES) if families is None else list(families)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown task families {unknown}; known: {sorted(FAMILIES)}")
    if domain is not None:
        keep = set(families_in_domain(domain))
        names = [n for n in names if n in keep]
    return names


# --------------------------------------------------------------------------------------------------------
# Helpers shared by the generators


def _solution(steps: list[str], answer: str) -> str:
    return "\n".join([*steps, ANSWER_MARKER + answer])


def _number(rng: random.Random, digits: int) -> int:
    """A number with exactly `digits` digits."""
    return rng.randint(1 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _digit(s: str, i: int) -> int:
    """Digit i of a reversed number string, 0 past its end."""
    return int(s[i]) if i < len(s) else 0


def _csv(xs: Iterable[int]) -> str:
    return ",".join(str(x) for x in xs)


VOWELS = "aeiou"
CONSONANTS = "".join(c for c in string.ascii_lowercase if c not in VOWELS)
NAMES = ("Ann", "Bob", "Cid", "Dan", "Eve", "Fay", "Gus", "Hal", "Ida", "Jon", "Kim", "Leo", "Max", "Ned")
COLORS = ("red", "blue", "green", "black", "white", "brown", "gray", "pink")
ANIMALS = ("cat", "dog", "fox", "owl", "pig", "cow", "hen", "rat")
# Template words; random letter strings avoid them so that they stay spelled out letter by letter.
_RESERVED = {
    *(n.lower() for n in NAMES), *COLORS, *ANIMALS,
    "add", "sub", "mul", "gcd", "convert", "base", "sort", "reverse", "list", "dedup", "count", "word",
    "uppercase", "remove", "vowels", "keep", "drop", "yes", "what", "color", "who", "has", "the", "pet",
    "does", "have",
}  # fmt: skip


def _word(rng: random.Random, length: int) -> str:
    """A random lowercase letter string, about one third vowels, never a template word."""
    while True:
        w = "".join(rng.choice(VOWELS if rng.random() < 0.35 else CONSONANTS) for _ in range(length))
        if w not in _RESERVED:
            return w


# --------------------------------------------------------------------------------------------------------
# Arithmetic


@register_family("add", "arithmetic", train={"digits": (2, 4)}, heldout={"digits": (5, 6)})
def gen_add(rng: random.Random, d: Difficulty) -> tuple[str, str, str]:
    """Column addition from the right: `x+y+carry=sum, partial result` per column."""
    a, b = _number(rng, d["digits"]), _number(rng, rng.randint(1, d["digits"]))
    if rng.random() < 0.5:
        a, b = b, a
    xs, ys = str(a)[::-1], str(b)[::-1]
    width = max(len(xs), len(ys))
    steps, carry, out = [], 0, ""
    for i in range(width):
        x, y = _digit(xs, i), _digit(ys, i)
        s = x + y + carry
        out = (str(s) if i == width - 1 else str(s % 10)) + out
        steps.append(f"{x}+{y}+{carry}={s}, {out}")
        carry = s // 10
    return f"add {a}+{b}\n", _solution(steps, str(a + b)), str(a + b)


@register_family("sub", "arithmetic", train={"digits": (2, 4)}, heldout={"digits": (5, 6)})
def gen_sub(rng: random.Random, d: Difficulty) -> tuple[str, str, str]:
    """Column subtraction from the right; a borrowed column is written as `1x-y-borrow`."""
    a, b = _number(rng, d["digits"]), _number(rng, rng.randint(1, d["digits"]))
    a, b = max(a, b), min(a, b)
    xs, ys = str(a)[::-1], str(b)[::-1]
    steps, borrow, out = [], 0, ""
    for i in range(len(xs)):
        x, y = _digit(xs, i), _digit(ys, i)
        v = x - y - borrow
        head = f"1{x}" if v < 0 else f"{x}"
        out = str(v % 10) + out
        steps.append(f"{head}-{y}-{borrow}={v % 10}, {out}")
        borrow = int(v < 0)
    return f"sub {a}-{b}\n", _solution(steps, str(a - b)), str(a - b)


@register_family("mul", "arithmetic", train={"digits": (2, 4)}, heldout={"digits": (5, 6)})
def gen_mul(rng: random.Random, d: Difficulty) -> tuple[str, str, str]:
    """Long multiplication by a one-digit multiplier: one partial product `x*m+carry` per digit."""
    a, m = _number(rng, d["digits"]), rng.randint(2, 9)
    xs = str(a)[::-1]
    steps, carry, out = [], 0, ""
    for i, c in enumerate(xs):
        s = int(c) * m + carry
        out = (str(s) if i == len(xs) - 1 else str(s % 10)) + out
        steps.append(f"{c}*{m}+{carry}={s}, {out}")
        carry = s // 10
    return f"mul {a}*{m}\n", _solution(steps, str(a * m)), str(a * m)


@register_family("gcd", "arithmetic", train={"digits": (2, 3)}, heldout={"digits": (4, 4)})
def gen_gcd(rng: random.Random, d: Difficulty) -> tuple[str, str, str]:
    """Euclid's algorithm, one `a=q*b+r` line per division; half the pairs share a factor 2-12."""
    n = d["digits"]
    if rng.random() < 0.5:
        g = rng.randint(2, 12)
        x = rng.randint(max(2, -(-(10 ** (n - 1)) // g)), (10**n - 1) // g)
        a, b = g * x, g * rng.randint(1, x - 1)
    else:
        a = _number(rng, n)
        b = rng.randint(1, a - 1)
    prompt = f"gcd {a} {b}\n"
    steps = []
    while b:
        q, r = divmod(a, b)
        steps.append(f"{a}={q}*{b}+{r}")
        a, b = b, r
    return prompt, _solution(steps, str(a)), str(a)


@register_family(
    "base",
    "arithmetic",
    train={"out_digits": (2, 4), "base": (2, 9)},
    heldout={"out_digits": (5, 6), "base": (2, 9)},
)
def gen_base(rng: random.Random, d: Difficulty) -> tuple[str, str, str]:
    """Decimal to base 2-9 by repeated division; remainders build the result from the right."""
    k, base = d["out_digits"], d["base"]
    n = rng.randint(base ** (k - 1), base**k - 1)
    prompt = f"convert {n} to base {base}\n"
    steps, out = [], ""
    while n:
        q, r = divmod(n, base)
        out = str(r) + out
        steps.append(f"{n}/{base}={q} r{r}, {out}")
        n = q
    return prompt, _solution(steps, out), out


# --------------------------------------------------------------------------------------------------------
# Lists


@register_family("sort", "lists", train={"length": (3, 6)}, heldout={"length": (7, 8)})
def gen_sort(rng: random.Random, d: Difficulty) -> tuple[str, str, str]:
    """Insertion sort: the sorted prefix after inserting each element."""
    xs = [rng.randint(0, 99) for _ in range(d["length"])]
    steps = [_csv(sorted(xs[: i + 1])) for i in range(len(xs))]
    return f"sort {_csv(xs)}\n", _solution(steps, _csv(sorted(xs))), _csv(sorted(xs))


@register_family("reverse", "lists", train={"length": (3, 7)}, heldout={"length": (8, 10)})
def gen_reverse(rng: random.Random, d: Difficulty) -> tuple[str, str, str]:
    """List reversal: `position:element` from the last position to the first."""
    xs = [rng.randint(0, 99) for _ in range(d["length"])]
    steps = [f"{i}:{xs[i - 1]}" for i in range(len(xs), 0, -1)]
    return f"reverse list {_csv(xs)}\n", _solution(steps, _csv(xs[::-1])), _csv(xs[::-1])


@register_family("dedup", "lists", train={"length": (4, 8)}, heldout={"length": (10, 12)})
def gen_dedup(rng: random.Random, d: Difficulty) -> tuple[str, str, str]:
    """Deduplication keeping first occurrences: `x keep` or `x drop` per element."""
    n = d["length"]
    xs = [rng.randint(0, n + 2) for _ in range(n)]
    if len(set(xs)) == n:  # guarantee at least one duplicate
        i, j = rng.sample(range(n), 2)
        xs[j] = xs[i]
    seen: set[int] = set()
    steps, out = [], []
    for x in xs:
        steps.append(f"{x} {'drop' if x in seen else 'keep'}")
        if x not in seen:
            seen.add(x)
            out.append(x)
    return f"dedup {_csv(xs)}\n", _solution(steps, _csv(out)), _csv(out)


@register_family("count", "lists", train={"length": (4, 8)}, heldout={"length": (10, 12)})
def gen_count(rng: random.Random, d: Difficulty) -> tuple[str, str, str]:
    """Counting occurrences of a value: `x yes|no running_count` per element."""
    xs = [rng.randint(0, 9) for _ in range(d["length"])]
    t = rng.choice(xs) if rng.random() < 0.85 else rng.randint(0, 9)
    steps, c = [], 0
    for x in xs:
        c += x == t
        steps.append(f"{x} {'yes' if x == t else 'no'} {c}")
    return f"count {t} in {_csv(xs)}\n", _solution(steps, str(c)), str(c)


# --------------------------------------------------------------------------------------------------------
# Text


def strrev_steps(w: str) -> list[str]:
    """`position:letter` from the last letter to the first (strrev's steps; long_tasks' infer reuses them)."""
    return [f"{i}:{w[i - 1]}" for i in range(len(w), 0, -1)]


def upper_steps(w: str) -> list[str]:
    """`letter=LETTER` per letter."""
    return [f"{c}={c.upper()}" for c in w]


def novowel_steps(w: str) -> list[str]:
    """`letter keep|drop` per letter."""
    return [f"{c} {'drop' if c in VOWELS else 'keep'}" for c in w]


@register_family("strrev", "text", train={"length": (4, 8)}, heldout={"length": (9, 11)})
def gen_strrev(rng: random.Random, d: Difficulty) -> tuple[str, str, str]:
    """Word reversal: `position:letter` from the last letter to the first."""
    w = _word(rng, d["length"])
    return f"reverse word {w}\n", _solution(strrev_steps(w), w[::-1]), w[::-1]


@register_family("upper", "text", train={"length": (4, 8)}, heldout={"length": (9, 11)})
def gen_upper(rng: random.Random, d: Difficulty) -> tuple[str, str, str]:
    """Uppercasing: `letter=LETTER` per letter."""
    w = _word(rng, d["length"])
    return f"uppercase {w}\n", _solution(upper_steps(w), w.upper()), w.upper()


@register_family("novowel", "text", train={"length": (4, 8)}, heldout={"length": (9, 11)})
def gen_novowel(rng: random.Random, d: Difficulty) -> tuple[str, str, str]:
    """Vowel removal: `letter keep|drop` per letter; words have at least one vowel and one consonant."""
    w = _word(rng, d["length"])
    while not (set(w) & set(VOWELS) and set(w) - set(VOWELS)):
        w = _word(rng, d["length"])
    out = "".join(c for c in w if c not in VOWELS)
    return f"remove vowels {w}\n", _solution(novowel_steps(w), out), out


@register_family("qa", "text", train={"facts": (2, 4)}, heldout={"facts": (5, 6)})
def gen_qa(rng: random.Random, d: Difficulty) -> tuple[str, str, str]:
    """Questions answered from a short passage.

    The solution copies each fact in turn and marks whether it matches the question
    (`Name color animal yes|no`), so the answer is read off the marked line: a two-hop lookup (find the fact,
    then its field) written out as steps, the way the arithmetic families write out their carries.
    """
    k = d["facts"]
    names = rng.sample(NAMES, k)
    pairs: list[tuple[str, str]] = []
    while len(pairs) < k:  # distinct (color, animal) pairs so "who has ..." has one answer
        p = (rng.choice(COLORS), rng.choice(ANIMALS))
        if p not in pairs:
            pairs.append(p)
    passage = " ".join(f"{n} has a {c} {a}." for n, (c, a) in zip(names, pairs, strict=True))
    i = rng.randrange(k)
    name, (color, animal) = names[i], pairs[i]
    kind = rng.randrange(3)
    if kind == 0:
        question, answer = f"what color is {name}'s {animal}?", color
    elif kind == 1:
        question, answer = f"who has the {color} {animal}?", name
    else:
        question, answer = f"what pet does {name} have?", animal
    steps = [f"{n} {c} {a} {'yes' if j == i else 'no'}"
             for j, (n, (c, a)) in enumerate(zip(names, pairs, strict=True))]
    return f"{passage}\nQ: {question}\n", _solution(steps, answer), answer


# --------------------------------------------------------------------------------------------------------
# Samples and splits


@dataclass
class Sample:
    """One problem. `target` is the worked solution ending in `#### answer`, without the EOS token."""

    id: str
    family: str
    domain: str
    prompt: str
    target: str
    answer: str
    difficulty: Difficulty = field(default_factory=dict)
    split: str = "train"
    level: str = "train"

    @property
    def text(self) -> str:
        """Prompt followed by target, as seen in training (the tokenizer side appends EOS)."""
        return self.prompt + self.target

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> Sample:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


def prompt_hash(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


def split_bucket(prompt: str) -> int:
    """The bucket 0-99 that decides which split a problem may appear in."""
    return int(prompt_hash(prompt), 16) % 100


def make_split(
    split: str,
    n_per_family: int,
    seed: int = 0,
    families: Iterable[str] | None = None,
    domain: str | None = None,
    difficulty: str | None = None,
    allow_fewer: bool = False,
    exclude: Iterable[str] = (),
) -> list[Sample]:
    """Deterministic, deduplicated samples of one split, grouped by family (shuffle them for training).

    Problems are re-drawn until their prompt hashes into the split's buckets, so splits never share a
    problem. `difficulty` is "train", "heldout" or "edge" (default: the split's own level for the heldout and
    edge splits, else "train"). The edge split (the hardest trained difficulty) excludes the test split's
    problems of the same seed and size, with which it shares hash buckets.
    `allow_fewer`: a family with fewer distinct problems in the split gives all it has instead of an error
    (base conversions have about 1,400 calibration problems). `exclude`: prompts never to draw, e.g. another
    sample of the same split, so that replication samples are disjoint (drawn from the same seeded stream
    otherwise).
    """
    if split not in SPLIT_BUCKETS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    level = difficulty or (split if split in ("heldout", "edge") else "train")
    if level not in LEVELS:
        raise ValueError(f"unknown difficulty {level!r}; expected one of {LEVELS}")
    lo, hi = SPLIT_BUCKETS[split]
    excluded = set(exclude)
    if split == "final":
        families = list(families) if families is not None else None
        excluded |= touched_prompts(tuple(select_families(families, domain)))
    # its problems are of trained sizes, in the test buckets: never one of the test sample's
    if split == "edge":
        families = list(families) if families is not None else None
        excluded |= {s.prompt
                     for s in make_split("test", n_per_family, seed, families, domain, allow_fewer=True)}
    max_attempts = 200 * n_per_family + 10_000
    samples = []
    for name in select_families(families, domain):
        fam = FAMILIES[name]
        rng = random.Random(f"slimwise-testbed:{seed}:{split}:{level}:{name}")
        seen: set[str] = set()
        attempts = 0
        while len(seen) < n_per_family:
            attempts += 1
            if attempts > max_attempts:
                if allow_fewer:
                    break
                raise RuntimeError(
                    f"{name}: only {len(seen)} distinct {split} problems after {max_attempts} draws"
                )
            knobs = fam.sample_difficulty(rng, level)
            prompt, target, answer = fam.generate(rng, knobs)
            if prompt in seen or prompt in excluded or not lo <= split_bucket(prompt) < hi:
                continue
            sid = f"{split}-{name}-{len(seen):05d}"
            samples.append(Sample(sid, name, fam.domain, prompt, target, answer, knobs, split, level))
            seen.add(prompt)
    return samples


@functools.lru_cache(maxsize=8)
def touched_prompts(families: tuple[str, ...]) -> frozenset[str]:
    """The prompts of `families` that the samples in `FINAL_EXCLUDES` hold: what the final split never draws.
    A test sample of n problems is the first n of its seeded stream, so the largest size covers every smaller
    one; an edge sample's draws are in the larger edge sample or in the test sample that one skips."""
    n, out = FINAL_EXCLUDES["per_family"], set()
    for split in FINAL_EXCLUDES["splits"]:
        for seed in FINAL_EXCLUDES["seeds"]:
            out |= {s.prompt for s in make_split(split, n, seed, families, allow_fewer=True)}
    chain = {s.prompt for s in make_split("test", n, 0, families, allow_fewer=True)}
    for seed in FINAL_EXCLUDES["replicates"]:
        chain |= {s.prompt for s in make_split("test", n, seed, families, exclude=chain, allow_fewer=True)}
    return frozenset(out | chain)


def check_disjoint(*splits: Iterable[Sample | Mapping | str]) -> bool:
    """True when no prompt (compared by sha256) occurs in two of the given splits."""
    seen: set[str] = set()
    for split in splits:
        hashes = {prompt_hash(_prompt_of(s)) for s in split}
        if hashes & seen:
            return False
        seen |= hashes
    return True


def _prompt_of(s: Sample | Mapping | str) -> str:
    if isinstance(s, Sample):
        return s.prompt
    return s if isinstance(s, str) else s["prompt"]


# --------------------------------------------------------------------------------------------------------
# JSONL


def export_jsonl(samples: Iterable[Sample], path: str | os.PathLike) -> Path:
    """One JSON object per line; written to a temporary file and renamed so readers never see half a file."""
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(s.to_dict(), ensure_ascii=False) + "\n")
    return path


def load_jsonl(path: str | os.PathLike) -> list[Sample]:
    with open(path, encoding="utf-8") as f:
        return [Sample.from_dict(json.loads(line)) for line in f if line.strip()]


def write_splits(
    out_dir: str | os.PathLike, n_train: int, n_calib: int, n_test: int, n_heldout: int, seed: int = 0
) -> dict[str, Path]:
    """Write train/calib/test/heldout.jsonl (counts are per family) for all families; returns the paths."""
    counts = {"train": n_train, "calib": n_calib, "test": n_test, "heldout": n_heldout}
    return {
        split: export_jsonl(make_split(split, n, seed), Path(out_dir) / f"{split}.jsonl")
        for split, n in counts.items()
    }


# --------------------------------------------------------------------------------------------------------
# Grading


@dataclass(frozen=True)
class Grade:
    """`stopped`: the generation ended by EOS and contains the final-answer line."""

    correct: bool
    parsed_answer: str | None
    stopped: bool


_ANSWER_LINE = re.compile(r"^####[ \t]*(.*)$", re.MULTILINE)


def parse_answer(text: str) -> str | None:
    """The stripped text of the first line starting with `####` (before any EOS), or None."""
    m = _ANSWER_LINE.search(text.split(EOS_TOKEN, 1)[0])
    return m.group(1).strip() if m else None


def grade(sample: Sample | Mapping, generated_text: str, stopped_by_eos: bool | None = None) -> Grade:
    """Exact-match grading of a generated continuation of `sample.prompt`; never raises on bad output.

    `stopped_by_eos` comes from the decoder (finish reason); when None it is inferred from an EOS token
    string left in `generated_text` (decode with special tokens kept).
    """
    answer = sample.answer if isinstance(sample, Sample) else str(sample["answer"])
    if isinstance(generated_text, bytes):
        generated_text = generated_text.decode("utf-8", errors="replace")
    text = "" if generated_text is None else str(generated_text)
    parsed = parse_answer(text)
    if stopped_by_eos is None:
        stopped_by_eos = EOS_TOKEN in text
    return Grade(
        correct=parsed is not None and parsed == answer.strip(),
        parsed_answer=parsed,
        stopped=bool(stopped_by_eos) and parsed is not None,
    )
