"""Atomic writes: a file appears whole or not at all, and a failed write leaves the old file and no debris."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from slimwise.io import atomic_path, atomic_torch_save, atomic_write_text


def test_atomic_writes(tmp_path):
    target = tmp_path / "sub" / "report.json"
    atomic_write_text(target, "old\n")
    assert target.read_text() == "old\n"
    umask = os.umask(0)
    os.umask(umask)
    # readable by others as a plain write would be
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash mid-write")
    assert target.read_text() == "old\n" and os.listdir(target.parent) == ["report.json"]
    atomic_torch_save({"x": torch.arange(3)}, tmp_path / "state.pt")
    assert torch.equal(torch.load(tmp_path / "state.pt")["x"], torch.arange(3))


def test_atomic_dir_replaces_whole_and_cleans_after_a_killed_run(tmp_path):
    """A directory appears whole (backup swap) or not at all; a temporary left by a process that died (kill -9
    mid-write) is removed by the next write, one of a live process is not."""
    import subprocess
    import sys

    from slimwise.io import atomic_dir

    target = tmp_path / "out"
    with atomic_dir(target) as tmp:
        (tmp / "a.txt").write_text("1")
    assert (target / "a.txt").read_text() == "1"
    with pytest.raises(RuntimeError), atomic_dir(target) as tmp:
        (tmp / "a.txt").write_text("half")
        raise RuntimeError("crash mid-write")
    assert (target / "a.txt").read_text() == "1" and sorted(os.listdir(tmp_path)) == ["out"]
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / f".out.tmp-{int(dead.stdout)}"  # that process has exited
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"x" * 100)
    live = tmp_path / f".out.tmp-{os.getppid()}"  # a running process (our parent): not ours to remove
    live.mkdir()
    with atomic_dir(target) as tmp:
        (tmp / "b.txt").write_text("2")
    assert not stale.exists() and live.exists()
    assert sorted(os.listdir(target)) == ["b.txt"]


def test_cli_expected_failures_are_one_line(tmp_path, capsys, monkeypatch):
    """An OS-level failure (here: a directory procfs will not create) is one line and exit 2, not a traceback;
    SLIMWISE_DEBUG=1 gives the traceback instead. An output path under a regular file is refused by name."""
    from lab.perf.cli import main
    from slimwise.errors import DEBUG_ENV

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    argv = ["roofline", "--preset", "qwen3-30b-a3b", "--hardware", "h200", "--out", str(blocker / "sub")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m lab.perf.cli: error: ") and "\n" not in err
    assert f"{blocker} is a file" in err
    argv[-1] = "/proc/slimwise-no-such-dir/sub"
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m lab.perf.cli: error: ") and "\n" not in err
    assert "/proc/slimwise-no-such-dir" in err
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(OSError):
        main(argv)
