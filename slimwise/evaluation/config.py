"""What a sweep evaluates: `EvalConfig` (criteria x ratios x calibration phases, modes, data, engine) and
`PlanSpec` (one plan of the grid), with the defaults and the report schema."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from slimwise.argtypes import comma_list, integer
from slimwise.decode_gates import DecodeGates, GateOptions
from slimwise.errors import SlimWiseError
from slimwise.evaluation.runs import ENGINES
from slimwise.evaluation.samples import GRADERS
from slimwise.plan import PrunePlan

SCHEMA = "slimwise-eval/1"
EVAL_MODES = ("full", "uniform", "slimwise", "distilled")
DEFAULT_CRITERIA = ("frequency", "soft", "ean", "reap")
DEFAULT_RATIOS = (0.25, 0.5, 0.75)
DEFAULT_PHASES = ("prompt", "decode")
# mixed-domain calibrations of the default sweep (headline criterion and phase, every ratio): every domain
# alike, and the target weighted 3:1:1 -- a deployment whose traffic is mostly, not only, the target domain
DEFAULT_CALIB_MIXES = ("all", "arithmetic:3,lists:1,text:1")
KL_REFERENCE_BYTES = 1 << 30  # cache the full model's teacher-forced log-probs across plans below this size


@dataclass
class EvalConfig(GateOptions):
    """Everything `slimwise eval` varies. Defaults are the default sweep (4 criteria x 3 ratios x 2 phases).
    The metadata of a field makes it an option of `slimwise eval` (slimwise.options)."""

    # pruning grid (or explicit plans)
    criteria: tuple[str, ...] = field(default=DEFAULT_CRITERIA, metadata={
        "type": comma_list(str), "help": "comma-separated criteria (default: frequency,soft,ean,reap)"})
    ratios: tuple[float, ...] = field(default=DEFAULT_RATIOS, metadata={
        "type": comma_list(float),
        "help": "comma-separated shares of experts to prune (default: 0.25,0.5,0.75)"})
    phases: tuple[str, ...] = field(default=DEFAULT_PHASES, metadata={
        "type": comma_list(str), "help": "comma-separated calibration phases (default: prompt,decode)"})
    plans: tuple[str, ...] = field(default=(), metadata={  # plan JSON files: replace the grid
        "flag": "--plan", "action": "append", "convert": tuple,
        "help": "evaluate this plan JSON (repeatable) instead of the grid"})
    stats: tuple[str, ...] = field(default=(), metadata={  # calibration stats files (phase read from them)
        "action": "append", "convert": tuple,
        "help": "calibration stats to plan from (repeatable) instead of calibrating"})
    scope: str = field(default="layer", metadata={
        "flag": "--global", "action": "store_const", "const": "global",
        "help": "one pruning budget across layers"})
    # the classic baseline as classic pruners calibrate it: whole sequences of the calibration data
    uniform_phase: str = field(default="all", metadata={
        "choices": ["all", "prompt", "decode", "same"],
        "help": "calibration phase of the uniform (classic pruning) baseline's plans: all (whole sequences, "
                "as classic pruners calibrate; default), prompt, decode, or same (each grid plan's own "
                "phase). Explicit --plan / --stats keep their own plans"})
    modes: tuple[str, ...] = field(default=("full", "uniform", "slimwise"), metadata={
        "type": comma_list(str),
        "help": "comma-separated among full,uniform,slimwise,distilled (default: full,uniform,slimwise)"})
    distilled: str | None = field(default=None, metadata={
        "help": "a `slimwise distill` delta: adds mode distilled on the plan it was made for"})
    engine: str = field(default="hf", metadata={
        "choices": ENGINES, "help": "hf (reference) or vllm (if installed)"})
    # tasks
    data: str | None = field(default=None, metadata={  # default: the testbed
        "help": "JSONL with prompt and answer (optional family) instead of the testbed"})
    grader: str = field(default="testbed", metadata={"help": "testbed | exact | contains | module:function"})
    domain: str | None = field(default=None, metadata={  # "all" = every domain
        "help": "testbed domain: arithmetic (default, the target), lists, text, or all"})
    families: tuple[str, ...] = field(default=(), metadata={
        "type": comma_list(str), "help": "comma-separated testbed families"})
    split: str = field(default="test", metadata={
        "choices": ["test", "edge", "heldout", "calib", "final"],
        "help": "testbed split: test; edge (the hardest trained sizes, e.g. 4-digit operands, never a test "
                "problem); heldout (beyond training: 5-6 digits, which the testbeds cannot solve); calib; "
                "final (trained sizes no earlier sample drew, reserved for the final tables: "
                "docs/results/protocol.md)"})
    # 240 target-domain problems: about ±6 pp at 50% accuracy, default sweep < 20 min
    n_per_family: int = field(default=48, metadata={
        "flag": "--per-family", "type": integer(1),
        "help": "testbed problems per family (default: %(default)s)"})
    max_samples: int | None = field(default=None, metadata={
        "type": integer(1), "help": "cap on problems (round-robin over families)"})
    # calibration
    calib_data: str | None = field(default=None, metadata={
        "help": "calibration prompts (JSONL) instead of the testbed calib split"})
    calib_domain: str | None = field(default=None, metadata={  # also when other domains are evaluated
        "help": "testbed domain to calibrate on (default: arithmetic, the target; evaluating other domains "
                "then measures transfer)"})
    calib_per_family: int = field(default=16, metadata={"type": integer(1), "help": None})
    calib_max_new_tokens: int = field(default=128, metadata={"type": integer(1), "help": None})
    # the calibration split and sampling; apart from `seed` so a new test sample keeps the plan
    calib_seed: int = field(default=0, metadata={
        "type": integer(0),
        "help": "seed of the calibration split and sampling (apart from --seed, so the plans stay fixed)"})
    # extra calibrations: "all" or "domain:weight,..." (testbed)
    calib_mixes: tuple[str, ...] = field(default=DEFAULT_CALIB_MIXES, metadata={
        "flag": "--calib-mix", "action": "append", "metavar": "MIX", "convert": tuple,
        "help": "a mixed-domain calibration of the headline criterion and phase, at every ratio: 'all' or "
                "domain:weight,... (repeatable; default: all and arithmetic:3,lists:1,text:1)"})
    # transfer: every plan also scored on the testbed's other domains (the ones not evaluated as the target)
    other_domains: bool = field(default=True, metadata={
        "help": "do not also score every plan on the testbed's other domains"})
    # 192 problems over the 8 other families: about ±7 pp at 50% accuracy
    other_per_family: int = field(default=24, metadata={
        "type": integer(1), "help": "other-domain problems per family (default: %(default)s)"})
    # generation
    max_new_tokens: int = field(default=160, metadata={"type": integer(1), "help": None})
    batch_size: int = field(default=32, metadata={
        "type": integer(1), "help": "decode batch size (traffic is measured at it)"})
    seed: int = field(default=0, metadata={  # never the calibration (`calib_seed`)
        "type": integer(0), "help": "seed of the test sample and the bootstrap intervals"})
    dtype: str = field(default="auto", metadata={
        "choices": ["auto", "float32", "bfloat16", "float16"],
        "help": "auto: the checkpoint's dtype, float32 for bf16 on a CPU without bf16 matrix units"})
    device: str = field(default="auto", metadata={
        "help": "where the transformers model runs (calibration, --engine hf, KL): auto (CUDA when "
                "present), cpu, cuda or cuda:N"})
    max_memory: str | None = field(default=None, metadata={
        "metavar": "DEV=SIZE,...", "help": "spread that model over devices within these bounds, e.g. "
                                           "0=70GiB,1=70GiB,cpu=200GiB"})
    # 1 is fastest for tiny models on a busy box
    threads: int | None = field(default=None, metadata={
        "type": integer(1), "help": "torch CPU threads (default: torch's choice)"})
    # metrics
    kl: bool = field(default=True, metadata={"help": "skip the teacher-forced KL"})
    kl_batch_size: int = 16
    traffic: bool = field(default=True, metadata={"help": "skip decode-traffic counting"})
    n_boot: int = 2000
    # output
    out_dir: str = field(default="runs/eval", metadata={
        "flag": "--out", "help": "report directory (one subdirectory per model if several)"})
    plots: bool = field(default=True, metadata={"help": None})
    cache: bool = field(default=True, metadata={"help": "recompute calibration and runs cached in --out"})
    # keep it out of committed reports
    cache_dir: str | None = field(default=None, metadata={
        "help": "where cached stats and generations go (default: OUT/cache)"})
    progress: bool = True
    headline: tuple[str, float, str] = ("reap", 0.5, "decode")  # plan the length plot and summary show

    def validate(self) -> None:
        from slimwise.calibrate import PHASES
        from slimwise.criteria import CRITERIA

        bad = [m for m in self.modes if m not in EVAL_MODES]
        if bad:
            raise SlimWiseError(f"unknown modes {bad}; choose among {', '.join(EVAL_MODES)}")
        if ("distilled" in self.modes or self.distilled) and not self.distilled:
            raise SlimWiseError("mode distilled needs --distilled DELTA (the output of `slimwise distill`)")
        DecodeGates.of(self)  # refuses an unknown variant or threshold
        if self.engine not in ENGINES:
            raise SlimWiseError(f"unknown engine {self.engine!r}; choose one of {', '.join(ENGINES)}")
        if not self.plans:
            unknown = [c for c in self.criteria if c not in CRITERIA]
            if unknown:
                raise SlimWiseError(f"unknown criteria {unknown}; choose among {', '.join(sorted(CRITERIA))}")
            if not self.criteria or not self.ratios:
                raise SlimWiseError("give at least one criterion and one ratio (or --plan)")
            for r in self.ratios:
                if not 0.0 <= r < 1.0:
                    raise SlimWiseError(f"ratio {r} is outside [0, 1): pass shares of experts to prune")
            for p in self.phases:
                if p not in PHASES:
                    raise SlimWiseError(f"unknown calibration phase {p!r}; choose among {', '.join(PHASES)}")
        if self.grader not in GRADERS and ":" not in self.grader:
            raise SlimWiseError(f"unknown grader {self.grader!r}; choose one of "
                                f"{', '.join(GRADERS)} or module:function")
        for mix in self.calib_mixes:
            parse_calib_mix(mix)
        if self.batch_size < 1 or self.max_new_tokens < 1:
            raise SlimWiseError("batch size and max new tokens must be at least 1")




def parse_calib_mix(mix: str) -> dict[str, float]:
    """A calibration mix: "all" (every testbed domain alike) or "domain:weight,..." -> {domain: weight}."""
    from slimwise.testbed import DOMAINS

    if mix == "all":
        return dict.fromkeys(DOMAINS, 1.0)
    out: dict[str, float] = {}
    for part in mix.split(","):
        domain, sep, weight = part.partition(":")
        try:
            w = float(weight) if sep else 1.0
        except ValueError:
            w = -1.0
        if domain not in DOMAINS or not w > 0:
            raise SlimWiseError(f"calibration mix {mix!r}: give 'all' or domain:weight pairs with domains "
                                f"among {', '.join(DOMAINS)} and positive weights, e.g. "
                                "arithmetic:3,lists:1,text:1")
        out[domain] = w
    return out


def calib_mix_label(mix: str) -> str:
    """A file-name-safe label: "all", or "arithmetic3-lists1-text1"."""
    return "all" if mix == "all" else "-".join(f"{d}{w:g}" for d, w in parse_calib_mix(mix).items())


@dataclass
class PlanSpec:
    """One pruned configuration of the sweep."""

    label: str
    plan: PrunePlan
    criterion: str
    ratio: float
    phase: str | None
    path: str | None = None

    @property
    def kept_key(self) -> str:
        """Identical kept sets give identical outputs: runs are shared between them."""
        blob = json.dumps(sorted((k, v) for k, v in self.plan.kept_experts.items()))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
