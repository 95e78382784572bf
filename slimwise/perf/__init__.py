"""Performance modelling: synthetic presets of real MoE shapes and an analytic decode-step roofline.

Why: SlimWise's gain is decode throughput, which depends on batch size and hardware; these tools predict it
(`roofline`) and build random-weight models of real shapes to measure it (`presets`). Names are loaded on
first use, so `slimwise.perf.cli` can register its subcommand without importing torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PRESETS": "presets",
    "build_synthetic": "presets",
    "preset_config": "presets",
    "HARDWARE": "roofline",
    "Hardware": "roofline",
    "RooflineConfig": "roofline",
    "StepPrediction": "roofline",
    "batch_reaching": "roofline",
    "expected_union": "roofline",
    "get_hardware": "roofline",
    "predict": "roofline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'slimwise.perf' has no attribute {name!r}")
    return getattr(importlib.import_module(f"slimwise.perf.{_EXPORTS[name]}"), name)
