"""The training-free frontier: accuracy against measured decode speedup per method (docs/results/frontier.md).

Methods, each at 25%, 50% and 75% of the experts pruned (REAP, decode calibration on arithmetic, the cache of
`experiments.decode_gates` and `experiments.layer_budgets`, so every method prunes with the same statistics):
plain (one count per layer, kept gates renormalized: the published mode), drop and substitute (the full
router's gates, pruned share dropped or replaced by the expert's calibration mean), budgets (per-layer counts
from measured sensitivity, `slimwise plan --budget-model`), budgets with drop or substitute, and drop with the
per-token fallback at tau = 0.5, alone and with budgets.

Accuracy: `slimwise eval` in the float32 reference engine on all three backbones (target and other domains,
paired against plain at the same ratio). Speed: `slimwise bench`, paired rounds at batch 32, on a synthetic
model of the preset's sizes whose MoE shape is the backbone's (4 layers, its experts and top-k: `--layers 4
--top-k K`) and whose routers follow the backbone's decode usage (`--routing-skew`), running the backbone's
own plans: testbed-a on `cpu` (qwen3_moe, 64 experts top-8), testbed-b on `cpu-shared` (qwen2_moe with a
shared expert, 32 experts top-4), testbed-c on `cpu-hybrid` (its Gated-DeltaNet layout, 64 experts top-8).

    python -m experiments.frontier --work runs/decode-gates --out docs/results/frontier

Each bench writes WORK/frontier-bench/<model>/<run>/bench.json and is skipped when that file exists (the runs
take about an hour here); `--report-only` re-renders from OUT/frontier.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.decode_gates import output_sums
from experiments.layer_budgets import RATIOS, config_for, plans_for
from slimwise.evaluation.metrics import paired_difference
from slimwise.evaluation.report import signed_pp
from slimwise.evaluation.sweep import run_eval
from slimwise.hardware import describe, machine_line
from slimwise.io import atomic_write_text, save_figure

MODELS = ("testbed-a", "testbed-b", "testbed-c")
#: backbone -> the bench preset whose layout it shares
PRESETS = {"testbed-a": "cpu", "testbed-b": "cpu-shared", "testbed-c": "cpu-hybrid"}
BATCH, OUTPUT_LEN, ROUNDS = 32, 48, 3
SLIMWISE = str(Path(sys.executable).parent / "slimwise")  # the CLI of this environment


@dataclass(frozen=True)
class Method:
    name: str
    scope: str  # the plan: "layer" (one count per layer) or "sensitivity" (per-layer budgets)
    gates: str
    fallback: float | None = None

    @property
    def slug(self) -> str:
        return self.name.replace("+", "-").replace(" ", "")


METHODS = (
    Method("plain", "layer", "renorm"),
    Method("drop", "layer", "drop"),
    Method("substitute", "layer", "substitute"),
    Method("budgets", "sensitivity", "renorm"),
    Method("budgets+drop", "sensitivity", "drop"),
    Method("budgets+substitute", "sensitivity", "substitute"),
    Method("drop+fallback 0.5", "layer", "drop", 0.5),
    Method("budgets+drop+fallback 0.5", "sensitivity", "drop", 0.5),
)
BY_NAME = {m.name: m for m in METHODS}
#: bench runs per backbone and ratio: (run name, plan scope, bench options, {variant: method it measures})
BENCH_RUNS = (
    ("layer-drop", "layer", ["--variants", "full", "slimwise", "gated", "--gates", "drop"],
     {"slimwise": "plain", "gated": "drop"}),
    ("layer-substitute", "layer", ["--variants", "full", "gated", "--gates", "substitute"],
     {"gated": "substitute"}),
    ("layer-fallback", "layer", ["--variants", "full", "gated", "--gates", "drop", "--fallback", "0.5"],
     {"gated": "drop+fallback 0.5"}),
    ("sensitivity-drop", "sensitivity", ["--variants", "full", "slimwise", "gated", "--gates", "drop"],
     {"slimwise": "budgets", "gated": "budgets+drop"}),
)


def plan_files(model: str, work: Path) -> dict[str, dict[float, str]]:
    """Per scope and ratio, the plan file `experiments.layer_budgets` wrote (made here if missing)."""
    folder = work / model / "budget-plans"
    files = {s: {r: str(folder / f"{s}-{r:g}.json") for r in RATIOS} for s in ("layer", "sensitivity")}
    if all(Path(f).is_file() for per in files.values() for f in per.values()):
        return files
    return plans_for(model, work)


def accuracy(model: str, work: Path) -> list[dict]:
    plans, rows, plain_report = plan_files(model, work), [], None
    for method in METHODS:  # plain first: its calibration is the one substitute's vectors must match
        files = tuple(plans[method.scope][r] for r in RATIOS)
        config = config_for(model, work, f"frontier-{method.slug}", files)
        config.gates, config.fallback = method.gates, method.fallback
        if method.gates == "substitute":
            config.substitutes = output_sums(model, config, plain_report, work)
        t0 = time.perf_counter()
        report = run_eval([model], config)[0]
        plain_report = plain_report or report
        for ratio in RATIOS:
            run = next(r for r in report["runs"] if r["mode"] == "slimwise" and r["ratio"] == ratio)
            m, other = run["metrics"], run["other_metrics"]
            rows.append({"model": model, "method": method.name, "ratio": ratio, "accuracy": m["accuracy"],
                         "correct": m["correct"], "other_accuracy": other["accuracy"],
                         "other_correct": other["correct"], "kl_mean": m["kl_mean"],
                         "length_mean": m["length_mean"],
                         "fallback_share": (m.get("fallback") or {}).get("fallback_share"),
                         "experts_per_step": m["traffic"]["distinct_experts_per_layer_step"],
                         "seconds": time.perf_counter() - t0,
                         "full": {"accuracy": report["full"]["accuracy"],
                                  "other_accuracy": report["other_domains"]["full"]["accuracy"],
                                  "experts_per_step":
                                      report["full"]["traffic"]["distinct_experts_per_layer_step"]}})
        print(f"{model} {method.name}: " + ", ".join(
            f"{r['ratio']:g} {100 * r['accuracy']:.1f}%" for r in rows[-len(RATIOS):]), flush=True)
    return rows


def synthetic_output_sums(model_dir: Path, out: Path) -> Path:
    """Expert output sums of the synthetic model (the substitute variant's vectors: their values do not change
    its speed, their shapes must be the model's): a short decode calibration on random-word prompts."""
    if out.is_file():
        return out
    data = out.with_suffix(".jsonl")
    words = [f"t{i}" for i in range(4, 4000, 37)]
    data.write_text("".join(json.dumps({"prompt": " ".join(words[i:i + 24])}) + "\n"
                            for i in range(0, 96, 6)))
    subprocess.run([SLIMWISE, "calibrate", str(model_dir), "--data", str(data),
                    "--phase", "decode", "--max-new-tokens", "8", "--output-sums", "--out", str(out)],
                   check=True)
    return out


def speed(model: str, work: Path) -> list[dict]:
    preset, plans = PRESETS[model], plan_files(model, work)
    top_k = str(json.loads(Path(plans["layer"][0.5]).read_text())["top_k"])
    root = work / "frontier-bench" / model
    skew = _stats_of(model, work)  # the decode statistics the plans were made from
    synthetic = root / "synthetic"
    rows = []
    for ratio in RATIOS:
        for run, scope, options, measures in BENCH_RUNS:
            out = root / f"{run}-{ratio:g}"
            if not (out / "bench.json").is_file():
                if "substitute" in options:
                    options = [*options, "--substitutes",
                               str(synthetic_output_sums(synthetic, root / "synthetic-sums.safetensors"))]
                cmd = [SLIMWISE, "bench", "--synthetic", preset, "--layers", "4",
                       "--top-k", top_k, "--routing-skew", skew, "--synthetic-dir", str(synthetic),
                       "--plan", plans[scope][ratio], *options, "--batch", str(BATCH), "--output-len",
                       str(OUTPUT_LEN), "--repetitions", str(ROUNDS), "--hardware", "none", "--in-process",
                       "--out", str(out)]
                print(" ".join(cmd[2:]), flush=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            bench = json.loads((out / "bench.json").read_text())
            for variant, method in measures.items():
                s = bench["summary"][variant][str(BATCH)]["speedup"]
                t = bench["traffic"][variant]["batches"][str(BATCH)]
                rows.append({"model": model, "preset": preset, "method": method, "ratio": ratio,
                             "speedup": s["median"], "speedup_min": s["min"], "speedup_max": s["max"],
                             "rounds": s["n"], "experts_touched": t["touched_mean"],
                             "full_experts_touched": bench["traffic"]["full"]["batches"][str(BATCH)][
                                 "touched_mean"],
                             "fallback_share": t.get("fallback_share"), "run": str(out / "bench.json"),
                             "dtype": bench["dtype"]["used"]})
    return rows


def _stats_of(model: str, work: Path) -> str:
    report = run_eval([model], config_for(model, work, "budget-layer"))[0]  # cached: no model runs
    return report["calibration"]["decode"]["stats"]


# ----- report ---------------------------------------------------------------------------------------------

def pareto(points: list[tuple[float, float]]) -> set[int]:
    """Indices of the points no other point beats on both axes (higher is better on each)."""
    return {i for i, (x, y) in enumerate(points)
            if not any((x2 >= x and y2 >= y) and (x2 > x or y2 > y) for x2, y2 in points)}


def merged(data: dict) -> list[dict]:
    """Accuracy rows with their bench figures (None where the backbone has no preset or the method no run)."""
    speeds = {(s["model"], s["method"], s["ratio"]): s for s in data["speed"]}
    return [{**row, "bench": speeds.get((row["model"], row["method"], row["ratio"]))}
            for row in data["accuracy"]]


def goal_lines(rows: list[dict]) -> list[str]:
    """The issue's bar at 50%: within 10 points of full on a and b, half of c's gap closed, at >= 95% of the
    plain plan's speedup (fallback settings excepted)."""
    out = []
    for method in (m.name for m in METHODS):
        at = {r["model"]: r for r in rows if r["method"] == method and r["ratio"] == 0.5}
        plain = {r["model"]: r for r in rows if r["method"] == "plain" and r["ratio"] == 0.5}
        checks = []
        for model, r in at.items():
            full = r["full"]["accuracy"]
            bar = full - 0.10 if model != "testbed-c" else plain[model]["accuracy"] + (
                full - plain[model]["accuracy"]) / 2
            checks.append(f"{model} {100 * r['accuracy']:.1f}% vs bar {100 * bar:.1f}% "
                          f"{'met' if r['accuracy'] >= bar else 'missed'}")
        speed = []
        for model, r in at.items():
            if r["bench"] and plain[model]["bench"] and method != "plain":
                mine, base = r["bench"]["speedup"], plain[model]["bench"]["speedup"]
                speed.append(f"{model} {mine:.3f}x against plain's {base:.3f}x ({100 * mine / base:.0f}%; "
                             f"{100 * (mine - 1) / (base - 1):.0f}% of plain's gain)")
        out.append(f"- {method}: " + "; ".join(checks) + (f"; speed {', '.join(speed)}" if speed else ""))
    return out


def win_lines(rows: list[dict]) -> list[str]:
    out = []
    models = sorted({r["model"] for r in rows})
    for ratio in RATIOS:
        ahead, sure = [], []
        for method in (m.name for m in METHODS[1:]):
            at = {(x["model"], x["method"]): x for x in rows if x["ratio"] == ratio}
            deltas = [paired_difference(at[model, method]["correct"], at[model, "plain"]["correct"])
                      for model in models]
            if all(d["diff"] > 0 for d in deltas):
                ahead.append(method)
            if all(d["ci_low"] > 0 for d in deltas):
                sure.append(method)
        out.append(f"- {ratio:.2f}: ahead on all {len(models)}: {', '.join(ahead) or 'none'}; beyond noise "
                   f"on all {len(models)}: {', '.join(sure) or 'none'}")
    return out


def markdown(data: dict) -> str:
    env, rows = data["environment"], merged(data)
    lines = ["# The training-free frontier", "", " ".join([
        "Generated by `python -m experiments.frontier --work runs/decode-gates --out docs/results/frontier`",
        "from [frontier.json](frontier/frontier.json); what each method is: docs/serving.md (\"Gate variants",
        "and the per-token fallback\") and `slimwise plan --budget-model`. REAP, decode calibration on",
        "arithmetic; accuracy: float32 reference engine, batch 32, greedy, 240 arithmetic test problems",
        "(target) and 192 problems of the other domains; Δ: paired against plain at the same ratio,",
        "bootstrap 95% interval. Experts/step: distinct routed experts per MoE layer per decode step",
        f"in the reference (full model's in the header). Speedup: `slimwise bench`, batch {BATCH},",
        f"{OUTPUT_LEN} output tokens, {ROUNDS} paired rounds, median (min-max) over rounds, on the",
        "backbone's preset with `--layers 4 --top-k K` (its MoE shape), routers skewed like the backbone's",
        "decode usage and the backbone's own plans",
        "(testbed-a: `cpu`; testbed-b: `cpu-shared`; testbed-c: `cpu-hybrid`). ✓: on the",
        "Pareto front of accuracy against measured speedup (the full model at 1.0x included). Plot:",
        "[frontier.png](frontier/frontier.png)."]), "",
             f"Machine: {env['lscpu']}; ISA {', '.join(env['cpu']['isa'])}.", ""]
    order = {m.name: i for i, m in enumerate(METHODS)}
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = sorted((r for r in rows if r["model"] == model),
                      key=lambda r: (r["ratio"], order[r["method"]]))
        full = mine[0]["full"]
        front = _front(mine)
        lines += [f"## {model}", "",
                  f"Full model: target {100 * full['accuracy']:.1f}%, other "
                  f"{100 * full['other_accuracy']:.1f}%, {full['experts_per_step']:.1f} experts/step.", "",
                  "| ratio | method | target | Δ target | other | Δ other | KL | fallback | experts/step "
                  "| speedup | front |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for i, r in enumerate(mine):
            base = next(b for b in mine if b["ratio"] == r["ratio"] and b["method"] == "plain")
            d, o = ("–", "–") if r is base else (
                signed_pp(paired_difference(r["correct"], base["correct"])),
                signed_pp(paired_difference(r["other_correct"], base["other_correct"])))
            b = r["bench"]
            speed = "–" if b is None else \
                f"{b['speedup']:.3f}x ({b['speedup_min']:.2f}-{b['speedup_max']:.2f})"
            fb = "–" if BY_NAME[r["method"]].fallback is None else f"{100 * r['fallback_share']:.1f}%"
            lines.append(f"| {r['ratio']:.2f} | {r['method']} | {100 * r['accuracy']:.1f}% | {d} | "
                         f"{100 * r['other_accuracy']:.1f}% | {o} | {r['kl_mean']:.3f} | {fb} | "
                         f"{r['experts_per_step']:.1f} | {speed} | {'✓' if i in front else ''} |")
        lines.append("")
    fallback_rows = [s for s in data["speed"] if BY_NAME[s["method"]].fallback is not None]
    if fallback_rows:
        reference = {(r["model"], r["method"], r["ratio"]): r for r in rows}
        lines += ["## The fallback in the bench", "",
                  "The bench's routers are random rows skewed to the backbone's usage shares, not its "
                  "trained routers, so its tokens fall back at their own rate; experts: distinct experts per "
                  f"layer per decode step at batch {BATCH} (the full model's in the bench: the last column).",
                  "",
                  "| backbone | ratio | method | fallback: bench | fallback: reference | experts read: bench "
                  "| full: bench |", "|---|---|---|---|---|---|---|"]
        for b in fallback_rows:
            ref = reference[b["model"], b["method"], b["ratio"]]
            lines.append(f"| {b['model']} | {b['ratio']:.2f} | {b['method']} | "
                         f"{100 * b['fallback_share']:.1f}% | {100 * ref['fallback_share']:.1f}% | "
                         f"{b['experts_touched']:.1f} | {b['full_experts_touched']:.1f} |")
        lines.append("")
    lines += ["## The goal at 50% (issue: within 10 points of full on a and b, half of c's gap closed, at "
              ">= 95% of the plain plan's speedup)", "", *goal_lines(rows), "",
              "## Against plain on every backbone", "",
              "Per ratio, the methods whose target accuracy beats plain on all three backbones (point "
              "estimate), and those whose paired 95% interval excludes zero on all three (what changing the "
              "recommended default would need):", "", *win_lines(rows), ""]
    return "\n".join(lines)


def _front(rows: list[dict]) -> set[int]:
    """Pareto indices among a backbone's rows with a measured speedup (the full model is a point too)."""
    measured = [i for i, r in enumerate(rows) if r["bench"]]
    if not measured:
        return set()
    points = [(rows[i]["bench"]["speedup"], rows[i]["accuracy"]) for i in measured]
    points.append((1.0, rows[0]["full"]["accuracy"]))
    return {measured[j] for j in pareto(points) if j < len(measured)}


def plot(data: dict, path: Path) -> None:
    """Per benched backbone: target (top) and other-domain (bottom) accuracy against measured speedup, one
    marker per method, ratios joined, the Pareto front dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in merged(data) if r["bench"]]
    models = list(dict.fromkeys(r["model"] for r in rows))
    if not models:
        return
    fig, axes = plt.subplots(2, len(models), figsize=(5.2 * len(models), 7.4), squeeze=False)
    markers = dict(zip([m.name for m in METHODS], "osD^vP*X", strict=True))
    for col, model in enumerate(models):
        mine = [r for r in rows if r["model"] == model]
        for row, key in enumerate(("accuracy", "other_accuracy")):
            ax = axes[row][col]
            for method in dict.fromkeys(r["method"] for r in mine):
                series = sorted((r for r in mine if r["method"] == method), key=lambda r: r["ratio"])
                ax.plot([r["bench"]["speedup"] for r in series], [100 * r[key] for r in series],
                        marker=markers[method], label=method, alpha=0.85)
            points = [(r["bench"]["speedup"], r[key]) for r in mine] + [(1.0, mine[0]["full"][key])]
            front = sorted((points[i] for i in pareto(points)), key=lambda p: p[0])
            ax.plot([p[0] for p in front], [100 * p[1] for p in front], "k--", lw=0.8, label="Pareto front")
            ax.plot([1.0], [100 * mine[0]["full"][key]], "k*", markersize=12, label="full")
            ax.set_title(f"{model} ({mine[0]['bench']['preset']} preset), "
                         f"{'target' if row == 0 else 'other domains'}")
            ax.set_xlabel(f"decode speedup over full, bench B={BATCH} (paired median)")
            ax.set_ylabel("accuracy (%)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, title="method (points: 25/50/75%)")
    save_figure(fig, path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--no-bench", action="store_true", help="accuracy only (the bench runs take longest)")
    parser.add_argument("--report-only", action="store_true", help="re-render from OUT/frontier.json")
    args = parser.parse_args()
    out, work = Path(args.out), Path(args.work)
    if args.report_only:
        data = json.loads((out / "frontier.json").read_text())
    else:
        acc = [row for model in args.models for row in accuracy(model, work)]
        spd = [] if args.no_bench else [row for model in args.models if model in PRESETS
                                        for row in speed(model, work)]
        data = {"environment": {"cpu": describe(), "lscpu": machine_line()}, "accuracy": acc, "speed": spd}
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "frontier.json", json.dumps(data, indent=1))
    atomic_write_text(out.parent / "frontier.md", markdown(data))
    plot(data, out / "frontier.png")
    print(f"wrote {out.parent / 'frontier.md'}")


if __name__ == "__main__":
    main()
