"""Masked view of a full model: pruned experts made unselectable in the routers, one weight copy.

`ExpertMask` wraps each pruned layer's router. While `active` is False the router runs its stock forward
(bit-identical to the unpruned model); while True it routes only to the plan's kept experts. The reference
engine switches it on for decode steps (SlimWise) or for everything (uniform pruning). An optional per-token
mask restricts pruning to some rows of a batch (mixed prompt/decode batches).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from slimwise.adapters import MoEAdapter, get_adapter
from slimwise.devices import execution_device, onloaded
from slimwise.hooks import ForwardWrappers
from slimwise.plan import PrunePlan


class ExpertMask:
    """Installs masked routers on `model` for `plan`; use as a context manager or call `remove()`."""

    def __init__(self, model: nn.Module, plan: PrunePlan, adapter: MoEAdapter | None = None):
        self.model = model
        self.adapter = adapter or get_adapter(model.config)
        self.active = False
        self.token_mask: torch.Tensor | None = None  # bool [num_tokens]: rows to prune (None = all rows)
        self._wrappers = ForwardWrappers("expert mask")
        num_experts = self.adapter.num_experts(model.config)
        plan.validate(self.adapter.min_kept_per_group(model.config))
        plan.check_model(model, self.adapter)
        for layer in self.adapter.moe_layers(model):
            pruned = torch.ones(num_experts, dtype=torch.bool, device=execution_device(layer.router))
            pruned[plan.kept(layer.index)] = False
            if not pruned.any():
                continue  # nothing pruned: this layer always runs its stock router
            self._install(layer.router, pruned)

    def _install(self, router: nn.Module, pruned: torch.Tensor) -> None:
        adapter = self.adapter

        def make(original):
            def forward(hidden_states, *args, **kwargs):
                if not self.active:
                    return original(hidden_states, *args, **kwargs)
                if self.token_mask is None:
                    with onloaded(router):  # an offloaded router's weight is only there while it runs
                        return adapter.route(router, hidden_states, pruned)
                rows = self.token_mask.reshape(-1, 1).to(hidden_states.device)  # a spread model's layer
                full = original(hidden_states, *args, **kwargs)
                with onloaded(router):
                    masked = adapter.route(router, hidden_states, pruned)
                return tuple(torch.where(rows, m, f) for f, m in zip(full, masked, strict=True))

            return forward

        self._wrappers.wrap(router, make)

    @contextmanager
    def pruned(self, active: bool = True, token_mask: torch.Tensor | None = None):
        """Route to the kept experts inside the block (optionally only for rows where token_mask is True)."""
        previous = (self.active, self.token_mask)
        self.active, self.token_mask = active, token_mask
        try:
            yield self
        finally:
            self.active, self.token_mask = previous

    def remove(self) -> None:
        """Restore each router's forward. Wrappers stack (another engine's mask, a delta), so they must come
        off in reverse order: removing one from under another would silently drop the one on top."""
        self._wrappers.remove()

    def __enter__(self) -> ExpertMask:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
