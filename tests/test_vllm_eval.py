"""`slimwise eval --engine vllm` (colocated plugin) gives the reference engine's greedy generations."""

from __future__ import annotations

import json

import pytest

from slimwise.cli import main as cli_main
from slimwise.testbed import build_tokenizer
from slimwise.tiny import save_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.vllm_in_process]


def generations(cache_dir) -> dict[str, list[list[int]]]:
    """mode -> generated token ids per sample, from the eval run cache (one plan, so one run per mode)."""
    return {f.name.split("-")[1]: [g["token_ids"] for g in json.loads(f.read_text())["gens"]]
            for f in sorted(cache_dir.glob("*/run-*.json"))}


def test_eval_engine_parity(tmp_path):
    tok = build_tokenizer(tmp_path / "model")
    save_tiny_model("qwen3_moe", tmp_path / "model", initializer_range=0.15, vocab_size=len(tok),
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    common = ["eval", str(tmp_path / "model"), "--criteria", "reap", "--ratios", "0.5", "--phases", "decode",
              "--per-family", "2", "--max-new-tokens", "16", "--calib-per-family", "1", "--no-kl", "--no-traffic",
              "--no-plots", "--threads", "1"]
    assert cli_main([*common, "--out", str(tmp_path / "hf"), "--cache-dir", str(tmp_path / "hf-cache")]) == 0
    assert cli_main([*common, "--engine", "vllm", "--out", str(tmp_path / "vllm"),
                     "--cache-dir", str(tmp_path / "vllm-cache")]) == 0
    hf, vllm = generations(tmp_path / "hf-cache"), generations(tmp_path / "vllm-cache")
    assert len(hf) == 3 and hf.keys() == vllm.keys()  # full, uniform, slimwise
    assert hf == vllm
    hf_report = json.loads((tmp_path / "hf" / "report.json").read_text())
    vllm_report = json.loads((tmp_path / "vllm" / "report.json").read_text())
    for a, b in zip(hf_report["runs"], vllm_report["runs"], strict=True):
        assert a["metrics"]["correct"] == b["metrics"]["correct"]
        assert a["metrics"]["lengths"] == b["metrics"]["lengths"]
