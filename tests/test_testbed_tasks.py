"""Task suite and tokenizer of the embedded testbed: every worked solution is re-checked independently."""

from __future__ import annotations

import json
import math
import random
import re
import string

import pytest

from lab.testbed.tokenizer import build_tokenizer, encode_sample, length_stats
from lab.testbed.tokenizer import load_saved_tokenizer as load_tokenizer
from slimwise.testbed import (
    DOMAINS,
    EOS_TOKEN,
    FAMILIES,
    TARGET_DOMAIN,
    Grade,
    Sample,
    check_disjoint,
    export_jsonl,
    families_in_domain,
    grade,
    load_jsonl,
    make_split,
    register_family,
    select_families,
    write_splits,
)
from slimwise.testbed.tasks import SPLIT_BUCKETS, split_bucket

# ------------------------------------------------------------------------------------------------------
# Independent checkers: parse the prompt, recompute the answer in Python, and check every step line.


def _digit(n: int, i: int) -> int:
    return n // 10**i % 10


def _ints(csv: str) -> list[int]:
    return [int(x) for x in csv.split(",")]


def check_add(prompt: str, steps: list[str], answer: str) -> None:
    a, b = map(int, re.fullmatch(r"add (\d+)\+(\d+)\n", prompt).groups())
    assert answer == str(a + b)
    assert len(steps) == max(len(str(a)), len(str(b)))
    carry = 0
    for i, line in enumerate(steps):
        x, y, c, s, part = re.fullmatch(r"(\d)\+(\d)\+(\d)=(\d+), (\d+)", line).groups()
        x, y, c, s = int(x), int(y), int(c), int(s)
        assert (x, y, c) == (_digit(a, i), _digit(b, i), carry) and s == x + y + c
        assert int(part) == (a + b) % 10 ** (i + 1) or i == len(steps) - 1
        carry = s // 10
    assert part == answer


def check_sub(prompt: str, steps: list[str], answer: str) -> None:
    a, b = map(int, re.fullmatch(r"sub (\d+)-(\d+)\n", prompt).groups())
    assert a >= b and answer == str(a - b)
    assert len(steps) == len(str(a))
    borrow = 0
    for i, line in enumerate(steps):
        ten, x, y, c, d, part = re.fullmatch(r"(1?)(\d)-(\d)-(\d)=(\d), (\d+)", line).groups()
        x, y, c, d = int(x), int(y), int(c), int(d)
        assert (x, y, c) == (_digit(a, i), _digit(b, i), borrow)
        assert (ten == "1") == (x - y - c < 0) and d == 10 * (ten == "1") + x - y - c
        assert part == str(a - b).zfill(len(str(a)))[-(i + 1) :]
        borrow = int(ten == "1")
    assert borrow == 0 and int(part) == int(answer)


def check_mul(prompt: str, steps: list[str], answer: str) -> None:
    a, m = map(int, re.fullmatch(r"mul (\d+)\*(\d)\n", prompt).groups())
    assert answer == str(a * m) and 2 <= m <= 9
    assert len(steps) == len(str(a))
    carry = 0
    for i, line in enumerate(steps):
        x, mm, c, s, part = map(int, re.fullmatch(r"(\d)\*(\d)\+(\d+)=(\d+), (\d+)", line).groups())
        assert (x, mm, c) == (_digit(a, i), m, carry) and s == x * m + c
        carry = s // 10
    assert str(part) == answer


def check_gcd(prompt: str, steps: list[str], answer: str) -> None:
    a, b = map(int, re.fullmatch(r"gcd (\d+) (\d+)\n", prompt).groups())
    assert a > b >= 1 and answer == str(math.gcd(a, b))
    for line in steps:
        x, q, y, r = map(int, re.fullmatch(r"(\d+)=(\d+)\*(\d+)\+(\d+)", line).groups())
        assert (x, y) == (a, b) and x == q * y + r and 0 <= r < y
        a, b = b, r
    assert b == 0 and str(a) == answer


