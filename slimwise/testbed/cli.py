"""The testbed's two command lines as functions, for callers that run them in-process (tests):
`train_main` is `python -m slimwise.testbed.train` (train.py's `main`), `card_main` is
`python -m slimwise.testbed.evaluate` (card_cli.py on evaluate.py's card functions). Nothing in the package
imports this module, so it closes no loop."""

from __future__ import annotations

from collections.abc import Sequence

from slimwise.testbed import evaluate
from slimwise.testbed.card_cli import card_command
from slimwise.testbed.train import main as train_main

__all__ = ["card_main", "train_main"]


def card_main(argv: Sequence[str] | None = None) -> int:
    """`python -m slimwise.testbed.evaluate ARGV` in this process; the exit code."""
    return card_command(evaluate, argv)
