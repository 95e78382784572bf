"""Calibration stats per phase and calibration mix: computed once, cached on disk, recorded for the report.

Invariants: a phase's stats live in `<cache_dir>/stats-<phase>-<key>.safetensors`, the key the digest of the
model fingerprint, the calibration prompts, the CalibrationConfig and the dtype, so another prompt, setting
or precision misses rather than reading stale stats. The calibration prompts follow `calib_seed` only, never
the test `seed`: another test sample keeps the plans. `entries` is the report's "calibration" section, keyed
by phase (or "<phase>@<mix label>") in the order calibrated.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slimwise.evaluation.cache_keys import digest
from slimwise.evaluation.config import EvalConfig, calib_mix_label, parse_calib_mix
from slimwise.evaluation.evaluated_model import EvaluatedModel

if TYPE_CHECKING:
    from slimwise.stats import ExpertStats


def calibration_prompts(config: EvalConfig, mix: str | None = None) -> tuple[list[str], str]:
    """The calibration prompts and a description. `mix` ("all" or "domain:weight,..."): each domain's families
    get calib_per_family x weight / (the largest weight) prompts each."""
    if config.calib_data:
        from slimwise.data import load_prompts

        return load_prompts(config.calib_data), str(config.calib_data)
    from slimwise.testbed import TARGET_DOMAIN, make_split

    per_family, seed = config.calib_per_family, config.calib_seed
    if mix is not None:
        weights = parse_calib_mix(mix)
        top = max(weights.values())
        per = {d: max(1, round(per_family * w / top)) for d, w in weights.items()}
        prompts = [s.prompt for d, n in per.items() for s in make_split("calib", n, seed=seed, domain=d)]
        return prompts, "testbed calib split, " + ", ".join(f"{d} {n}/family" for d, n in per.items())
    domain = config.calib_domain or TARGET_DOMAIN  # the deployment's domain, whatever is evaluated
    calib = make_split("calib", per_family, seed=seed, domain=None if domain == "all" else domain)
    return [s.prompt for s in calib], f"testbed calib split, {domain}, {per_family}/family"


class CalibrationCache:
    """Stats of one model per calibration phase and mix, from `cache_dir` when they match."""

    def __init__(self, config: EvalConfig, subject: EvaluatedModel, cache_dir: Path):
        self.config = config
        self.subject = subject
        self.cache_dir = cache_dir
        self.entries: dict[str, dict[str, Any]] = {}

    def calibrate(self, phase: str, mix: str | None = None) -> ExpertStats:
        """Stats for `phase` on calibration mix `mix` (else the calibration domain)."""
        from slimwise.calibrate import CalibrationConfig, calibrate
        from slimwise.stats import ExpertStats

        cfg, subject = self.config, self.subject
        prompts, source = calibration_prompts(cfg, mix)
        ccfg = CalibrationConfig(phase=phase, max_new_tokens=cfg.calib_max_new_tokens, seed=cfg.calib_seed,
                                 batch_size=cfg.batch_size)
        key = digest({"fp": subject.fingerprint, "prompts": prompts, "config": asdict(ccfg),
                      "dtype": subject.dtype})
        path = self.cache_dir / f"stats-{phase}-{key}.safetensors"
        cached = bool(cfg.cache) and path.is_file()
        if cached:
            stats = ExpertStats.load(path)
        else:
            stats = calibrate(subject.model, prompts, subject.tokenizer, ccfg, progress=cfg.progress)
            stats.meta["data"] = source
            stats.save(path)
        seconds = float(stats.meta.get("seconds", 0.0))
        self.entries[phase if mix is None else f"{phase}@{calib_mix_label(mix)}"] = {
            "stats": str(path), "cached": cached, "prompts": len(prompts), "source": source,
            "tokens_counted": float(stats.tokens[0]) if len(stats.tokens) else 0.0,
            "seconds": 0.0 if cached else seconds, "original_seconds": seconds}
        return stats

    def load_given(self, path: str | Path) -> tuple[str, ExpertStats]:
        """A given stats file (--stats) and the phase it was calibrated in; it replaces calibration."""
        from slimwise.stats import ExpertStats

        stats = ExpertStats.load(path)
        phase = stats.meta.get("config", {}).get("phase", "unknown")
        self.entries[phase] = {"stats": str(path), "cached": True, "source": stats.meta.get("data"),
                               "tokens_counted": float(stats.tokens[0]), "seconds": 0.0}
        return phase, stats
