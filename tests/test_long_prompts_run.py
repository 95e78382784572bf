"""`python -m experiments.long_prompts run` resumes a run only on the weights it started with: a backbone
re-shipped under the same name must not inherit the old weights' full-model rows (a re-shipped testbed-c-long
once resumed an earlier run's directory and took its full-model answers as the new model's)."""

from __future__ import annotations

import json

import pytest

from experiments.long_prompts import LongConfig, merge, run


def _tiny() -> LongConfig:
    return LongConfig(ratios=(0.5,), lengths=(64,), test_per_family=1, calib_per_family=1,
                      calib_max_new_tokens=4, max_new_tokens=8, distilled=False, threads=1)


def test_a_run_resumes_only_on_the_weights_it_started_with(tmp_path):
    out = tmp_path / "run"
    first = run("testbed-a", out, _tiny())
    assert first["weights"]["weights_sha256"] and list(first["ratios"]) == ["0.5"]
    again = run("testbed-a", out, _tiny())  # finished: nothing run again, the same rows
    assert again["full"] == first["full"] and again["ratios"] == first["ratios"]

    path = out / "report.json"
    stored = json.loads(path.read_text())
    stored["weights"]["weights_sha256"] = "0" * 16  # what a re-ship under the same name looks like
    path.write_text(json.dumps(stored))
    with pytest.raises(SystemExit, match="was written for other weights .* pass another --out"):
        run("testbed-a", out, _tiny())
    del stored["weights"]  # a run from before the check: no fingerprint to resume on
    path.write_text(json.dumps(stored))
    with pytest.raises(SystemExit, match="no fingerprint"):
        run("testbed-a", out, _tiny())
    with pytest.raises(SystemExit, match="other weights"):  # another model into the same directory
        path.write_text(json.dumps(first))
        run("testbed-b", out, _tiny())
    assert path.read_text() == json.dumps(first)  # a refused resume writes nothing

    other = json.loads(json.dumps(first))
    other["weights"]["weights_sha256"] = "0" * 16
    with pytest.raises(SystemExit, match="two reports of other weights under one name"):
        merge([first, other])
