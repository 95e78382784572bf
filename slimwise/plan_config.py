"""The options of `slimwise plan` (`PlanCommand`) and `slimwise prune` (`PruneCommand`), declared once: a
field's metadata makes it an option (`slimwise.options`). Both make a plan from statistics the same way
(`PlanSource`); `plan` takes several ratios, `prune` one, or a plan file instead."""

from __future__ import annotations

from dataclasses import dataclass, field

from slimwise.argtypes import integer, number
from slimwise.load_options import ModelOptions, dry_run_field

RATIO_TYPE = number(0, 1, hi_open=True)


@dataclass
class PlanSource:
    """A plan from calibration statistics: the criterion, the share of routed experts pruned and the scope
    (per layer, or one budget across layers)."""

    stats: str | None = field(default=None, metadata={
        "help": "calibration statistics from `slimwise calibrate`"})
    criterion: str = field(default="reap", metadata={"help": "frequency | soft | ean | reap (default: reap)"})
    ratio: float = field(default=0.5, metadata={
        "type": RATIO_TYPE, "help": "share of routed experts to prune, in [0, 1)"})
    global_budget: bool = field(default=False, metadata={
        "flag": "--global",
        "help": "one budget across layers (non-uniform; served by masking, not exportable)"})

    @property
    def scope(self) -> str:
        return "global" if self.global_budget else "layer"


@dataclass
class PlanCommand(PlanSource):
    """`slimwise plan`: one plan, or one per ratio (nested or not) into a directory, optionally balanced for
    expert parallelism or with per-layer budgets from measured sensitivity (`slimwise.layer_budgets`)."""

    ratio: list[float] = field(default_factory=lambda: [PlanSource.ratio], metadata={
        "type": RATIO_TYPE, "nargs": "+",
        "help": "share of routed experts to prune, in [0, 1); several ratios write one plan each into the "
                "--out directory"})
    ep_size: int = field(default=1, metadata={
        "type": integer(1),
        "help": "expert-parallel size to balance for: keep the same number of experts in every EP rank's "
                "block, so no rank's decode step waits on a fuller one (default 1: unbalanced)"})
    ep_placement: str = field(default="linear", metadata={
        "choices": ["linear", "round_robin"],
        "help": "vLLM's expert placement the plan balances for (--expert-placement-strategy)"})
    nested: bool = field(default=False, metadata={
        "help": "with several --ratio values: each plan keeps a subset of the next lower ratio's kept "
                "experts in every layer, so an engine serving them together reads at most the lowest ratio's "
                "experts in a mixed step"})
    budget_model: str | None = field(default=None, metadata={
        "metavar": "MODEL",
        "help": "spread the per-layer plan's kept experts over the layers by each layer's measured output "
                "error on MODEL's decode tokens (the model --stats was calibrated on; non-uniform: served by "
                "masking, not exportable)"})
    budget_data: str | None = field(default=None, metadata={
        "metavar": "PROMPTS",
        "help": "--budget-model: prompts whose generations are measured (.jsonl, .txt or a directory)"})
    budget_tokens: int = field(default=4096, metadata={
        "type": integer(1), "help": "--budget-model: decode tokens measured per layer (default 4096)"})
    out: str = field(kw_only=True, metadata={
        "required": True,
        "help": "plan JSON to write; a new directory with several --ratio values or --nested (one "
                "CRITERION-RATIO.json per ratio)"})


@dataclass
class PruneCommand(PlanSource, ModelOptions):
    """`slimwise prune`: MODEL, its plan (a file, or `PlanSource`'s statistics), the output and the delta
    folded in."""

    plan: str | None = field(default=None, metadata={
        "help": "a plan JSON (instead of --stats/--criterion/--ratio)"})
    out: str = field(kw_only=True, metadata={
        "required": True, "help": "new directory for the pruned checkpoint"})
    distilled: str | None = field(default=None, metadata={
        "help": "a `slimwise distill` delta for this plan, folded in (pruned-and-distilled decoder for the "
                "decode instance); exported in memory: loads the whole model"})
    force: bool = field(default=False, metadata={"help": "replace a non-empty output directory"})
    dry_run: bool = dry_run_field()


#: `slimwise prune`'s options in --help's order (--plan before the statistics it replaces)
PRUNE_OPTIONS = ("model", "dtype", "plan", "stats", "criterion", "ratio", "global_budget", "out", "distilled",
                 "force", "dry_run")