def check_base(prompt: str, steps: list[str], answer: str) -> None:
    n, base = map(int, re.fullmatch(r"convert (\d+) to base (\d)\n", prompt).groups())
    assert int(answer, base) == n and answer[0] != "0" and max(answer) < str(base)
    out = ""
    for line in steps:
        x, bb, q, r, part = re.fullmatch(r"(\d+)/(\d)=(\d+) r(\d), (\d+)", line).groups()
        x, bb, q, r = int(x), int(bb), int(q), int(r)
        assert (x, bb) == (n, base) and x == q * base + r and r < base
        out = str(r) + out
        assert part == out
        n = q
    assert n == 0 and out == answer and len(steps) == len(answer)


def check_sort(prompt: str, steps: list[str], answer: str) -> None:
    xs = _ints(re.fullmatch(r"sort ([\d,]+)\n", prompt).group(1))
    assert _ints(answer) == sorted(xs)
    assert [_ints(s) for s in steps] == [sorted(xs[: i + 1]) for i in range(len(xs))]


def check_reverse(prompt: str, steps: list[str], answer: str) -> None:
    xs = _ints(re.fullmatch(r"reverse list ([\d,]+)\n", prompt).group(1))
    assert _ints(answer) == xs[::-1]
    assert steps == [f"{i}:{xs[i - 1]}" for i in range(len(xs), 0, -1)]


def check_dedup(prompt: str, steps: list[str], answer: str) -> None:
    xs = _ints(re.fullmatch(r"dedup ([\d,]+)\n", prompt).group(1))
    assert _ints(answer) == list(dict.fromkeys(xs)) and len(set(xs)) < len(xs)
    assert steps == [f"{x} {'drop' if x in xs[:i] else 'keep'}" for i, x in enumerate(xs)]


def check_count(prompt: str, steps: list[str], answer: str) -> None:
    t, csv = re.fullmatch(r"count (\d) in ([\d,]+)\n", prompt).groups()
    xs, t = _ints(csv), int(t)
    assert answer == str(xs.count(t))
    assert steps == [f"{x} {'yes' if x == t else 'no'} {xs[: i + 1].count(t)}" for i, x in enumerate(xs)]


def check_strrev(prompt: str, steps: list[str], answer: str) -> None:
    w = re.fullmatch(r"reverse word ([a-z]+)\n", prompt).group(1)
    assert answer == w[::-1]
    assert "".join(s.split(":")[1] for s in steps) == answer
    assert [int(s.split(":")[0]) for s in steps] == list(range(len(w), 0, -1))


def check_upper(prompt: str, steps: list[str], answer: str) -> None:
    w = re.fullmatch(r"uppercase ([a-z]+)\n", prompt).group(1)
    assert answer == w.upper() and steps == [f"{c}={c.upper()}" for c in w]


def check_novowel(prompt: str, steps: list[str], answer: str) -> None:
    w = re.fullmatch(r"remove vowels ([a-z]+)\n", prompt).group(1)
    assert answer == re.sub("[aeiou]", "", w) and answer and answer != w
    assert steps == [f"{c} {'drop' if c in 'aeiou' else 'keep'}" for c in w]


def check_qa(prompt: str, steps: list[str], answer: str) -> None:
    passage, question = re.fullmatch(r"(.+)\nQ: (.+)\n", prompt).groups()
    facts = re.findall(r"(\w+) has a (\w+) (\w+)\.", passage)
    assert " ".join(f"{n} has a {c} {a}." for n, c, a in facts) == passage
    if m := re.fullmatch(r"what color is (\w+)'s (\w+)\?", question):
        hits = [i for i, f in enumerate(facts) if (f[0], f[2]) == m.groups()]
        expected = facts[hits[0]][1] if hits else None
    elif m := re.fullmatch(r"who has the (\w+) (\w+)\?", question):
        hits = [i for i, f in enumerate(facts) if f[1:] == m.groups()]
        expected = facts[hits[0]][0] if hits else None
    else:
        m = re.fullmatch(r"what pet does (\w+) have\?", question)
        hits = [i for i, f in enumerate(facts) if f[0] == m.group(1)]
        expected = facts[hits[0]][2] if hits else None
    assert len(hits) == 1 and answer == expected
    assert steps == [f"{' '.join(f)} {'yes' if i == hits[0] else 'no'}" for i, f in enumerate(facts)]


