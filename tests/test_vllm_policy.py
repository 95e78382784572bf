"""`python -m lab.perf.cli policy-quality`: the load-aware policy in a real vLLM engine, against load."""

from __future__ import annotations

import json

import pytest

from lab.perf.cli import main as cli_main
from slimwise.calibrate import CalibrationConfig, calibrate
from slimwise.criteria import plan_from_stats
from slimwise.models import load_model, load_tokenizer
from slimwise.testbed import TARGET_DOMAIN, make_split

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.vllm_in_process]


def test_policy_quality_against_load(tmp_path, capsys):
    # float32 as the command's engine runs (its default); bf16 calibration is emulated on AVX2-only CPUs
    model, tok = load_model("testbed-a", dtype="float32"), load_tokenizer("testbed-a")
    calib = [s.prompt for s in make_split("calib", 2, domain=TARGET_DOMAIN)]
    stats = calibrate(model, calib, tok, CalibrationConfig(phase="decode", max_new_tokens=64), progress=False)
    plan = plan_from_stats(stats, "reap", 0.5).save(tmp_path / "plan.json")
    out = tmp_path / "policy.json"
    args = ["policy-quality", "testbed-a", "--threshold", "4", "--concurrency", "1", "8", "--plan", str(plan),
            "--n-per-family", "4", "--max-new-tokens", "80", "--out", str(out)]
    assert cli_main(args) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = {(r["mode"], r["concurrency"]): r for r in result["rows"]}
    assert result["samples"] == 20 and len(rows) == 6
    for conc in (1, 8):
        assert rows[("full", conc)]["pruned_share"] == 0 and rows[("full", conc)]["identical_to_full"] == 1
        assert rows[("slimwise", conc)]["pruned_share"] == 1  # every decode token took the kept experts
        assert rows[("slimwise", conc)]["identical_to_full"] < 1  # and pruning changed some outputs
    # one request at a time never reaches 4 decode tokens per step: the policy serves the full model
    assert (
        rows[("slimwise-min4", 1)]["pruned_share"] == 0
        and rows[("slimwise-min4", 1)]["identical_to_full"] == 1
    )
    assert rows[("slimwise-min4", 1)]["accuracy"] == rows[("full", 1)]["accuracy"]
    # eight at a time: steps holding >= 4 decode tokens prune; the last requests' steps (< 4) do not
    assert 0 < rows[("slimwise-min4", 8)]["pruned_share"] < 1
    assert "| slimwise-min4 | 8 |" in table
    assert cli_main([*args[:3], "0", *args[4:]]) == 2
    assert "threshold and concurrencies must be >= 1" in capsys.readouterr().err
