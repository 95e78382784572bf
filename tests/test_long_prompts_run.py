"""`python -m experiments.long_prompts run` resumes a run only on the weights it started with: a backbone
re-shipped under the same name must not inherit the old weights' full-model rows (a re-shipped testbed-c-long
once resumed an earlier run's directory and took its full-model answers as the new model's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.long_prompts import main, merge

ROOT = Path(__file__).resolve().parents[1]

TINY = ["--ratios", "0.5", "--lengths", "64", "--test-per-family", "1", "--calib-per-family", "1",
        "--no-distill", "--threads", "1"]


def test_a_run_resumes_only_on_the_weights_it_started_with(tmp_path):
    out = tmp_path / "run"
    path = out / "report.json"
    assert main(["run", "testbed-a", "--out", str(out), *TINY]) == 0
    first = path.read_text()
    report = json.loads(first)
    assert report["weights"]["weights_sha256"] and list(report["ratios"]) == ["0.5"]
    written = path.stat().st_mtime_ns
    assert main(["run", "testbed-a", "--out", str(out), *TINY]) == 0  # finished: nothing run again
    assert path.stat().st_mtime_ns == written and path.read_text() == first

    stored = json.loads(first)
    stored["weights"]["weights_sha256"] = "0" * 16  # what a re-ship under the same name looks like
    path.write_text(json.dumps(stored))
    with pytest.raises(SystemExit, match="was written for other weights .* pass another --out"):
        main(["run", "testbed-a", "--out", str(out), *TINY])
    del stored["weights"]  # a run from before the check: no fingerprint to resume on
    path.write_text(json.dumps(stored))
    with pytest.raises(SystemExit, match="no fingerprint"):
        main(["run", "testbed-a", "--out", str(out), *TINY])
    path.write_text(first)
    with pytest.raises(SystemExit, match="other weights"):  # another model into the same directory
        main(["run", "testbed-b", "--out", str(out), *TINY])
    assert path.read_text() == first  # a refused resume writes nothing

    other = json.loads(first)
    other["weights"]["weights_sha256"] = "0" * 16
    with pytest.raises(SystemExit, match="two reports of other weights under one name"):
        merge([report, other])


@pytest.mark.parametrize("bad, says", [
    (["--ratios", "0.5,1.5"], "argument --ratios: 1.5 is outside (0, 1)"),
    (["--lengths", "64,10"], "argument --lengths: 10 is outside [48, inf]"),
    (["--ratios", ","], "--ratios names none"),
])
def test_a_bad_option_is_one_line_and_writes_nothing(tmp_path, bad, says):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "experiments.long_prompts", "run", "testbed-a", "--out", str(out), *bad]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr
    assert not out.exists()
