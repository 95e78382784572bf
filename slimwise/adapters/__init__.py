"""Model-family adapters. Importing this package registers every family."""

from slimwise.adapters import (  # noqa: F401  (registration side effect)
    deepseek_v3,
    gpt_oss,
    mixtral,
    olmoe,
    qwen2_moe,
    qwen3_moe,
    qwen3_next,
)
from slimwise.adapters.base import MoEAdapter, MoELayer
from slimwise.adapters.registry import get_adapter, register_adapter, supported_families

__all__ = ["MoEAdapter", "MoELayer", "get_adapter", "register_adapter", "supported_families"]
