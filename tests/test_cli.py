"""The `slimwise` command line: the full core flow and its error handling.

Each test runs its first command as a real process (`python -m slimwise.cli`: exit code, stdout and stderr as a
user sees them) and the rest in this process through `slimwise.cli.main`, the same entry point without the 9-11 s
of importing torch and transformers again per command (measured on a 2-core AVX2-only VM: these three tests took
153 s as eight plus four plus four processes).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from tiny import save_tiny_model

from slimwise.testbed import build_tokenizer, export_jsonl, make_split

SLIMWISE = [sys.executable, "-m", "slimwise.cli"]


def run(*args, check=True):
    proc = subprocess.run([*SLIMWISE, *map(str, args)], capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"slimwise {' '.join(map(str, args))} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def call(capsys, *args, check=True) -> subprocess.CompletedProcess:
    """`run` in this process: `slimwise.cli.main`, whose return value (or argparse's SystemExit) is the exit code."""
    from slimwise.cli import main

    capsys.readouterr()
    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    proc = subprocess.CompletedProcess(["slimwise", *map(str, args)], code, out.out, out.err)
    if check and code != 0:
        raise AssertionError(f"slimwise {' '.join(map(str, args))} failed:\n{out.out}\n{out.err}")
    return proc


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model = save_tiny_model("qwen3_moe", root / "model", initializer_range=0.15)
    build_tokenizer(model)
    export_jsonl(make_split("calib", 2, seed=0), root / "calib.jsonl")
    export_jsonl(make_split("test", 1, seed=0), root / "test.jsonl")
    return root


def test_help_lists_subcommands():
    out = run("--help").stdout
    for name in ("calibrate", "plan", "prune", "generate", "demo"):
        assert name in out


def test_core_flow(workdir, capsys):
    model, stats, plan, pruned = (workdir / n for n in ("model", "stats.safetensors", "plan.json", "pruned"))
    out = run("calibrate", model, "--data", workdir / "calib.jsonl", "--phase", "decode", "--out", stats,
              "--max-new-tokens", "8")
    assert "MoE layers" in out.stdout and stats.is_file()
    call(capsys, "plan", "--stats", stats, "--criterion", "reap", "--ratio", "0.5", "--out", plan)
    saved = json.loads(plan.read_text())
    assert saved["criterion"] == "reap" and saved["phase"] == "decode"
    assert all(len(v) == 8 for v in saved["kept_experts"].values())
    call(capsys, "prune", model, "--plan", plan, "--out", pruned)
    assert json.loads((pruned / "config.json").read_text())["num_experts"] == 8
    assert (pruned / "tokenizer.json").is_file() and (pruned / "slimwise_plan.json").is_file()

    results = {}
    for mode, extra in (("full", []), ("slimwise", ["--plan", plan]), ("uniform", ["--plan", plan]),
                        ("slimwise-sliced", ["--decode-model", pruned])):
        out_file = workdir / f"{mode}.jsonl"
        call(capsys, "generate", model, "--mode", mode.split("-")[0], "--prompts", workdir / "test.jsonl",
            "--max-new-tokens", "10", "--out", out_file, *extra)
        results[mode] = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert len(results["full"]) == 13
    assert [r["token_ids"] for r in results["slimwise"]] == [r["token_ids"] for r in results["slimwise-sliced"]]
    assert [r["token_ids"][0] for r in results["slimwise"]] == [r["token_ids"][0] for r in results["full"]]
    assert all(isinstance(r["text"], str) for r in results["full"])


def test_errors_are_one_line_and_nonzero(workdir, capsys):
    cases = [
        ("prune", workdir / "model", "--stats", workdir / "missing.safetensors", "--out", workdir / "x"),
        ("prune", workdir / "model", "--plan", workdir / "calib.jsonl", "--out", workdir / "x"),
        ("calibrate", workdir / "nope", "--data", workdir / "calib.jsonl", "--out", workdir / "s"),
        ("generate", workdir / "model", "--mode", "slimwise", "--prompts", workdir / "test.jsonl"),
    ]
    for i, args in enumerate(cases):
        proc = run(*args, check=False) if i == 0 else call(capsys, *args, check=False)
        assert proc.returncode == 2, proc.stderr
        lines = [line for line in proc.stderr.splitlines() if line.startswith("slimwise: error:")]
        assert len(lines) == 1, proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (workdir / "x").exists() and not (workdir / "s").exists()


def test_prune_ratio_refused(workdir, capsys):
    stats = workdir / "stats2.safetensors"
    call(capsys, "calibrate", workdir / "model", "--data", workdir / "calib.jsonl", "--phase", "prompt", "--out", stats)
    for ratio in ("1.0", "-0.2", "0.9"):
        proc = call(capsys, "prune", workdir / "model", "--stats", stats, "--ratio", ratio, "--out", workdir / "r",
                    check=False)
        # 1.0 and -0.2 by the option's range (argparse, "slimwise prune: error: ..."), 0.9 by the plan (below top-k)
        assert proc.returncode == 2 and proc.stderr.startswith("slimwise") and ": error: " in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    assert not (workdir / "r").exists()
    shutil.rmtree(workdir / "r", ignore_errors=True)
