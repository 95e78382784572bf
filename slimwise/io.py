"""Atomic file writes: every file SlimWise writes appears whole or not at all.

Why one helper: plans, statistics, reports, checkpoints and caches are read by other processes (a resumed run,
a serving instance, a re-rendered report) and a crash mid-write must not leave half a file under the real name.
Each write goes to a unique temporary sibling (same directory, so the rename is atomic on POSIX) and is renamed
over the target only once complete; on any error the temporary file is removed.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path next to `path` to write to; renamed onto `path` when the block ends without error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a unique name, created by the writer itself (mkstemp would leave the file 0600 after the rename)
    tmp = path.parent / f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def atomic_torch_save(obj, path: str | Path) -> Path:
    """`torch.save(obj, path)`, atomically."""
    import torch

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
    return Path(path)


__all__ = ["atomic_path", "atomic_torch_save", "atomic_write_text"]
