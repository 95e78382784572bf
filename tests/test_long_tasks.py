"""The long-prompt task families (`slimwise.testbed.long_tasks`): determinism, grading, length control, and
answers that only the prompt's content decides (each recomputed here by an independent solver)."""

from __future__ import annotations

import re

import pytest

from lab.testbed.tokenizer import build_tokenizer
from slimwise.testbed.long_tasks import (
    LENGTHS,
    LONG_DOMAIN,
    LONG_FAMILIES,
    MIN_LENGTH,
    draw_long_samples,
    make_long_split,
)
from slimwise.testbed.tasks import EOS_TOKEN, FAMILIES, check_disjoint, grade


def solve(family: str, prompt: str) -> str:
    """The answer from the prompt alone."""
    lines = prompt.rstrip("\n").split("\n")
    if family == "lookup":
        facts = dict(line.split("=") for line in lines[1:-1])
        return facts[lines[-1].removeprefix("find ")]
    if family == "chain":
        links = dict(line.split(">") for line in lines[1:-1])
        start = re.fullmatch(r"follow (\w+) twice", lines[-1]).group(1)
        return links[links[start]]
    examples = [re.fullmatch(r"in: (\w+) out: (\w+)", line).groups() for line in lines[:-1]]
    query = re.fullmatch(r"in: (\w+) out:", lines[-1]).group(1)
    rules = {"reverse": lambda w: w[::-1], "uppercase": str.upper,
             "novowel": lambda w: "".join(c for c in w if c not in "aeiou") or w,
             "double": lambda w: "".join(c + c for c in w)}
    fitting = [f for f in rules.values() if all(f(i) == o for i, o in examples)]
    assert len(fitting) == 1, (prompt, examples)  # the examples pin the rule down
    return fitting[0](query)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("length", LENGTHS)
def test_length_control_answers_and_grading(length, tok):
    samples = make_long_split("test", 12, length)
    assert {s.family for s in samples} == set(LONG_FAMILIES) and len(samples) == 12 * len(LONG_FAMILIES)
    for s in samples:
        assert s.domain == LONG_DOMAIN and s.difficulty == {"length": length} and len(s.prompt) <= length
        ids = tok(s.prompt, add_special_tokens=False)["input_ids"]
        assert 0.75 * length <= len(ids) <= length, (s.family, len(ids))
        assert tok.decode(tok(s.text, add_special_tokens=False)["input_ids"]) == s.text  # no unknown token
        assert solve(s.family, s.prompt) == s.answer
        assert grade(s, s.target + EOS_TOKEN).correct and grade(s, s.target + EOS_TOKEN).stopped
        assert not grade(s, s.target.replace(f"#### {s.answer}", f"#### {s.answer}9") + EOS_TOKEN).correct


@pytest.mark.parametrize("length", [MIN_LENGTH, MIN_LENGTH + 8])
def test_shortest_prompts_still_decide_the_answer(length):
    """Where only one or two items fit: the chain keeps both of its links, the examples pin the rule."""
    for s in make_long_split("test", 30, length):
        assert len(s.prompt) <= length and solve(s.family, s.prompt) == s.answer, s.prompt


def test_infer_names_the_rule_then_works_it_as_the_short_family_does():
    """infer's solution: `rule: NAME`, then per letter the step line of the short family of that
    transformation (strrev, upper, novowel; double as upper's `c=cc`); the steps alone rebuild the answer."""
    from slimwise.testbed.tasks import make_split

    short = {"reverse": "strrev", "uppercase": "upper", "novowel": "novowel"}
    step_re = {"reverse": r"\d+:[a-z]", "uppercase": r"[a-z]=[A-Z]", "novowel": r"[a-z] (keep|drop)",
               "double": r"([a-z])=\1\1"}
    rebuild = {"reverse": lambda st: "".join(x.split(":")[1] for x in st),
               "uppercase": lambda st: "".join(x.split("=")[1] for x in st),
               "novowel": lambda st: "".join(x[0] for x in st if x.endswith("keep")),
               "double": lambda st: "".join(x.split("=")[1] for x in st)}
    for rule, family in short.items():  # the short family writes its steps in this very format
        steps = make_split("test", 3, families=[family])[0].target.split("\n")[:-1]
        assert all(re.fullmatch(step_re[rule], x) for x in steps), (family, steps)
    seen = set()
    for length in (64, LENGTHS[-1]):
        for s in make_long_split("test", 40, length, families=["infer"]):
            first, *steps, last = s.target.split("\n")
            rule = first.removeprefix("rule: ")
            seen.add(rule)
            query = re.fullmatch(r"in: (\w+) out:", s.prompt.rstrip("\n").split("\n")[-1]).group(1)
            assert len(steps) == len(query) and all(re.fullmatch(step_re[rule], x) for x in steps), s.target
            assert last == f"#### {s.answer}" and rebuild[rule](steps) == s.answer == solve("infer", s.prompt)
    assert seen == set(step_re)


