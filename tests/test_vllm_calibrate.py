"""`slimwise calibrate --engine vllm`: vLLM generates the decode-phase continuations, one teacher-forced pass
of the transformers model counts them. On testbed-a in float32 it writes the statistics `--engine hf` writes
(vLLM's greedy continuations equal the reference engine's there: docs/results/calibration-engines.md), and
vLLM's own options pass through."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from slimwise.criteria import plan_from_stats
from slimwise.stats import ExpertStats
from slimwise.testbed import make_split

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SLIMWISE = [sys.executable, "-m", "slimwise.cli"]


def calibrate(tmp_path, name, *extra):
    out = tmp_path / f"{name}.safetensors"
    proc = subprocess.run([*SLIMWISE, "calibrate", "testbed-a", "--data", str(tmp_path / "calib.jsonl"),
                           "--out", str(out), "--dtype", "float32", "--max-new-tokens", "40", *extra],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return ExpertStats.load(out), proc


def test_vllm_calibration_counts_what_the_reference_counts(tmp_path):
    """The vLLM side is a real `slimwise calibrate --engine vllm` process: the one command in CI whose own
    process starts a vLLM engine, so a CLI that vLLM's spawned engine core or worker re-executes is caught
    here (tests/test_vllm_teacher.py runs its command in-process)."""
    prompts = [s.prompt for s in make_split("calib", 3, seed=0, domain="arithmetic")]
    (tmp_path / "calib.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    # the reference side in this process (the same main() a process runs)
    from slimwise.cli import main

    assert main(["calibrate", "testbed-a", "--data", str(tmp_path / "calib.jsonl"), "--out",
                 str(tmp_path / "hf.safetensors"), "--dtype", "float32", "--max-new-tokens", "40"]) == 0
    hf = ExpertStats.load(tmp_path / "hf.safetensors")
    vllm, proc = calibrate(tmp_path, "vllm", "--engine", "vllm", "--max-num-seqs", "8")
    assert "decode tokens counted per layer" in proc.stdout
    assert vllm.meta["engine"] == {"continuations": "vllm", "vllm_options": {"max_num_seqs": 8}}
    assert torch.equal(hf.count, vllm.count) and torch.equal(hf.tokens, vllm.tokens)
    torch.testing.assert_close(vllm.norm_sum, hf.norm_sum, rtol=1e-5, atol=1e-9)
    for criterion in ("frequency", "reap"):
        assert plan_from_stats(vllm, criterion, 0.5).kept_experts == \
            plan_from_stats(hf, criterion, 0.5).kept_experts


def test_vllm_options_without_the_vllm_engine_are_refused_in_one_line(tmp_path):
    (tmp_path / "calib.jsonl").write_text('{"prompt": "add 1+2\\n"}\n')
    proc = subprocess.run([*SLIMWISE, "calibrate", "testbed-a", "--data", str(tmp_path / "calib.jsonl"),
                           "--out", str(tmp_path / "s.safetensors"), "--tensor-parallel-size", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "slimwise: error: unrecognized arguments: --tensor-parallel-size 2 (vLLM options need --engine vllm)"]
    assert not (tmp_path / "s.safetensors").exists()
