"""The sweep: evaluation of full / uniform / SlimWise decoding: accuracy, generation length, fidelity,
decode traffic.

Accuracy alone hides pruning-induced length changes and drift from the full model, so every run reports,
per task family and overall:
  - accuracy with a 95% bootstrap interval (and a paired bootstrap of SlimWise minus uniform);
  - generated length (mean, median, p90), EOS and truncation shares, per-sample length ratio to full;
  - fidelity to the full model: whole-output exact match, first differing position, and teacher-forced
    KL(full || mode) over the full model's own continuations;
  - decode traffic: distinct experts touched per MoE layer per decode step at the eval batch size (router
    hooks), the expert bytes that implies, and the uniform-routing expectation E(1-(1-k/E)^B) beside it.

The metric functions are pure and hand-checkable; `Sweep` drives criterion x ratio x calibration-phase grids
and only orchestrates: the model is loaded once (`evaluated_model`), stats are calibrated once per phase
(`calibration_cache`), plans come from them (`plan_grid`), `full` is generated once and every run is cached on
disk so an interrupted sweep resumes (`run_cache`), and the report is assembled and written by
`report_assembly`. `slimwise.evaluation.report` turns the result into Markdown and PNG plots.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from slimwise.delta import Delta, plan_hash
from slimwise.engines.reference import Generation, GenerationConfig, PhaseSplitEngine
from slimwise.errors import SlimWiseError
from slimwise.evaluation.calibration_cache import CalibrationCache, calibration_prompts
from slimwise.evaluation.config import EvalConfig, PlanSpec
from slimwise.evaluation.evaluated_model import load_evaluated_model, model_label
from slimwise.evaluation.metrics import accuracy_metrics
from slimwise.evaluation.plan_grid import explicit_plans, grid_plans
from slimwise.evaluation.report_assembly import assemble_report, write_report
from slimwise.evaluation.run_cache import RunCache
from slimwise.evaluation.runs import run_metrics
from slimwise.evaluation.samples import domain_of, load_samples, make_grader
from slimwise.plan import PrunePlan

__all__ = ["Sweep", "model_label", "run_eval"]


class Sweep:
    """One model through the grid: samples, calibration per phase, plans, full once, then every plan's runs.

    Runs are cached under out_dir/cache keyed by model fingerprint, prompts, generation settings, mode and
    kept-expert sets, so a rerun (or an interrupted sweep) only computes what is missing.
    """

    def __init__(self, model: str | Path, config: EvalConfig, out_dir: str | Path | None = None,
                 console=None):
        from rich.console import Console

        config.validate()
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        self.console = console or Console()
        self.out_dir = Path(out_dir or config.out_dir)
        self.cache_dir = Path(config.cache_dir) / model_label(model) if config.cache_dir \
            else self.out_dir / "cache"
        subject = self.subject = load_evaluated_model(model, config.dtype, config.engine, config.device,
                                                            config.max_memory)
        self.model_name, self.model_dir = subject.name, subject.path
        self.model, self.tokenizer, self.adapter = subject.model, subject.tokenizer, subject.adapter
        self.fingerprint = subject.fingerprint  # cache keys: stable across versions
        self.dtype = subject.dtype  # what ran: every cache key holds it
        self.timing: dict[str, float] = {"load_s": subject.load_seconds}
        self.samples = load_samples(config.data, split=config.split, n_per_family=config.n_per_family,
                                    seed=config.seed, domain=self._domain(), families=config.families,
                                    max_samples=config.max_samples)
        self.grader = make_grader(config.grader)
        self.ref_engine = PhaseSplitEngine(self.model, self.tokenizer)
        self.prompt_ids = self.ref_engine.encode([s.prompt for s in self.samples])
        # transfer: the testbed's other domains, scored for every plan beside the target domain
        self.other_samples = self._other_samples()
        self.other_prompt_ids = self.ref_engine.encode([s.prompt for s in self.other_samples]) \
            if self.other_samples else []
        self.gen_config = GenerationConfig(max_new_tokens=config.max_new_tokens, batch_size=config.batch_size,
                                           seed=config.seed, progress=config.progress)
        self.calib_cache = CalibrationCache(config, subject, self.cache_dir)
        self.calibration = self.calib_cache.entries  # the report's "calibration" section
        self.uniform_specs: dict[tuple[str, float], PlanSpec] = {}  # the baseline's plans (`run`)
        self.delta = Delta.load(config.distilled) if config.distilled else None
        modes = [*config.modes, *(["distilled"] if self.delta else [])]
        self.modes = [m for m in dict.fromkeys(modes) if m != "full"]
        self.run_cache = RunCache(subject, config, self.cache_dir, self.gen_config, self.delta,
                                  self.prompt_ids, self.other_prompt_ids)
        self._check_inputs()
        # created only once every input loaded: a missing model or unreadable data leaves no empty directory
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def _check_inputs(self) -> None:
        """Explicit plans (checked against the model), given stats and calibration prompts are read now, so a
        bad one is refused before the output directory exists."""
        cfg = self.config
        for path in cfg.plans:
            PrunePlan.load(path).check_model(self.model, self.adapter)
        if cfg.stats:
            from slimwise.stats import ExpertStats

            for path in cfg.stats:
                ExpertStats.load(path)
        if cfg.calib_data:
            calibration_prompts(cfg)

    def _delta_fits(self, spec: PlanSpec) -> bool:
        """A delta belongs to one plan (same kept experts on the same weights): mode distilled runs only
        there."""
        return self.delta is not None and self.delta.manifest.get("plan_hash") == plan_hash(spec.plan)

    def _domain(self) -> str | None:
        from slimwise.testbed import TARGET_DOMAIN

        return self.config.domain or TARGET_DOMAIN

    def _other_samples(self) -> list:
        """Problems of every testbed domain the main sample does not cover (none for --data, --families or
        --domain all, which already score every domain)."""
        cfg = self.config
        if not cfg.other_domains or cfg.data or cfg.families or self._domain() == "all":
            return []
        from slimwise.testbed import DOMAINS, families_in_domain

        families = [f for d in DOMAINS if d != self._domain() for f in families_in_domain(d)]
        return load_samples(None, split=cfg.split, n_per_family=cfg.other_per_family, seed=cfg.seed,
                            families=families, max_samples=cfg.max_samples)

    # ----- calibration and plans -------------------------------------------------------------------------
    def calibrate(self, phase: str, mix: str | None = None):
        """Stats for `phase` (on calibration mix `mix`, else the calibration domain), from the cache when they
        match this model and calibration setup."""
        return self.calib_cache.calibrate(phase, mix)

    def build_plans(self) -> list[PlanSpec]:
        """Explicit plans, or criterion x ratio for each calibration phase (stats computed or cached once)."""
        if self.config.plans:
            return explicit_plans(self.config.plans, self.subject)
        t0 = time.perf_counter()
        specs = grid_plans(self.config, self.subject, self.calib_cache, self.out_dir, self.console)
        self.timing["calibration_s"] = time.perf_counter() - t0
        return specs

    # ----- runs ------------------------------------------------------------------------------------------
    def full(self) -> list[Generation]:
        return self.run_cache.full()["gens"]

    def _other_metrics(self, mode: str, spec: PlanSpec | None) -> dict[str, Any]:
        """One run's accuracy (overall, per other domain, per family) and lengths on the other-domain
        problems."""
        full = self.run_cache.full(other=True)
        rec = full if mode == "full" else self.run_cache.generate(mode, spec, other=True)
        m = run_metrics(self.other_samples, rec["gens"], full["gens"], self.grader,
                        self.gen_config.max_new_tokens, None, self.config.seed, self.config.n_boot)
        domains = [domain_of(s) for s in self.other_samples]
        pairs = list(zip(m["correct"], domains, strict=True))
        seed, n_boot = self.config.seed, self.config.n_boot
        m["by_domain"] = {d: accuracy_metrics([c for c, x in pairs if x == d], seed, n_boot)
                          for d in dict.fromkeys(domains)}
        m["seconds"] = rec["seconds"]
        m["cached"] = rec.get("cached", False)
        return m

    def _metrics(self, rec: dict[str, Any]) -> dict[str, Any]:
        m = run_metrics(self.samples, rec["gens"], self.full(), self.grader, self.gen_config.max_new_tokens,
                        rec.get("kl"), self.config.seed, self.config.n_boot)
        m["traffic"] = rec.get("traffic")
        if rec.get("fallback"):
            m["fallback"] = rec["fallback"]
        m["seconds"] = rec["seconds"]
        m["kl_seconds"] = rec.get("kl_seconds", 0.0)
        m["cached"] = rec.get("cached", False)
        return m

    def run(self, specs: list[PlanSpec] | None = None) -> dict[str, Any]:
        """The whole sweep for this model; writes report.json (+ report.md and plots) to out_dir."""
        t_start, cpu_start = time.perf_counter(), time.process_time()
        cfg = self.config
        specs = self.build_plans() if specs is None else specs
        modes = self.modes
        if self.delta is not None and not any(self._delta_fits(sp) for sp in specs):
            raise SlimWiseError(f"the delta {cfg.distilled} was distilled for another plan than any "
                                "evaluated here: pass --plan PLAN, the plan given to `slimwise distill`")
        todo = [(sp, m) for sp in specs for m in modes if m != "distilled" or self._delta_fits(sp)]
        self.uniform_specs = self._uniform_specs(specs) if "uniform" in modes else {}
        total = 1 + len(todo)
        kept_sets = len({s.kept_key for s in specs})
        self.console.print(f"[bold]{self.model_name}[/]: {len(self.samples)} samples, {len(specs)} plans, "
                           f"modes {', '.join(modes)}: {total} runs with full ({kept_sets} distinct kept "
                           "sets)", soft_wrap=True)
        self.run_cache.first_spec = specs[0] if specs else None
        try:
            return self._run(todo, total, t_start, cpu_start)
        finally:
            self.run_cache.release_shared_engine()

    def _run(self, todo: list[tuple[PlanSpec, str]], total: int, t_start: float, cpu_start: float
             ) -> dict[str, Any]:
        t0 = time.perf_counter()
        full_metrics = self._metrics(self.run_cache.full())
        other_full = self._other_metrics("full", None) if self.other_samples else None
        self.timing["full_s"] = time.perf_counter() - t0
        self._say(1, total, "full", None, full_metrics, other=other_full)
        t0 = time.perf_counter()
        runs, shared, shared_other = self._pruned_runs(todo, total)
        self.timing["pruned_runs_s"] = time.perf_counter() - t0
        self.timing["total_s"] = time.perf_counter() - t_start + self.timing.get("load_s", 0.0)
        self.timing["process_cpu_s"] = time.process_time() - cpu_start  # > wall when threads run in parallel
        # what the work costs without the cache: original seconds of every distinct run and calibration
        self.timing["uncached_estimate_s"] = (
            sum(m["seconds"] + m.get("kl_seconds", 0.0) for m in [full_metrics, *shared])
            + sum(m["seconds"] for m in [*([other_full] if other_full else []), *shared_other])
            + sum(c.get("original_seconds", c.get("seconds", 0.0)) for c in self.calibration.values())
            + self.timing.get("load_s", 0.0))
        report = assemble_report(config=self.config, subject=self.subject, samples=self.samples,
                                 other_samples=self.other_samples, domain=self._domain(),
                                 gen_config=self.gen_config, calibration=self.calibration, delta=self.delta,
                                 timing=self.timing, full_metrics=full_metrics, runs=runs,
                                 other_full=other_full)
        self.write(report)
        return report

    def _uniform_specs(self, specs: list[PlanSpec]) -> dict[tuple[str, float], PlanSpec]:
        """The uniform baseline's plan per (criterion, ratio), calibrated on `uniform_phase` (default: whole
        sequences, as classic pruners calibrate), when it differs from a grid plan's own phase; empty for
        `same` and for explicit plans or statistics (the uniform runs then use each plan itself)."""
        cfg = self.config
        if cfg.uniform_phase == "same" or cfg.plans or cfg.stats:
            return {}
        have = {(s.criterion, s.ratio, s.phase): s for s in specs}
        out = {}
        wanted = {(s.criterion, s.ratio) for s in specs if s.phase != cfg.uniform_phase}
        missing = sorted((c, r) for c, r in wanted if (c, r, cfg.uniform_phase) not in have)
        extra = {}
        if missing:
            extra_cfg = replace(cfg, phases=(cfg.uniform_phase,), calib_mixes=(),
                                criteria=tuple(dict.fromkeys(c for c, _ in missing)),
                                ratios=tuple(dict.fromkeys(r for _, r in missing)))
            extra = {(s.criterion, s.ratio): s for s in grid_plans(extra_cfg, self.subject, self.calib_cache,
                                                                     self.out_dir, self.console)}
        for criterion, ratio in wanted:
            out[(criterion, ratio)] = have.get((criterion, ratio, cfg.uniform_phase)) \
                or extra[(criterion, ratio)]
        return out

    def _pruned_runs(self, todo: list[tuple[PlanSpec, str]], total: int
                     ) -> tuple[list[dict[str, Any]], list[dict], list[dict]]:
        """The report's runs in grid order, and the metrics of each distinct (mode, kept set) run and its
        other-domain run: plans with the same kept experts share one run (the same metrics object)."""
        runs: list[dict[str, Any]] = []
        shared: dict[tuple[str, str], dict] = {}
        shared_other: dict[tuple[str, str], dict] = {}
        t0 = time.perf_counter()
        for done, (spec, mode) in enumerate(todo, start=2):
            # uniform runs on the baseline's own calibration (`uniform_phase`), reported beside the plan
            baseline = self.uniform_specs.get((spec.criterion, spec.ratio), spec)
            run_spec = baseline if mode == "uniform" else spec
            key = (mode, run_spec.kept_key)
            if key not in shared:
                shared[key] = self._metrics(self.run_cache.generate(mode, run_spec))
                if self.other_samples:
                    shared_other[key] = self._other_metrics(mode, run_spec)
                elapsed = time.perf_counter() - t0
                eta = elapsed / (done - 1) * (total - done)
                self._say(done, total, mode, run_spec, shared[key], f"elapsed {elapsed / 60:.1f} min, ETA "
                          f"{eta / 60:.1f} min", other=shared_other.get(key))
            else:
                self.console.print(f"[{done}/{total}] {mode:8s} {spec.label}: same kept experts as an "
                                   "earlier plan, reusing its run")
            runs.append({"mode": mode, "criterion": spec.criterion, "ratio": spec.ratio, "phase": spec.phase,
                         "label": spec.label, "plan": run_spec.path, "kept_key": run_spec.kept_key,
                         "kept_per_layer": run_spec.plan.num_kept if run_spec.plan.is_uniform else None,
                         **({"calibrated_on": run_spec.phase} if run_spec is not spec else {}),
                         "metrics": shared[key]})
            if key in shared_other:
                runs[-1]["other_metrics"] = shared_other[key]
        return runs, list(shared.values()), list(shared_other.values())

    def _say(self, done: int, total: int, mode: str, spec: PlanSpec | None, m: dict[str, Any],
             extra: str = "", other: dict[str, Any] | None = None) -> None:
        kl = m.get("kl_mean")
        tr = (m.get("traffic") or {}).get("distinct_experts_per_layer_step")
        took = "cached" if m.get("cached") else f"{m['seconds'] + m.get('kl_seconds', 0):.1f}s"
        self.console.print(
            f"[{done}/{total}] {mode:8s} {spec.label if spec else '-':22s} acc {m['accuracy']:.1%} "
            f"[{m['accuracy_ci_low']:.0%}, {m['accuracy_ci_high']:.0%}]  len {m['length_mean']:.1f}  "
            f"EM {m['exact_match']:.0%}  KL {'-' if kl is None else f'{kl:.3f}'}  "
            f"experts/step {'-' if tr is None else f'{tr:.1f}'}  "
            + (f"other domains {other['accuracy']:.1%}  " if other else "")
            + f"({took}{'; ' + extra if extra else ''})", soft_wrap=True)

    # ----- report ----------------------------------------------------------------------------------------
    def write(self, report: dict[str, Any]) -> None:
        write_report(report, self.out_dir, self.config.plots, self.console)

    def close(self) -> None:
        self.run_cache.close()


def run_eval(models: Sequence[str | Path], config: EvalConfig, console=None) -> list[dict[str, Any]]:
    """The sweep for every model; with several models each gets out_dir/<name>/ plus an index.md."""
    from rich.console import Console

    from slimwise.evaluation.report import write_index

    config.validate()
    console = console or Console()
    labels = [model_label(m) for m in models]
    if len(set(labels)) != len(labels):
        raise SlimWiseError(f"models {labels} share a directory name; their reports would overwrite each "
                            "other")
    out = Path(config.out_dir)
    reports = []
    t0 = time.perf_counter()
    for model in models:
        target = out / model_label(model) if len(models) > 1 else out
        sweep = Sweep(model, config, target, console)
        try:
            reports.append(sweep.run())
        finally:
            sweep.close()
    if len(models) > 1:
        write_index(reports, out, [model_label(m) for m in models])
    console.print(f"eval done in {time.perf_counter() - t0:.0f}s on {os.cpu_count()} CPUs "
                  f"({torch.get_num_threads()} torch threads)")
    return reports
