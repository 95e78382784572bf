"""The plans a sweep evaluates: explicit --plan files, or criterion x ratio per calibration phase plus the
headline criterion and phase at every ratio on each mixed-domain calibration.

Invariants: grid labels are "<criterion>-<phase>-<ratio:g>", a mix's phase reads "<phase>@<mix label>"; an
explicit plan whose label repeats an earlier one gets "-<file stem>". Grid plans are saved as
out_dir/plans/<label>.json, and every plan is checked against the model before anything runs. Given --stats
replace calibration (their phases are the only ones) and, like --calib-data, leave out the mixes. The order,
phases then criteria then ratios then mixes, is the order of the report's runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from slimwise.evaluation.calibration_cache import CalibrationCache
from slimwise.evaluation.config import EvalConfig, PlanSpec, calib_mix_label
from slimwise.evaluation.evaluated_model import EvaluatedModel
from slimwise.plan import PrunePlan

if TYPE_CHECKING:
    from slimwise.stats import ExpertStats


def explicit_plans(paths: tuple[str, ...], subject: EvaluatedModel) -> list[PlanSpec]:
    """The given plan files, labelled by their own criterion, phase and ratio."""
    specs: list[PlanSpec] = []
    for p in paths:
        plan = PrunePlan.load(p)
        plan.check_model(subject.model, subject.adapter)
        label = f"{plan.criterion}-{plan.phase or 'na'}-{plan.ratio:g}"
        if any(sp.label == label for sp in specs):
            label = f"{label}-{Path(p).stem}"
        specs.append(PlanSpec(label, plan, plan.criterion, plan.ratio, plan.phase, str(p)))
    return specs


def grid_plans(config: EvalConfig, subject: EvaluatedModel, calibration: CalibrationCache, out_dir: Path,
               console) -> list[PlanSpec]:
    """criterion x ratio for each calibration phase (stats given, cached or computed once), then the mixes."""
    stats_by_phase: dict[str, ExpertStats] = {}
    for path in config.stats:
        phase, stats = calibration.load_given(path)
        stats_by_phase[phase] = stats
    for phase in config.phases if not config.stats else ():  # given stats replace calibration
        console.print(f"[bold]calibrating[/] ({phase} phase)")
        stats_by_phase[phase] = calibration.calibrate(phase)
    plan_dir = out_dir / "plans"
    specs = [_saved_plan(stats, criterion, ratio, phase, config, subject, plan_dir)
             for phase, stats in stats_by_phase.items()
             for criterion in config.criteria for ratio in config.ratios]
    return specs + mix_plans(config, subject, calibration, plan_dir, console)


def mix_plans(config: EvalConfig, subject: EvaluatedModel, calibration: CalibrationCache, plan_dir: Path,
              console) -> list[PlanSpec]:
    """Plans of the headline criterion and phase, at every ratio, calibrated on each mixed-domain calibration
    (`calib_mixes`). Their reported phase is "<phase>@<mix>" (e.g. "decode@all"), so tables and plots show
    them as calibrations of their own."""
    criterion, _, phase = config.headline
    if config.stats or config.calib_data or criterion not in config.criteria or phase not in config.phases:
        return []
    specs = []
    for mix in config.calib_mixes:
        name = calib_mix_label(mix)
        if name == (config.calib_domain or ""):  # "all" as the main calibration domain already
            continue
        console.print(f"[bold]calibrating[/] ({phase} phase, mix {mix})")
        stats = calibration.calibrate(phase, mix)
        specs += [_saved_plan(stats, criterion, ratio, f"{phase}@{name}", config, subject, plan_dir)
                  for ratio in config.ratios]
    return specs


def _saved_plan(stats: ExpertStats, criterion: str, ratio: float, phase: str, config: EvalConfig,
                subject: EvaluatedModel, plan_dir: Path) -> PlanSpec:
    """One grid plan, checked against the model and saved as plan_dir/<label>.json."""
    from slimwise.criteria import plan_from_stats

    plan = plan_from_stats(stats, criterion, ratio, scope=config.scope)
    plan.check_model(subject.model, subject.adapter)
    label = f"{criterion}-{phase}-{ratio:g}"
    path = plan.save(plan_dir / f"{label}.json")
    return PlanSpec(label, plan, criterion, ratio, phase, str(path))
