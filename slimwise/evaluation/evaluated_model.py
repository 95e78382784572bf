"""The model under evaluation, loaded once: weights, tokenizer, adapter, and the identity cache keys hold.

Invariants: `fingerprint` hashes the weights as loaded (stable across SlimWise versions) and `dtype` is the
dtype that ran ("auto" already resolved), not the one asked for; both go into every calibration and run cache
key, so a sweep never reads stats or generations made from other weights or at another precision. `name` is
the directory-safe label that names per-model output and cache directories.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from slimwise.adapters import get_adapter
from slimwise.fingerprint import memory_fingerprint, model_fingerprint


def model_label(model: str | Path) -> str:
    """A short directory-safe name: the embedded name as given, else the directory name."""
    return Path(str(model)).name or str(model)


@dataclass(frozen=True)
class EvaluatedModel:
    name: str
    path: Path
    model: nn.Module
    tokenizer: Any
    adapter: Any
    fingerprint: str
    dtype: str
    load_seconds: float  # weights, tokenizer and fingerprint; reported as timing load_s


def load_evaluated_model(model: str | Path, dtype: str, engine: str, device: str = "cpu",
                         max_memory: str | None = None) -> EvaluatedModel:
    """Load `model` (a directory or an embedded testbed name) at the dtype `engine` runs for `dtype`, on
    `device`."""
    from slimwise.devices import resolve_device
    from slimwise.hardware import resolve_dtype
    from slimwise.models import load_model, load_tokenizer, resolve_model_dir
    from slimwise.serving.platform import vllm_on_cpu

    name = model_label(model)
    path = resolve_model_dir(model)
    t0 = time.perf_counter()
    device = resolve_device(device)
    # "auto": the dtype this CPU runs fastest (slimwise.hardware): vLLM's for engine vllm, which the reference
    # matches; for the HF engine float32 where bf16 would be emulated (docs/serving.md, "dtype on CPU"). On a
    # GPU, load_model's own auto (bf16).
    if device == "cpu" and max_memory is None:
        dtype = resolve_dtype(dtype, path, vllm_on_cpu() if engine == "vllm" else None, engine=engine)[0]
    loaded = load_model(path, dtype=dtype, device=device, max_memory=max_memory)
    ran = str(loaded.dtype).removeprefix("torch.")
    tokenizer = load_tokenizer(path)
    adapter = get_adapter(loaded.config)
    fingerprint = memory_fingerprint(model_fingerprint(loaded))
    return EvaluatedModel(name, path, loaded, tokenizer, adapter, fingerprint, ran, time.perf_counter() - t0)