CHECKERS = {
    "add": check_add, "sub": check_sub, "mul": check_mul, "gcd": check_gcd, "base": check_base,
    "sort": check_sort, "reverse": check_reverse, "dedup": check_dedup, "count": check_count,
    "strrev": check_strrev, "upper": check_upper, "novowel": check_novowel, "qa": check_qa,
}  # fmt: skip


def _steps(s: Sample) -> list[str]:
    lines = s.target.split("\n")
    assert lines[-1] == f"#### {s.answer}" and EOS_TOKEN not in s.target
    return lines[:-1]


@pytest.fixture(scope="module")
def samples() -> dict[str, list[Sample]]:
    return {split: make_split(split, 40, seed=0) for split in ("train", "calib", "test", "heldout")}


# ------------------------------------------------------------------------------------------------------
# Registry


def test_registry_covers_domains():
    assert len(FAMILIES) >= 10 and set(CHECKERS) == set(FAMILIES)
    assert TARGET_DOMAIN == "arithmetic" and TARGET_DOMAIN in DOMAINS and len(DOMAINS) >= 3
    assert sorted(n for d in DOMAINS for n in families_in_domain(d)) == sorted(FAMILIES)
    for d in DOMAINS:
        assert families_in_domain(d) and all(FAMILIES[n].domain == d for n in families_in_domain(d))
    assert select_families(domain="lists") == families_in_domain("lists")
    assert select_families(["add", "qa"], domain="text") == ["qa"]
    with pytest.raises(ValueError):
        select_families(["nope"])
    with pytest.raises(ValueError):
        families_in_domain("poetry")
    with pytest.raises(ValueError):
        register_family("add", "arithmetic", {"digits": (1, 2)}, {"digits": (3, 4)})(
            lambda rng, d: ("", "", "")
        )


def test_heldout_knobs_lie_beyond_training_range():
    for name, fam in FAMILIES.items():
        assert set(fam.train) == set(fam.heldout), name
        assert all(fam.heldout[k][0] >= fam.train[k][0] for k in fam.train), name
        assert any(fam.heldout[k][0] > fam.train[k][1] for k in fam.train), name


def test_edge_split_is_the_hardest_trained_difficulty_and_never_a_test_problem():
    """The edge level sets every knob the held-out level moves to its training maximum (a conversion's base
    keeps its range), so problems are harder than the test average yet of sizes the models were trained on;
    the split shares the test buckets but never one of the test sample's problems (same seed and size)."""
    assert FAMILIES["add"].edge == {"digits": (4, 4)} and FAMILIES["gcd"].edge == {"digits": (3, 3)}
    assert FAMILIES["base"].edge == {"out_digits": (4, 4), "base": (2, 9)}
    for name, fam in FAMILIES.items():
        assert set(fam.edge) == set(fam.train), name
        assert all(
            fam.train[k][0] <= fam.edge[k][0] <= fam.edge[k][1] == fam.train[k][1] for k in fam.train
        ), name
    edge, test = make_split("edge", 40, seed=3), make_split("test", 40, seed=3)
    assert len(edge) == 40 * len(FAMILIES) and check_disjoint(edge, test)
    lo, hi = SPLIT_BUCKETS["test"]
    for s in edge:
        assert s.split == "edge" and s.level == "edge" and lo <= split_bucket(s.prompt) < hi
        assert all(s.difficulty[k] == FAMILIES[s.family].train[k][1] for k in s.difficulty if k != "base")
    assert [s.prompt for s in make_split("edge", 40, seed=3, domain="lists")] == \
        [s.prompt for s in edge if s.domain == "lists"]  # a domain's edge sample is the full sample's


def test_sample_difficulty_within_ranges(samples):
    for split, ss in samples.items():
        for s in ss:
            ranges = FAMILIES[s.family].ranges(s.level)
            assert set(s.difficulty) == set(ranges)
            assert all(lo <= s.difficulty[k] <= hi for k, (lo, hi) in ranges.items())
            train = FAMILIES[s.family].train
            beyond = any(s.difficulty[k] > train[k][1] for k in train)
            assert beyond == (split == "heldout") == (s.level == "heldout")


# ------------------------------------------------------------------------------------------------------
# Generator, splits, worked solutions


