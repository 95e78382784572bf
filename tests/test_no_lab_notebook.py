"""Code says why and states invariants; the history of runs lives in docs/.

Session numbers, issue numbers and dated measurements in .py files go stale the day they are written and send
a reader to a lab notebook that is not in the tree. So do measurement notes in comments and docstrings
("12 ms", "0.4 s a step", "1.7x faster here", "took 153 s"): a figure measured on one machine, true of one
run.
docs/history/ and docs/results/ hold them instead; the code keeps the reason and the invariant.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for d in ("slimwise", "tests", "experiments", "scripts", "lab")
                 for p in (ROOT / d).rglob("*.py")
                 if p != Path(__file__).resolve())  # this file quotes what it forbids

#: what a run label or an issue reference looks like in prose
FORBIDDEN = {
    "session number": re.compile(r"\bsessions? \d+\b", re.IGNORECASE),
    "issue number": re.compile(r"\bissues? #?\d+\b|(?<![\w&{/])#\d{1,4}\b(?![\w}])", re.IGNORECASE),
    "dated measurement": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
}


_NUMBER = r"(?<![\w.-])\d+(?:[.,]\d+)?(?:\s?[-–]\s?\d+(?:[.,]\d+)?)?"  # a figure or a range, 2-5
_DURATION = r"\s?(?:ms|s|sec|seconds?|min|minutes?|h|hours?)\b"
#: what a measured figure looks like in a comment or docstring (never checked in code or option help, where
#: "timeout_s=600", "--budget-ms" and "(ms)" name units, not results)
MEASUREMENTS = {
    "milliseconds": re.compile(rf"(?<!every ){_NUMBER}\s?ms\b(?![-\w])"),
    "time per step": re.compile(rf"{_NUMBER}{_DURATION}\s*(?:per|/|an?)\s*"
                                r"(?:step|token|batch|iteration|epoch|call|round|layer|prompt|request)s?\b",
                                re.IGNORECASE),
    "speed ratio": re.compile(rf"{_NUMBER}\s?[x×]\s+(?:faster|slower|quicker|speed-?up)\b", re.IGNORECASE),
    "measured here": re.compile(r"\bmeasured\b.*\bhere\b", re.IGNORECASE),
    "run time": re.compile(rf"\btook\s+(?:about\s+|~)?{_NUMBER}{_DURATION}", re.IGNORECASE),
}
#: prose that matches a measurement pattern but is no measurement: the figures a test feeds its code
NOT_MEASUREMENTS = {
    "tests/test_perf_kernels.py": ("20 ms full step: 8 x 10 us x 20 = 1.6 ms saved",),  # the test's inputs
    "tests/test_testbed_train.py": ("2 threads win, then turn 6x slower", "2 threads turned 6x slower"),
}


def prose(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every comment and every docstring line (a string standing alone as a
    statement) of a Python source."""
    lines = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(getattr(node.value, "value", None), str):
            lines += [(node.lineno + i, line) for i, line in enumerate(node.value.value.splitlines())]
    return sorted(lines)


def offences(text: str, allowed: tuple[str, ...] = ()) -> list[str]:
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN.items():
            if pattern.search(line):
                found.append(f"{n}: {what}: {line.strip()[:100]}")
    for n, line in prose(text):
        for what, pattern in MEASUREMENTS.items():
            if pattern.search(line) and not any(a in line for a in allowed):
                found.append(f"{n}: {what}: {line.strip()[:100]}")
    return found


def test_the_patterns_catch_what_they_should():
    assert offences("x = 1  # seen in session 19")
    assert offences('"""Where a decode step goes (issue #18)."""')
    assert offences("# issue 14's bars")
    assert offences("# (#17: seeds 1-4)")
    assert offences("# Measured (2026-12-02): mean 0.010")
    assert not offences('name = f"#{i}"; color = "#ff0000"; url = "a/#3x"; n = 3  # round 0 warms up')


def test_the_measurement_patterns_catch_what_they_should():
    for note in ("# a step took 12 ms instead of 40", "# Newton-Schulz is ~0.4 s a step on one core",
                 "# 2.5 s per step on this VM", "# batch 128: 1.7x faster here", "# 2-5x faster",
                 "# measured on the EPYC here: 8 MB left behind", "# these tests took 153 s",
                 '"""Docstring: the probe took about 3 minutes."""', 'def f():\n    """Costs 0.2 ms."""'):
        assert offences(note), note
    for fine in ("timeout_s = 600  # the engine's start-up limit",
                 'p.add_argument("--budget-ms", type=float)', 'HELP = "per-step budget (ms)"',
                 "elapsed_ms = 1000 * (time.perf_counter() - t0)",
                 'print(f"{ms:.1f} ms per step")', 'label = "12 ms"', "# samples memory every 50 ms",
                 "# a tolerance of 1e-3, not a measurement", "# times the pass: see docs/results/gpu.md",
                 "# the 2x2 grid; top-4 of 8 experts", "# 0.5 s timeout between polls"):
        assert not offences(fine), fine
    assert offences("# 2 threads turned 6x slower")
    assert not offences("# 2 threads turned 6x slower", ("2 threads turned 6x slower",))


def test_every_allowed_measurement_is_still_there():
    """An exemption whose line is gone or no longer matches is removed, not kept as a standing permission."""
    for name, allowed in NOT_MEASUREMENTS.items():
        text = (ROOT / name).read_text()
        for line in allowed:
            assert any(line in text_line and any(p.search(text_line) for p in MEASUREMENTS.values())
                       for _, text_line in prose(text)), (name, line)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_run_history_in_code(path):
    found = offences(path.read_text(), NOT_MEASUREMENTS.get(path.relative_to(ROOT).as_posix(), ()))
    assert not found, \
        f"{path.relative_to(ROOT)}: move these to docs/history/ or docs/results/:\n" + "\n".join(found)
