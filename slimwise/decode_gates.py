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

Batch budget (`budget` E, `budget_share`, or `extra` M; `renorm` gates only): the experts a decode step may
read are chosen per MoE layer from that step's own routing. The decode rows of one plan form a group; each
expert's score is its summed top-k gate weight over the group's live decode rows (the full router's slots, as
the family computes them), and the group's rows route (`renorm`) within S:
  budget E   S = the E experts of highest score (ties: lower expert id), from every expert: E = all experts
             is the full model, and a step never reads more than E experts in that layer;
  extra M    S = the plan's kept experts plus the M pruned experts of highest score: M = 0 is the static
             plan, and a step reads at most kept + M experts.
A fallback on top decides per row against S. Prefill rows and uniform pruning keep the static plan: a budget
is a decode-step choice. A row's tokens now depend on the rows it is batched with
(docs/results/batch-budgets.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from slimwise.argtypes import integer, number
from slimwise.errors import SlimWiseError

GATES = ("renorm", "drop", "substitute")
GATES_HELP = ("pruned rows' gates: renorm (the sliced router's, default), drop (the full router's, pruned "
              "slots zeroed) or substitute (drop, plus each pruned slot's weight times its expert's mean "
              "output: --substitutes)")
SUBSTITUTES_HELP = ("--gates substitute: calibration statistics with expert outputs (`slimwise calibrate "
                    "--output-sums`) whose per-expert means replace the pruned experts")
BUDGET_HELP = ("batch budget: each decode step routes a plan's decode rows within the E experts per MoE "
               "layer with the most summed gate weight over the step's decode rows (E = all experts: the "
               "full model)")
BUDGET_SHARE_HELP = "--budget as a share of each layer's experts, E = round(SHARE x experts)"
EXTRA_HELP = ("batch budget on the plan: each decode step adds at most M of the plan's pruned experts per "
              "MoE layer, those with the most summed gate weight over the step's decode rows (0: the static "
              "plan)")
FALLBACK_HELP = ("route a pruned token with every expert in a layer where its full top-k puts more than TAU "
                 "of the gate weight on pruned experts (0: the full model, 1: never)")


@dataclass(frozen=True)
class DecodeGates:
    """The gate variant and the fallback threshold (None: never fall back) of a pruned decode step."""

    gates: str = "renorm"
    fallback: float | None = None
    substitutes: str | None = None  # `substitute`: a statistics file with expert output sums
    # batch budget (at most one of the three): experts per layer and step, as a count or a share of the
    # layer's experts, or experts added per step to the plan's kept set
    budget: int | None = None
    budget_share: float | None = None
    extra: int | None = None

    def __post_init__(self) -> None:
        if self.gates not in GATES:
            raise SlimWiseError(f"unknown gates {self.gates!r}; choose one of {', '.join(GATES)}")
        if self.fallback is not None and not (math.isfinite(self.fallback) and 0 <= self.fallback <= 1):
            raise SlimWiseError(f"fallback {self.fallback!r} must be a share in [0, 1]")
        if (self.gates == "substitute") != bool(self.substitutes):
            raise SlimWiseError("--gates substitute reads its vectors from --substitutes STATS (made by "
                                "`slimwise calibrate --output-sums`), and --substitutes goes with it only")
        given = [name for name, v in (("--budget", self.budget), ("--budget-share", self.budget_share),
                                      ("--extra", self.extra)) if v is not None]
        if len(given) > 1:
            raise SlimWiseError(f"{' and '.join(given)} are different batch budgets: give one")
        if self.budget is not None and not (isinstance(self.budget, int) and self.budget >= 1):
            raise SlimWiseError(f"budget {self.budget!r} must be a whole number of experts, at least 1")
        share = self.budget_share
        if share is not None and not (math.isfinite(share) and 0 < share <= 1):
            raise SlimWiseError(f"budget share {self.budget_share!r} must be in (0, 1]")
        if self.extra is not None and not (isinstance(self.extra, int) and self.extra >= 0):
            raise SlimWiseError(f"extra {self.extra!r} must be a whole number of experts, at least 0")
        if given and self.gates != "renorm":
            raise SlimWiseError(f"a batch budget routes decode rows within the step's experts (renorm); it "
                                f"does not combine with --gates {self.gates}")

    @classmethod
    def of(cls, config) -> DecodeGates:
        """The settings of a config object (or argparse namespace) with the fields of this class."""
        return cls(*(getattr(config, name, None) for name in (
            "gates", "fallback", "substitutes", "budget", "budget_share", "extra")))

    @property
    def plain(self) -> bool:
        """Today's masked routing with nothing added: the engines keep their cheapest path."""
        return self.gates == "renorm" and self.fallback is None and not self.budgeted

    @property
    def budgeted(self) -> bool:
        """Whether decode steps choose their experts from the batch (`budget`, `budget_share` or `extra`)."""
        return self.budget is not None or self.budget_share is not None or self.extra is not None

    @property
    def static(self) -> DecodeGates:
        """These gates without the batch budget: what uniform pruning and prefill rows use."""
        return DecodeGates(self.gates, self.fallback, self.substitutes)

    def step_experts(self, num_experts: int, top_k: int, kept: int) -> int:
        """A budgeted layer's size of S: E (from `budget` or `budget_share`), or `kept` + M (`extra`), at most
        `num_experts`. Refuses E < top_k (a row could not take its k experts) and E > `num_experts`."""
        if self.extra is not None:
            return min(num_experts, kept + self.extra)
        e = self.budget if self.budget is not None else round(self.budget_share * num_experts)
        if e < top_k or e > num_experts:
            what = f"--budget {self.budget}" if self.budget is not None else \
                f"--budget-share {self.budget_share} ({e} of {num_experts} experts)"
            raise SlimWiseError(f"{what}: a decode step must be able to read between top-k ({top_k}) and all "
                                f"{num_experts} experts per layer")
        return e

    @property
    def routes_as_drop(self) -> bool:
        """`drop` and `substitute` keep the full router's slots and zero the pruned ones (substitute adds its
        vectors on top); `renorm` re-routes to kept experts."""
        return self.gates in ("drop", "substitute")

    def drops_experts(self, plan) -> bool:
        """Whether decode rows of `plan` (a `PrunePlan`) can lose an expert under these settings: a plan
        that prunes nothing, or a budget of every expert, serves the full model (no mask to self-check).
        Refuses a budget the plan's model cannot take (E below its top-k or above its experts)."""
        if not self.budgeted:
            return not plan.is_empty
        return any([self.step_experts(plan.num_experts, plan.top_k, len(kept)) < plan.num_experts
                    for kept in plan.kept_experts.values()])  # every layer checked (refuses E < top-k)

    def describe(self) -> dict:
        budget = {k: v for k, v in (("budget", self.budget), ("budget_share", self.budget_share),
                                    ("extra", self.extra)) if v is not None}
        return {"gates": self.gates, "fallback": self.fallback,
                **({"substitutes": self.substitutes} if self.substitutes else {}), **budget}

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


@dataclass
class GateOptions:
    """`--gates`, `--fallback`, `--substitutes` and the batch budget, declared once for the config
    dataclasses of `eval`, `bench`, `serve` and `generate` (a base class: its fields are keyword-only, so they
    follow each config's own fields in the constructor)."""

    gates: str = field(default="renorm", kw_only=True, metadata={"choices": GATES, "help": GATES_HELP})
    fallback: float | None = field(default=None, kw_only=True, metadata={
        "type": number(0, 1), "metavar": "TAU", "help": FALLBACK_HELP})
    substitutes: str | None = field(default=None, kw_only=True, metadata={
        "metavar": "STATS", "help": SUBSTITUTES_HELP})
    budget: int | None = field(default=None, kw_only=True, metadata={
        "type": integer(1), "metavar": "E", "help": BUDGET_HELP})
    budget_share: float | None = field(default=None, kw_only=True, metadata={
        "type": number(0, 1, lo_open=True), "metavar": "SHARE", "help": BUDGET_SHARE_HELP})
    extra: int | None = field(default=None, kw_only=True, metadata={
        "type": integer(0), "metavar": "M", "help": EXTRA_HELP})

    @property
    def decode_gates(self) -> DecodeGates:
        return DecodeGates.of(self)