def test_worked_solutions_yield_the_answer(samples):
    for ss in samples.values():
        for s in ss:
            assert s.domain == FAMILIES[s.family].domain
            CHECKERS[s.family](s.prompt, _steps(s), s.answer)


def test_checkers_reject_wrong_solutions():
    # The checkers themselves must catch a wrong answer or a broken step, or the test above proves nothing.
    rng = random.Random(0)
    for name, fam in FAMILIES.items():
        prompt, target, answer = fam.generate(rng, fam.sample_difficulty(rng))
        steps = target.split("\n")[:-1]
        with pytest.raises((AssertionError, AttributeError, ValueError)):
            CHECKERS[name](prompt, steps, answer + "1")
        with pytest.raises((AssertionError, AttributeError, ValueError)):
            CHECKERS[name](prompt, steps[:-1] + [steps[-1] + "1"], answer)


def test_make_split_deterministic():
    a = make_split("train", 15, seed=3)
    b = make_split("train", 15, seed=3)
    c = make_split("train", 15, seed=4)
    assert [s.to_dict() for s in a] == [s.to_dict() for s in b]
    assert [s.prompt for s in a] != [s.prompt for s in c]
    assert len(a) == 15 * len(FAMILIES) and len({s.id for s in a}) == len(a)


def test_make_split_selects_families_and_domains():
    ss = make_split("test", 5, domain="text")
    assert {s.family for s in ss} == set(families_in_domain("text")) and {s.domain for s in ss} == {"text"}
    ss = make_split("calib", 7, families=["gcd"])
    assert len(ss) == 7 and {s.family for s in ss} == {"gcd"} and {s.split for s in ss} == {"calib"}
    with pytest.raises(ValueError):
        make_split("dev", 1)
    with pytest.raises(ValueError):
        make_split("train", 1, difficulty="extreme")


def test_make_split_allow_fewer_gives_what_a_family_has():
    """Base conversions have about 1,400 distinct calibration problems: asking for 2,000 is an error unless
    allow_fewer, which returns every one found, starting with the same problems as a smaller request."""
    with pytest.raises(RuntimeError, match="base: only"):
        make_split("calib", 2000, families=["base"])
    some = make_split("calib", 2000, families=["base"], allow_fewer=True)
    assert 1000 < len(some) < 2000 and len({s.prompt for s in some}) == len(some)
    assert [s.prompt for s in some[:50]] == [s.prompt for s in make_split("calib", 50, families=["base"])]


def test_splits_disjoint_and_deduplicated(samples):
    assert check_disjoint(*samples.values())
    for split, ss in samples.items():
        assert len({s.prompt for s in ss}) == len(ss), split
        lo, hi = SPLIT_BUCKETS[split]
        assert all(lo <= split_bucket(s.prompt) < hi and s.split == split for s in ss)
    train = samples["train"]
    assert check_disjoint(train[:10], train[10:20])
    assert not check_disjoint(train[:10], samples["test"], train[5:6])
    assert not check_disjoint([train[0].to_dict()], [train[0].prompt])


def test_length_grows_with_difficulty():
    for name, fam in FAMILIES.items():
        means = []
        for level, end in (("train", 0), ("train", 1), ("heldout", 1)):
            knobs = {
                k: r[end] if fam.train[k] != fam.heldout[k] else fam.train[k][0]
                for k, r in fam.ranges(level).items()
            }
            rng = random.Random(name)
            means.append(sum(len(fam.generate(rng, knobs)[1]) for _ in range(60)) / 60)
        assert means[0] < means[1] < means[2], (name, means)


# ------------------------------------------------------------------------------------------------------
# JSONL


def test_jsonl_round_trip(tmp_path):
    paths = write_splits(tmp_path / "data", n_train=4, n_calib=2, n_test=2, n_heldout=3, seed=1)
    assert sorted(p.name for p in paths.values()) == [
        "calib.jsonl",
        "heldout.jsonl",
        "test.jsonl",
        "train.jsonl",
    ]
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == sorted(p.name for p in paths.values())
    loaded = {split: load_jsonl(p) for split, p in paths.items()}
    assert loaded["train"] == make_split("train", 4, seed=1)
    assert len(loaded["heldout"]) == 3 * len(FAMILIES) and check_disjoint(*loaded.values())
    row = json.loads(paths["test"].read_text().splitlines()[0])
    assert {"id", "family", "domain", "prompt", "target", "answer", "difficulty", "split"} <= set(row)
    out = export_jsonl(loaded["calib"][:3], tmp_path / "one.jsonl")
    assert load_jsonl(out) == loaded["calib"][:3]


