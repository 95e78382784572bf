"""How a command ends when something fails: one clear line for what the user's input or machine caused, a
traceback for a bug.

`SlimWiseError` is every refusal SlimWise makes itself. Library failures on the user's files and machine (an
unreadable path, a corrupt safetensors header, a config transformers cannot parse) are expected too and get
one line. `KeyError` and `RuntimeError` are expected only when a library raised them: raised by SlimWise's own
code they are bugs (SlimWise validates what it reads and refuses with `SlimWiseError`), so they keep their
traceback under a one-line header.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path


class SlimWiseError(Exception):
    """A user-facing error: the message names the problem and the fix, in one line."""


#: failures a user's input or machine causes (unreadable, corrupt or contradictory files, a full or read-only
#: disk): one line and exit 2 at the command line, unless `is_own_bug` says SlimWise's code raised them
EXPECTED_FAILURES: tuple[type[BaseException], ...] = (OSError, ValueError, UnicodeError,
                                                      KeyError, RuntimeError)
#: expected only from a library; from SlimWise's own code these are bugs
LIBRARY_ONLY_FAILURES: tuple[type[BaseException], ...] = (KeyError, RuntimeError)
DEBUG_ENV = "SLIMWISE_DEBUG"
PACKAGE_DIR = Path(__file__).resolve().parent


def raised_in_package(exc: BaseException) -> bool:
    """True when the innermost Python frame of `exc`'s traceback is in the slimwise package."""
    tb, last = exc.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None:
        return False
    return Path(last.tb_frame.f_code.co_filename).resolve().is_relative_to(PACKAGE_DIR)


def is_own_bug(exc: BaseException) -> bool:
    return isinstance(exc, LIBRARY_ONLY_FAILURES) and raised_in_package(exc)


def describe_failure(exc: BaseException) -> str:
    """One line for an expected failure: its kind and the first line of its message (paths included)."""
    if isinstance(exc, OSError) and exc.filename is not None:
        what = f"{exc.strerror or type(exc).__name__}: {exc.filename}"
    else:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        what = f"{type(exc).__name__}: {lines[0] if lines else 'no message'}"
    if len(what) > 300:
        what = what[:297] + "..."
    return what


def bug_header(exc: BaseException) -> str:
    return (f"slimwise: this is a bug in SlimWise ({type(exc).__name__} raised by its own code), not a "
            "problem with your input; please report it with the traceback below")


def run_command(func: Callable[[], object], prog: str = "slimwise") -> int:
    """Run a command's body: 0 when it returns, 2 with one line on stderr for a refusal or an
    expected failure; a bug (any other exception, or `is_own_bug`) propagates with its traceback,
    the latter under `bug_header`."""
    try:
        func()
    except SlimWiseError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except EXPECTED_FAILURES as exc:
        if is_own_bug(exc):
            print(bug_header(exc), file=sys.stderr)
            raise
        if os.environ.get(DEBUG_ENV) == "1":
            raise
        print(f"{prog}: error: {describe_failure(exc)} (set {DEBUG_ENV}=1 for the traceback)",
              file=sys.stderr)
        return 2
    return 0
