"""Where full-model prefill pays: full / uniform / SlimWise / uniform-distilled / SlimWise-distilled on the
long-prompt families (`slimwise.testbed.long_tasks`) as the prompt grows.

An experiment, not library code: nothing in `slimwise/` imports it. It regenerates
docs/results/long-prompts.md:
  python -m experiments.long_prompts run testbed-a-long --out runs/long-prompts/testbed-a-long
  python -m experiments.long_prompts run testbed-c-long --out runs/long-prompts/testbed-c-long
  python -m experiments.long_prompts report runs/long-prompts/*/report.json --out docs/results/long-prompts
(`report` also reads the reports.json it wrote, so a new backbone's run adds to the committed tables.)

Per backbone: REAP plans from decode-phase calibration on the long families' calib split (every swept length);
the test split at each prompt length, the same problems for every mode, so every difference is paired. Uniform
prunes prefill and decode; SlimWise prefills with the full model and decodes pruned; the two distilled modes
train the same decode-only delta recipe on long calib prompts (distinct from the calibration and test ones),
SlimWise's on the full prefill, the uniform baseline's on the pruned prefill (prefill trained too). A run
resumes: the report is written after each ratio and a finished ratio is not run again, on the weights it
started with only (their fingerprint is in the report: a re-shipped backbone needs another --out). The deltas
train under a wall-clock cap (`--distill-minutes`, the same time for both students) or for `--distill-steps`
each (the same steps).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from experiments.distill_bars import BarsConfig, distill_delta, evaluate_run
from slimwise.argtypes import OneLineParser, comma_list, integer, number
from slimwise.distill import DistillConfig, build_teacher
from slimwise.engines.reference import PhaseSplitEngine
from slimwise.evaluation.metrics import paired_difference
from slimwise.fingerprint import memory_fingerprint, model_fingerprint
from slimwise.hardware import describe, machine_line
from slimwise.io import atomic_write_text
from slimwise.options import add_dataclass_options, config_from_args
from slimwise.testbed.long_tasks import LENGTHS, MIN_LENGTH, make_long_split

MODES = ("uniform", "slimwise", "uniform_distilled", "distilled")
LABELS = {"full": "full", "uniform": "uniform", "slimwise": "SlimWise",
          "uniform_distilled": "uniform-distilled", "distilled": "SlimWise-distilled"}


@dataclass
class LongConfig:
    """What `run` sweeps and how; the command line's options are generated from the fields with help."""

    ratios: tuple[float, ...] = field(default=(0.25, 0.5, 0.75), metadata={
        "help": "pruning ratios, comma-separated, each in (0, 1)", "metavar": "R,R,...",
        "type": comma_list(number(0, 1, lo_open=True, hi_open=True)), "convert": tuple})
    lengths: tuple[int, ...] = field(default=LENGTHS, metadata={
        "help": f"prompt lengths in characters, comma-separated, each >= {MIN_LENGTH}", "metavar": "N,N,...",
        "type": comma_list(integer(MIN_LENGTH)), "convert": tuple})
    #: per length: 150 problems per length, 600 per mode
    test_per_family: int = field(default=50, metadata={"help": "test problems per family and length",
                                                         "type": integer(1)})
    calib_per_family: int = field(default=8, metadata={"help": "calibration prompts per family and length",
                                                         "type": integer(1)})
    calib_max_new_tokens: int = 32
    #: drawn with another seed than calibration's prompts
    distill_per_family: int = field(default=100, metadata={
        "help": "distillation prompts per family and length", "type": integer(1)})
    max_new_tokens: int = 48  # the longest worked target (infer's, with its steps) is 43 tokens
    batch_size: int = 16
    threads: int = field(default=2, metadata={"help": "torch threads", "type": integer(1)})
    seed: int = 0
    distilled: bool = field(default=True, metadata={
        "help": "training-free modes only (no distilled deltas)", "flag": "--no-distill"})
    distill: DistillConfig = field(default_factory=lambda: DistillConfig(max_minutes=7.0, max_new_tokens=32))


def _bars(config: LongConfig) -> BarsConfig:
    return BarsConfig(max_new_tokens=config.max_new_tokens, batch_size=config.batch_size)


