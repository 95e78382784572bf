"""How a command ends: one line for what the user's input or machine caused, a
traceback for SlimWise's bugs."""

from __future__ import annotations

import os

import pytest

from slimwise.errors import DEBUG_ENV, SlimWiseError, bug_header, is_own_bug, run_command


def _library_key_error():
    return os.environ["SLIMWISE_TEST_NO_SUCH_VARIABLE"]  # KeyError raised inside the standard library


def _own_key_error():
    from slimwise.evaluation.report import write_markdown

    write_markdown({}, os.devnull)  # KeyError raised by SlimWise's own code: a report without its sections


def test_a_refusal_is_one_line(capsys):
    def refuse():
        raise SlimWiseError("plan.json: not a plan")

    assert run_command(refuse) == 2
    assert capsys.readouterr().err == "slimwise: error: plan.json: not a plan\n"


def test_a_library_key_error_is_one_line(capsys, monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert run_command(_library_key_error) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 \
        and err.startswith("slimwise: error: KeyError: 'SLIMWISE_TEST_NO_SUCH_VARIABLE'")


def test_a_key_error_from_slimwise_is_a_bug_with_its_traceback(capsys, monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    with pytest.raises(KeyError) as info:
        run_command(_own_key_error)
    assert is_own_bug(info.value)
    assert capsys.readouterr().err == bug_header(info.value) + "\n"
    assert "this is a bug in SlimWise (KeyError" in bug_header(info.value)


def test_runtime_errors_are_judged_by_where_they_were_raised(capsys):
    """The same RuntimeError is a bug when a frame of the package raised it, one line when a library did."""
    from slimwise.errors import PACKAGE_DIR

    def raise_from(filename: str):
        exec(compile("raise RuntimeError('diverged')", filename, "exec"))

    with pytest.raises(RuntimeError):
        run_command(lambda: raise_from(str(PACKAGE_DIR / "engines" / "reference.py")))
    assert capsys.readouterr().err.startswith("slimwise: this is a bug in SlimWise (RuntimeError")
    assert run_command(lambda: raise_from("/usr/lib/python3/site-packages/torch/nn/modules/module.py")) == 2
    assert capsys.readouterr().err.startswith("slimwise: error: RuntimeError: diverged")


def test_the_cli_shows_a_bug_with_its_traceback(tmp_path):
    """As a user sees it: the header, then Python's traceback, and a non-zero exit (no tidy one-liner)."""
    import subprocess
    import sys

    code = ("import sys\nfrom slimwise.errors import run_command\n"
            "from slimwise.evaluation.report import write_markdown\n"
            "sys.exit(run_command(lambda: write_markdown({}, 'x.md')))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in os.environ.items() if k != DEBUG_ENV})
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert lines[0].startswith("slimwise: this is a bug in SlimWise (KeyError")
    assert lines[1] == "Traceback (most recent call last):" and lines[-1].startswith("KeyError")
