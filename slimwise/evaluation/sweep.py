"""The sweep: evaluation of full / uniform / SlimWise decoding: accuracy, generation length, fidelity, decode traffic.

Accuracy alone hides pruning-induced length changes and drift from the full model, so every run reports,
per task family and overall:
  - accuracy with a 95% bootstrap interval (and a paired bootstrap of SlimWise minus uniform);
  - generated length (mean, median, p90), EOS and truncation shares, per-sample length ratio to full;
  - fidelity to the full model: whole-output exact match, first differing position, and teacher-forced
    KL(full || mode) over the full model's own continuations;
  - decode traffic: distinct experts touched per MoE layer per decode step at the eval batch size (router
    hooks), the expert bytes that implies, and the uniform-routing expectation E(1-(1-k/E)^B) beside it.

The metric functions are pure and hand-checkable; `Sweep` drives criterion x ratio x calibration-phase
grids (calibrate once per phase, plans from cached stats, `full` generated once, runs cached on disk so an
interrupted sweep resumes). `slimwise.evaluation.report` turns the result into Markdown and PNG plots.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from slimwise.adapters import get_adapter
from slimwise.delta import Delta, plan_hash
from slimwise.engines.reference import Generation, GenerationConfig, PhaseSplitEngine
from slimwise.errors import SlimWiseError
from slimwise.evaluation.config import (
    KL_REFERENCE_BYTES,
    SCHEMA,
    EvalConfig,
    PlanSpec,
    calib_mix_label,
    parse_calib_mix,
)
from slimwise.evaluation.metrics import (
    accuracy_metrics,
    paired_difference,
    teacher_forced_kl,
)
from slimwise.evaluation.reference_traffic import DecodeTrafficMeter
from slimwise.evaluation.runs import (
    active_experts,
    close_engine,
    make_engine,
    run_metrics,
)
from slimwise.evaluation.samples import domain_of, load_samples, make_grader
from slimwise.fingerprint import memory_fingerprint, model_fingerprint
from slimwise.io import atomic_write_text, dumps_compact
from slimwise.plan import PrunePlan


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _gen_to_json(g: Generation) -> dict:
    return {"token_ids": g.token_ids, "finish_reason": g.finish_reason, "text": g.text}


def _gen_from_json(d: dict, prompt_ids: list[int]) -> Generation:
    return Generation(prompt_ids, list(d["token_ids"]), d["finish_reason"], d.get("text"))


def model_label(model: str | Path) -> str:
    """A short directory-safe name: the embedded name as given, else the directory name."""
    return Path(str(model)).name or str(model)


class Sweep:
    """One model through the grid: samples, calibration per phase, plans, full once, then every plan's runs.

    Runs are cached under out_dir/cache keyed by model fingerprint, prompts, generation settings, mode and
    kept-expert sets, so a rerun (or an interrupted sweep) only computes what is missing.
    """

    def __init__(self, model: str | Path, config: EvalConfig, out_dir: str | Path | None = None, console=None):
        from rich.console import Console

        from slimwise.models import load_model, load_tokenizer, resolve_model_dir

        config.validate()
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        self.console = console or Console()
        self.out_dir = Path(out_dir or config.out_dir)
        self.cache_dir = Path(config.cache_dir) / model_label(model) if config.cache_dir else self.out_dir / "cache"
        self.model_name = model_label(model)
        self.model_dir = resolve_model_dir(model)
        t0 = time.perf_counter()
        # "auto": the dtype this CPU runs fastest (slimwise.hardware): vLLM's for engine vllm, which the reference
        # matches; for the HF engine float32 where bf16 would be emulated (4x slower on an AVX2-only CPU)
        from slimwise.hardware import resolve_dtype

        self.model = load_model(self.model_dir, dtype=resolve_dtype(config.dtype, self.model_dir, engine=config.engine)[0])
        self.dtype = str(self.model.dtype).removeprefix("torch.")  # what ran: every cache key holds it
        self.tokenizer = load_tokenizer(self.model_dir)
        self.adapter = get_adapter(self.model.config)
        self.fingerprint = memory_fingerprint(model_fingerprint(self.model))  # cache keys: stable across versions
        self.timing: dict[str, float] = {"load_s": time.perf_counter() - t0}
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
        self._other_full: dict[str, Any] | None = None
        self.gen_config = GenerationConfig(max_new_tokens=config.max_new_tokens, batch_size=config.batch_size,
                                           seed=config.seed, progress=config.progress)
        self.calibration: dict[str, dict] = {}
        self._kl_reference: dict[int, torch.Tensor] = {}
        self._full: list[Generation] | None = None
        # vLLM: one engine per plan serves full, slimwise and uniform (mode switched in place): (kept_key, engine)
        self._vllm: tuple[str | None, Any] | None = None
        self._first_spec: PlanSpec | None = None  # the plan whose engine also runs mode full
        self.delta = Delta.load(config.distilled) if config.distilled else None
        self.modes = [m for m in dict.fromkeys([*config.modes, *(["distilled"] if self.delta else [])]) if m != "full"]
        # explicit plans, given stats and calibration prompts are read (and plans checked against the model) now,
        # so a bad one is refused before the output directory exists
        for path in config.plans:
            PrunePlan.load(path).check_model(self.model, self.adapter)
        if config.stats:
            from slimwise.stats import ExpertStats

            for path in config.stats:
                ExpertStats.load(path)
        if config.calib_data:
            self._calibration_prompts()
        # created only once every input loaded: a missing model or unreadable data leaves no empty directory behind
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def _delta_fits(self, spec: PlanSpec) -> bool:
        """A delta belongs to one plan (same kept experts on the same weights): mode distilled runs only there."""
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
    def _calibration_prompts(self, mix: str | None = None) -> tuple[list[str], str]:
        """The calibration prompts and a description. `mix` ("all" or "domain:weight,..."): each domain's families
        get calib_per_family x weight / (the largest weight) prompts each."""
        cfg = self.config
        if cfg.calib_data:
            from slimwise.data import load_prompts

            return load_prompts(cfg.calib_data), str(cfg.calib_data)
        from slimwise.testbed import TARGET_DOMAIN, make_split

        if mix is not None:
            weights = parse_calib_mix(mix)
            top = max(weights.values())
            per = {d: max(1, round(cfg.calib_per_family * w / top)) for d, w in weights.items()}
            prompts = [s.prompt for d, n in per.items() for s in make_split("calib", n, seed=cfg.calib_seed, domain=d)]
            return prompts, "testbed calib split, " + ", ".join(f"{d} {n}/family" for d, n in per.items())
        domain = cfg.calib_domain or TARGET_DOMAIN  # the deployment's domain, whatever is evaluated
        calib = make_split("calib", cfg.calib_per_family, seed=cfg.calib_seed, domain=None if domain == "all" else domain)
        return [s.prompt for s in calib], f"testbed calib split, {domain}, {cfg.calib_per_family}/family"

    def calibrate(self, phase: str, mix: str | None = None):
        """Stats for `phase` (on calibration mix `mix`, else the calibration domain), from out_dir/cache when they
        match this model and calibration setup."""
        from slimwise.calibrate import CalibrationConfig, calibrate
        from slimwise.stats import ExpertStats

        prompts, source = self._calibration_prompts(mix)
        ccfg = CalibrationConfig(phase=phase, max_new_tokens=self.config.calib_max_new_tokens, seed=self.config.calib_seed,
                                 batch_size=self.config.batch_size)
        key = _digest({"fp": self.fingerprint, "prompts": prompts, "config": asdict(ccfg), "dtype": self.dtype})
        path = self.cache_dir / f"stats-{phase}-{key}.safetensors"
        if self.config.cache and path.is_file():
            stats = ExpertStats.load(path)
            cached = True
        else:
            stats = calibrate(self.model, prompts, self.tokenizer, ccfg, progress=self.config.progress)
            stats.meta["data"] = source
            stats.save(path)
            cached = False
        self.calibration[phase if mix is None else f"{phase}@{calib_mix_label(mix)}"] = {
                                   "stats": str(path), "cached": cached, "prompts": len(prompts), "source": source,
                                   "tokens_counted": float(stats.tokens[0]) if len(stats.tokens) else 0.0,
                                   "seconds": 0.0 if cached else float(stats.meta.get("seconds", 0.0)),
                                   "original_seconds": float(stats.meta.get("seconds", 0.0))}
        return stats

    def build_plans(self) -> list[PlanSpec]:
        """Explicit plans, or criterion x ratio for each calibration phase (stats computed or cached once)."""
        from slimwise.criteria import plan_from_stats
        from slimwise.stats import ExpertStats

        cfg = self.config
        specs: list[PlanSpec] = []
        if cfg.plans:
            for p in cfg.plans:
                plan = PrunePlan.load(p)
                plan.check_model(self.model, self.adapter)
                label = f"{plan.criterion}-{plan.phase or 'na'}-{plan.ratio:g}"
                if any(sp.label == label for sp in specs):
                    label = f"{label}-{Path(p).stem}"
                specs.append(PlanSpec(label, plan, plan.criterion, plan.ratio, plan.phase, str(p)))
            return specs
        t0 = time.perf_counter()
        stats_by_phase = {}
        for s in cfg.stats:
            stats = ExpertStats.load(s)
            phase = stats.meta.get("config", {}).get("phase", "unknown")
            stats_by_phase[phase] = stats
            self.calibration[phase] = {"stats": str(s), "cached": True, "source": stats.meta.get("data"),
                                       "tokens_counted": float(stats.tokens[0]), "seconds": 0.0}
        for phase in cfg.phases if not cfg.stats else ():  # given stats replace calibration
            self.console.print(f"[bold]calibrating[/] ({phase} phase)")
            stats_by_phase[phase] = self.calibrate(phase)
        plan_dir = self.out_dir / "plans"
        for phase in stats_by_phase:
            for criterion in cfg.criteria:
                for ratio in cfg.ratios:
                    plan = plan_from_stats(stats_by_phase[phase], criterion, ratio, scope=cfg.scope)
                    plan.check_model(self.model, self.adapter)
                    label = f"{criterion}-{phase}-{ratio:g}"
                    path = plan.save(plan_dir / f"{label}.json")
                    specs.append(PlanSpec(label, plan, criterion, ratio, phase, str(path)))
        specs += self._mix_plans(plan_dir)
        self.timing["calibration_s"] = time.perf_counter() - t0
        return specs

    def _mix_plans(self, plan_dir: Path) -> list[PlanSpec]:
        """Plans of the headline criterion and phase, at every ratio, calibrated on each mixed-domain calibration
        (`calib_mixes`). Their reported phase is "<phase>@<mix>" (e.g. "decode@all"), so tables and plots show
        them as calibrations of their own."""
        from slimwise.criteria import plan_from_stats

        cfg = self.config
        criterion, _, phase = cfg.headline
        if cfg.stats or cfg.calib_data or criterion not in cfg.criteria or phase not in cfg.phases:
            return []
        specs = []
        for mix in cfg.calib_mixes:
            name = calib_mix_label(mix)
            if name == (cfg.calib_domain or ""):  # "all" as the main calibration domain already
                continue
            self.console.print(f"[bold]calibrating[/] ({phase} phase, mix {mix})")
            stats = self.calibrate(phase, mix)
            for ratio in cfg.ratios:
                plan = plan_from_stats(stats, criterion, ratio, scope=cfg.scope)
                plan.check_model(self.model, self.adapter)
                label = f"{criterion}-{phase}@{name}-{ratio:g}"
                path = plan.save(plan_dir / f"{label}.json")
                specs.append(PlanSpec(label, plan, criterion, ratio, f"{phase}@{name}", str(path)))
        return specs

    # ----- runs ------------------------------------------------------------------------------------------
    def _run_key(self, mode: str, spec: PlanSpec | None, other: bool = False) -> str:
        g = self.gen_config
        delta = _digest(self.delta.manifest) if mode == "distilled" and self.delta is not None else None
        return _digest({"fp": self.fingerprint, "prompts": self.other_prompt_ids if other else self.prompt_ids,
                        "mode": mode, "engine": self.config.engine, "dtype": self.dtype, "delta": delta,
                        "kept": spec.kept_key if spec else None, "max_new": g.max_new_tokens, "bs": g.batch_size,
                        "t": g.temperature, "seed": g.seed, "kl": self.config.kl and not other,
                        "traffic": self.config.traffic and not other})

    def _generate(self, mode: str, spec: PlanSpec | None, other: bool = False) -> dict[str, Any]:
        """Generations (+ traffic, KL, seconds) of one mode and plan, from the run cache when present. `other`: the
        other-domain problems (accuracy and lengths only: no traffic, no KL)."""
        key = self._run_key(mode, spec, other)
        prompt_ids = self.other_prompt_ids if other else self.prompt_ids
        path = self.cache_dir / f"run-{mode}-{key}.json"
        if self.config.cache and path.is_file():
            rec = json.loads(path.read_text())
            rec["gens"] = [_gen_from_json(d, p) for d, p in zip(rec["gens"], prompt_ids, strict=True)]
            rec["cached"] = True
            return rec
        plan = spec.plan if spec else None
        engine, owned = self._engine(mode, spec)
        hf = isinstance(engine, PhaseSplitEngine)
        meter = DecodeTrafficMeter(self.model, active_experts(plan, mode), self.config.batch_size) \
            if self.config.traffic and hf and not other else None
        try:
            t0 = time.perf_counter()
            if hf:
                gens = engine.generate(prompt_ids, mode=mode, config=self.gen_config, observer=meter)
            else:
                gens = engine.generate(prompt_ids, mode, self.gen_config)
            seconds = time.perf_counter() - t0
        finally:
            if meter is not None:
                meter.remove()
            if owned:
                close_engine(engine)
        if self.tokenizer is not None:
            for g in gens:
                if g.text is None:
                    g.text = self.tokenizer.decode(g.token_ids[:-1] if g.finish_reason == "eos" else g.token_ids)
        rec = {"gens": gens, "seconds": seconds, "traffic": meter.summary() if meter else None, "kl": None}
        rec["kl_seconds"] = 0.0
        if self.config.kl and not other and mode != "full":
            t0 = time.perf_counter()
            rec["kl"] = self._kl(mode, plan)
            rec["kl_seconds"] = time.perf_counter() - t0
        elif self.config.kl and not other:
            rec["kl"] = [0.0] * len(gens)
        if self.config.cache:
            atomic_write_text(path, json.dumps({**rec, "gens": [_gen_to_json(g) for g in gens]}))
        rec["cached"] = False
        return rec

    def _kl(self, mode: str, plan: PrunePlan | None) -> list[float]:
        engine = make_engine("hf", self.model, self.tokenizer, plan, None, self.delta if mode == "distilled" else None)
        conts = [g.token_ids for g in self.full()]
        vocab = int(getattr(self.adapter.text_config(self.model.config), "vocab_size", 0) or 0)
        # keep the full model's log-probs across plans only while they are small (testbed vocabularies)
        reference = self._kl_reference if vocab * sum(map(len, conts)) * 4 <= KL_REFERENCE_BYTES else None
        try:
            return teacher_forced_kl(engine, self.prompt_ids, conts, mode, self.config.kl_batch_size, reference)
        finally:
            engine.close()

    def _engine(self, mode: str, spec: PlanSpec | None) -> tuple[Any, bool]:
        """The engine for one run and whether the caller closes it. vLLM engines are kept across the modes of a
        plan (full runs on the first plan's engine): one engine start per plan instead of one per run."""
        delta = self.delta if mode == "distilled" else None
        if self.config.engine != "vllm" or delta is not None:
            return make_engine(self.config.engine, self.model, self.tokenizer, spec.plan if spec else None,
                               self.model_dir, delta), True
        spec = spec or self._first_spec
        key = spec.kept_key if spec else None
        if self._vllm is None or self._vllm[0] != key:
            self._close_engine()
            self._vllm = (key, make_engine("vllm", self.model, self.tokenizer, spec.plan if spec else None,
                                           self.model_dir, share=True))
        return self._vllm[1], False

    def _close_engine(self) -> None:
        """Stop a kept vLLM engine (its EngineCore process holds the weights and the KV cache)."""
        if self._vllm is not None:
            close_engine(self._vllm[1])
            self._vllm = None

    def full(self) -> list[Generation]:
        if self._full is None:
            self._full_rec = self._generate("full", None)
            self._full = self._full_rec["gens"]
        return self._full

    def _other_metrics(self, mode: str, spec: PlanSpec | None) -> dict[str, Any]:
        """One run's accuracy (overall, per other domain, per family) and lengths on the other-domain problems."""
        if self._other_full is None:
            self._other_full = self._generate("full", None, other=True)
        rec = self._other_full if mode == "full" else self._generate(mode, spec, other=True)
        m = run_metrics(self.other_samples, rec["gens"], self._other_full["gens"], self.grader,
                        self.gen_config.max_new_tokens, None, self.config.seed, self.config.n_boot)
        domains = [domain_of(s) for s in self.other_samples]
        m["by_domain"] = {d: accuracy_metrics([c for c, x in zip(m["correct"], domains, strict=True) if x == d],
                                              self.config.seed, self.config.n_boot) for d in dict.fromkeys(domains)}
        m["seconds"] = rec["seconds"]
        m["cached"] = rec.get("cached", False)
        return m

    def _metrics(self, rec: dict[str, Any]) -> dict[str, Any]:
        m = run_metrics(self.samples, rec["gens"], self.full(), self.grader, self.gen_config.max_new_tokens,
                        rec.get("kl"), self.config.seed, self.config.n_boot)
        m["traffic"] = rec.get("traffic")
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
            raise SlimWiseError(f"the delta {cfg.distilled} was distilled for another plan than any evaluated here: "
                                "pass --plan PLAN, the plan given to `slimwise distill`")
        todo = [(sp, m) for sp in specs for m in modes if m != "distilled" or self._delta_fits(sp)]
        total = 1 + len(todo)
        self.console.print(f"[bold]{self.model_name}[/]: {len(self.samples)} samples, {len(specs)} plans, modes "
                           f"{', '.join(modes)}: {total} runs with full ({len({s.kept_key for s in specs})} distinct "
                           "kept sets)", soft_wrap=True)
        self._first_spec = specs[0] if specs else None
        try:
            return self._run(specs, modes, todo, total, t_start, cpu_start)
        finally:
            self._close_engine()

    def _run(self, specs: list[PlanSpec], modes: list[str], todo: list, total: int, t_start: float,
             cpu_start: float) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.full()
        full_metrics = self._metrics(self._full_rec)
        other_full = self._other_metrics("full", None) if self.other_samples else None
        self.timing["full_s"] = time.perf_counter() - t0
        self._say(1, total, "full", None, full_metrics, other=other_full)
        runs: list[dict[str, Any]] = []
        shared: dict[tuple[str, str], dict] = {}
        shared_other: dict[tuple[str, str], dict] = {}
        done = 1
        t0 = time.perf_counter()
        for spec, mode in todo:
            done += 1
            key = (mode, spec.kept_key)
            if key not in shared:
                shared[key] = self._metrics(self._generate(mode, spec))
                if self.other_samples:
                    shared_other[key] = self._other_metrics(mode, spec)
                elapsed = time.perf_counter() - t0
                eta = elapsed / (done - 1) * (total - done)
                self._say(done, total, mode, spec, shared[key], f"elapsed {elapsed / 60:.1f} min, ETA "
                          f"{eta / 60:.1f} min", other=shared_other.get(key))
            else:
                self.console.print(f"[{done}/{total}] {mode:8s} {spec.label}: same kept experts as an earlier "
                                   "plan, reusing its run")
            runs.append({"mode": mode, "criterion": spec.criterion, "ratio": spec.ratio, "phase": spec.phase,
                         "label": spec.label, "plan": spec.path, "kept_key": spec.kept_key,
                         "kept_per_layer": spec.plan.num_kept if spec.plan.is_uniform else None,
                         "metrics": shared[key]})
            if key in shared_other:
                runs[-1]["other_metrics"] = shared_other[key]
        self.timing["pruned_runs_s"] = time.perf_counter() - t0
        self.timing["total_s"] = time.perf_counter() - t_start + self.timing.get("load_s", 0.0)
        self.timing["process_cpu_s"] = time.process_time() - cpu_start  # > wall when threads run in parallel
        # what the work costs without the cache: original seconds of every distinct run and calibration
        self.timing["uncached_estimate_s"] = (
            sum(m["seconds"] + m.get("kl_seconds", 0.0) for m in [full_metrics, *shared.values()])
            + sum(m["seconds"] for m in [*([other_full] if other_full else []), *shared_other.values()])
            + sum(c.get("original_seconds", c.get("seconds", 0.0)) for c in self.calibration.values())
            + self.timing.get("load_s", 0.0))
        report = self._assemble(full_metrics, runs, other_full)
        self.write(report)
        return report

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
    def _comparisons(self, full_metrics: dict, runs: list[dict], key: str = "metrics") -> list[dict]:
        """Paired accuracy differences per plan: slimwise - uniform and each pruned mode - full, on the main sample
        (`key` "metrics") or on the other-domain problems ("other_metrics")."""
        by_plan: dict[str, dict[str, dict]] = {}
        for r in runs:
            if key in r:
                by_plan.setdefault(r["label"], {})[r["mode"]] = r[key]
        out = []
        n_boot, seed = self.config.n_boot, self.config.seed
        for label, modes in by_plan.items():
            any_run = next(r for r in runs if r["label"] == label)
            row = {"label": label, "criterion": any_run["criterion"], "ratio": any_run["ratio"],
                   "phase": any_run["phase"]}
            for mode, m in modes.items():
                row[f"{mode}_minus_full"] = paired_difference(m["correct"], full_metrics["correct"], n_boot, seed)
            for a, b in (("slimwise", "uniform"), ("distilled", "slimwise"), ("distilled", "uniform")):
                if a in modes and b in modes:
                    row[f"{a}_minus_{b}"] = paired_difference(modes[a]["correct"], modes[b]["correct"], n_boot, seed)
            out.append(row)
        return out

    def _assemble(self, full_metrics: dict, runs: list[dict], other_full: dict | None = None) -> dict[str, Any]:
        cfg = self.config
        params = sum(p.numel() for p in self.model.parameters())
        layers = self.adapter.moe_layers(self.model)
        comparisons = self._comparisons(full_metrics, runs)
        sw = [c["slimwise_minus_uniform"] for c in comparisons if "slimwise_minus_uniform" in c]
        families = sorted({s.family for s in self.samples})
        return {
            "schema": SCHEMA,
            "model": {"name": self.model_name, "path": str(self.model_dir), "family": self.adapter.family,
                      "parameters": params, "num_experts": self.adapter.num_experts(self.model.config),
                      "top_k": self.adapter.top_k(self.model.config), "moe_layers": len(layers),
                      "expert_bytes": int(self.adapter.expert_bytes(layers[0].experts)) if layers else 0,
                      "fingerprint": self.fingerprint},
            "config": {**asdict(cfg), "headline": list(cfg.headline)},
            "tasks": {"source": cfg.data or "testbed", "split": None if cfg.data else cfg.split,
                      "domain": None if cfg.data or cfg.families else self._domain(), "grader": cfg.grader,
                      "n": len(self.samples), "families": families,
                      "per_family": {f: sum(s.family == f for s in self.samples) for f in families}},
            "generation": {"max_new_tokens": self.gen_config.max_new_tokens, "batch_size": self.gen_config.batch_size,
                           "temperature": self.gen_config.temperature, "engine": cfg.engine, "dtype": self.dtype},
            "environment": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "torch": torch.__version__, "python": platform.python_version(),
                            "platform": platform.platform()},
            "calibration": self.calibration,
            "other_domains": None if other_full is None else {
                "domains": list(dict.fromkeys(domain_of(s) for s in self.other_samples)),
                "n": len(self.other_samples),
                "per_family": {f: sum(s.family == f for s in self.other_samples)
                               for f in dict.fromkeys(s.family for s in self.other_samples)},
                "full": other_full, "comparisons": self._comparisons(other_full, runs, "other_metrics")},
            "distilled": None if self.delta is None else {
                "path": str(self.config.distilled),
                **{k: self.delta.manifest.get(k) for k in ("mode", "params", "plan_hash", "steps", "trainable_params",
                                                           "trainable_share", "seconds")}},
            "timing": {k: round(v, 2) for k, v in self.timing.items()},
            "full": full_metrics,
            "runs": runs,
            "comparisons": comparisons,
            "summary": {
                "plans": len(comparisons),
                "slimwise_better": sum(c["ci_low"] > 0 for c in sw),
                "slimwise_worse": sum(c["ci_high"] < 0 for c in sw),
                "no_significant_difference": sum(c["ci_low"] <= 0 <= c["ci_high"] for c in sw),
                "slimwise_higher_point_estimate": sum(c["diff"] > 0 for c in sw),
                "slimwise_lower_point_estimate": sum(c["diff"] < 0 for c in sw),
                "full_accuracy": full_metrics["accuracy"],
                "accuracy_ci_halfwidth_at_half": 1.96 * math.sqrt(0.25 / max(len(self.samples), 1)),
            },
            "plots": [],
        }

    def write(self, report: dict[str, Any]) -> None:
        from slimwise.evaluation.plots import write_plots
        from slimwise.evaluation.report import write_markdown

        if self.config.plots:
            report["plots"] = write_plots(report, self.out_dir)
        atomic_write_text((self.out_dir / "report.json"), dumps_compact(report) + "\n")
        write_markdown(report, self.out_dir / "report.md")
        self.console.print(f"report: {self.out_dir / 'report.md'}, {self.out_dir / 'report.json'}"
                           + (f", {len(report['plots'])} plots" if report["plots"] else "")
                           + f"  (total {report['timing']['total_s']:.0f}s on {torch.get_num_threads()} threads)",
                           soft_wrap=True)

    def close(self) -> None:
        self._close_engine()
        self._kl_reference.clear()


def run_eval(models: Sequence[str | Path], config: EvalConfig, console=None) -> list[dict[str, Any]]:
    """The sweep for every model; with several models each gets out_dir/<name>/ plus an index.md."""
    from rich.console import Console

    from slimwise.evaluation.report import write_index

    config.validate()
    console = console or Console()
    labels = [model_label(m) for m in models]
    if len(set(labels)) != len(labels):
        raise SlimWiseError(f"models {labels} share a directory name; their reports would overwrite each other")
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
