"""Models shipped with the package, addressable by name wherever a model directory is expected."""

from __future__ import annotations

from pathlib import Path

CHECKPOINTS = Path(__file__).parent / "testbed" / "checkpoints"
#: name -> directory under slimwise/testbed/checkpoints
EMBEDDED = {"testbed-a": "qwen3moe-a", "testbed-b": "qwen2moe-b", "testbed-c": "qwen3_5moe-c",
            # testbed-a and -c continued on the long-prompt families (slimwise.testbed.long_tasks), 1,152
            # positions; testbed-c-long's layer 1 is full attention (docs/history/testbeds.md says why)
            "testbed-a-long": "qwen3moe-a-long", "testbed-c-long": "qwen3_5moe-c-long"}


def embedded_model_dir(name: str) -> Path | None:
    sub = EMBEDDED.get(name)
    if sub is None:
        return None
    path = CHECKPOINTS / sub
    return path if (path / "config.json").is_file() else None


def available_embedded() -> list[str]:
    return [name for name in EMBEDDED if embedded_model_dir(name) is not None]
