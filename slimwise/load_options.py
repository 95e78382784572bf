"""The options of the commands that load a model -- MODEL, --dtype, --device, --max-memory, --dry-run --
declared once, as bases of the commands' config dataclasses (`slimwise.options` turns the fields into
options). Their fields are keyword-only, so they come first in a command's option list (before its own
fields) without forcing defaults on the fields that follow."""

from __future__ import annotations

from dataclasses import dataclass, field

from slimwise.devices import DEVICE_HELP, MAX_MEMORY_HELP
from slimwise.embedded import EMBEDDED

MODEL_HELP = f"local checkpoint directory (or an embedded name: {', '.join(EMBEDDED)})"
DTYPES = ("auto", "float32", "bfloat16", "float16")
DRY_RUN_HELP = ("print what the command holds in memory (computed from config.json on the meta device; MODEL "
                "may also be a full-size preset such as qwen3.6-35b-a3b) and exit without loading anything")


def dry_run_field():
    """`--dry-run` (`slimwise.footprint`), placed where each command lists it."""
    return field(default=False, metadata={"help": DRY_RUN_HELP})


@dataclass
class ModelOptions:
    """MODEL (a positional) and the dtype it loads in."""

    model: str = field(kw_only=True, metadata={"flag": "model", "help": MODEL_HELP})
    dtype: str = field(default="auto", kw_only=True, metadata={
        "choices": DTYPES, "help": "weights dtype (default auto: as saved on the CPU, bf16 on a GPU)"})


@dataclass
class DeviceOptions:
    """Where a model loads: one device, or spread over several within bounds (`slimwise.devices`)."""

    device: str = field(default="auto", kw_only=True, metadata={"help": DEVICE_HELP})
    max_memory: str | None = field(default=None, kw_only=True, metadata={
        "metavar": "DEV=SIZE,...", "help": MAX_MEMORY_HELP})


@dataclass
class LoadOptions(DeviceOptions, ModelOptions):
    """MODEL, --dtype, --device, --max-memory, in that order (a dataclass lists its bases' fields from the
    last base to the first)."""
