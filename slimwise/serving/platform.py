"""Which vLLM platform this process would run on, asked of vLLM itself.

The one place outside the plugin proper that probes vLLM for the machine: the dtype and thread-binding
defaults (`slimwise.hardware.resolve_dtype`, `cpu_binding_env`) take the answer from their callers, so the
foundations never import vLLM.
"""

from __future__ import annotations


def vllm_on_cpu() -> bool:
    """Whether vLLM's platform here is its CPU backend (False without vLLM)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())
