"""Rows counted inside the forward: the evidence that the decode mask was in effect.

A host-side counter (`DecodeRouting.set_step`) proves only that the runner seam ran. What the product promises
is that the *forward* routed a plan's rows with its kept experts. `install_row_counter` hooks one gate (after
the mask hook) and adds, per plan row index, the rows it saw and the rows whose logits hold a -inf (masked) to
the fixed-address buffer `DecodeRouting.rows_seen`. It is a custom op with a declared mutation, so eager
mode, torch.compile (the op stays one node, its write to the buffer kept) and CUDA-graph capture (replay adds
again, as the kernel is recorded) all count what actually ran; a step whose mask was never set counts its
rows under plan 0 (every expert) and the start-up self-check (`serving/selfcheck.py`) refuses.
"""

from __future__ import annotations

import torch
from torch import nn

from slimwise.hooks import first_output


@torch.library.custom_op("slimwise::count_rows", mutates_args=("counts",))
def count_rows(counts: torch.Tensor, row_plan: torch.Tensor, masked: torch.Tensor) -> None:
    """counts[0][k] += rows routed with plan row k; counts[1][k] += those of them with a -inf logit."""
    counts[0].index_add_(0, row_plan, torch.ones_like(row_plan))
    counts[1].index_add_(0, row_plan, masked.to(row_plan.dtype))


@count_rows.register_fake
def _count_rows_fake(counts: torch.Tensor, row_plan: torch.Tensor, masked: torch.Tensor) -> None:
    return None


def install_row_counter(gate: nn.Module, routing) -> None:
    """Count this gate's rows into `routing.rows_seen` (registered after the gate's mask hook, so the hook
    sees the masked logits)."""

    def hook(module, args, output):
        logits = first_output(output)
        n = logits.shape[0]
        torch.ops.slimwise.count_rows(routing.rows_seen, routing.row_plan[:n],
                                      torch.isneginf(logits).any(dim=-1))

    gate.register_forward_hook(hook)
