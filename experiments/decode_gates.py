"""Gate variants and the per-token fallback at 50% on the three testbeds (docs/results/decode-gates.md).

For each backbone, one `slimwise eval` sweep per setting (REAP, decode calibration on arithmetic, 50%, modes
full and slimwise, the target and the other domains), all sharing one calibration and one full-model run
through the eval cache, so every setting prunes with the same plan and is paired with the others on the same
problems:

    python -m experiments.decode_gates --work runs/decode-gates --out docs/results/decode-gates

Settings: the plain gates (renorm, no fallback: the published SlimWise mode), drop, substitute, and each with
a fallback at tau = 0.5, 0.3 and 0.1 (substitute at 0.5). Substitute's vectors come from a second calibration
with the sweep's prompts and settings plus `output_sums`, whose counts must equal the sweep's (so its plan is
the same). Per setting: accuracy (target, other domains) with the paired difference to the
plain setting, mean length and KL against the full model, the share of token-layer pairs that fell back, and
the distinct experts per MoE layer per decode step at batch 32 (what a step reads: the cost side; measured
speed needs `slimwise bench`, which runs synthetic weights whose routing says nothing about fallback shares).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from slimwise.calibrate import CalibrationConfig, calibrate
from slimwise.evaluation.calibration_cache import calibration_prompts
from slimwise.evaluation.config import EvalConfig
from slimwise.evaluation.evaluated_model import load_evaluated_model
from slimwise.evaluation.metrics import paired_difference
from slimwise.evaluation.report import signed_pp
from slimwise.evaluation.sweep import run_eval
from slimwise.hardware import describe, machine_line
from slimwise.io import atomic_write_text
from slimwise.stats import ExpertStats

MODELS = ("testbed-a", "testbed-b", "testbed-c")
SETTINGS = [("renorm", None), ("drop", None), ("renorm", 0.5), ("renorm", 0.3), ("renorm", 0.1),
            ("drop", 0.5), ("drop", 0.3), ("drop", 0.1), ("substitute", None), ("substitute", 0.5)]


def label(gates: str, fallback: float | None) -> str:
    return gates if fallback is None else f"{gates}, fallback {fallback:g}"


def output_sums(model: str, config: EvalConfig, report: dict, work: Path) -> str:
    """The sweep's decode calibration again, with the expert output sums; refuses if the counts differ from
    the sweep's own statistics (then its plan would not be the one evaluated)."""
    path = work / model / "output-sums.safetensors"
    if not path.is_file():
        subject = load_evaluated_model(model, config.dtype, config.engine)
        prompts, _ = calibration_prompts(config, None)
        stats = calibrate(subject.model, prompts, subject.tokenizer, CalibrationConfig(
            phase="decode", max_new_tokens=config.calib_max_new_tokens, seed=config.calib_seed,
            batch_size=config.batch_size, output_sums=True), progress=False)
        if not torch.equal(stats.count, ExpertStats.load(report["calibration"]["decode"]["stats"]).count):
            raise SystemExit(f"{model}: the calibration with output sums counted other selections")
        stats.save(path)
    return str(path)


def one(model: str, gates: str, fallback: float | None, work: Path, threads: int,
        plain_report: dict | None = None) -> tuple[dict, dict]:
    """The sweep's slimwise run (and the full model's) for one setting, from its report."""
    tag = f"{gates}-{'none' if fallback is None else f'{fallback:g}'}"
    config = EvalConfig(criteria=("reap",), ratios=(0.5,), phases=("decode",), modes=("full", "slimwise"),
                        calib_mixes=(), gates=gates, fallback=fallback, plots=False, threads=threads,
                        out_dir=str(work / model / tag), cache_dir=str(work / "cache"), progress=False)
    if gates == "substitute":  # the vectors come from the plain sweep's calibration, made first
        config.substitutes = output_sums(model, config, plain_report, work)
    t0 = time.perf_counter()
    report = run_eval([model], config)[0]
    run = next(r for r in report["runs"] if r["mode"] == "slimwise")
    m, other = run["metrics"], run["other_metrics"]
    return {"model": model, "gates": gates, "fallback": fallback, "seconds": time.perf_counter() - t0,
            "accuracy": m["accuracy"], "ci": [m["accuracy_ci_low"], m["accuracy_ci_high"]],
            "correct": m["correct"], "other_accuracy": other["accuracy"], "other_correct": other["correct"],
            "length_mean": m["length_mean"],
            "kl_mean": m["kl_mean"], "fallback_share": (m.get("fallback") or {}).get("fallback_share"),
            "touching_pruned_share": (m.get("fallback") or {}).get("touching_pruned_share"),
            "experts_per_step": m["traffic"]["distinct_experts_per_layer_step"],
            "full": {"accuracy": report["full"]["accuracy"], "length_mean": report["full"]["length_mean"],
                     "other_accuracy": report["other_domains"]["full"]["accuracy"],
                     "experts_per_step": report["full"]["traffic"]["distinct_experts_per_layer_step"]},
            "n": m["n"], "other_n": other["n"]}, report