def run(model_name: str, out_dir: str | Path, config: LongConfig) -> dict:
    """Every mode at every ratio and prompt length on one backbone; writes report.json after each ratio."""
    from slimwise.calibrate import CalibrationConfig, calibrate
    from slimwise.criteria import plan_from_stats
    from slimwise.models import load_model, load_tokenizer

    torch.set_num_threads(config.threads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    if report and report.get("config") != json.loads(json.dumps(asdict(config))):
        raise SystemExit(f"{path} was written with another configuration: pass another --out")
    model = load_model(model_name, dtype="float32")
    # a name can be re-shipped with new weights: a run resumes only on the weights it started with
    weights = memory_fingerprint(model_fingerprint(model))
    if report and (report.get("model"), report.get("weights")) != (model_name, weights):
        raise SystemExit(f"{path} was written for other weights ({report.get('model')}, "
                         f"{report.get('weights') or 'no fingerprint'}) than {model_name}'s now ({weights}): "
                         "pass another --out")
    report |= {"model": model_name, "weights": weights, "config": asdict(config), "machine": _machine()}
    report.setdefault("ratios", {})
    tok = load_tokenizer(model_name)
    tests = {str(n): make_long_split("test", config.test_per_family, n, seed=config.seed)
             for n in config.lengths}
    bars = _bars(config)
    if "full" not in report:
        engine = PhaseSplitEngine(model, tok)
        report["full"] = {n: evaluate_run(engine, s, "full", bars)
                          for n, s in tqdm(tests.items(), desc="full")}
        engine.close()
        _write(out, report)
    reference = {n: r["token_ids"] for n, r in report["full"].items()}
    calib = [s.prompt for n in config.lengths
             for s in make_long_split("calib", config.calib_per_family, n, seed=config.seed)]
    stats = calibrate(model, calib, tok, CalibrationConfig(phase="decode",
                                                           max_new_tokens=config.calib_max_new_tokens),
                      progress=False)
    # another seed than calibration's: distillation, calibration and test never share a prompt
    distill_prompts = [s.prompt for n in config.lengths
                       for s in make_long_split("calib", config.distill_per_family, n, seed=config.seed + 1)]
    calib_set = set(calib)
    distill_prompts = [p for p in distill_prompts if p not in calib_set]
    teacher = None
    for ratio in config.ratios:
        if str(ratio) in report["ratios"]:
            continue
        plan = plan_from_stats(stats, "reap", ratio)
        plan.save(out / f"plan-{ratio}.json")
        row: dict = {}
        engine = PhaseSplitEngine(model, tok, plan=plan)
        for mode in ("uniform", "slimwise"):
            row[mode] = {n: evaluate_run(engine, s, mode, bars, reference[n])
                         for n, s in tqdm(tests.items(), desc=f"{ratio} {mode}")}
        engine.close()
        if config.distilled:
            if teacher is None:  # depends on the model and the prompts only: one for every ratio and mode
                tqdm.write(f"teacher: the full model's continuations of {len(distill_prompts)} prompts")
                teacher = build_teacher(model, distill_prompts, tok,
                                        DistillConfig(**(asdict(config.distill) | {"progress": False})))
            for mode, label in (("uniform", "uniform_distilled"), ("slimwise", "distilled")):
                tqdm.write(f"{ratio} {label}: training its delta ({_budget(config.distill)})")
                delta = distill_delta(model, plan, distill_prompts, tok, config.distill, mode, teacher,
                                      out / f"delta-{label}-{ratio}")
                engine = PhaseSplitEngine(model, tok, plan=plan, delta=delta)
                row[label] = {n: evaluate_run(engine, s, "distilled", bars, reference[n])
                              for n, s in tqdm(tests.items(), desc=f"{ratio} {label}")}
                row[label]["distill"] = {k: delta.manifest[k]
                                         for k in ("seconds", "steps", "trainable_params")}
                engine.close()
        report["ratios"][str(ratio)] = row
        _write(out, report)
        tqdm.write(f"{model_name} {ratio}: " + "; ".join(
            f"{LABELS[m]} " + "/".join(f"{row[m][n]['accuracy']:.0f}" for n in tests) for m in row))
    return report


def _budget(config: DistillConfig) -> str:
    if config.max_minutes is None:
        return f"{config.steps} steps"
    return f"up to {config.steps} steps or {config.max_minutes:g} min"


def _machine() -> str:
    return f"{machine_line()}; ISA {', '.join(describe()['isa'])}"


def _write(out: Path, report: dict) -> None:
    atomic_write_text(out / "report.json", json.dumps(report, indent=1) + "\n")


# --------------------------------------------------------------------------------------------------------
# Report


def _pp(d: dict) -> str:
    return f"{100 * d['diff']:+.1f} [{100 * d['ci_low']:+.1f}, {100 * d['ci_high']:+.1f}]"


def comparisons(report: dict) -> list[dict]:
    """Per ratio and length: each mode's accuracy, length and KL, and the paired differences the question
    turns on (full prefill against pruned prefill, without and with distillation; each mode against full)."""
    rows = []
    for ratio, row in report["ratios"].items():
        for n, full in report["full"].items():
            entry = {"ratio": float(ratio), "length": int(n), "full": full["accuracy"],
                     "full_length": full["mean_length"]}
            for mode in MODES:
                if mode not in row:
                    continue
                r = row[mode][n]
                entry[mode] = {"accuracy": r["accuracy"], "mean_length": r["mean_length"], "kl": r.get("kl"),
                               "vs_full": paired_difference(r["correct"], full["correct"])}
            for key, a, b in (("slimwise_vs_uniform", "slimwise", "uniform"),
                              ("distilled_vs_uniform_distilled", "distilled", "uniform_distilled")):
                if a not in entry:
                    continue
                ra, rb = row[a][n], row[b][n]
                entry[key] = paired_difference(ra["correct"], rb["correct"])
                entry[f"{key}_length"] = paired_difference(ra["lengths"], rb["lengths"])
                if "kl_per_problem" in ra and "kl_per_problem" in rb:  # reports from before it: no interval
                    entry[f"{key}_kl"] = paired_difference(ra["kl_per_problem"], rb["kl_per_problem"])
            rows.append(entry)
    return rows


def _distill_line(report: dict) -> list[str]:
    d = report.get("distill_config")
    if not d:
        return []
    cfg = report["config"]
    params = "+".join(d["params"])
    steps = [f"{float(ratio):.0%} uniform-distilled {row['uniform_distilled']['distill']['steps']}, "
             f"SlimWise-distilled {row['distilled']['distill']['steps']}"
             for ratio, row in report["ratios"].items() if "distilled" in row]
    head = (f"Distilled: `slimwise distill`'s recipe ({params}, LoRA rank {d['lora_rank']}, ")
    tail = (f"on {cfg['distill_per_family']} calib problems per family and length (another seed than the "
            f"calibration's), the full model's continuations of up to {d['max_new_tokens']} tokens as the "
            "teacher.")
    if d["max_minutes"] is None:  # --distill-steps: both students train the same number of steps
        return [head + f"{d['steps']} steps of {d['batch_size']} prompts for each delta, no time cap) " + tail
                + " Equal steps, not equal time: the uniform student backpropagates through the pruned "
                "prefill of the whole prompt, SlimWise's only through its decode steps. Seconds per delta: "
                + "; ".join(f"{float(ratio):.0%} uniform-distilled "
                            f"{row['uniform_distilled']['distill']['seconds']:.0f}, SlimWise-distilled "
                            f"{row['distilled']['distill']['seconds']:.0f}"
                            for ratio, row in report["ratios"].items() if "distilled" in row) + ".", ""]
    return [head + f"up to {d['steps']} steps of {d['batch_size']} prompts, capped at {d['max_minutes']:g} "
            "min per delta) " + tail + " Steps done within the cap (the uniform student backpropagates "
            "through the pruned prefill of the whole prompt, SlimWise's only through its decode steps, so an "
            "equal wall-clock budget is not an equal number of steps): " + "; ".join(steps) + ".", ""]


def markdown(reports: Sequence[dict]) -> str:
    lines = ["# Long prompts: full prefill against pruned prefill as the prompt grows", "",
             "Generated by `python -m experiments.long_prompts report` from the reports below; accuracy "
             "in %, paired differences in points with 95% bootstrap intervals over the same problems.", ""]
    for report in reports:
        cfg = report["config"]
        lines += [f"## {_section(report)}", "",
                  f"{cfg['test_per_family']} test problems per family and length (lookup, chain, infer), "
                  f"greedy, max {cfg['max_new_tokens']} new tokens; REAP plans from decode-phase calibration "
                  f"on {cfg['calib_per_family']} calib problems per family and length. Machine: "
                  + report["machine"] + ".", "", *_distill_line(report),
                  "| ratio | prompt chars | full | uniform | SlimWise | SlimWise - uniform | "
                  "uniform-distilled | SlimWise-distilled | distilled - uniform-distilled |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for e in comparisons(report):
            def acc(m: str, e: dict = e) -> str:
                return f"{e[m]['accuracy']:.1f}" if m in e else "-"

            def diff(key: str, e: dict = e) -> str:
                return _pp(e[key]) if key in e else "-"

            lines.append(f"| {e['ratio']:.0%} | {e['length']:,} | {e['full']:.1f} | {acc('uniform')} | "
                         f"{acc('slimwise')} | {diff('slimwise_vs_uniform')} | {acc('uniform_distilled')} | "
                         f"{acc('distilled')} | {diff('distilled_vs_uniform_distilled')} |")
        lines += ["", "Generated length (mean tokens) and KL(full || mode) per token over the full model's "
                  "continuations:", "",
                  "| ratio | prompt chars | full length | "
                  + " | ".join(f"{LABELS[m]} length / KL" for m in MODES) + " |",
                  "|---|---|---|" + "---|" * len(MODES)]
        for e in comparisons(report):
            cells = [f"{e[m]['mean_length']:.1f} / {e[m]['kl']:.3f}" if m in e else "-" for m in MODES]
            lines.append(f"| {e['ratio']:.0%} | {e['length']:,} | {e['full_length']:.1f} | "
                         + " | ".join(cells) + " |")
        lines += ["", "Paired differences in length (tokens) and KL per problem (the problem's mean over its "
                  "tokens), with 95% bootstrap intervals (\"-\" under KL: the report predates per-problem "
                  "KL):", "",
                  "| ratio | prompt chars | SlimWise - uniform: length | KL | distilled - uniform-distilled: "
                  "length | KL |", "|---|---|---|---|---|---|"]
        for e in comparisons(report):
            def ci(key: str, digits: int, e: dict = e) -> str:
                if key not in e:
                    return "-"
                d = e[key]
                return f"{d['diff']:+.{digits}f} [{d['ci_low']:+.{digits}f}, {d['ci_high']:+.{digits}f}]"

            lines.append(f"| {e['ratio']:.0%} | {e['length']:,} | "
                         + " | ".join(ci(f"{k}{suffix}", digits) for k in ("slimwise_vs_uniform",
                                                                           "distilled_vs_uniform_distilled")
                                      for suffix, digits in (("_length", 2), ("_kl", 3))) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(reports: Sequence[dict], path: Path) -> None:
    """Accuracy against prompt length, one panel per backbone and ratio, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = sorted({float(r) for rep in reports for r in rep["ratios"]})
    fig, axes = plt.subplots(len(reports), len(ratios), figsize=(4 * len(ratios), 3.2 * len(reports)),
                             squeeze=False, sharey=True)
    for i, report in enumerate(reports):
        lengths = [int(n) for n in report["full"]]
        for j, ratio in enumerate(ratios):
            ax = axes[i][j]
            ax.plot(lengths, [report["full"][str(n)]["accuracy"] for n in lengths], "k-o", label="full")
            row = report["ratios"].get(str(ratio), {})
            if not row:  # a section run at some ratios only (an equal-steps run, say)
                ax.text(0.5, 0.5, "not run at this ratio", ha="center", va="center", transform=ax.transAxes,
                        fontsize=8, color="0.4")
            for mode, style in zip(MODES, ("C0--s", "C1-s", "C0:^", "C1-^"), strict=True):
                if mode in row:
                    ax.plot(lengths, [row[mode][str(n)]["accuracy"] for n in lengths], style,
                            label=LABELS[mode])
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [str(n) for n in lengths])
            ax.set_title(f"{_section(report)}, {ratio:.0%} pruned", fontsize=8)
            ax.set_xlabel("prompt length (characters)")
            if j == 0:
                ax.set_ylabel("accuracy (%)")
    # one legend for the figure: the first panel may lack modes a later one has (a 25% row run training-free)
    handles = {label: h for ax in axes.flat for h, label in zip(*ax.get_legend_handles_labels(), strict=True)}
    axes[0][0].legend(handles.values(), handles.keys(), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _section(report: dict) -> str:
    """Runs whose deltas train equal steps (`--distill-steps`) get their own section: merged into the
    wall-clock-capped one, a ratio would show one regime's students under the other's "Distilled:" line. A
    merged report keeps its first run's config, so its section is derived again from it."""
    cfg = report["config"]
    if cfg.get("distilled", True) and cfg["distill"]["max_minutes"] is None:
        return f"{report['model']}, equal distillation steps"
    return report["model"]


def merge(reports: Sequence[dict]) -> list[dict]:
    """One report per model and distillation regime: runs of the same model (say all ratios training-free,
    then one ratio distilled) share its full-model runs, which must agree; a ratio keeps the run with the most
    modes."""
    merged: dict[str, dict] = {}
    for rep in reports:
        into = merged.setdefault(_section(rep), {**rep, "ratios": {}})
        if into.get("weights") and rep.get("weights") and into["weights"] != rep["weights"]:
            raise SystemExit(f"{rep['model']}: two reports of other weights under one name (re-shipped?)")
        if any(into["full"][n]["correct"] != rep["full"][n]["correct"] for n in rep["full"]):
            raise SystemExit(f"{rep['model']}: two reports disagree on the full model's answers")
        for ratio, row in rep["ratios"].items():
            if len(row) >= len(into["ratios"].get(ratio, {})):
                into["ratios"][ratio] = row
                if any(m in row for m in ("distilled", "uniform_distilled")):
                    into["distill_config"] = rep["config"]["distill"]
    return [dict(rep, ratios=dict(sorted(rep["ratios"].items(), key=lambda kv: float(kv[0]))))
            for rep in merged.values()]


def _distill_config(minutes: float, steps: int | None) -> DistillConfig:
    """The wall-clock cap by default; with `steps`, that many steps for each delta and no cap."""
    if steps is None:
        return DistillConfig(max_minutes=minutes, max_new_tokens=32)
    return DistillConfig(steps=steps, max_minutes=None, max_new_tokens=32)


def main(argv: Sequence[str] | None = None) -> int:
    p = OneLineParser(prog="python -m experiments.long_prompts")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    r = sub.add_parser("run", help="every mode, ratio and prompt length on one backbone")
    r.add_argument("model", help="a shipped testbed name or a checkpoint directory")
    r.add_argument("--out", required=True, help="the run's directory (report.json, plans, deltas); resumed")
    add_dataclass_options(r, LongConfig)
    r.add_argument("--distill-minutes", type=number(0, lo_open=True), default=7.0,
                   help="wall-clock cap per delta")
    r.add_argument("--distill-steps", type=integer(1), default=None,
                   help="each delta trains exactly this many steps, no time cap (equal steps)")
    g = sub.add_parser("report", help="tables and plot from finished reports")
    g.add_argument("reports", nargs="+", help="report.json files of `run`, or a reports.json of `report`")
    g.add_argument("--out", required=True, help="writes OUT.md and OUT/accuracy_vs_length.png")
    args = p.parse_args(argv)
    if args.command == "run":
        config = config_from_args(LongConfig, args,
                                  distill=_distill_config(args.distill_minutes, args.distill_steps))
        for name in ("ratios", "lengths"):
            if not getattr(config, name):
                r.error(f"--{name} names none")
        run(args.model, args.out, config)
        return 0
    loaded = []  # a report.json of `run`, or the reports.json a `report` wrote (a list, merged already)
    for x in args.reports:
        data = json.loads(Path(x).read_text())
        loaded += data if isinstance(data, list) else [data]
    reports = merge(loaded)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for report in reports:  # the committed copies keep what the tables need, not every token id
        for by_length in report["full"].values():
            by_length.pop("token_ids", None)
    atomic_write_text(out.with_suffix(".md"), markdown(reports) + "\n")
    plot(reports, out / "accuracy_vs_length.png")
    atomic_write_text(out / "reports.json", json.dumps(reports, indent=1) + "\n")
    print(out.with_suffix(".md"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
