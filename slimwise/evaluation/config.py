"""What a sweep evaluates: `EvalConfig` (criteria x ratios x calibration phases, modes, data, engine) and `PlanSpec`
(one plan of the grid), with the defaults and the report schema."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from slimwise.errors import SlimWiseError
from slimwise.evaluation.runs import ENGINES
from slimwise.evaluation.samples import GRADERS
from slimwise.plan import PrunePlan

SCHEMA = "slimwise-eval/1"
EVAL_MODES = ("full", "uniform", "slimwise", "distilled")
DEFAULT_CRITERIA = ("frequency", "soft", "ean", "reap")
DEFAULT_RATIOS = (0.25, 0.5, 0.75)
DEFAULT_PHASES = ("prompt", "decode")
# mixed-domain calibrations of the default sweep (headline criterion and phase, every ratio): every domain alike,
# and the target weighted 3:1:1 -- a deployment whose traffic is mostly, not only, the target domain
DEFAULT_CALIB_MIXES = ("all", "arithmetic:3,lists:1,text:1")
KL_REFERENCE_BYTES = 1 << 30  # cache the full model's teacher-forced log-probs across plans below this size


@dataclass
class EvalConfig:
    """Everything `slimwise eval` varies. Defaults are the default sweep (4 criteria x 3 ratios x 2 phases)."""

    # pruning grid (or explicit plans)
    criteria: tuple[str, ...] = DEFAULT_CRITERIA
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    phases: tuple[str, ...] = DEFAULT_PHASES
    plans: tuple[str, ...] = ()  # plan JSON files: replace the grid
    stats: tuple[str, ...] = ()  # calibration stats files (phase read from them): skip calibration
    scope: str = "layer"
    modes: tuple[str, ...] = ("full", "uniform", "slimwise")
    distilled: str | None = None  # a `slimwise distill` delta: adds mode `distilled` on the plan it was made for
    engine: str = "hf"
    # tasks
    data: str | None = None  # JSONL with prompt/answer[/family]; default: the testbed
    grader: str = "testbed"
    domain: str | None = None  # testbed domain (default: the target domain); "all" = every domain
    families: tuple[str, ...] = ()
    split: str = "test"
    n_per_family: int = 48  # 240 target-domain problems: about ±6 pp at 50% accuracy, default sweep < 20 min
    max_samples: int | None = None
    # calibration
    calib_data: str | None = None
    calib_domain: str | None = None  # default: the target domain (also when other domains are evaluated)
    calib_per_family: int = 16
    calib_max_new_tokens: int = 128
    calib_seed: int = 0  # the calibration split and sampling; apart from `seed` so a new test sample keeps the plan
    calib_mixes: tuple[str, ...] = DEFAULT_CALIB_MIXES  # extra calibrations: "all" or "domain:weight,..." (testbed)
    # transfer: every plan also scored on the testbed's other domains (the ones not evaluated as the target)
    other_domains: bool = True
    other_per_family: int = 24  # 192 problems over the 8 other families: about ±7 pp at 50% accuracy
    # generation
    max_new_tokens: int = 160
    batch_size: int = 32
    seed: int = 0  # the test sample (and bootstrap); never the calibration (`calib_seed`)
    dtype: str = "auto"
    threads: int | None = None  # torch CPU threads (default: torch's); 1 is fastest for tiny models on a busy box
    # metrics
    kl: bool = True
    kl_batch_size: int = 16
    traffic: bool = True
    n_boot: int = 2000
    # output
    out_dir: str = "runs/eval"
    plots: bool = True
    cache: bool = True
    cache_dir: str | None = None  # default: <out>/cache (generations, stats); keep it out of committed reports
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
            raise SlimWiseError(f"unknown grader {self.grader!r}; choose one of {', '.join(GRADERS)} or module:function")
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
            raise SlimWiseError(f"calibration mix {mix!r}: give 'all' or domain:weight pairs with domains among "
                                f"{', '.join(DOMAINS)} and positive weights, e.g. arithmetic:3,lists:1,text:1")
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
