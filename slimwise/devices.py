"""Where a model runs: `--device` and `--max-memory` to a placement transformers and accelerate understand.

Every command that runs a model takes `--device`: `auto` (CUDA when present, else the CPU), `cpu`, `cuda` or
`cuda:N`. A model larger than one GPU is spread over all visible GPUs (and, past them, host memory) by
accelerate's `device_map="auto"`, bounded by `--max-memory` ("0=70GiB,1=70GiB,cpu=200GiB"). Spread models keep
each layer's tensors on that layer's device: the engine puts its inputs on the embedding's device
(`input_device`), and everything SlimWise installs on a layer (mask, delta, observer) follows the layer's own
weights, so nothing crosses to the host inside the per-token loop.

Invariant: `placement` never changes what the model computes on the CPU: `device="cpu"` with no
`--max-memory` loads exactly as before (no accelerate, no hooks).
"""

from __future__ import annotations

import contextlib
import re
import tempfile
from dataclasses import dataclass

import torch
from torch import nn

from slimwise.errors import SlimWiseError

DEVICE_HELP = ("auto (CUDA when present, else cpu), cpu, cuda or cuda:N; a model larger than one GPU is "
               "spread over all of them with --max-memory")
MAX_MEMORY_HELP = ("spread the model over devices (accelerate's device_map=auto) within these bounds, "
                   "e.g. 0=70GiB,1=70GiB,cpu=200GiB")

_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GiB|GB|MiB|MB)\s*$", re.IGNORECASE)


def resolve_device(spec: str) -> str:
    """`auto` → "cuda" when CUDA is available, else "cpu"; `cuda[:N]` is refused in one line without CUDA or
    with fewer GPUs."""
    spec = str(spec).strip().lower()
    if not _DEVICE.match(spec):
        raise SlimWiseError(f"--device {spec!r}: expected auto, cpu, cuda or cuda:N")
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SlimWiseError(f"--device {spec}: this torch build sees no CUDA device; use --device cpu")
        index = int(spec.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise SlimWiseError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return spec


def parse_max_memory(text: str | None) -> dict[int | str, str] | None:
    """"0=70GiB,1=70GiB,cpu=200GiB" → accelerate's max_memory dict; None stays None."""
    if text is None or not str(text).strip():
        return None
    out: dict[int | str, str] = {}
    for part in str(text).split(","):
        key, _, size = part.partition("=")
        key = key.strip().lower()
        if not _SIZE.match(size) or not (key.isdigit() or key in ("cpu", "disk")):
            raise SlimWiseError(f"--max-memory {part.strip()!r}: expected DEVICE=SIZE with DEVICE a GPU "
                                "index, cpu or disk and SIZE like 70GiB")
        out[int(key) if key.isdigit() else key] = size.strip()
    return out


@dataclass(frozen=True)
class Placement:
    """What `from_pretrained` gets: a single device (loaded there) or accelerate's spread over several."""

    device: str  # the resolved --device; for a spread model, where its inputs start is `input_device`
    max_memory: dict[int | str, str] | None = None

    @property
    def spread(self) -> bool:
        return self.max_memory is not None

    def from_pretrained_kwargs(self) -> dict:
        """Keyword arguments for `AutoModelForCausalLM.from_pretrained`. The CPU without `--max-memory` gets
        none (the plain load every CPU result was produced with)."""
        if self.spread:
            require_accelerate("--max-memory")
            # what does not fit the budgets goes to disk (accelerate's offload folder, removed at exit)
            return {"device_map": "auto", "max_memory": dict(self.max_memory),
                    "offload_folder": _offload_dir()}
        if self.device == "cpu":
            return {}
        require_accelerate(f"--device {self.device}")
        return {"device_map": self.device}  # straight to the GPU: never the whole model in host RAM


def _offload_dir() -> str:
    import atexit
    import shutil

    path = tempfile.mkdtemp(prefix="slimwise-offload-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def placement(device: str = "cpu", max_memory: str | dict | None = None) -> Placement:
    memory = parse_max_memory(max_memory) if isinstance(max_memory, str) or max_memory is None else max_memory
    return Placement(resolve_device(device), memory)


def require_accelerate(why: str) -> None:
    try:
        import accelerate  # noqa: F401
    except ImportError as exc:
        raise SlimWiseError(f"{why} needs accelerate (pip install accelerate): transformers places weights "
                            "on devices through it") from exc


def input_device(model: nn.Module) -> torch.device:
    """Where a model's input ids go: its input embedding's (execution) device, the first device of a spread
    model."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None:
        return execution_device(embeddings)
    return next(p.device for p in model.parameters() if p.device.type != "meta")


def is_offloaded(module: nn.Module) -> bool:
    """Whether accelerate keeps this module's own weights off its execution device between forwards (CPU or
    disk offload of a spread model: the parameters are on the meta device until the module runs)."""
    hook = getattr(module, "_hf_hook", None)
    return bool(getattr(hook, "offload", False)) or any(
        p.device.type == "meta" for p in module.parameters(recurse=False))


def execution_device(module: nn.Module) -> torch.device:
    """The device a module computes on: where its weights are, or, for an offloaded module, where accelerate
    brings them when it runs."""
    hook = getattr(module, "_hf_hook", None)
    if hook is not None and getattr(hook, "execution_device", None) is not None:
        return torch.device(hook.execution_device)
    for p in module.parameters(recurse=False):
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


@contextlib.contextmanager
def onloaded(module: nn.Module):
    """The module's own weights on its execution device for the block, as accelerate's hook does around its
    forward (SlimWise's mask and observer replace some forwards and read weights directly); a no-op for a
    module whose weights stay put."""
    if getattr(getattr(module, "_hf_hook", None), "offload", False):
        from accelerate.utils import align_module_device

        with align_module_device(module):
            yield
    else:
        yield


def auto_dtype_on(device: str, checkpoint_dtype: str | None) -> str | None:
    """`--dtype auto` on a GPU: bf16, unless the checkpoint is already half precision (kept). None: not a GPU,
    the CPU's rule applies (`slimwise.hardware.choose_cpu_dtype`)."""
    if not str(device).startswith("cuda"):
        return None
    dtype = str(checkpoint_dtype or "").removeprefix("torch.")
    return dtype if dtype in ("bfloat16", "float16") else "bfloat16"


def synchronize(device: torch.device | str) -> None:
    """Wait for a device's queued work (timings): a no-op on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["DEVICE_HELP", "MAX_MEMORY_HELP", "Placement", "auto_dtype_on", "execution_device",
           "input_device", "is_offloaded", "onloaded", "parse_max_memory", "placement", "require_accelerate",
           "resolve_device", "synchronize"]
