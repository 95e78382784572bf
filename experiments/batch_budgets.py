"""Batch-aware decode budgets against static SlimWise and the classic baseline (results: batch-budgets.md).

Each backbone (testbed-a, -b, -c), REAP, float32 reference engine, greedy, 240 arithmetic test problems,
batch 32:
  full       the model as is;
  uniform    classic pruning of both phases, calibrated on whole sequences (phase `all`), as classic
             pruners calibrate;
  static     SlimWise with the decode-calibrated plan (the published mode);
  budget     SlimWise with a dynamic batch budget of E = the static plan's kept count per layer
             (`--budget-share 1 - ratio`): at most the same experts per step, chosen per step;
  extra      the static plan plus at most M = experts / 8 more per step (`--extra M`).
Stages: `half` (every variant at 50%), `grid` (the budget at 9 values of E; static and uniform at 5 ratios
over 3 calibration seeds: accuracy against the experts each decode step read, from the reference traffic
meter), `batch` (testbed-a at 50%: the budget and the static plan at batch 1, 8, 32, 64, tokens compared
problem by problem with batch 32, and mixed-domain batches), `long` (testbed-a-long at 1,024 characters),
`bench` / `bench32` (`slimwise bench` on testbed-a's MoE shape: batch 8, 32, 64 with 3 rounds; batch 32
with 7).

    python -m experiments.batch_budgets --work runs/batch-budgets --out docs/results/batch-budgets

Every eval's generations are cached under WORK/cache, the long-prompt runs in WORK/testbed-a-long/long.json
and each bench in its bench.json, so a rerun only renders; `--report-only` re-renders from
OUT/batch-budgets.json.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from slimwise.evaluation.config import EvalConfig
from slimwise.evaluation.metrics import paired_difference
from slimwise.evaluation.sweep import Sweep, run_eval
from slimwise.hardware import describe, machine_line
from slimwise.io import atomic_write_text, save_figure

MODELS = ("testbed-a", "testbed-b", "testbed-c")
RATIOS = (0.25, 0.5, 0.75)
BATCHES = (1, 8, 32, 64)
EXPERTS = {"testbed-a": 64, "testbed-b": 32, "testbed-c": 64}
#: the dynamic budget's E as shares of each layer's experts (testbed-b: 32 experts, top-4, so 0.125 is E = 4)
SHARES = (0.125, 0.1875, 0.25, 0.3125, 0.375, 0.4375, 0.5, 0.625, 0.75)
GRID_RATIOS = (0.25, 0.375, 0.5, 0.625, 0.75)
CALIB_SEEDS = (0, 1, 2)
PLOT = "batch-budgets.png"
BENCH_BATCHES = (8, 32, 64)
OTHER_BATCHES = (8, 64)  # the grid's curve at other batch sizes
BATCH_SHARES = (0.25, 0.375, 0.5, 0.625)
BATCH_RATIOS = (0.375, 0.5, 0.625, 0.75)
CAVEATS = [
    "- One test sample (seed 0) of the test split on which the backbones and earlier defaults were chosen "
    "(no untouched split, no exact tests here); the dynamic budget has no calibration to vary, static and "
    "uniform vary over 3 calibration seeds.",
    "- Experts per step are the reference engine's: a batch of 32 problems whose finished rows leave, so "
    "later steps have fewer rows; the bracketed figures count only steps whose 32 rows were all alive, "
    "closer to a server that keeps its batch full.",
    "- Speed is a synthetic model of testbed-a's MoE shape on a 2-core AVX2 CPU, routed by skewed random "
    "routers, not the backbone's own routing; at batch 32 both variants read 32 experts per step, so the "
    "measured gap is the budget's per-step work (full routing, summing and ranking in every MoE layer). A "
    "GPU run is not yet measured.",
    "- `static + M` (M = experts / 8) lands on the dynamic budget's accuracy at 50% here; it is not a "
    "separate curve.",
]
ARITHMETIC = ("add", "sub", "mul", "gcd", "base")  # the target domain's families


def base_config(work: Path, model: str, tag: str, **changes) -> EvalConfig:
    config = EvalConfig(criteria=("reap",), ratios=RATIOS, phases=("decode",), modes=("full", "slimwise"),
                        calib_mixes=(), other_domains=False, kl=False, plots=False, threads=2,
                        uniform_phase="same",  # phases are explicit here: uniform runs on its own plan
                        out_dir=str(work / model / tag), cache_dir=str(work / "cache"), progress=False)
    return replace(config, **changes)


def runs_of(report: dict) -> dict[tuple[str, float, str], dict]:
    """(mode, ratio, phase) -> metrics, and ("full", 0, "") -> the full model's."""
    out = {("full", 0.0, ""): report["full"]}
    for r in report["runs"]:
        out[(r["mode"], r["ratio"], r["phase"])] = r["metrics"]
    return out


