"""The README stays a first screen: short, with the test command CI runs, and no link that leads nowhere.
Results prose and history belong in docs/results/ and docs/history/, test tiers in CONTRIBUTING.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 115
# [text](target) and ![alt](target); the target ends at the first space or closing parenthesis
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")


def broken_links(markdown: Path, root: Path = ROOT) -> list[str]:
    """The relative link targets in `markdown` that are not a file under `root` (anchors dropped; web and mail
    links are not checked)."""
    bad = []
    for target in _LINK.findall(markdown.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        path = (markdown.parent / target.split("#", 1)[0]).resolve()
        if not path.is_file() or not path.is_relative_to(root.resolve()):
            bad.append(target)
    return bad


def test_the_readme_is_a_first_screen():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; at most {MAX_LINES}"


def test_the_readme_gives_the_test_command_ci_runs():
    """`.ci/run` runs `make test`, and the README tells a user to run the same command."""
    assert re.search(r"^make test\b(?!-)", (ROOT / ".ci" / "run").read_text(), re.M)
    assert re.search(r"^make test(?![-\w])", README.read_text(), re.M)


def test_every_relative_link_in_the_readme_is_a_file():
    assert broken_links(README) == []


def test_the_link_check_finds_what_it_should(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) [anchor](page.md#top) [web](https://example.org/x) [self](#here)\n"
                    "[gone](docs/missing.md) ![img](missing.png) [dir](.) [up](../../../etc/hostname)\n")
    assert broken_links(page, tmp_path) == ["docs/missing.md", "missing.png", ".", "../../../etc/hostname"]