# ------------------------------------------------------------------------------------------------------
# Grader


def test_grade_correct_and_incorrect(samples):
    s = samples["test"][0]
    assert grade(s, s.target + EOS_TOKEN) == Grade(True, s.answer, True)
    assert grade(s, s.target, stopped_by_eos=True) == Grade(True, s.answer, True)
    assert grade(s, s.target, stopped_by_eos=False) == Grade(True, s.answer, False)  # ran out of tokens
    assert grade(s, s.target) == Grade(True, s.answer, False)  # no EOS seen
    assert grade(s, f"#### {s.answer}   \n").correct
    assert grade(s.to_dict(), s.target + EOS_TOKEN + "#### junk").correct
    wrong = grade(s, s.target.rsplit("\n", 1)[0] + f"\n#### {s.answer}9" + EOS_TOKEN)
    assert wrong == Grade(False, f"{s.answer}9", True)
    assert grade(s, f"#### {s.answer}\n#### 0").parsed_answer == s.answer  # first answer line counts
    assert grade(s, f"so it is {s.answer}" + EOS_TOKEN) == Grade(False, None, False)


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "####",
        "#### ",
        "\n\n\n",
        "<|pad|>" * 5,
        "###",
        "####\x00\ud800",
        "é" * 1000,
        None,
        b"\xff#### 1",
        12345,
    ],
)
def test_grade_garbage_never_raises(samples, garbage):
    g = grade(samples["test"][0], garbage)
    assert isinstance(g, Grade) and not g.correct and not g.stopped


def test_grade_random_garbage():
    s = make_split("test", 1, families=["add"])[0]
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice(string.printable + "#" * 10 + "é") for _ in range(rng.randint(0, 60)))
        g = grade(s, text, stopped_by_eos=rng.choice([True, False, None]))
        assert g.correct == (g.parsed_answer == s.answer)


# ------------------------------------------------------------------------------------------------------
# Tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path, seed=0)
    return path


def test_tokenizer_files_load_with_autotokenizer(tok_dir):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= {
        p.name for p in tok_dir.iterdir()
    }
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) <= 512 and len(tok) == len(tok.get_vocab())
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == "<|pad|>" and tok.eos_token_id != tok.pad_token_id
    assert tok.encode("add 1+2\n") == tok.encode("add 1+2\n", add_special_tokens=False)  # no BOS/EOS added
    vocab = tok.get_vocab()
    assert all(c in vocab for c in string.printable if c not in "\r\x0b\x0c")


def test_tokenizer_is_deterministic(tok_dir, tmp_path):
    build_tokenizer(tmp_path, seed=0)
    assert (tmp_path / "tokenizer.json").read_text() == (tok_dir / "tokenizer.json").read_text()


def test_tokenizer_round_trips_every_family(tok_dir, samples):
    tok = load_tokenizer(tok_dir)
    for ss in samples.values():
        for s in ss:
            ids = tok.encode(s.text, add_special_tokens=False)
            assert tok.decode(ids) == s.text
            p, t = encode_sample(tok, s)
            assert (
                p + t[:-1] == ids and t[-1] == tok.eos_token_id
            )  # prompt/target boundary is a token boundary
            assert tok.decode(p + t) == s.text + EOS_TOKEN
            assert tok.decode(p + t, skip_special_tokens=True) == s.text
    text = "".join(chr(i) for i in range(32, 127)) + "\n\t  x  \n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_tokenizer_digits_and_letter_strings_are_single_characters(tok_dir):
    tok = load_tokenizer(tok_dir)
    assert tok.tokenize("add 90817+2345\n") == ["add", " ", *"90817", "+", *"2345", "\n"]
    assert tok.tokenize("reverse word qxzt\n")[-5:] == [*"qxzt", "\n"]
    assert tok.tokenize("Ann has a red cat.") == ["Ann", " has", " a", " red", " cat", "."]
    assert tok.tokenize("xadd") == [*"xadd"]  # template words only as whole words


