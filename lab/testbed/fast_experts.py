"""A fast CPU experts implementation for training the testbed backbones (`slimwise_sorted`).

Registered in transformers' ExpertsInterface: assignments sorted by expert, one matmul per expert on a
contiguous slice, and a hand-written backward that writes each expert's weight gradient straight into
the fused (E, ...) gradient. The module classes and parameter names stay stock; models are switched
back to `eager` before saving.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

FAST_EXPERTS = "slimwise_sorted"


class _GroupedSwiGLU(torch.autograd.Function):
    """SwiGLU experts over token rows sorted by expert:
    y[rows of e] = down[e] @ (silu(g) * u), [g; u] = gate_up[e] @ x.

    `counts[e]` rows belong to expert e, in expert order. The backward loops over experts again and writes
    each expert's weight gradient into one preallocated (E, ...) tensor (no per-expert full-size gradients).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: list[int]):
        dtype = gate_up.dtype
        x = x.to(dtype).contiguous()
        h = x.new_empty(x.shape[0], gate_up.shape[1])
        start = 0
        for e, n in enumerate(counts):
            if n:
                torch.mm(x[start:start + n], gate_up[e].t(), out=h[start:start + n])
                start += n
        g, u = h.chunk(2, dim=-1)
        a = F.silu(g) * u
        y = x.new_empty(x.shape[0], down.shape[1])
        start = 0
        for e, n in enumerate(counts):
            if n:
                torch.mm(a[start:start + n], down[e].t(), out=y[start:start + n])
                start += n
        ctx.save_for_backward(x, gate_up, down, h)
        ctx.counts = counts
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, gate_up, down, h = ctx.saved_tensors
        counts = ctx.counts
        grad_y = grad_y.contiguous().to(x.dtype)
        g, u = h.chunk(2, dim=-1)
        sig = torch.sigmoid(g)
        silu = g * sig
        a = silu * u
        grad_a = torch.empty_like(a)
        grad_down = torch.zeros_like(down)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = slice(start, start + n)
                torch.mm(grad_y[rows], down[e], out=grad_a[rows])
                torch.mm(grad_y[rows].t(), a[rows], out=grad_down[e])
                start += n
        grad_h = torch.cat([grad_a * u * (sig * (1 + g * (1 - sig))), grad_a * silu], dim=-1)
        grad_x = torch.empty_like(x)
        grad_gate_up = torch.zeros_like(gate_up)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = slice(start, start + n)
                torch.mm(grad_h[rows], gate_up[e], out=grad_x[rows])
                torch.mm(grad_h[rows].t(), x[rows], out=grad_gate_up[e])
                start += n
        return grad_x, grad_gate_up, grad_down, None


def sorted_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """ExpertsInterface function for the fused (E, 2I, H) / (E, H, I) SwiGLU experts of Qwen-style models."""
    if not getattr(self, "has_gate", True) or getattr(self, "has_bias", False) \
            or getattr(self, "is_transposed", False):
        raise NotImplementedError(f"{FAST_EXPERTS} supports gated, bias-free, non-transposed experts only")
    num_tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=self.num_experts).tolist()
    # index_select, not x[idx]: its backward is index_add_, where advanced indexing's is a
    # slow accumulating index_put_
    y = _GroupedSwiGLU.apply(hidden_states.index_select(0, order // top_k), self.gate_up_proj,
                             self.down_proj, counts)
    y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return y.index_select(0, inverse).view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


ALL_EXPERTS_FUNCTIONS.register(FAST_EXPERTS, sorted_experts_forward)
