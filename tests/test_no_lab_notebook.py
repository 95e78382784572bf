"""Code says why and states invariants; the history of runs lives in docs/.

Session numbers, issue numbers and dated measurements in .py files go stale the day they are written and send
a reader to a lab notebook that is not in the tree. docs/history/ and docs/results/ hold them instead.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for d in ("slimwise", "tests", "experiments", "scripts") for p in (ROOT / d).rglob("*.py")
                 if p != Path(__file__).resolve())  # this file quotes what it forbids

#: what a run label or an issue reference looks like in prose
FORBIDDEN = {
    "session number": re.compile(r"\bsessions? \d+\b", re.IGNORECASE),
    "issue number": re.compile(r"\bissues? #?\d+\b|(?<![\w&{/])#\d{1,4}\b(?![\w}])", re.IGNORECASE),
    "dated measurement": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
}


def offences(text: str) -> list[str]:
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN.items():
            if pattern.search(line):
                found.append(f"{n}: {what}: {line.strip()[:100]}")
    return found


def test_the_patterns_catch_what_they_should():
    assert offences("x = 1  # seen in session 19")
    assert offences('"""Where a decode step goes (issue #18)."""')
    assert offences("# issue 14's bars")
    assert offences("# (#17: seeds 1-4)")
    assert offences("# Measured (2026-12-02): mean 0.010")
    assert not offences('name = f"#{i}"; color = "#ff0000"; url = "a/#3x"; n = 3  # round 0 warms up')


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_run_history_in_code(path):
    found = offences(path.read_text())
    assert not found, \
        f"{path.relative_to(ROOT)}: move these to docs/history/ or docs/results/:\n" + "\n".join(found)
