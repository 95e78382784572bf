"""Packed-sequence training for the hybrid backbone: several samples per row,
Gated-DeltaNet state reset at each one.

Why: transformers' torch path for Qwen3.5's Gated-DeltaNet has no sequence boundaries (its `cu_seqlens` goes
to flash-linear-attention only), so the trainer gave every sample its own right-padded row. On testbed-c that
spends 17% of the positions on padding, and the chunked delta rule pads each row again to a multiple of 64.
Full attention already isolates packed samples (transformers builds a block-diagonal mask from position ids
that restart at 0); this module does the same for the two linear-attention token mixers, exactly:

- the causal depthwise convolution reads no position of an earlier sample;
- the chunked gated delta rule (transformers' algorithm, with masks) starts every sample from a zero state: no
  state enters a chunk past a sample start, intra-chunk terms stay inside one sample, and a chunk's final
  state keeps only its last sample's writes.

`packed_sequences(position_ids)` is a context for one forward; outside it the stock functions run
unchanged, so evaluation and export see stock transformers. Training-only, like `fast_experts.py`; the
model stays stock. `tests/test_testbed_train.py` checks that a packed batch's loss and gradients equal
those of the same samples in padded rows.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

_SEGMENTS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("slimwise_segments",
                                                                                default=None)


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) ids, equal within one sample: a new sample wherever the position does not follow the
    previous one (transformers' `find_packed_sequence_indices` rule, so attention and linear
    attention agree on the samples)."""
    step = torch.ones_like(position_ids[:, :1])
    return (torch.diff(position_ids, dim=-1, prepend=position_ids[:, :1] - step) != 1).cumsum(-1)


@contextlib.contextmanager
def packed_sequences(position_ids: torch.Tensor) -> Iterator[None]:
    """Within this context, the patched linear-attention functions keep the samples of each row apart."""
    token = _SEGMENTS.set(segment_ids(position_ids))
    try:
        yield
    finally:
        _SEGMENTS.reset(token)


def _segments_for(batch: int, length: int) -> torch.Tensor | None:
    seg = _SEGMENTS.get()
    if seg is not None and tuple(seg.shape) != (batch, length):
        raise ValueError(f"packed_sequences was given position ids of shape {tuple(seg.shape)}, but the "
                         f"layer sees ({batch}, {length}): pass the forward's own position ids")
    return seg


def segmented_causal_conv1d(hidden_states: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None, activation: str | None = None,
                            seg: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution over (B, C, T) where tap k (k steps back) is
    dropped across a sample start."""
    x = hidden_states.to(weight.dtype)
    taps = weight.shape[-1]
    out = x * weight[:, taps - 1].unsqueeze(-1)
    for k in range(1, taps):
        shifted = F.pad(x[:, :, :-k], (k, 0))
        same = F.pad(seg[:, k:] == seg[:, :-k], (k, 0)).unsqueeze(1)  # (B, 1, T): t and t-k in one sample
        out = out + shifted * same * weight[:, taps - 1 - k].unsqueeze(-1)
    if bias is not None:
        out = out + bias.unsqueeze(-1)
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


def segmented_chunk_gated_delta_rule(query, key, value, g, beta, seg: torch.Tensor, chunk_size: int = 64,
                                     use_qk_l2norm_in_kernel: bool = False) -> torch.Tensor:
    """transformers' `torch_chunk_gated_delta_rule` with a zero state at every sample start of `seg` (B, T).

    Same shapes and scaling as the stock function (query/key/value (B, T, H, D), g/beta (B, T, H)); returns
    the output only (no final state: a packed row has one per sample).
    """
    initial_dtype = query.dtype
    batch, length = key.shape[:2]
    v_dim = value.shape[-1]
    query, key, value, beta, g = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                                  for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6)
        key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    query = query * query.shape[-1] ** -0.5
    pad = (chunk_size - length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    seg = F.pad(seg, (0, pad), value=-1)  # the chunk padding is a sample of its own (zeros in, discarded out)
    chunks = (length + pad) // chunk_size

    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = (x.reshape(x.shape[0], x.shape[1], chunks, chunk_size, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta))
    g = g.reshape(g.shape[0], g.shape[1], chunks, chunk_size)
    seg = seg.reshape(batch, 1, chunks, chunk_size)

    # masks: same sample (i, j) within a chunk; "carries" = in the sample the previous chunk ended in
    same = seg.unsqueeze(-1) == seg.unsqueeze(-2)  # (B, 1, N, C, C)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).tril()
    keep = same & causal
    previous_last = torch.cat([torch.full_like(seg[:, :, :1, -1:], -2), seg[:, :, :-1, -1:]], dim=2)
    carries = (seg == previous_last).to(torch.float32)  # (B, 1, N, C)
    # in the chunk's last sample: writes the state passed on
    in_last = (seg == seg[..., -1:]).to(torch.float32)

    cum = g.cumsum(dim=3)
    pairwise = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(~keep, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * (cum.exp() * carries).unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)

    state = torch.zeros(batch, v_beta.shape[1], key.shape[-1], v_dim,
                        dtype=new_values.dtype, device=query.device)
    out = torch.zeros_like(new_values)
    query = query * (cum.exp() * carries).unsqueeze(-1)
    key = key * ((cum[..., -1:] - cum).exp() * in_last).unsqueeze(-1)
    chunk_decay = (cum[..., -1].exp() * carries[..., -1])[..., None, None]
    for i in range(chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = query[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(batch, out.shape[1], -1, v_dim)[:, :, :length]
    return out.transpose(1, 2).to(initial_dtype, memory_format=torch.contiguous_format)


def _patched(module):
    stock_conv, stock_rule = module.causal_conv1d_fn, module.torch_chunk_gated_delta_rule

    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        seg = _segments_for(hidden_states.shape[0], hidden_states.shape[-1])
        if seg is None:
            return stock_conv(hidden_states, weight, bias, activation=activation, **kwargs)
        return segmented_causal_conv1d(hidden_states, weight, bias, activation, seg)

    def torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        seg = _segments_for(*query.shape[:2])
        if seg is None:
            return stock_rule(query, key, value, g=g, beta=beta, chunk_size=chunk_size,
                              initial_state=initial_state, output_final_state=output_final_state,
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
        if initial_state is not None or output_final_state:
            raise ValueError("packed sequences carry no cache state: train without a cache (use_cache=False)")
        return segmented_chunk_gated_delta_rule(query, key, value, g, beta, seg, chunk_size,
                                                use_qk_l2norm_in_kernel), None

    return {"causal_conv1d_fn": causal_conv1d_fn,
            "torch_chunk_gated_delta_rule": torch_chunk_gated_delta_rule}


@contextlib.contextmanager
def segment_aware_linear_attention() -> Iterator[None]:
    """Swap Qwen3.5-MoE's two linear-attention functions for segment-aware ones for the duration (the stock
    functions run whenever no `packed_sequences` context is active)."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as module

    saved = {name: getattr(module, name) for name in ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")}
    for name, fn in _patched(module).items():
        setattr(module, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