def test_determinism_and_disjoint_splits():
    a, b = make_long_split("calib", 5, 256, seed=3), make_long_split("calib", 5, 256, seed=3)
    assert [s.to_dict() for s in a] == [s.to_dict() for s in b]
    assert [s.prompt for s in make_long_split("calib", 5, 256, seed=4)] != [s.prompt for s in a]
    assert check_disjoint(make_long_split("train", 40, 256), make_long_split("calib", 40, 256),
                          make_long_split("test", 40, 256))
    assert not set(LONG_FAMILIES) & set(FAMILIES)  # not in the shipped backbones' training stream or cards


def test_training_draw_lengths_and_top_share():
    """The training stream's lengths: log-uniform in [MIN_LENGTH, max] (more short than long), a pure
    function of its arguments; top_share sends that share of the samples to the top octave and leaves the
    rest of the draw as it was (top_share 0 is exactly the default stream)."""
    def lengths(samples):
        return [s.difficulty["length"] for s in samples]

    base = draw_long_samples("chain", 400, seed=7, max_length=1024)
    assert [s.to_dict() for s in base] == [s.to_dict() for s in draw_long_samples("chain", 400, 7, 1024)]
    assert [s.to_dict() for s in base] == [s.to_dict() for s in draw_long_samples("chain", 400, 7, 1024,
                                                                                  top_share=0.0)]
    n = lengths(base)
    assert min(n) >= MIN_LENGTH and max(n) <= 1024
    assert all(len(s.prompt) <= s.difficulty["length"] for s in base)
    # log-uniform over 48..1,024: a quarter in the top octave (ln 2 / ln(1024/48) = 0.23), the median 222
    assert 0.15 < sum(x >= 512 for x in n) / len(n) < 0.31 and sum(x < 300 for x in n) > len(n) / 2
    top = lengths(draw_long_samples("chain", 400, seed=7, max_length=1024, top_share=0.5))
    assert all(512 <= x <= 1024 for x in top[:200])
    assert 0.55 < sum(x >= 512 for x in top) / len(top) < 0.7  # the top half, plus a quarter of the rest
    assert all(MIN_LENGTH <= x <= 96 for x in lengths(draw_long_samples("lookup", 20, 1, 96, top_share=1.0)))
    with pytest.raises(ValueError, match="top_share"):
        draw_long_samples("chain", 2, 0, 1024, top_share=1.5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown split"):
        make_long_split("dev", 1, 256)
    with pytest.raises(ValueError, match="unknown long task families"):
        make_long_split("test", 1, 256, families=["add"])
    with pytest.raises(ValueError, match="length"):
        make_long_split("test", 1, MIN_LENGTH - 1)


def test_long_final_split_never_draws_a_test_problem_an_earlier_run_drew():
    from slimwise.testbed.long_tasks import LONG_FINAL_EXCLUDES

    final = make_long_split("final", 20, 256, seed=0)
    assert len(final) == 20 * len(LONG_FAMILIES) and final == make_long_split("final", 20, 256, seed=0)
    earlier = {s.prompt for seed in LONG_FINAL_EXCLUDES["seeds"]
               for s in make_long_split("test", LONG_FINAL_EXCLUDES["per_family"], 256, seed)}
    assert not earlier & {s.prompt for s in final}