def markdown(results: list[dict], environment: dict) -> str:
    lines = ["# Gate variants and the per-token fallback", "",
             "Generated by `python -m experiments.decode_gates --work runs/decode-gates --out "
             "docs/results/decode-gates` from decode-gates.json (settings: docs/serving.md, \"Gate variants "
             "and the per-token fallback\"). REAP, decode calibration on arithmetic, 50% of the experts "
             "pruned, greedy, float32 reference engine, batch 32; target: arithmetic test split; other: the "
             "other domains' test problems. Δ: paired against the plain setting on the same problems, "
             "bootstrap 95% interval. Experts/step: distinct routed experts per MoE layer per decode step "
             "(the full model's in the header). Fallback: share of pruned token-layer pairs routed with "
             "every expert. Plot: [decode-gates.png](decode-gates.png).",
             "", f"Machine: {environment['lscpu']}; ISA {', '.join(environment['cpu']['isa'])}.", ""]
    for model in dict.fromkeys(r["model"] for r in results):
        rows = [r for r in results if r["model"] == model]
        plain = rows[0]
        f = plain["full"]
        lines += [f"## {model}", "",
                  f"Full model: target {100 * f['accuracy']:.1f}% (n = {plain['n']}), other "
                  f"{100 * f['other_accuracy']:.1f}% (n = {plain['other_n']}), mean length "
                  f"{f['length_mean']:.1f}, {f['experts_per_step']:.1f} experts/step.", "",
                  "| setting | target | Δ target | other | Δ other | length | KL | fallback | experts/step |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            d, o = (None, None) if r is plain else (
                paired_difference(r["correct"], plain["correct"]),
                paired_difference(r["other_correct"], plain["other_correct"]))
            fb = "–" if r["fallback"] is None else f"{100 * r['fallback_share']:.1f}%"
            lines.append(f"| {label(r['gates'], r['fallback'])} | {100 * r['accuracy']:.1f}% | "
                         f"{signed_pp(d)} | {100 * r['other_accuracy']:.1f}% | {signed_pp(o)} | "
                         f"{r['length_mean']:.1f} | "
                         f"{r['kl_mean']:.3f} | {fb} | {r['experts_per_step']:.1f} |")
        lines.append("")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    """Target accuracy against the experts a decode step reads (share of the full model's), one panel per
    backbone: each variant's fallback series from tau = 1 (the variant alone) to 0.1, and the full model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in results))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = [r for r in results if r["model"] == model]
        full = rows[0]["full"]
        for gates, marker in (("renorm", "o"), ("drop", "s"), ("substitute", "^")):
            series = sorted((r for r in rows if r["gates"] == gates), key=lambda r: -(r["fallback"] or 1.0))
            x = [r["experts_per_step"] / full["experts_per_step"] for r in series]
            ax.plot(x, [100 * r["accuracy"] for r in series], marker=marker, label=gates)
            for r, xi in zip(series, x, strict=True):
                ax.annotate("" if r["fallback"] is None else f"{r['fallback']:g}",
                            (xi, 100 * r["accuracy"]), textcoords="offset points", xytext=(4, -10),
                            fontsize=7)
        ax.plot([1.0], [100 * full["accuracy"]], marker="*", markersize=11, color="k", linestyle="",
                label="full")
        ax.set_title(model)
        ax.set_xlabel("experts read per decode step / full model's")
        ax.set_ylabel("target accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(title="gates (labels: fallback tau)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--report-only", action="store_true", help="re-render from OUT/decode-gates.json")
    args = parser.parse_args()
    out = Path(args.out)
    if args.report_only:
        data = json.loads((out / "decode-gates.json").read_text())
    else:
        results = []
        for model in args.models:
            plain = None
            for gates, fallback in SETTINGS:  # the plain setting first: its calibration feeds substitute
                result, report = one(model, gates, fallback, Path(args.work), args.threads, plain)
                plain = plain or report
                results.append(result)
        data = {"environment": {"cpu": describe(), "lscpu": machine_line()}, "results": results}
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "decode-gates.json", json.dumps(data, indent=1))
    atomic_write_text(out / "decode-gates.md", markdown(data["results"], data["environment"]))
    plot(data["results"], out / "decode-gates.png")
    print(f"wrote {out / 'decode-gates.md'}")


if __name__ == "__main__":
    main()
