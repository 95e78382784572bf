"""report.json's content, assembled from a finished sweep's runs, and the files written from it.

Invariants: the report's keys, their order and their shapes are the report.json schema (`SCHEMA`) that
`slimwise.evaluation.report` renders and that committed reports are re-rendered from. Comparisons are paired
bootstraps over the same samples with the sweep's `seed` and `n_boot`, so a report's intervals reproduce.
Plots are written before report.json, so that its "plots" lists them, and report.json (atomically) before
report.md.
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from slimwise.engines.reference import GenerationConfig
from slimwise.evaluation.config import SCHEMA, EvalConfig
from slimwise.evaluation.evaluated_model import EvaluatedModel
from slimwise.evaluation.metrics import holm, paired_difference, significant
from slimwise.evaluation.samples import GradedSample, domain_of
from slimwise.io import atomic_write_text, dumps_compact

# (a, b): every plan with both modes gets a paired bootstrap of a - b
MODE_PAIRS = (("slimwise", "uniform"), ("distilled", "slimwise"), ("distilled", "uniform"))
DISTILLED_KEYS = ("mode", "params", "plan_hash", "steps", "trainable_params", "trainable_share", "seconds")


def paired_comparisons(full_metrics: dict, runs: list[dict], n_boot: int, seed: int,
                       key: str = "metrics") -> list[dict]:
    """Paired accuracy differences per plan: slimwise - uniform and each pruned mode - full, on the main
    sample (`key` "metrics") or on the other-domain problems ("other_metrics")."""
    by_plan: dict[str, dict[str, dict]] = {}
    for r in runs:
        if key in r:
            by_plan.setdefault(r["label"], {})[r["mode"]] = r[key]
    out = []
    for label, modes in by_plan.items():
        any_run = next(r for r in runs if r["label"] == label)
        row = {"label": label, "criterion": any_run["criterion"], "ratio": any_run["ratio"],
               "phase": any_run["phase"]}
        for mode, m in modes.items():
            row[f"{mode}_minus_full"] = paired_difference(m["correct"], full_metrics["correct"], n_boot, seed)
        for a, b in MODE_PAIRS:
            if a in modes and b in modes:
                row[f"{a}_minus_{b}"] = paired_difference(modes[a]["correct"], modes[b]["correct"], n_boot,
                                                          seed)
        out.append(row)
    # the table is one family: every paired difference in it gets its Holm-adjusted exact p
    cells = [d for row in out for k, d in row.items() if "_minus_" in k]
    for d, p in zip(cells, holm([d["p_exact"] for d in cells]), strict=True):
        d["p_holm"] = p
    return out



def model_section(subject: EvaluatedModel) -> dict[str, Any]:
    model, adapter = subject.model, subject.adapter
    layers = adapter.moe_layers(model)
    return {"name": subject.name, "path": str(subject.path), "family": adapter.family,
            "parameters": sum(p.numel() for p in model.parameters()),
            "num_experts": adapter.num_experts(model.config),
            "top_k": adapter.top_k(model.config), "moe_layers": len(layers),
            "expert_bytes": int(adapter.expert_bytes(layers[0].experts)) if layers else 0,
            "fingerprint": subject.fingerprint}


def tasks_section(config: EvalConfig, samples: Sequence[GradedSample], domain: str | None) -> dict[str, Any]:
    families = sorted({s.family for s in samples})
    return {"source": config.data or "testbed", "split": None if config.data else config.split,
            "domain": None if config.data or config.families else domain, "grader": config.grader,
            "n": len(samples), "families": families,
            "per_family": {f: sum(s.family == f for s in samples) for f in families}}


def environment_section() -> dict[str, Any]:
    return {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


def other_domains_section(other_samples: Sequence[GradedSample], other_full: dict | None, runs: list[dict],
                          n_boot: int, seed: int) -> dict[str, Any] | None:
    if other_full is None:
        return None
    return {"domains": list(dict.fromkeys(domain_of(s) for s in other_samples)),
            "n": len(other_samples),
            "per_family": {f: sum(s.family == f for s in other_samples)
                           for f in dict.fromkeys(s.family for s in other_samples)},
            "full": other_full,
            "comparisons": paired_comparisons(other_full, runs, n_boot, seed, "other_metrics")}


def distilled_section(config: EvalConfig, delta: Any) -> dict[str, Any] | None:
    if delta is None:
        return None
    return {"path": str(config.distilled), **{k: delta.manifest.get(k) for k in DISTILLED_KEYS}}


def summary_section(comparisons: list[dict], full_metrics: dict, n: int) -> dict[str, Any]:
    """Counts of plans where SlimWise beats, loses to or ties uniform (`significant`)."""
    sw = [c["slimwise_minus_uniform"] for c in comparisons if "slimwise_minus_uniform" in c]
    return {
        "plans": len(comparisons),
        "slimwise_better": sum(significant(c, 1) for c in sw),
        "slimwise_worse": sum(significant(c, -1) for c in sw),
        "no_significant_difference": sum(not significant(c, 1) and not significant(c, -1) for c in sw),
        "slimwise_higher_point_estimate": sum(c["diff"] > 0 for c in sw),
        "slimwise_lower_point_estimate": sum(c["diff"] < 0 for c in sw),
        "full_accuracy": full_metrics["accuracy"],
        "accuracy_ci_halfwidth_at_half": 1.96 * math.sqrt(0.25 / max(n, 1)),
    }


def assemble_report(*, config: EvalConfig, subject: EvaluatedModel, samples: Sequence[GradedSample],
                    other_samples: Sequence[GradedSample], domain: str | None, gen_config: GenerationConfig,
                    calibration: dict[str, dict], delta: Any, timing: dict[str, float], full_metrics: dict,
                    runs: list[dict], other_full: dict | None = None) -> dict[str, Any]:
    """The whole report of one model's sweep (plots filled in by `write_report`)."""
    comparisons = paired_comparisons(full_metrics, runs, config.n_boot, config.seed)
    return {
        "schema": SCHEMA,
        "model": model_section(subject),
        "config": {**asdict(config), "headline": list(config.headline)},
        "tasks": tasks_section(config, samples, domain),
        "generation": {"max_new_tokens": gen_config.max_new_tokens, "batch_size": gen_config.batch_size,
                       "temperature": gen_config.temperature, "engine": config.engine,
                       "dtype": subject.dtype},
        "environment": environment_section(),
        "calibration": calibration,
        "other_domains": other_domains_section(other_samples, other_full, runs, config.n_boot, config.seed),
        "distilled": distilled_section(config, delta),
        "timing": {k: round(v, 2) for k, v in timing.items()},
        "full": full_metrics,
        "runs": runs,
        "comparisons": comparisons,
        "summary": summary_section(comparisons, full_metrics, len(samples)),
        "plots": [],
    }


def write_report(report: dict[str, Any], out_dir: Path, plots: bool, console) -> None:
    """Plots (when on), report.json and report.md in out_dir."""
    from slimwise.evaluation.plots import write_plots
    from slimwise.evaluation.report import write_markdown

    if plots:
        report["plots"] = write_plots(report, out_dir)
    atomic_write_text((out_dir / "report.json"), dumps_compact(report) + "\n")
    write_markdown(report, out_dir / "report.md")
    console.print(f"report: {out_dir / 'report.md'}, {out_dir / 'report.json'}"
                  + (f", {len(report['plots'])} plots" if report["plots"] else "")
                  + f"  (total {report['timing']['total_s']:.0f}s on {torch.get_num_threads()} threads)",
                  soft_wrap=True)
