"""Command-line value types and the parser both CLIs use: a bad value is one line naming the option and the
range, exit 2 (argparse's default prints the whole usage block first)."""

from __future__ import annotations

import argparse
import math


def integer(lo: int, hi: int | None = None):
    """argparse type: an integer in [lo, hi] (one clear line otherwise)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{value} is outside [{lo}, {hi if hi is not None else 'inf'}]")
        return value

    return parse


def number(lo: float, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False):
    """argparse type: a finite number in the range (open ends where asked)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        ok = math.isfinite(value) and (value > lo if lo_open else value >= lo)
        if hi is not None:
            ok = ok and (value < hi if hi_open else value <= hi)
        if not ok:
            left, right = "(" if lo_open else "[", ")" if hi_open or hi is None else "]"
            raise argparse.ArgumentTypeError(f"{text} is outside {left}{lo}, "
                                             f"{hi if hi is not None else 'inf'}{right}")
        return value

    return parse


def comma_list(kind):
    """argparse type: comma-separated values, each converted by `kind`, as a tuple (empty items dropped)."""
    return lambda text: tuple(kind(x) for x in text.split(",") if x.strip())


def gib_to_bytes(gib: float) -> int:
    """A size given in GiB (the options say GB), in bytes."""
    return int(gib * 2**30)


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line (`slimwise: error: ...; see slimwise COMMAND --help`), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def option_value(args: list[str], *names: str) -> str | None:
    """The value of the first of `names` on a pass-through command line (`--name value` or
    `--name=value`), else None: how SlimWise reads the vLLM options it must know about without
    parsing vLLM's whole command line."""
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if key in names:
            if eq:
                return value
            if i + 1 < len(args):
                return args[i + 1]
    return None


def option_count(args: list[str], *names: str) -> int:
    """A positive integer option (a parallel size) from a pass-through command line; 1 when absent or
    malformed (vLLM reports a malformed value itself)."""
    value = option_value(args, *names)
    return max(1, int(value)) if value is not None and value.isdigit() else 1
