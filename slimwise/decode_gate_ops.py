"""The tensor side of the gate variants and the fallback (settings and definitions: `slimwise.decode_gates`).

Both engines call these on their own router's full routing (T, w): the reference mask (`slimwise.masking`) and
the vLLM plugin (`slimwise.serving.routing`), so they decide alike.
"""

from __future__ import annotations

import torch


def pruned_share(weights: torch.Tensor, slot_pruned: torch.Tensor) -> torch.Tensor:
    """Per row, the share of the top-k gate weight that sits on pruned slots, in [0, 1].

    weights [n, k] (>= 0), slot_pruned [n, k] bool. The pruned sum adds the same values as the total in the
    same order with zeros in place of the kept ones, so it never exceeds the total in floating point (rounding
    is monotone): a row whose slots are all pruned has a share of exactly 1, and tau = 1 never falls back."""
    w = weights.float()
    hit = torch.where(slot_pruned, w, torch.zeros_like(w)).sum(dim=-1)
    total = w.sum(dim=-1)
    return torch.where(total > 0, hit / total.clamp_min(torch.finfo(torch.float32).tiny),
                       torch.zeros_like(total)).clamp(max=1.0)


def falls_back(weights: torch.Tensor, slot_pruned: torch.Tensor, tau: float | None) -> torch.Tensor:
    """Per row: whether it is routed with every expert (share > tau); all False without a threshold."""
    if tau is None:
        return torch.zeros(weights.shape[0], dtype=torch.bool, device=weights.device)
    return pruned_share(weights, slot_pruned) > tau


def drop_pruned(weights: torch.Tensor, ids: torch.Tensor, slot_pruned: torch.Tensor,
                placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`drop`: pruned slots get weight 0 and the id of the row's heaviest kept slot (or `placeholder[row]`, a
    kept expert, when every slot is pruned), so the step reads no pruned expert and the output is unchanged
    (0 * f = 0). The other slots keep the full router's weights and ids."""
    w = torch.where(slot_pruned, torch.zeros_like(weights), weights)
    kept_w = torch.where(slot_pruned, torch.full_like(w, -1.0), w)
    best = ids.gather(1, kept_w.argmax(dim=-1, keepdim=True))
    any_kept = (~slot_pruned).any(dim=-1, keepdim=True)
    fill = torch.where(any_kept, best, placeholder.reshape(-1, 1).to(ids.dtype))
    return w, torch.where(slot_pruned, fill, ids)


def substitution(weights: torch.Tensor, ids: torch.Tensor, slot_pruned: torch.Tensor,
                 vectors: torch.Tensor) -> torch.Tensor:
    """`substitute`: sum over a row's pruned slots of weight x its expert's vector ([n, hidden], float32)."""
    w = torch.where(slot_pruned, weights.float(), torch.zeros_like(weights, dtype=torch.float32))
    return torch.einsum("nk,nkh->nh", w, vectors[ids.long()])


def encode_prerouted(weights: torch.Tensor, ids: torch.Tensor, slot_pruned: torch.Tensor,
                     placeholder: torch.Tensor, experts: int, dtype: torch.dtype) -> torch.Tensor:
    """A `drop` routing written into a router-logits-shaped row, for routers that only see the logits
    (vLLM's, where a per-step buffer read inside the router is not seen by torch.compile): -inf everywhere,
    the kept slots' weights at their experts, and a weight 0 at `placeholder[row]` when every slot is pruned.
    `decode_prerouted` reads it back; a row holding any -inf is pre-routed (stock logits are finite)."""
    enc = torch.full((weights.shape[0], experts), float("-inf"), dtype=torch.float32, device=weights.device)
    kept_w = torch.where(slot_pruned, torch.full_like(weights, float("-inf")), weights.float())
    enc.scatter_(1, ids.long(), kept_w)  # kept slots hold distinct experts; pruned ones write -inf
    at = placeholder.long().reshape(-1, 1)
    current = enc.gather(1, at)
    none_kept = slot_pruned.all(dim=-1, keepdim=True)
    enc.scatter_(1, at, torch.where(none_kept, torch.zeros_like(current), current))
    return enc.to(dtype)


def decode_prerouted(encoded: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32, ids int32) of `encode_prerouted` rows: the finite entries by weight, and weight 0 on
    the row's heaviest finite entry for the slots left over (ids are never a pruned expert)."""
    values, ids = torch.topk(encoded.float(), top_k, dim=-1, sorted=True)
    real = torch.isfinite(values)
    weights = torch.where(real, values, torch.zeros_like(values))
    ids = torch.where(real, ids, ids[:, :1])
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def budget_allowed(weights: torch.Tensor, ids: torch.Tensor, groups: torch.Tensor, counted: torch.Tensor,
                   forced: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """The batch budget's S per routing group (plan): [G, N] bool, the experts the group's rows may route to.

    weights, ids [n, k]: the full router's slots; groups [n] (long, in [0, G)): each row's group; counted
    [n] bool: rows whose gate weight is summed (a step's live decode rows); forced [G, N] bool: experts
    always in S; size [G] long: |S| per group. S is `forced` plus, by summed weight of the group's counted
    rows (ties: lower expert id), the other experts up to `size`. Fixed shapes and no host read: the same
    ops run in a CUDA graph. Exact ends: size N allows every expert; size = forced.sum() allows exactly
    `forced`.
    """
    num_groups, num_experts = forced.shape
    w = torch.where(counted[:, None], weights.float(), torch.zeros((), device=weights.device))
    slots = (groups.long()[:, None] * num_experts + ids.long()).reshape(-1)
    mass = torch.zeros(num_groups * num_experts, dtype=torch.float32, device=weights.device)
    mass = mass.index_add(0, slots, w.reshape(-1)).view(num_groups, num_experts)
    score = mass.masked_fill(forced, float("inf"))
    order = score.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(num_experts, device=weights.device).expand(num_groups, num_experts)
    rank = torch.empty_like(order).scatter_(1, order, ranks)
    return rank < size.to(rank.device)[:, None]


def within(weights: torch.Tensor, ids: torch.Tensor,
           pruned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A masked routing held to the allowed experts: a slot on an expert of `pruned` ([E] or [n, E] bool) gets
    weight 0 and the id of the row's heaviest allowed slot (`drop_pruned`). A no-op wherever every row found
    k allowed experts; a grouped router (DeepSeek: top-k within the best groups) whose groups hold fewer than
    k of a batch budget's S fills its other slots with -inf experts, which must read no weights."""
    rows = pruned.expand(ids.shape[0], -1) if pruned.dim() == 1 else pruned
    slot_pruned = rows.gather(1, ids.long())
    placeholder = (~rows).to(torch.int8).argmax(dim=-1)
    return drop_pruned(weights, ids, slot_pruned, placeholder)
