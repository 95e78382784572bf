"""Evaluation of full / uniform / SlimWise decoding: accuracy, generation length, fidelity, decode traffic.

One module per concern: `config` (EvalConfig, PlanSpec), `samples` (data and graders), `metrics` (pure metric
functions, teacher-forced KL), `reference_traffic` (distinct experts per decode step), `runs` (engines and one
run's metrics), `sweep` (criterion x ratio x calibration-phase grids, resumable) and what it orchestrates:
`evaluated_model` (the model loaded once), `calibration_cache` (stats per phase and mix), `plan_grid` (the
plans), `run_cache` (generations cached on disk, keyed by `cache_keys`) and `report_assembly` (report.json);
`report` (Markdown) and `plots` (PNG) of a sweep, and `mix` (a traffic mix routed over several plans in one
vLLM engine).
"""

from slimwise.evaluation.config import (
    DEFAULT_CRITERIA,
    DEFAULT_PHASES,
    DEFAULT_RATIOS,
    EVAL_MODES,
    SCHEMA,
    EvalConfig,
    PlanSpec,
)
from slimwise.evaluation.metrics import (
    accuracy_metrics,
    bootstrap_ci,
    fidelity_metrics,
    first_difference,
    length_metrics,
    length_ratios,
    paired_difference,
    teacher_forced_kl,
)
from slimwise.evaluation.reference_traffic import DecodeTrafficMeter
from slimwise.evaluation.runs import ENGINES, GenerationEngine, evaluate_modes, make_engine, run_metrics
from slimwise.evaluation.samples import GRADERS, GradedSample, load_samples, make_grader
from slimwise.evaluation.sweep import Sweep, run_eval
from slimwise.io import dumps_compact
from slimwise.scoring import continuation_logprobs, kl_divergence
from slimwise.stats import expected_union

__all__ = [
    "DEFAULT_CRITERIA", "DEFAULT_PHASES", "DEFAULT_RATIOS", "ENGINES", "EVAL_MODES", "GRADERS", "SCHEMA",
    "DecodeTrafficMeter", "EvalConfig", "GenerationEngine", "GradedSample", "PlanSpec", "Sweep",
    "accuracy_metrics", "bootstrap_ci", "continuation_logprobs", "dumps_compact", "evaluate_modes",
    "expected_union", "fidelity_metrics", "first_difference", "kl_divergence", "length_metrics",
    "length_ratios", "load_samples", "make_engine", "make_grader", "paired_difference", "run_eval",
    "run_metrics", "teacher_forced_kl",
]
