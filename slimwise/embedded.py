"""Models shipped with SlimWise, addressable by name wherever a model directory is expected.

Only testbed-a (what `slimwise demo` runs) ships in the package; the other testbeds live in a source
checkout's lab (lab/testbed/checkpoints), which the wheel does not ship. A name resolves to the first of
those two places that holds the checkpoint, so every name works in a checkout and an install refuses the
names it lacks in one line (`missing_embedded`).
"""

from __future__ import annotations

from pathlib import Path

#: the checkpoints the package ships (testbed-a)
CHECKPOINTS = Path(__file__).parent / "testbed" / "checkpoints"
#: the lab's checkpoints in a source checkout (absent from an installed wheel)
LAB_CHECKPOINTS = Path(__file__).resolve().parents[1] / "lab" / "testbed" / "checkpoints"
#: name -> directory under CHECKPOINTS or LAB_CHECKPOINTS
EMBEDDED = {"testbed-a": "qwen3moe-a", "testbed-b": "qwen2moe-b", "testbed-c": "qwen3_5moe-c",
            # testbed-a and -c continued on the long-prompt families (slimwise.testbed.long_tasks), 1,152
            # positions; testbed-c-long's layer 1 is full attention (docs/history/testbeds.md says why)
            "testbed-a-long": "qwen3moe-a-long", "testbed-c-long": "qwen3_5moe-c-long"}


def embedded_model_dir(name: str) -> Path | None:
    """The checkpoint directory of an embedded name, or None for another name or one this install lacks."""
    sub = EMBEDDED.get(name)
    if sub is None:
        return None
    for root in (CHECKPOINTS, LAB_CHECKPOINTS):
        path = root / sub
        if (path / "config.json").is_file():
            return path
    return None


def available_embedded() -> list[str]:
    return [name for name in EMBEDDED if embedded_model_dir(name) is not None]


def missing_embedded(name: str) -> str | None:
    """The one-line refusal for an embedded name whose checkpoint this install does not hold, else None."""
    if name not in EMBEDDED or embedded_model_dir(name) is not None:
        return None
    return (f"embedded model {name} is not in this install: only a source checkout of SlimWise holds it "
            f"(lab/testbed/checkpoints/{EMBEDDED[name]}); available here: "
            f"{', '.join(available_embedded()) or 'none'}")
