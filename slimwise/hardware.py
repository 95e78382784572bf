"""The machine SlimWise runs on: CPU model and ISA flags, and the dtype a CPU decodes fastest in.

Why a module of its own: the CPU speedup of expert pruning depends on the machine's bf16 support. On a CPU
with bf16 matrix instructions (AMX, AVX512-BF16) bf16 halves the bytes per step and decode stays memory-bound;
on an AVX2-only CPU torch's bf16 matmul is emulated and far slower than float32, vLLM falls back to
torch linears for bf16, and float32 decodes faster (the figures: docs/serving.md, "dtype on CPU").
`--dtype auto` on a CPU asks `choose_cpu_dtype`, and every results file records `describe()`.
"""

from __future__ import annotations

import contextlib
import os
import platform
from functools import lru_cache
from pathlib import Path

#: CPU flags (Linux /proc/cpuinfo names) that give bf16 matrix arithmetic, best first
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
#: model types whose vLLM CPU kernels run in bf16 only (the Gated DeltaNet kernel of the hybrids)
BF16_ONLY_ON_CPU = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")


@lru_cache(maxsize=1)
def cpu_info() -> dict:
    """CPU model name, logical CPUs and ISA flags, from /proc/cpuinfo (Linux); empty flags elsewhere."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name":
                model = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "cpus": os.cpu_count(), "flags": flags}


def bf16_support() -> str | None:
    """The best bf16 matrix instruction set this CPU has (a `BF16_FLAGS` name), or None."""
    flags = cpu_info()["flags"]
    return next((f for f in BF16_FLAGS if f in flags), None)


def choose_cpu_dtype(checkpoint_dtype: str | None, model_type: str | None = None) -> tuple[str, str]:
    """(dtype, why) for `--dtype auto` on a CPU. vLLM's own "auto" is the checkpoint's dtype; SlimWise keeps
    it except for a bf16/fp16 checkpoint on a CPU without bf16 matrix instructions, which decodes in float32
    (bf16 would be emulated there). Models whose vLLM CPU kernels exist in bf16 only stay bf16."""
    dtype = str(checkpoint_dtype or "float32").removeprefix("torch.")
    if model_type in BF16_ONLY_ON_CPU:
        return "bfloat16", f"{model_type}: vLLM's CPU Gated DeltaNet kernel runs in bf16 only"
    if dtype not in ("bfloat16", "float16"):
        return dtype, f"the checkpoint's dtype ({dtype})"
    support = bf16_support()
    if support:
        return dtype, f"the checkpoint's dtype ({dtype}); the CPU has {support} (bf16 matrix instructions)"
    return "float32", (
        f"the checkpoint is {dtype} but the CPU has no bf16 matrix instructions (no amx_bf16 or "
        "avx512_bf16): bf16 would be emulated, about 1.5x slower than float32 in decode"
    )


def resolve_dtype(dtype: str, model_dir: str | Path, on_cpu: bool | None = None,
                  engine: str = "vllm") -> tuple[str, str]:
    """(dtype, why) an engine gets for a requested dtype. "auto" on vLLM's CPU backend goes through
    `choose_cpu_dtype` with the checkpoint's dtype and model type; engine "hf" (the transformers reference,
    which runs on the CPU) through `choose_cpu_dtype` without the model type, as torch has no bf16-only
    kernels. Anything else is kept. `on_cpu`: whether vLLM runs on its CPU backend, which a caller resolving
    "auto" for engine "vllm" must say (`slimwise.serving.platform.vllm_on_cpu()`: this module never imports
    vLLM)."""
    if dtype != "auto":
        return dtype, "as requested"
    if engine == "vllm" and on_cpu is None:
        raise TypeError("resolve_dtype('auto', engine='vllm') needs on_cpu "
                        "(slimwise.serving.platform.vllm_on_cpu())")
    if engine == "vllm" and not on_cpu:
        return dtype, "vLLM's auto (the checkpoint's dtype)"
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = config.get("text_config") or config
    return choose_cpu_dtype(
        text.get("dtype") or config.get("dtype") or config.get("torch_dtype"),
        (text.get("model_type") or config.get("model_type")) if engine == "vllm" else None,
    )


def machine_line() -> str:
    """`lscpu`'s model name, family, model and CPU count in one line (what published figures record)."""
    import subprocess

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown (no lscpu)"
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    return (f"{fields.get('Model name')} family {fields.get('CPU family')} model {fields.get('Model')}, "
            f"{fields.get('CPU(s)')} CPUs")


def describe() -> dict:
    """What a results file records about the machine."""
    info = cpu_info()
    keep = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")
    return {"cpu": info["model"], "cpus": info["cpus"], "isa": [f for f in keep if f in info["flags"]],
            "bf16_support": bf16_support()}


__all__ = [
    "BF16_FLAGS",
    "BF16_ONLY_ON_CPU",
    "bf16_support",
    "choose_cpu_dtype",
    "cpu_info",
    "describe",
    "machine_line",
    "resolve_dtype",
]


#: vLLM's CPU backend: per-rank OpenMP core lists, "a-b|c-d" (one entry per local rank)
THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_thread_binding(ranks: int, cpus: list[int] | None = None) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `ranks` local CPU workers (tensor x pipeline parallel): the allowed
    cores split into equal contiguous blocks, one per rank. vLLM's own "auto" binds one NUMA node per rank and
    refuses to start with more ranks than nodes ("Not enough allowed NUMA nodes to bind threads of 2 local
    CPUWorkers"), which is every single-socket machine."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if len(cpus) < ranks:  # fewer cores than ranks: ranks share cores round-robin (slow, but it runs)
        return "|".join(str(cpus[r % len(cpus)]) for r in range(ranks))
    per = len(cpus) // ranks
    blocks = [cpus[r * per:(r + 1) * per] for r in range(ranks)]
    return "|".join(",".join(map(str, b)) for b in blocks)


def parallel_ranks(args: list[str]) -> int:
    """Local ranks of one vLLM instance from its command-line options: tensor x pipeline parallel size."""
    from slimwise.argtypes import option_count

    return option_count(args, "--tensor-parallel-size", "-tp") * option_count(
        args, "--pipeline-parallel-size", "-pp"
    )


def cpu_binding_env(ranks: int, on_cpu: bool, environ=None) -> dict[str, str]:
    """On vLLM's CPU backend with `ranks` local ranks (tensor x pipeline parallel): the per-rank core binding
    vLLM needs on a single-NUMA-node machine, where its default ("auto": one node per rank) refuses to start.
    The user's own VLLM_CPU_OMP_THREADS_BIND wins; {} when nothing is needed. `on_cpu`: the caller's
    `slimwise.serving.platform.vllm_on_cpu()`."""
    environ = os.environ if environ is None else environ
    if ranks == 1 or THREADS_BIND_ENV in environ or not on_cpu:
        return {}
    return {THREADS_BIND_ENV: cpu_thread_binding(ranks)}


@contextlib.contextmanager
def scoped_environ(env: dict[str, str]):
    """Set `env` in os.environ for the block (what processes started in it inherit), then restore every key as
    it was: nothing leaks into the caller's later processes or the next test."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
