"""`slimwise demo`: the main job on the embedded default model, end to end in a few minutes.

decode-aware calibration on the testbed's target domain -> REAP plan at 50% -> pruned checkpoint export
-> full / uniform / SlimWise generation on test problems -> table + JSON/Markdown report.
When no trained testbed model is shipped yet, a small random Qwen3-MoE is built so the pipeline still runs
(its accuracies are then meaningless; the fidelity columns are not).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from slimwise.calibrate import CalibrationConfig, calibrate
from slimwise.criteria import plan_from_stats
from slimwise.embedded import embedded_model_dir
from slimwise.evaluation import GradedSample, evaluate_modes
from slimwise.export import export_pruned
from slimwise.generate import GenerationConfig, PhaseSplitEngine
from slimwise.models import load_model, load_tokenizer
from slimwise.testbed import TARGET_DOMAIN, build_tokenizer, grade, make_split
from slimwise.tiny import save_tiny_model

MODES = ("full", "uniform", "slimwise")


def _default_model(out_dir: Path, console: Console) -> Path:
    embedded = embedded_model_dir("testbed-a")
    if embedded is not None:
        return embedded
    path = out_dir / "random-qwen3moe"
    if not (path / "config.json").is_file():
        console.print("[yellow]no trained testbed model is shipped yet: building a random Qwen3-MoE "
                      "(accuracy will be ~0; fidelity columns still show the method)[/]")
        save_tiny_model("qwen3_moe", path, initializer_range=0.15, vocab_size=256, num_experts=32,
                        num_experts_per_tok=4, num_hidden_layers=4)
        build_tokenizer(path)
    return path


def run_demo(out_dir: str | Path = "runs/demo", samples: int = 64, seed: int = 0, ratio: float = 0.5,
             criterion: str = "reap") -> dict:
    console = Console()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model_dir = _default_model(out_dir, console)
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    console.print(f"model: {model_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)")

    calib = make_split("calib", 16, seed=seed, domain=TARGET_DOMAIN)
    stats = calibrate(model, [s.prompt for s in calib], tokenizer,
                      CalibrationConfig(phase="decode", max_new_tokens=128, seed=seed))
    plan = plan_from_stats(stats, criterion, ratio)
    plan.save(out_dir / "plan.json")
    export_pruned(load_model(model_dir), plan, out_dir / "pruned", source_dir=model_dir, force=True)
    console.print(f"plan: {criterion} at {ratio:.0%} keeps {plan.num_kept}/{plan.num_experts} experts per layer; "
                  f"pruned checkpoint in {out_dir / 'pruned'}")

    per_family = max(1, samples // 5)
    test = make_split("test", per_family, seed=seed, domain=TARGET_DOMAIN)[:samples]
    graded = [GradedSample(s.prompt, s.answer, s.family, s.to_dict()) for s in test]
    engine = PhaseSplitEngine(model, tokenizer, plan=plan)
    config = GenerationConfig(max_new_tokens=160, batch_size=32, seed=seed, progress=True)
    report = evaluate_modes(engine, graded, MODES, config,
                            grader=lambda s, g: grade(s.raw, g.text or "", g.finish_reason == "eos").correct)
    engine.close()

    table = Table(title=f"SlimWise demo: {criterion} {ratio:.0%} on {len(graded)} {TARGET_DOMAIN} test problems")
    for col in ("mode", "accuracy (95% CI)", "mean len", "EOS %", "len ratio vs full", "exact match vs full", "sec"):
        table.add_column(col, justify="right")
    for mode in MODES:
        m = report[mode]
        table.add_row(mode, f"{m['accuracy']:.1%} ({m['accuracy_ci_low']:.0%}-{m['accuracy_ci_high']:.0%})",
                      f"{m['length_mean']:.1f}", f"{m['eos_share']:.0%}", f"{m['length_ratio_mean']:.2f}",
                      f"{m['exact_match']:.0%}", f"{m['seconds']:.1f}")
    console.print(table)
    summary = {"model": str(model_dir), "criterion": criterion, "ratio": ratio, "samples": len(graded),
               "calibration_tokens": stats.tokens.tolist(), "modes": report,
               "seconds_total": round(time.perf_counter() - t0, 1)}
    (out_dir / "report.json").write_text(json.dumps(summary, indent=1))
    console.print(f"report: {out_dir / 'report.json'}  (total {summary['seconds_total']}s)")
    return summary