def cell(metrics: dict, full: dict | None = None) -> dict:
    traffic = metrics.get("traffic") or {}
    out = {"accuracy": metrics["accuracy"], "n": metrics["n"], "correct": metrics["correct"],
           "experts_per_step": traffic.get("distinct_experts_per_layer_step"),
           # over the steps whose batch was still whole (no row finished yet), as a busy server's are
           "experts_per_full_step": traffic.get("distinct_experts_per_layer_step_full_batch"),
           "length_mean": metrics.get("length_mean"),
           "by_family": {f: [m["accuracy"], m["n"]]
                         for f, m in (metrics.get("by_family") or {}).items()}}
    if full is not None:
        out["minus_full"] = paired_difference(metrics["correct"], full["correct"], 2000, 0)
    return out


def measure_model(work: Path, model: str, ratios: tuple[float, ...]) -> dict:
    """Per variant and ratio, the accuracy cell of `model` (and the full model's under "full")."""
    static = runs_of(run_eval([model], base_config(work, model, "static", ratios=ratios,
                                                   modes=("full", "uniform", "slimwise"),
                                                   phases=("decode", "all")))[0])
    full = static[("full", 0.0, "")]
    rows: dict = {"full": {"0": cell(full)}}
    for ratio in ratios:
        key = f"{ratio:g}"
        rows.setdefault("uniform", {})[key] = cell(static[("uniform", ratio, "all")], full)
        rows.setdefault("uniform-decode", {})[key] = cell(static[("uniform", ratio, "decode")], full)
        rows.setdefault("static", {})[key] = cell(static[("slimwise", ratio, "decode")], full)
        variants = (("budget", {"budget_share": 1 - ratio}), ("extra", {"extra": EXPERTS[model] // 8}))
        for name, changes in variants:
            run = runs_of(run_eval([model], base_config(work, model, f"{name}-{key}", ratios=(ratio,),
                                                        **changes))[0])
            rows.setdefault(name, {})[key] = cell(run[("slimwise", ratio, "decode")], full)
    return rows


def budget_grid(work: Path, model: str) -> dict:
    """The dynamic budget at several E (shares of the layer's experts) and the static plans at several ratios,
    batch 32: the accuracy / experts-read curve of each (a dynamic budget uses no calibration)."""
    out: dict = {"budget": {}, "static": {}, "uniform": {}}
    for share in SHARES:
        report = run_eval([model], base_config(work, model, f"grid-budget-{share:g}", ratios=(0.5,),
                                               budget_share=share))[0]
        out["budget"][f"{share:g}"] = cell(runs_of(report)[("slimwise", 0.5, "decode")], report["full"])
    for seed in CALIB_SEEDS:
        # SlimWise on the decode-calibrated plans, uniform on the whole-sequence ones: two sweeps
        for name, mode, phase in (("static", "slimwise", "decode"), ("uniform", "uniform", "all")):
            config = base_config(work, model, f"grid-{name}-seed{seed}", ratios=GRID_RATIOS, calib_seed=seed,
                                 modes=("full", mode), phases=(phase,))
            report = run_eval([model], config)[0]
            runs = runs_of(report)
            for ratio in GRID_RATIOS:
                out[name].setdefault(f"{ratio:g}", {})[str(seed)] = cell(runs[(mode, ratio, phase)],
                                                                          report["full"])
    return out


def long_prompts(work: Path, ratio: float = 0.5) -> dict:
    """testbed-a-long at 1,024-character prompts, `ratio` of the experts pruned, batch 32: full, uniform
    (whole-sequence and decode calibration), static SlimWise, the budget E = kept and the static plan + M (48
    new tokens, the long families' setting in docs/results/long-prompts.md; 150 problems, seed 0)."""
    from dataclasses import replace as with_

    from experiments.distill_bars import BarsConfig, evaluate_run
    from slimwise.calibrate import CalibrationConfig, calibrate
    from slimwise.criteria import plan_from_stats
    from slimwise.decode_gates import DecodeGates
    from slimwise.engines.reference import PhaseSplitEngine
    from slimwise.models import load_model, load_tokenizer
    from slimwise.testbed.long_tasks import LENGTHS, make_long_split

    model_name, length = "testbed-a-long", 1024
    path = work / model_name / ("long.json" if ratio == 0.5 else f"long-{ratio:g}.json")
    if path.is_file():
        return json.loads(path.read_text())
    model, tok = load_model(model_name, dtype="float32"), load_tokenizer(model_name)
    bars = with_(BarsConfig(), max_new_tokens=48, batch_size=32)
    tests = make_long_split("test", 50, length, seed=0)
    calib = [s.prompt for n in LENGTHS for s in make_long_split("calib", 8, n, seed=0)]
    plans = {phase: plan_from_stats(calibrate(model, calib, tok, CalibrationConfig(phase=phase,
                                                                                    max_new_tokens=32),
                                              progress=False), "reap", ratio) for phase in ("decode", "all")}
    with PhaseSplitEngine(model, tok) as engine:
        full = evaluate_run(engine, tests, "full", bars)
    out = {"length": length, "ratio": ratio, "n": len(tests), "full": _long_cell(full, full)}
    runs = (("uniform", "all", "uniform", DecodeGates()),
            ("uniform-decode", "decode", "uniform", DecodeGates()),
            ("static", "decode", "slimwise", DecodeGates()),
            ("budget", "decode", "slimwise", DecodeGates(budget_share=1 - ratio)),
            ("extra", "decode", "slimwise", DecodeGates(extra=EXPERTS["testbed-a"] // 8)))
    for name, phase, mode, gates in runs:
        with PhaseSplitEngine(model, tok, plan=plans[phase], gates=gates) as engine:
            out[name] = _long_cell(evaluate_run(engine, tests, mode, bars, full["token_ids"]), full)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(out))
    return out


def _long_cell(run: dict, full: dict) -> dict:
    return {"accuracy": run["accuracy"] / 100, "n": len(run["correct"]), "correct": run["correct"],
            "length_mean": run["mean_length"],
            "minus_full": None if run is full else paired_difference(run["correct"], full["correct"], 2000,
                                                                     0)}


def bench(work: Path, model: str = "testbed-a", batches: tuple[int, ...] = BENCH_BATCHES, rounds: int = 3,
          tag: str = "bench") -> dict:
    """`slimwise bench` on the backbone's MoE shape (the frontier's synthetic model: preset `cpu`, 4 layers,
    top-8, routers skewed like testbed-a's decode usage) with its static 50% plan: full, static SlimWise and
    the budget E = 32 (`gated --budget-share 0.5`) at batch 8, 32 and 64, three paired rounds, the experts
    each variant read per step counted beside. Per round: budget / static tokens per second."""
    import subprocess
    import sys

    static = json.loads((work / model / "static" / "report.json").read_text())
    plan = next(r["plan"] for r in static["runs"] if r["phase"] == "decode" and r["ratio"] == 0.5)
    stats = static["calibration"]["decode"]["stats"]
    out = work / model / tag
    if not (out / "bench.json").is_file():
        slimwise = str(Path(sys.executable).parent / "slimwise")
        cmd = [slimwise, "bench", "--synthetic", "cpu", "--layers", "4", "--top-k", "8",
               "--routing-skew", stats, "--synthetic-dir", str(work / "synthetic"), "--plan", plan,
               "--variants", "full", "slimwise", "gated", "--budget-share", "0.5",
               "--batch", *map(str, batches), "--output-len", "48",
               "--repetitions", str(rounds), "--hardware", "none", "--in-process", "--out", str(out)]
        print(" ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True)
    b = json.loads((out / "bench.json").read_text())
    rows = {}
    for batch in map(str, batches):
        runs = {v: b["runs"][v][batch] for v in ("full", "slimwise", "gated")}
        per_round = [g["tokens_per_s"] / s["tokens_per_s"] for g, s in zip(runs["gated"], runs["slimwise"],
                                                                              strict=True)]
        rows[batch] = {"speedup": {v: b["summary"][v][batch]["speedup"] for v in runs},
                       "budget_over_static": sorted(per_round),
                       "experts_touched": {v: (b.get("traffic") or {}).get(v, {}).get("batches", {}).get(
                           batch, {}).get("touched_mean") for v in runs}}
    return {"model": model, "rounds": rounds, "machine": b.get("machine"), "rows": rows}


def by_batch(work: Path, model: str) -> dict:
    """The budget and the static plans (calibration seed 0) at batch 8 and 64: the curve's shift with the
    batch it serves (batch 32 is the grid's)."""
    out: dict = {}
    for batch in OTHER_BATCHES:
        cells: dict = {"budget": {}, "static": {}}
        for share in BATCH_SHARES:
            report = run_eval([model], base_config(work, model, f"bybatch-budget-{share:g}-{batch}",
                                                   ratios=(0.5,), batch_size=batch, budget_share=share))[0]
            cells["budget"][f"{share:g}"] = cell(runs_of(report)[("slimwise", 0.5, "decode")], report["full"])
        report = run_eval([model], base_config(work, model, f"bybatch-static-{batch}", ratios=BATCH_RATIOS,
                                               batch_size=batch))[0]
        runs = runs_of(report)
        for ratio in BATCH_RATIOS:
            cells["static"][f"{ratio:g}"] = cell(runs[("slimwise", ratio, "decode")], report["full"])
        cells["full"] = cell(report["full"])
        out[str(batch)] = cells
    return out


def with_fallback(work: Path, model: str) -> dict:
    """The budget E = half combined with the per-token fallback (TAU 0.5), batch 32."""
    report = run_eval([model], base_config(work, model, "budget-fallback-0.5", ratios=(0.5,),
                                           budget_share=0.5, fallback=0.5))[0]
    return cell(runs_of(report)[("slimwise", 0.5, "decode")], report["full"])


def measure(work: Path, out: Path, stages: list[str]) -> dict:
    """Run the stages in order ("a-b-c@0.5", "batch", "ratios"), saving the results after each one."""
    data = out / "batch-budgets.json"
    results = json.loads(data.read_text()) if data.is_file() else {"models": {}}
    results.update(machine=machine_line(), hardware=describe())
    for stage in stages:
        if stage == "batch":
            results["batch"] = batch_dependence(work)
        elif stage == "bench":
            results["bench"] = bench(work)
        elif stage == "bench32":  # batch 32 alone, more rounds: the goal's comparison past the round noise
            results["bench32"] = bench(work, batches=(32,), rounds=7, tag="bench-32x7")
        elif stage == "bybatch":
            results["by_batch"] = {model: by_batch(work, model) for model in MODELS}
        elif stage == "fallback":
            for model in MODELS:
                results["models"][model].setdefault("budget+fallback", {})["0.5"] = with_fallback(work, model)
        elif stage == "long":
            results["long"] = long_prompts(work)
        elif stage == "long-ratios":
            results["long_ratios"] = {f"{r:g}": long_prompts(work, r) for r in (0.25, 0.75)}
        elif stage == "grid":
            results["grid"] = {model: budget_grid(work, model) for model in MODELS}
        else:
            ratios = (0.5,) if stage == "half" else RATIOS
            for model in MODELS:
                rows = measure_model(work, model, ratios)
                kept = results["models"].setdefault(model, {})
                for name, cells in rows.items():
                    kept.setdefault(name, {}).update(cells)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(data, json.dumps(results, indent=1))
    return results


def _slimwise_run(config: EvalConfig, model: str) -> tuple[dict, dict, list[list[int]]]:
    """One sweep at 50%: (the slimwise run's metrics, the full model's, its token ids per problem)."""
    sweep = Sweep(model, config, config.out_dir)
    try:
        report = sweep.run()
        spec = next(s for s in sweep.build_plans() if s.ratio == 0.5)
        gens = sweep.run_cache.generate("slimwise", spec)["gens"]
    finally:
        sweep.close()
    tokens = [list(g.token_ids if hasattr(g, "token_ids") else g["token_ids"]) for g in gens]
    return runs_of(report)[("slimwise", 0.5, "decode")], report["full"], tokens


def batch_dependence(work: Path) -> dict:
    """testbed-a at 50%: the budget and the static plan at each batch size, and a mixed-domain sample."""
    model, out = "testbed-a", {}
    tokens: dict[tuple[str, int], list] = {}
    for variant, changes in (("budget", {"budget_share": 0.5}), ("static", {})):
        for batch in BATCHES:
            config = base_config(work, model, f"batch-{variant}-{batch}", ratios=(0.5,), batch_size=batch,
                                 **changes)
            run, full, tokens[(variant, batch)] = _slimwise_run(config, model)
            out.setdefault(variant, {})[str(batch)] = cell(run, full)
    for variant in ("budget", "static"):
        for batch in BATCHES:
            a, b = tokens[(variant, batch)], tokens[(variant, 32)]
            same = sum(x == y for x, y in zip(a, b, strict=True))
            out[variant][str(batch)]["same_tokens_as_batch_32"] = same
            out[variant][str(batch)]["n"] = len(a)
    for variant, changes in (("budget", {"budget_share": 0.5}), ("static", {})):
        config = base_config(work, model, f"mixed-{variant}", ratios=(0.5,), domain="all", **changes)
        run, full, _ = _slimwise_run(config, model)
        out.setdefault("mixed", {})[variant] = cell(run, full)
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _acc(c: dict) -> str:
    d = c.get("minus_full")
    return _pct(c["accuracy"]) + (f" ({100 * d['diff']:+.1f})" if d else "")


def _reads(c: dict) -> str:
    """Experts read per layer and decode step: the mean over every step, and in brackets over the steps whose
    batch was still whole (what a server that keeps its batch full reads)."""
    whole = c.get("experts_per_full_step")
    return f"{c['experts_per_step']:.1f}" + (f" ({whole:.1f})" if whole is not None else "")


def _seeds(cells: dict) -> tuple[float, float, float, float]:
    """(mean accuracy, min, max, mean experts per step) over calibration seeds."""
    accs = [c["accuracy"] for c in cells.values()]
    steps = [c["experts_per_step"] for c in cells.values()]
    return sum(accs) / len(accs), min(accs), max(accs), sum(steps) / len(steps)


def headline(results: dict) -> list[str]:
    lines = ["| backbone | pruned | full | uniform, whole-seq. calib. | static SlimWise | budget E = kept | "
             "static + M | experts read per step (whole-batch steps): full / static / budget / +M |",
             "|---|---|---|---|---|---|---|---|"]
    for model, rows in results["models"].items():
        full = rows["full"]["0"]
        for k in sorted(rows["static"], key=float):
            steps = " / ".join(_reads(full if n == "full" else rows[n][k])
                               for n in ("full", "static", "budget", "extra"))
            lines.append(f"| {model} | {100 * float(k):.0f}% | {_pct(full['accuracy'])} | "
                         f"{_acc(rows['uniform'][k])} | {_acc(rows['static'][k])} | "
                         f"{_acc(rows['budget'][k])} | {_acc(rows['extra'][k])} | {steps} |")
    return lines


def grid_table(results: dict) -> list[str]:
    lines = []
    for model, g in results.get("grid", {}).items():
        e = EXPERTS[model]
        full = results["models"][model]["full"]["0"]
        lines += ["", f"**{model}** ({e} experts; full: {_pct(full['accuracy'])}%, "
                  f"{full['experts_per_step']:.1f} experts per step)", "",
                  "| dynamic budget E | accuracy (Δ full) | experts/step || static ratio (kept) | "
                  "static: mean [min, max] over 3 calibration seeds | experts/step | "
                  "uniform, whole-seq.: mean [min, max] |",
                  "|---|---|---|---|---|---|---|---|"]
        budgets = sorted(g["budget"].items(), key=lambda kv: float(kv[0]))
        statics = sorted(g["static"].items(), key=lambda kv: -float(kv[0]))
        for i in range(max(len(budgets), len(statics))):
            left = "| | | |"
            if i < len(budgets):
                share, c = budgets[i]
                left = f"| {round(float(share) * e)} | {_acc(c)} | {c['experts_per_step']:.1f} |"
            right = "| | | | |"
            if i < len(statics):
                ratio, cells = statics[i]
                m, lo, hi, st = _seeds(cells)
                um, ulo, uhi, _ = _seeds(g["uniform"][ratio])
                kept = e - round(float(ratio) * e)
                right = (f"| {100 * float(ratio):.1f}% ({kept}) | {_pct(m)} [{_pct(lo)}, {_pct(hi)}] | "
                         f"{st:.1f} | {_pct(um)} [{_pct(ulo)}, {_pct(uhi)}] |")
            lines.append(left + right[1:])
    return lines


def batch_table(results: dict) -> list[str]:
    b = results.get("batch")
    if not b:
        return []
    lines = ["| batch | budget E = 32: accuracy | experts/step | same tokens as batch 32 | "
             "static: accuracy | "
             "experts/step | same tokens as batch 32 |", "|---|---|---|---|---|---|---|"]
    for batch in BATCHES:
        x, y = b["budget"][str(batch)], b["static"][str(batch)]
        lines.append(f"| {batch} | {_acc(x)} | {x['experts_per_step']:.1f} | "
                     f"{x['same_tokens_as_batch_32']} / {x['n']} | {_acc(y)} | {y['experts_per_step']:.1f} | "
                     f"{y['same_tokens_as_batch_32']} / {y['n']} |")
    mixed = b.get("mixed")
    if mixed:
        def arithmetic(c: dict) -> str:
            pairs = [v for f, v in c["by_family"].items() if f in ARITHMETIC]
            return _pct(sum(a * n for a, n in pairs) / sum(n for _, n in pairs))

        lines += ["", "Mixed domains: `--domain all`, every testbed domain in each batch of 32 "
                  f"({mixed['budget']['n']} problems), against the arithmetic-only batches above. Budget: "
                  f"{_acc(mixed['budget'])} over every domain, {arithmetic(mixed['budget'])} on its "
                  f"arithmetic problems (arithmetic-only batches: {_pct(b['budget']['32']['accuracy'])}), "
                  f"{mixed['budget']['experts_per_step']:.1f} experts per step. Static: "
                  f"{_acc(mixed['static'])}, {arithmetic(mixed['static'])} on arithmetic (alone: "
                  f"{_pct(b['static']['32']['accuracy'])}), "
                  f"{mixed['static']['experts_per_step']:.1f} experts per step."]
    return lines


def goal(results: dict) -> list[str]:
    """The issue's goal, each part checked from the data: batch 32, a budget of half the experts."""
    lines = ["| goal (batch 32, E = half the experts) | measured | met |", "|---|---|---|"]
    for model, bar in (("testbed-a", "within 5 points of full"), ("testbed-b", "within 5 points of full"),
                       ("testbed-c", "ahead of static SlimWise")):
        rows = results["models"].get(model)
        if not rows or "0.5" not in rows.get("budget", {}):
            continue
        full, budget, static = rows["full"]["0"], rows["budget"]["0.5"], rows["static"]["0.5"]
        if bar.startswith("within"):
            gap = 100 * (full["accuracy"] - budget["accuracy"])
            lines.append(f"| {model}: {bar} | budget {_pct(budget['accuracy'])} vs full "
                         f"{_pct(full['accuracy'])} ({gap:.1f} points behind) | "
                         f"{'yes' if gap <= 5 else 'no'} |")
        else:
            lead = 100 * (budget["accuracy"] - static["accuracy"])
            lines.append(f"| {model}: {bar} | budget {_pct(budget['accuracy'])} vs static "
                         f"{_pct(static['accuracy'])} ({lead:+.1f}) | {'yes' if lead > 0 else 'no'} |")
    b = (results.get("bench32") or results.get("bench") or {}).get("rows", {}).get("32")
    if b:
        ratio = b["budget_over_static"]
        median = ratio[len(ratio) // 2]
        lines.append(f"| decode speed >= 95% of static SlimWise's (testbed-a's shape) | budget / static per "
                     f"round {ratio[0]:.3f}-{ratio[-1]:.3f}, median {median:.3f} | "
                     f"{'yes' if median >= 0.95 else 'no'} |")
    return lines


def equal_reads(results: dict) -> list[str]:
    """Per backbone: the static 50% plan against the largest budget that reads no more experts per step."""
    lines = []
    for model, g in results.get("grid", {}).items():
        static = g["static"].get("0.5")
        if not static:
            continue
        mean, lo, hi, reads = _seeds(static)
        fits = [(float(k), c) for k, c in g["budget"].items() if c["experts_per_step"] <= reads]
        if not fits:
            continue
        share, c = max(fits, key=lambda kc: kc[0])
        lines.append(f"- {model}: static 50% reads {reads:.1f} experts per step for {_pct(mean)}% "
                     f"(seeds {_pct(lo)}-{_pct(hi)}); the budget E = {round(share * EXPERTS[model])} reads "
                     f"{c['experts_per_step']:.1f} for {_pct(c['accuracy'])}%.")
    return lines


def bench_table(results: dict) -> list[str]:
    runs = [results[k] for k in ("bench", "bench32") if results.get(k)]
    if not runs:
        return []
    lines = [f"## Decode speed ({runs[0]['model']}'s MoE shape, `slimwise bench`)", "",
             "Synthetic model of preset `cpu` (4 layers, 64 experts, top-8, routers skewed like testbed-a's "
             "decode usage), its static 50% plan; 48 output tokens, paired rounds (variants interleaved); "
             "speedup over full, median (min-max); budget / static: each round's tokens per second, "
             f"min / median / max. Machine: {results['machine']}, "
             f"{', '.join(results['hardware'].get('isa', []))}.", "",
             "| batch | rounds | static SlimWise | budget E = 32 | budget / static per round | "
             "experts read per step: full / static / budget |", "|---|---|---|---|---|---|"]
    for b in runs:
        for batch, r in b["rows"].items():
            sp = r["speedup"]

            def fmt(x: dict) -> str:
                return f"{x['median']:.2f}x ({x['min']:.2f}-{x['max']:.2f})"

            ratio = r["budget_over_static"]
            touched = " / ".join("-" if r["experts_touched"][v] is None
                                 else f"{r['experts_touched'][v]:.1f}" for v in ("full", "slimwise", "gated"))
            lines.append(f"| {batch} | {b.get('rounds', 3)} | {fmt(sp['slimwise'])} | {fmt(sp['gated'])} | "
                         f"{ratio[0]:.3f} / {ratio[len(ratio) // 2]:.3f} / {ratio[-1]:.3f} | {touched} |")
    return lines


def fallback_line(results: dict) -> list[str]:
    cells = {m: r["budget+fallback"]["0.5"] for m, r in results["models"].items() if "budget+fallback" in r}
    if not cells:
        return []
    return ["With the per-token fallback on top (`--budget-share 0.5 --fallback 0.5`: a row whose pruned "
            "share against S exceeds 0.5 uses every expert): " + "; ".join(
                f"{m} {_acc(c)}, {_reads(c)} experts per step" for m, c in cells.items()) + "."]


def _at(c: dict) -> str:
    return f"{_pct(c['accuracy'])} ({c['experts_per_step']:.1f})"


def by_batch_table(results: dict) -> list[str]:
    data = results.get("by_batch")
    if not data:
        return []
    lines = ["## By batch size", "",
             "Accuracy (experts read per step) of the dynamic budget at E and of the static plan keeping the "
             "same count (calibration seed 0), at batch 8, 32 and 64; batch 32 from the grid above.", "",
             "| backbone | batch | full | " + " | ".join(f"E = {100 * s:g}% of experts: budget / static"
                                                      for s in BATCH_SHARES) + " |",
             "|---|---|---|" + "---|" * len(BATCH_SHARES)]
    for model, batches in data.items():
        grid = results["grid"][model]
        merged = {**batches, "32": {"full": results["models"][model]["full"]["0"], "budget": grid["budget"],
                                    "static": {k: v["0"] for k, v in grid["static"].items()}}}
        for batch in sorted(merged, key=int):
            b = merged[batch]
            parts = []
            for share in BATCH_SHARES:
                bud, st = b["budget"].get(f"{share:g}"), b["static"].get(f"{1 - share:g}")
                parts.append(" / ".join("-" if c is None else _at(c) for c in (bud, st)))
            lines.append(f"| {model} | {batch} | {_at(b['full'])} | " + " | ".join(parts) + " |")
    return lines


def long_table(results: dict) -> list[str]:
    lg = results.get("long")
    if not lg:
        return []
    names = (("full", "full"), ("uniform", "uniform, whole-seq. calib."),
             ("uniform-decode", "uniform, decode calib."), ("static", "static SlimWise"),
             ("budget", "budget E = kept"), ("extra", "static + M"))
    rows = sorted([lg, *(results.get("long_ratios") or {}).values()], key=lambda r: r["ratio"])
    return [f"## Long prompts (testbed-a-long, {lg['length']} characters, batch 32)", "",
            f"{lg['n']} problems, 48 new tokens; accuracy (Δ full, paired); full: "
            f"{_pct(lg['full']['accuracy'])}.",
            "", "| pruned | " + " | ".join(label for key, label in names if key != "full") + " |",
            "|---|" + "---|" * (len(names) - 1),
            *(f"| {100 * r['ratio']:.0f}% | " + " | ".join(_acc(r[key]) for key, _ in names if key != "full")
              + " |" for r in rows)]


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grids = results.get("grid", {})
    if not grids:
        return
    fig, axes = plt.subplots(1, len(grids), figsize=(4.2 * len(grids), 3.6), squeeze=False)
    for ax, (model, g) in zip(axes[0], grids.items(), strict=True):
        full = results["models"][model]["full"]["0"]
        b = sorted(g["budget"].values(), key=lambda c: c["experts_per_step"])
        ax.plot([c["experts_per_step"] for c in b], [100 * c["accuracy"] for c in b], "o-",
                label="dynamic budget")
        for name, style in (("static", "s-"), ("uniform", "^--")):
            pts = sorted((_seeds(cells)[3], 100 * _seeds(cells)[0]) for cells in g[name].values())
            ax.plot(*zip(*pts, strict=True), style, label=f"{name} (3 seeds)" if name == "static"
                    else "uniform, whole-seq. (3 seeds)")
        ax.plot([full["experts_per_step"]], [100 * full["accuracy"]], "k*", markersize=10, label="full")
        ax.set_title(model)
        ax.set_xlabel("experts read per MoE layer per decode step (batch 32)")
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)


def render(results: dict, out: Path) -> None:
    body = ["# Batch-aware decode budgets", "",
            "Generated by `python -m experiments.batch_budgets --work runs/batch-budgets --out "
            "docs/results/batch-budgets` from [batch-budgets.json](batch-budgets/batch-budgets.json) "
            f"(per-problem correctness inside). Machine: {results['machine']}, "
            f"{', '.join(results['hardware'].get('isa', []))}.", "",
            "## The goal", "", *goal(results), "", "## At half the experts, batch 32", "",
            *headline(results), "", *fallback_line(results), "",
            "At equal experts read per step (batch 32):", "",
            *equal_reads(results), "",
            "## Accuracy against experts read", "", *grid_table(results), "",
            f"![accuracy against experts read](batch-budgets/{PLOT})", "",
            "## Batch dependence (testbed-a, 50%)", "", *batch_table(results), "",
            *by_batch_table(results), "", *long_table(results), "",
            *bench_table(results), "", "## What these numbers do not show", "", *CAVEATS]
    plot(results, out / PLOT)
    atomic_write_text(out.parent / f"{out.name}.md", "\n".join(body) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="runs/batch-budgets")
    p.add_argument("--out", default="docs/results/batch-budgets")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--stages", default="half,batch,grid,long,bench,bench32,bybatch,fallback,long-ratios",
                   help="comma-separated, in order: half (every backbone at 50%%, every variant), batch "
                        "(testbed-a's batch dependence), grid (budgets and static / uniform plans over 3 "
                        "calibration seeds), long (testbed-a-long at 1,024 characters), bench (batch 8, 32, "
                        "64; 3 rounds), bench32 (batch 32, 7 rounds), bybatch (the budget and static plans "
                        "at batch 8 and 64), fallback (the budget with --fallback 0.5); ratios: each variant "
                        "at 25/50/75%%")
    args = p.parse_args(argv)
    out = Path(args.out)
    data = out / "batch-budgets.json"
    if args.report_only:
        results = json.loads(data.read_text())
    else:
        results = measure(Path(args.work), out, args.stages.split(","))
    render(results, out)


if __name__ == "__main__":
    main()
