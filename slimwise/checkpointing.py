"""Activation checkpointing of the sparse MoE blocks while a delta trains.

What the backward pass keeps of an MoE block is large: the routed copies of every token (tokens x k x hidden)
and the experts' intermediates (tokens x k x 2 x intermediate), against one hidden-size row per token at its
input. `checkpointed_moe_blocks` keeps only the input and recomputes the block in the backward pass
(`torch.utils.checkpoint`, non-reentrant).

Why the MoE blocks only, not whole decoder layers as transformers' `gradient_checkpointing_enable` does:
the student continues on the full model's prefill cache, and attention and linear-attention layers write into
that cache during their forward. Recomputing them would write the keys, values and recurrent states a second
time; transformers avoids that by turning the cache off, which the decode-only delta cannot do. The MoE block
reads and writes no cache.

Invariant: the recomputation is the same computation as the forward. The mask and the delta act on a block
according to switches the engine flips per phase (`ExpertMask.active`/`token_mask`, `InstalledDelta.on`), and
the backward pass runs after the engine has put them back; the switches seen by each forward are therefore
captured and set again around its recomputation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from slimwise.hooks import ForwardWrappers

#: (object, attribute names): the switches a block's computation depends on
Switches = Sequence[tuple[object, Sequence[str]]]


@contextmanager
def _set(values: list[tuple[object, str, object]]) -> Iterator[None]:
    previous = [(obj, name, getattr(obj, name)) for obj, name, _ in values]
    for obj, name, value in values:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in previous:
            setattr(obj, name, value)


def _checkpointed(previous, switches: Switches):
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return previous(*args, **kwargs)
        seen = [(obj, name, getattr(obj, name)) for obj, names in switches for name in names]
        return checkpoint(previous, *args, use_reentrant=False,
                          context_fn=lambda: (nullcontext(), _set(seen)), **kwargs)

    return forward


@contextmanager
def checkpointed_moe_blocks(blocks: Sequence[nn.Module], switches: Switches = ()) -> Iterator[None]:
    """Within the block, each module of `blocks` (the adapter's sparse MoE blocks) recomputes its forward in
    the backward pass instead of keeping its activations; without gradients it runs as before."""
    wrappers = ForwardWrappers("activation checkpointing")
    try:
        for block in blocks:
            wrappers.wrap(block, lambda previous: _checkpointed(previous, switches))
        yield
    finally:
        wrappers.remove()


__all__ = ["checkpointed_moe_blocks"]
