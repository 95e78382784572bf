"""Atomic file and directory writes: every file SlimWise writes appears whole or not at all.

Why one helper: plans, statistics, reports, checkpoints and caches are read by other processes (a resumed run,
a serving instance, a re-rendered report) and a crash mid-write must not leave half a file under the real
name. Each write goes to a unique temporary sibling (same directory, so the rename is atomic on POSIX) and is
renamed over the target only once complete; on any error the temporary file is removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from slimwise.errors import SlimWiseError


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path next to `path` to write to; renamed onto `path` when the block ends without error."""
    path = Path(path)
    if path.is_dir():
        raise SlimWiseError(f"output {path} is a directory; pass a file path")
    make_parent(path)
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


def save_figure(fig, path: str | Path, *, dpi: float | None = None, rect: tuple | None = None) -> Path:
    """Lay out, write atomically (parents created) and close a matplotlib figure: the one ending of every
    SlimWise plot. `rect` is tight_layout's (room for a legend below the axes)."""
    import matplotlib.pyplot as plt

    if rect is None:
        fig.tight_layout()
    else:
        fig.tight_layout(rect=rect)
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", **({"dpi": dpi} if dpi else {}))
    plt.close(fig)
    return path


def _blocking_file(path: Path) -> Path | None:
    """The nearest existing ancestor of `path` if it is a file (so `path`'s directory cannot be created), else
    None."""
    for p in Path(path).absolute().parents:
        if p.exists():
            return None if p.is_dir() else p
    return None


def _blocked(path: str | Path, blocker: Path) -> SlimWiseError:
    return SlimWiseError(
        f"cannot write {path}: {blocker} is a file, not a directory; choose another output path"
    )


def refuse_blocked_parent(path: str | Path) -> None:
    """Before a long run: refuse an output whose directory cannot be created because a file is in the way (the
    check `make_parent` makes at write time, without creating anything)."""
    blocker = _blocking_file(Path(path))
    if blocker is not None:
        raise _blocked(path, blocker)


def make_parent(path: str | Path) -> None:
    """Create `path`'s directory; a file where a directory should be is refused in one line."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise _blocked(path, _blocking_file(Path(path)) or Path(path).parent) from exc


def refuse_existing(path: str | Path, force: bool = False) -> None:
    """Refuse to write over a file or a non-empty directory unless `force` (the one wording for every
    output)."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())) and not force:
        raise SlimWiseError(f"output {path} exists and is not empty; choose a new path or pass --force")


def pid_alive(pid: int) -> bool:
    """True while process `pid` exists (signal 0: nothing is sent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(path: str | Path) -> list[Path]:
    """Remove `atomic_dir` temporaries next to `path` left by processes that died (kill -9 mid-write)."""
    path = Path(path)
    removed = []
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(?:tmp|old)-(\d+)$")
    if not path.parent.is_dir():
        return removed
    for entry in path.parent.iterdir():
        m = pattern.match(entry.name)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """A fresh temporary directory next to `path` to fill; it replaces `path` (a backup swap: never half a
    directory under the real name) when the block ends without error, and is removed on any error. Temporaries
    of dead processes from earlier runs are removed first."""
    path = Path(path)
    make_parent(path)
    remove_stale_temporaries(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        yield tmp
        backup = path.with_name(f".{path.name}.old-{os.getpid()}")
        if path.exists():
            os.replace(path, backup)
        os.replace(tmp, path)
        if backup.exists():
            shutil.rmtree(backup) if backup.is_dir() else backup.unlink()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_NUMBER_LIST = re.compile(r"\[\s*(?:-?[\d.eE+-]+|null)(?:,\s*(?:-?[\d.eE+-]+|null))*\s*\]")


def dumps_compact(obj: Any) -> str:
    """Indented JSON with every list of numbers on one line (per-sample vectors stay readable and small)."""
    text = json.dumps(obj, indent=1, default=_json_default)
    return _NUMBER_LIST.sub(lambda m: re.sub(r"\s+", "", m.group(0)).replace(",", ", "), text)


def _json_default(obj: Any) -> Any:
    import numpy as np

    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


__all__ = [
    "atomic_dir",
    "atomic_path",
    "atomic_torch_save",
    "atomic_write_text",
    "dumps_compact",
    "make_parent",
    "pid_alive",
    "refuse_blocked_parent",
    "refuse_existing",
    "remove_stale_temporaries",
    "save_figure",
]
