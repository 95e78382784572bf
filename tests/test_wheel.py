"""The wheel ships the product and the demo's model, and nothing of the lab.

`pip wheel` builds it offline from a copy of the working tree (a build in place would leave build/ and
*.egg-info behind), the copy holding lab/, experiments/ and tests/ as a checkout does, so the package
discovery and package-data rules of pyproject.toml are what keeps them out. `wheel_problems` is the check;
it is also applied to a wheel that breaks each rule, so that it can fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = "slimwise/testbed/checkpoints/qwen3moe-a/"
DEMO_FILES = ("model.safetensors", "config.json", "tokenizer.json")
MAX_BYTES = 30 * 1024 * 1024
#: what a wheel build reads from a checkout, and the folders it must leave out
COPIED = ("pyproject.toml", "README.md", "slimwise", "lab", "experiments", "tests")
LEFT_OUT = ("lab/", "experiments/", "tests/")


def wheel_problems(names: list[str], size: int) -> list[str]:
    """What is wrong with a wheel holding files `names` in `size` bytes; empty when nothing is."""
    problems = []
    if not any(n.startswith("slimwise/") and n.endswith(".py") for n in names):
        problems.append("no slimwise/ modules")
    problems += [f"missing {DEMO}{f}" for f in DEMO_FILES if DEMO + f not in names]
    problems += [f"ships {n}" for n in names if n.startswith(LEFT_OUT)]
    problems += [f"ships another checkpoint: {n}" for n in names
                 if n.startswith("slimwise/testbed/checkpoints/") and not n.startswith(DEMO)]
    if size >= MAX_BYTES:
        problems.append(f"{size / 2**20:.1f} MiB, not under {MAX_BYTES / 2**20:.0f} MiB")
    return problems


def test_the_check_can_fail():
    good = ["slimwise/__init__.py", *(DEMO + f for f in DEMO_FILES)]
    assert wheel_problems(good, 1000) == []
    bad = [*good[:2], "lab/perf/cli.py", "experiments/frontier.py", "tests/test_cli.py",
           "slimwise/testbed/checkpoints/qwen2moe-b/model.safetensors"]
    assert wheel_problems(bad, MAX_BYTES) == [
        f"missing {DEMO}config.json", f"missing {DEMO}tokenizer.json", "ships lab/perf/cli.py",
        "ships experiments/frontier.py", "ships tests/test_cli.py",
        "ships another checkpoint: slimwise/testbed/checkpoints/qwen2moe-b/model.safetensors",
        "30.0 MiB, not under 30 MiB"]
    assert wheel_problems([DEMO + f for f in DEMO_FILES], 1) == ["no slimwise/ modules"]


@pytest.mark.slow  # builds the wheel (copies the tree, runs setuptools)
def test_the_wheel_ships_the_product_and_the_demo_model_only(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist")
    for name in COPIED:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=skip)
        else:
            shutil.copy2(path, src / name)
    out = tmp_path / "wheel"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = out.glob("slimwise-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert wheel_problems(names, wheel.stat().st_size) == []

    # installed from it (unpacked ahead of the checkout on the path): testbed-a resolves, and a user who asks
    # the CLI for a lab model gets one line that says where it is, exit 2
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = ("import slimwise; from slimwise.embedded import available_embedded; "
            "from slimwise.models import resolve_model_dir\n"
            "print(slimwise.__file__); print(available_embedded()); print(resolve_model_dir('testbed-a'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    where, names, demo = proc.stdout.splitlines()
    assert where.startswith(str(site)) and names == "['testbed-a']" and demo.startswith(str(site))
    (tmp_path / "p.jsonl").write_text('{"prompt": "add 1+2\\n"}\n')
    proc = subprocess.run([sys.executable, "-m", "slimwise.cli", "generate", "testbed-b", "--mode", "full",
                           "--prompts", "p.jsonl", "--out", "o.jsonl"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=env)
    [refusal] = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and not (tmp_path / "o.jsonl").exists(), proc.stderr
    assert refusal.startswith("slimwise: error: embedded model testbed-b is not in this install") \
        and "lab/testbed/checkpoints/qwen2moe-b" in refusal, refusal
