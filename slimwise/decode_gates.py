"""What a pruned decode token's gates do: the gate variant and the per-token fallback to every expert.

This module holds the settings (standard library only: the CLI parsers import it); the tensor functions that
both engines run on their own router's full routing -- the reference mask (`slimwise.masking`) and the vLLM
plugin (`slimwise.serving.routing`), so they decide alike -- are in `slimwise.decode_gate_ops`. Notation, per
token and MoE layer: the full router picks slots (T, w) -- top-k expert ids and their gate weights as the
family computes them (renormalized or not, scaled or not); P is the plan's pruned set.

Gate variants (`gates`):
  renorm  route as a router whose pruned rows were sliced away: pruned logits (DeepSeek: selection scores) at
          -inf before the top-k, so the k slots fill with kept experts and the family's renormalization
          spreads the pruned share over them. Equal to the pruned checkpoint, token for token (the default).
  drop    keep the full router's slots and weights; slots on pruned experts get weight 0 and read no weights
          (their id becomes one of the row's kept experts). The pruned share of the gate mass is lost, and a
          token with no pruned expert among its slots is routed exactly as by the full model.
  substitute
          `drop`, plus each pruned slot's weight times a constant vector for its expert added to the MoE
          layer's output: the expert's mean un-gated output over the calibration tokens (`slimwise calibrate
          --output-sums`, read from the statistics file `substitutes`). It reads no expert weights.

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

from slimwise.argtypes import number
from slimwise.errors import SlimWiseError

GATES = ("renorm", "drop", "substitute")
GATES_HELP = ("pruned rows' gates: renorm (the sliced router's, default), drop (the full router's, pruned "
              "slots zeroed) or substitute (drop, plus each pruned slot's weight times its expert's mean "
              "output: --substitutes)")
SUBSTITUTES_HELP = ("--gates substitute: calibration statistics with expert outputs (`slimwise calibrate "
                    "--output-sums`) whose per-expert means replace the pruned experts")
FALLBACK_HELP = ("route a pruned token with every expert in a layer where its full top-k puts more than TAU "
                 "of the gate weight on pruned experts (0: the full model, 1: never)")


def gates_field():
    """`--gates`, declared once for every config dataclass that has it (slimwise.options)."""
    return field(default="renorm", metadata={"choices": GATES, "help": GATES_HELP})


def fallback_field():
    """`--fallback TAU`, declared once for every config dataclass that has it (slimwise.options)."""
    return field(default=None, metadata={"type": number(0, 1), "metavar": "TAU", "help": FALLBACK_HELP})


def substitutes_field():
    """`--substitutes STATS`, declared once for every config dataclass that has it (slimwise.options)."""
    return field(default=None, metadata={"metavar": "STATS", "help": SUBSTITUTES_HELP})


@dataclass(frozen=True)
class DecodeGates:
    """The gate variant and the fallback threshold (None: never fall back) of a pruned decode step."""

    gates: str = "renorm"
    fallback: float | None = None
    substitutes: str | None = None  # `substitute`: a statistics file with expert output sums

    def __post_init__(self) -> None:
        if self.gates not in GATES:
            raise SlimWiseError(f"unknown gates {self.gates!r}; choose one of {', '.join(GATES)}")
        if self.fallback is not None and not (math.isfinite(self.fallback) and 0 <= self.fallback <= 1):
            raise SlimWiseError(f"fallback {self.fallback!r} must be a share in [0, 1]")
        if (self.gates == "substitute") != bool(self.substitutes):
            raise SlimWiseError("--gates substitute reads its vectors from --substitutes STATS (made by "
                                "`slimwise calibrate --output-sums`), and --substitutes goes with it only")

    @property
    def plain(self) -> bool:
        """Today's masked routing with nothing added: the engines keep their cheapest path."""
        return self.gates == "renorm" and self.fallback is None

    @property
    def routes_as_drop(self) -> bool:
        """`drop` and `substitute` keep the full router's slots and zero the pruned ones (substitute adds its
        vectors on top); `renorm` re-routes to kept experts."""
        return self.gates in ("drop", "substitute")

    def describe(self) -> dict:
        return {"gates": self.gates, "fallback": self.fallback,
                **({"substitutes": self.substitutes} if self.substitutes else {})}

    def vectors(self, layers: list[int], num_experts: int, hidden: int) -> dict:
        """`substitute`: per MoE layer, every expert's mean output [experts, hidden] (float32 torch tensors),
        checked against the served model's layers and sizes."""
        from slimwise.stats import ExpertStats

        stats = ExpertStats.load(self.substitutes)
        means = stats.output_mean()
        if stats.num_experts != num_experts or means.shape[-1] != hidden \
                or not set(layers) <= set(stats.layers):
            raise SlimWiseError(f"--substitutes {self.substitutes} holds {stats.num_experts} experts of "
                                f"hidden size {means.shape[-1]} in layers {stats.layers}, not this model's "
                                f"{num_experts} x {hidden} in layers {layers}: calibrate this model")
        return {layer: means[stats.row(layer)].float() for layer in layers}


PLAIN = DecodeGates()
