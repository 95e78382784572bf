"""Shared-memory segments vLLM's killed workers leave in /dev/shm, found and removed.

Why: with tensor parallelism on the CPU backend, every vLLM engine creates shared-memory segments: the CPU
all-reduce's (`vllm_dist_<id>-tp:...-cpushm_<rank>`, 4 MB in use each) and the executor's message queues
(Python `psm_<id>` segments). vLLM's shutdown force-kills its workers, so their destructors never unlink them:
every TP engine leaves segments and their memory behind, for good (docs/history/measurement-notes.md). On a
machine with a small /dev/shm (64 MB is Docker's default) a few runs fill it, and the next TP engine dies
during start-up.

A segment is removed only when it matches those names, belongs to this user, and no live process maps it; with
`since`, only those that appeared after that snapshot (what `slimwise serve` and the engine wrapper started).
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PATTERNS = ("vllm_dist_*cpushm*", "psm_*")


def segments(directory: Path = SHM_DIR) -> set[str]:
    """Names of this user's files in `directory` that match vLLM's segment names."""
    out = set()
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if any(fnmatch.fnmatch(entry.name, p) for p in PATTERNS):
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_uid == os.getuid():
                        out.add(entry.name)
    return out


def mapped(directory: Path = SHM_DIR) -> set[str]:
    """Names of files in `directory` that a live process maps (its own processes are all this user can read,
    and the segments are mode 0600: nobody else can map them)."""
    prefix = str(directory).rstrip("/") + "/"
    out = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            for line in maps.read_text().splitlines():
                fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
                if len(fields) == 6 and fields[5].startswith(prefix):
                    out.add(fields[5][len(prefix):].removesuffix(" (deleted)"))
    return out


def remove_leftovers(since: set[str] | None = None, directory: Path = SHM_DIR) -> list[str]:
    """Unlink vLLM's segments that no live process maps (only those not in the `since` snapshot, if given);
    returns the names removed."""
    candidates = segments(directory) - (since or set())
    if not candidates:
        return []
    removed = []
    for name in sorted(candidates - mapped(directory)):
        with contextlib.suppress(FileNotFoundError):
            (directory / name).unlink()
            removed.append(name)
    return removed


def remove_after_exit(
    since: set[str] | None = None, timeout: float = 3.0, directory: Path = SHM_DIR
) -> list[str]:
    """`remove_leftovers`, retried while a process that was just killed may still hold its mappings (the
    kernel tears a SIGKILLed process down asynchronously); stops as soon as nothing new is left or `timeout`
    passes."""
    deadline = time.monotonic() + timeout
    removed = remove_leftovers(since, directory)
    while segments(directory) - (since or set()) and time.monotonic() < deadline:
        time.sleep(0.25)
        removed += remove_leftovers(since, directory)
    return removed
