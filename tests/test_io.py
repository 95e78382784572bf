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
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask  # readable by others as a plain write would be
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash mid-write")
    assert target.read_text() == "old\n" and os.listdir(target.parent) == ["report.json"]
    atomic_torch_save({"x": torch.arange(3)}, tmp_path / "state.pt")
    assert torch.equal(torch.load(tmp_path / "state.pt")["x"], torch.arange(3))
