"""Children that die with their parent: the serving supervisor's vLLM processes and the trainer's ranks share
this.

Standard library only, so a spawned training rank imports nothing heavy to use it."""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parent_death_hook(parent: int | None = None) -> Callable[[], None] | None:
    """A function to run in a child that makes it get SIGTERM when `parent` (default: this process) exits,
    even by SIGKILL; None where prctl is missing (not Linux). libc is loaded here, in the caller, so the hook
    itself imports nothing (safe as a `preexec_fn` in a forked child). The signal follows the thread that
    forked."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid() if parent is None else parent

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return hook