def test_tokenizer_without_spaced_pairs_spells_a_name_one_way(tok_dir, tmp_path, samples):
    """spaced_pairs=False (testbed-c's tokenizer): no " Bob" beside "Bob", so a qa name is the same token in
    the passage, the question and the solution lines; every other word keeps its token and text still
    round-trips."""
    tok, bare = load_tokenizer(tok_dir), build_tokenizer(tmp_path, spaced_pairs=False)
    both, one = tok.get_vocab(), bare.get_vocab()
    dropped = sorted(set(both) - set(one))
    assert len(dropped) >= 10 and all(w.startswith(" ") and w[1:] in one for w in dropped), dropped
    assert set(one) <= set(both) and " has" in one and " blue" in one
    sample = next(s for s in samples["test"] if s.family == "qa" and "who has" not in s.prompt)
    ids = bare.encode(sample.text, add_special_tokens=False)
    assert bare.decode(ids) == sample.text
    name = sample.target.split()[0]  # the first solution line starts with the passage's first name
    assert [bare.decode([i]) for i in ids].count(name) == sample.text.count(name)
    assert bare.tokenize("Q: what color is Bob's dog?\nBob") == [
        "Q", ":", " what", " color", " is", " ", "Bob", "'", "s", " dog", "?", "\n", "Bob"]


def test_length_stats_fit_a_tiny_model(tok_dir):
    tok = load_tokenizer(tok_dir)
    train = length_stats(make_split("train", 60, seed=0), tok)
    held = length_stats(make_split("heldout", 30, seed=0), tok)
    assert set(train) == set(FAMILIES)
    for fam, st in train.items():
        assert 30 <= st["total"] <= 150 and st["max_total"] <= 200, (fam, st)
        assert held[fam]["total"] > st["total"], fam


def test_exclude_draws_a_disjoint_sample_from_the_same_stream():
    base = make_split("test", 30, seed=0, domain="arithmetic")
    assert make_split("test", 30, seed=0, domain="arithmetic", exclude=()) == base  # no exclusion: unchanged
    other = make_split("test", 30, seed=1, domain="arithmetic", exclude={s.prompt for s in base})
    assert {s.prompt for s in other}.isdisjoint(s.prompt for s in base) and len(other) == len(base)
    again = make_split("test", 30, seed=1, domain="arithmetic", exclude={s.prompt for s in base})
    assert [s.prompt for s in again] == [s.prompt for s in other]  # deterministic


def test_final_split_never_draws_a_problem_an_earlier_sample_drew():
    """The reserved final split (docs/results/protocol.md): trained sizes in the test buckets, deterministic,
    and disjoint from every test and edge sample any earlier run drew -- the plain seeds at the largest size,
    and the replication samples drawn disjoint from seed 0 -- checked against those samples drawn here."""
    from slimwise.testbed.tasks import FINAL_EXCLUDES

    final = make_split("final", 48, seed=0, domain="arithmetic")
    assert final == make_split("final", 48, seed=0, domain="arithmetic")
    assert all(90 <= split_bucket(s.prompt) < 100 and s.level == "train" for s in final)
    n = FINAL_EXCLUDES["per_family"]
    earlier = [make_split(split, n, seed, domain="arithmetic", allow_fewer=True)
               for split in FINAL_EXCLUDES["splits"] for seed in FINAL_EXCLUDES["seeds"]]
    chain = make_split("test", n, 0, domain="arithmetic")
    for seed in FINAL_EXCLUDES["replicates"]:
        chain += make_split("test", n, seed, domain="arithmetic", exclude={s.prompt for s in chain},
                            allow_fewer=True)
    seen = {s.prompt for sample in earlier for s in sample} | {s.prompt for s in chain}
    assert not seen & {s.prompt for s in final}
    # without the exclusion the same stream would have drawn earlier problems: the check can fail
    plain = make_split("test", 48, seed=0, domain="arithmetic")
    assert {s.prompt for s in plain} <= seen
