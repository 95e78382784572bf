"""The long-prompt task families (`slimwise.testbed.long_tasks`): determinism, grading, length control, and
answers that only the prompt's content decides (each recomputed here by an independent solver)."""

from __future__ import annotations

import re

import pytest

from slimwise.testbed import build_tokenizer
from slimwise.testbed.long_tasks import LENGTHS, LONG_DOMAIN, LONG_FAMILIES, MIN_LENGTH, make_long_split
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


def test_determinism_and_disjoint_splits():
    a, b = make_long_split("calib", 5, 256, seed=3), make_long_split("calib", 5, 256, seed=3)
    assert [s.to_dict() for s in a] == [s.to_dict() for s in b]
    assert [s.prompt for s in make_long_split("calib", 5, 256, seed=4)] != [s.prompt for s in a]
    assert check_disjoint(make_long_split("train", 40, 256), make_long_split("calib", 40, 256),
                          make_long_split("test", 40, 256))
    assert not set(LONG_FAMILIES) & set(FAMILIES)  # not in the shipped backbones' training stream or cards


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown split"):
        make_long_split("dev", 1, 256)
    with pytest.raises(ValueError, match="unknown long task families"):
        make_long_split("test", 1, 256, families=["add"])
    with pytest.raises(ValueError, match="length"):
        make_long_split("test", 1, MIN_LENGTH - 1)
