"""`slimwise demo`: the main job on the embedded default model, end to end in a few minutes.

decode-aware calibration on the testbed's target domain -> REAP plan at 50% -> pruned checkpoint export
-> full / uniform / SlimWise generation on test problems -> table + JSON / Markdown report + plots.
The default model is the shipped testbed-a (slimwise/testbed/checkpoints/qwen3moe-a).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from slimwise.argtypes import integer
from slimwise.evaluation import EvalConfig, Sweep
from slimwise.evaluation.report import console_table
from slimwise.export_stream import export_checkpoint
from slimwise.load_options import DeviceOptions
from slimwise.models import resolve_model_dir
from slimwise.testbed import TARGET_DOMAIN, families_in_domain

MODES = ("full", "uniform", "slimwise")
#: `slimwise demo`'s --help order
DEMO_OPTIONS = ("out", "samples", "seed", "device", "max_memory")


@dataclass
class DemoConfig(DeviceOptions):
    """`slimwise demo`'s options (its fields declare them); the defaults are `run_demo`'s."""

    out: str = field(default="runs/demo", metadata={"help": "where to write the report"})
    samples: int = field(default=64, metadata={"type": integer(1), "help": "test prompts per mode"})
    seed: int = field(default=0, metadata={"type": integer(0), "help": None})  # shown without a help line


def run_demo(out_dir: str | Path = DemoConfig.out, samples: int = DemoConfig.samples,
             seed: int = DemoConfig.seed, ratio: float = 0.5, criterion: str = "reap",
             model: str | Path | None = None, max_new_tokens: int = 160, batch_size: int = 32,
             threads: int | None = 1, **overrides) -> dict:
    """Calibrate (decode phase), plan, export, evaluate full / uniform / SlimWise; print and save the report.
    The uniform baseline prunes with the same criterion and ratio calibrated on whole sequences
    (`EvalConfig.uniform_phase`), as classic pruners calibrate.

    One torch thread by default: the testbed models are too small to gain from more, and on a shared box extra
    threads only contend (docs/history/measurement-notes.md). `overrides` go to EvalConfig.
    """
    console = Console()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model_dir = Path(model) if model is not None else resolve_model_dir("testbed-a")
    per_family = math.ceil(samples / len(families_in_domain(TARGET_DOMAIN)))
    config = EvalConfig(
        criteria=(criterion,),
        ratios=(ratio,),
        phases=("decode",),
        modes=MODES,
        n_per_family=per_family,
        max_samples=samples,
        seed=seed,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        out_dir=str(out_dir),
        cache=False,
        headline=(criterion, ratio, "decode"),
        threads=threads,
        calib_mixes=(),
        other_per_family=per_family,
        **overrides,
    )
    console.rule("[bold]1/4 load")
    sweep = Sweep(model_dir, config, out_dir, console)
    console.print(
        f"model: {model_dir} ({sum(p.numel() for p in sweep.model.parameters()) / 1e6:.1f}M parameters, "
        f"{sweep.adapter.num_experts(sweep.model.config)} experts, "
        f"top-{sweep.adapter.top_k(sweep.model.config)}); {len(sweep.samples)} {TARGET_DOMAIN} test problems"
    )

    console.rule("[bold]2/4 decode-aware calibration and plan")
    spec = sweep.build_plans()[0]
    plan = spec.plan
    export_checkpoint(model_dir, plan, out_dir / "pruned", force=True)
    console.print(
        f"plan: {criterion} at {ratio:.0%} keeps {plan.num_kept}/{plan.num_experts} experts per layer "
        f"({spec.path}); pruned checkpoint in {out_dir / 'pruned'}"
    )

    console.rule("[bold]3/4 generate full / uniform / SlimWise")
    report = sweep.run([spec])
    sweep.close()

    console.rule("[bold]4/4 result")
    Console(width=max(console.width, 130)).print(
        console_table(
            report,
            f"SlimWise demo: {criterion} {ratio:.0%} on {report['tasks']['n']} {TARGET_DOMAIN} test problems",
        )
    )
    if report.get("other_domains"):
        od = report["other_domains"]
        acc = {r["mode"]: r["other_metrics"]["accuracy"] for r in report["runs"] if "other_metrics" in r}
        console.print(f"outside {TARGET_DOMAIN} ({od['n']} problems of {', '.join(od['domains'])}): full "
                      f"{od['full']['accuracy']:.1%}, " + ", ".join(f"{m} {a:.1%}" for m, a in acc.items())
                      + f" -- a plan calibrated on {TARGET_DOMAIN} costs the other domains this much")
    report["demo_seconds_total"] = round(time.perf_counter() - t0, 1)
    console.print(
        f"report: {out_dir / 'report.md'} (+ report.json, plots)  total {report['demo_seconds_total']}s"
    )
    return report
