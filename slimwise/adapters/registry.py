"""Adapter registry: model_type -> adapter, lm-eval style. A new family is one file with
`@register_adapter`."""

from __future__ import annotations

from slimwise.adapters.base import MoEAdapter
from slimwise.errors import SlimWiseError

_ADAPTERS: dict[str, type[MoEAdapter]] = {}


def register_adapter(cls: type[MoEAdapter]) -> type[MoEAdapter]:
    """Register `cls` for each of its model types; a model type that already has an adapter is refused (a
    second registration would silently replace the first, as lm-eval's registries also refuse)."""
    taken = {t: _ADAPTERS[t].__name__ for t in cls.model_types if t in _ADAPTERS and _ADAPTERS[t] is not cls}
    if taken:
        raise SlimWiseError(
            f"model type(s) {', '.join(f'{t!r} (by {n})' for t, n in taken.items())} already have "
            f"an adapter; give {cls.__name__} other model_types or edit the existing adapter"
        )
    for model_type in cls.model_types:
        _ADAPTERS[model_type] = cls
    return cls


def supported_families() -> list[str]:
    return sorted({cls.family for cls in _ADAPTERS.values()})


def get_adapter(config) -> MoEAdapter:
    """The adapter for a transformers config (or a model, via its `.config`)."""
    config = getattr(config, "config", config)
    model_type = getattr(config, "model_type", None)
    cls = _ADAPTERS.get(model_type)
    if cls is None:
        raise SlimWiseError(
            f"model type {model_type!r} is not a supported MoE family; supported: "
            f"{', '.join(supported_families())}"
        )
    adapter = cls()
    try:
        routed = adapter.num_experts(config)
    except SlimWiseError:
        routed = 0
    if routed <= 1:
        raise SlimWiseError(
            f"model type {model_type!r} has no routed experts in this config (dense model); "
            f"SlimWise needs an MoE checkpoint of: {', '.join(supported_families())}"
        )
    return adapter
