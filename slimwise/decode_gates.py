"""What a pruned decode token's gates do: the gate variant and the per-token fallback to every expert.

Both engines (the reference mask, `slimwise.masking`, and the vLLM plugin, `slimwise.serving.routing`) run
these functions on their own router's full routing, so they decide alike. Notation, per token and MoE layer:
the full router picks slots (T, w) -- top-k expert ids and their gate weights as the family computes them
(renormalized or not, scaled or not); P is the plan's pruned set.

Gate variants (`gates`):
  renorm  route as a router whose pruned rows were sliced away: pruned logits (DeepSeek: selection scores) at
          -inf before the top-k, so the k slots fill with kept experts and the family's renormalization
          spreads the pruned share over them. Equal to the pruned checkpoint, token for token (the default).
  drop    keep the full router's slots and weights; slots on pruned experts get weight 0 and read no weights
          (their id becomes one of the row's kept experts). The pruned share of the gate mass is lost, and a
          token with no pruned expert among its slots is routed exactly as by the full model.

Fallback (`fallback` tau in [0, 1]): a decode token whose pruned share
    s = sum of w over slots in P / sum of w over all k slots
exceeds tau is routed with every expert in that layer (the decision is per token per MoE layer: the share is
only known at each layer's router). tau = 1 never falls back (s <= 1 exactly: see `pruned_share`), so it is
the variant alone; tau = 0 falls back wherever a pruned expert holds any weight, which gives the full model's
routing in every layer where `drop` does, and under `renorm` wherever the family renormalizes the top-k (a
router that does not -- Qwen2-MoE and OLMoE with `norm_topk_prob` false -- still rescales the kept weights of
a token that touches no pruned expert by 1 / (kept softmax mass)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from slimwise.argtypes import number
from slimwise.errors import SlimWiseError

GATES = ("renorm", "drop")
GATES_HELP = ("pruned rows' gates: renorm (the sliced router's, default) or drop (the full router's, pruned "
              "slots zeroed)")
FALLBACK_HELP = ("route a pruned token with every expert in a layer where its full top-k puts more than TAU "
                 "of the gate weight on pruned experts (0: the full model, 1: never)")


def gates_field():
    """`--gates`, declared once for every config dataclass that has it (slimwise.options)."""
    return field(default="renorm", metadata={"choices": GATES, "help": GATES_HELP})


def fallback_field():
    """`--fallback TAU`, declared once for every config dataclass that has it (slimwise.options)."""
    return field(default=None, metadata={"type": number(0, 1), "metavar": "TAU", "help": FALLBACK_HELP})


@dataclass(frozen=True)
class DecodeGates:
    """The gate variant and the fallback threshold (None: never fall back) of a pruned decode step."""

    gates: str = "renorm"
    fallback: float | None = None

    def __post_init__(self) -> None:
        if self.gates not in GATES:
            raise SlimWiseError(f"unknown gates {self.gates!r}; choose one of {', '.join(GATES)}")
        if self.fallback is not None and not (math.isfinite(self.fallback) and 0 <= self.fallback <= 1):
            raise SlimWiseError(f"fallback {self.fallback!r} must be a share in [0, 1]")

    @property
    def plain(self) -> bool:
        """Today's masked routing with nothing added: the engines keep their cheapest path."""
        return self.gates == "renorm" and self.fallback is None

    def describe(self) -> dict:
        return {"gates": self.gates, "fallback": self.fallback}


PLAIN = DecodeGates()


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
