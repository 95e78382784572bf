"""Markdown report of an evaluation (`slimwise.evaluation` report dict -> report.md, README tables, index.md).

Kept apart from the metrics so the JSON stays the single source of truth: every number in the Markdown (and in
the PNG plots, `plots`) is read back from it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from slimwise.evaluation.config import calib_mix_label
from slimwise.evaluation.metrics import significant
from slimwise.io import atomic_write_text

# ----------------------------------------------------------------------------------------------------------
# helpers


def _pct(x: float | None, digits: int = 1) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{digits}f}%"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def signed_pp(d: dict | None) -> str:
    """A paired difference as "+x.x pp [lo, hi]" (with "p=..." where the report holds the Holm-adjusted
    exact p), marked where it is significant (`metrics.significant`)."""
    if not d:
        return "–"
    mark = " **↑**" if significant(d, 1) else (" **↓**" if significant(d, -1) else "")
    p = f" p={d['p_holm']:.2g}" if "p_holm" in d else ""
    return f"{100 * d['diff']:+.1f} pp [{100 * d['ci_low']:+.1f}, {100 * d['ci_high']:+.1f}]{p}{mark}"


def run_criteria(report: dict) -> list[str]:
    return list(dict.fromkeys(r["criterion"] for r in report["runs"]))


def run_phases(report: dict) -> list[str | None]:
    return list(dict.fromkeys(r["phase"] for r in report["runs"]))


def run_modes(report: dict) -> list[str]:
    return list(dict.fromkeys(r["mode"] for r in report["runs"]))


def headline_runs(report: dict) -> tuple[str, float, str | None, dict[str, dict]]:
    """The configured headline plan's runs per mode, else the closest available (criterion, ratio, phase)."""
    criterion, ratio, phase = report["config"].get("headline", ("reap", 0.5, "decode"))
    runs = report["runs"]
    if not runs:
        return criterion, ratio, phase, {}

    distilled = {(r["criterion"], r["ratio"], r["phase"]) for r in runs if r["mode"] == "distilled"}

    def score(r: dict) -> tuple:  # a plan with a distilled run first: it is the one the delta was made for
        return ((r["criterion"], r["ratio"], r["phase"]) not in distilled, r["criterion"] != criterion,
                r["phase"] != phase, abs(r["ratio"] - ratio))

    best = min(runs, key=score)
    picked = {r["mode"]: r for r in runs if (r["criterion"], r["ratio"], r["phase"]) ==
              (best["criterion"], best["ratio"], best["phase"])}
    return best["criterion"], best["ratio"], best["phase"], picked


def table_row(mode: str, run: dict | None, m: dict, full: dict) -> list[str]:
    """One row of the main table (also used by the demo's console table)."""
    tr = m.get("traffic") or {}
    diff = None if mode == "full" else m["accuracy"] - full["accuracy"]
    mb = tr.get("expert_bytes_per_step")
    return [
        mode,
        run["criterion"] if run else "–",
        str(run["phase"]) if run else "–",
        f"{run['ratio']:.2f}" if run else "0",
        f"{_pct(m['accuracy'])} [{_pct(m['accuracy_ci_low'], 0)}, {_pct(m['accuracy_ci_high'], 0)}]",
        "–" if diff is None else f"{100 * diff:+.1f} pp",
        f"{m['length_mean']:.1f} / {m['length_median']:.0f} / {m['length_p90']:.0f}",
        _pct(m["eos_share"], 0),
        _pct(m["truncated_share"], 0),
        f"{m['length_ratio_mean']:.2f} / {m['length_ratio_median']:.2f} ({m['length_ratio_p10']:.2f}–"
        f"{m['length_ratio_p90']:.2f})",
        _pct(m["exact_match"], 0),
        _num(m.get("first_diff_mean"), ".1f"),
        _num(m.get("kl_mean"), ".4f"),
        (f"{tr['distinct_experts_per_layer_step']:.1f} ({tr['uniform_expectation']:.1f})"
         if tr.get("distinct_experts_per_layer_step") is not None else "–"),
        "–" if mb is None else f"{mb / 2**20:.2f}",
    ]


TABLE_HEADER = ["mode", "criterion", "calib", "ratio", "accuracy [95% CI]", "Δ acc vs full",
                "len mean / med / p90", "EOS", "truncated", "len ratio vs full: mean / med (p10–p90)",
                "exact match", "first diff pos", "KL(full‖mode)",
                "experts/layer/step (uniform-routing exp.)", "expert MiB/step"]


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _sorted_runs(report: dict) -> list[dict]:
    order = {m: i for i, m in enumerate(run_modes(report))}
    return sorted(report["runs"],
                  key=lambda r: (r["criterion"], str(r["phase"]), r["ratio"], order[r["mode"]]))


def main_table(report: dict) -> list[list[str]]:
    full = report["full"]
    return [table_row("full", None, full, full)] + [table_row(r["mode"], r, r["metrics"], full)
                                                    for r in _sorted_runs(report)]


# ----------------------------------------------------------------------------------------------------------
# Markdown


def summary_lines(report: dict) -> list[str]:
    """Plain statements of what the numbers show, including where SlimWise does not beat uniform."""
    full = report["full"]
    lines = [f"- Full model: accuracy {_pct(full['accuracy'])} "
             f"[{_pct(full['accuracy_ci_low'], 0)}, {_pct(full['accuracy_ci_high'], 0)}] on "
             f"{report['tasks']['n']} problems, mean length {full['length_mean']:.1f} tokens, "
             f"{_pct(full['eos_share'], 0)} stopped by EOS."]
    lines += _comparison_lines(report)
    by_ratio: dict[float, dict[str, list[dict]]] = {}
    for r in report["runs"]:
        by_ratio.setdefault(r["ratio"], {}).setdefault(r["mode"], []).append(r["metrics"])
    lines += _per_ratio_lines(report, by_ratio)
    ftr = full.get("traffic") or {}
    lines += _traffic_lines(report, by_ratio, ftr)
    for c in report["comparisons"]:
        if "distilled_minus_slimwise" in c:
            d = report.get("distilled") or {}
            lines.append(f"- Distilled decoder ({'+'.join(d.get('params') or [])}, {d.get('steps')} steps) "
                         f"at {c['criterion']}/{c['phase']}/{c['ratio']:g}: distilled − SlimWise "
                         f"{signed_pp(c['distilled_minus_slimwise'])}, distilled − full "
                         f"{signed_pp(c.get('distilled_minus_full'))}.")
    return lines + _headline_lines(report, ftr)


def _comparison_lines(report: dict) -> list[str]:
    """SlimWise against uniform pruning over the plans (paired CIs, where it is lower or ties), and against
    full by calibration phase."""
    s = report["summary"]
    comps = [c for c in report["comparisons"] if "slimwise_minus_uniform" in c]
    if not comps:
        return []
    test = ("McNemar's exact test, Holm-adjusted over the paired table, p < 0.05"
            if "p_holm" in comps[0]["slimwise_minus_uniform"] else "paired bootstrap 95% CI")
    lines = [f"- SlimWise − uniform accuracy ({test}) over {len(comps)} plans: "
             f"significantly higher in {s['slimwise_better']}, significantly lower in {s['slimwise_worse']}, "
             f"not distinguishable in {s['no_significant_difference']} (point estimate higher in "
             f"{s['slimwise_higher_point_estimate']}, lower in {s['slimwise_lower_point_estimate']})."]
    lower = [c for c in comps if c["slimwise_minus_uniform"]["diff"] < 0]
    ties = [c for c in comps if c["slimwise_minus_uniform"]["diff"] == 0]
    if lower:
        names = ", ".join(f"{c['criterion']}/{c['phase']}/{c['ratio']:g} "
                          f"({100 * c['slimwise_minus_uniform']['diff']:+.1f} pp)" for c in lower)
        lines.append(f"- SlimWise scores below uniform pruning (point estimate) at: {names}.")
    if ties:
        names = ", ".join(f"{c['criterion']}/{c['phase']}/{c['ratio']:g}" for c in ties)
        lines.append(f"- SlimWise ties uniform pruning at: {names}.")
    if not lower and not ties:
        lines.append("- SlimWise's point estimate is above uniform pruning's at every plan.")
    by_phase: dict[str, list[float]] = {}
    for c in report["comparisons"]:
        if "slimwise_minus_full" in c:
            by_phase.setdefault(str(c["phase"]), []).append(c["slimwise_minus_full"]["diff"])
    if len(by_phase) > 1:
        parts = ", ".join(f"{p}: {100 * sum(v) / len(v):+.1f} pp" for p, v in by_phase.items())
        lines.append(f"- Mean SlimWise − full accuracy by calibration phase: {parts}.")
    return lines


def _per_ratio_lines(report: dict, by_ratio: dict[float, dict[str, list[dict]]]) -> list[str]:
    """Length ratio, KL and exact match per pruning ratio and mode (means over criteria and phases)."""
    if not by_ratio:
        return []

    def mean(ms: list[dict], key: str) -> float | None:
        vals = [m[key] for m in ms if m.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    def per_ratio(key: str, fmt: str) -> str:
        return "; ".join(f"{ratio:.0%}: " + ", ".join(f"{mode} {_num(mean(ms, key), fmt)}"
                                                      for mode, ms in modes.items())
                         for ratio, modes in sorted(by_ratio.items()))

    lines = ["- Mean length ratio to full (averaged over criteria and calibration phases) — "
             + per_ratio("length_ratio_mean", ".2f") + ".",
             "- Mean KL(full‖mode) per generated token — " + per_ratio("kl_mean", ".3f") + ".",
             "- Whole-output exact match with full — " + per_ratio("exact_match", ".2f") + "."]
    plans: dict[str, dict[str, float | None]] = {}
    for r in report["runs"]:
        plans.setdefault(r["label"], {})[r["mode"]] = r["metrics"].get("kl_mean")
    both = [v for v in plans.values() if v.get("slimwise") is not None and v.get("uniform") is not None]
    if both:
        lower = sum(v["slimwise"] < v["uniform"] for v in both)
        lines.append(f"- SlimWise's KL is below uniform pruning's in {lower} of {len(both)} plans.")
    return lines


def _traffic_lines(report: dict, by_ratio: dict[float, dict[str, list[dict]]], ftr: dict) -> list[str]:
    """Distinct experts per layer and decode step: full, and SlimWise's mean per ratio."""
    if ftr.get("distinct_experts_per_layer_step") is None or not by_ratio:
        return []
    parts = []
    for ratio, modes in sorted(by_ratio.items()):
        tr = [m["traffic"]["distinct_experts_per_layer_step"] for m in modes.get("slimwise", [])
              if (m.get("traffic") or {}).get("distinct_experts_per_layer_step") is not None]
        if tr:
            avg = sum(tr) / len(tr)
            parts.append(f"{avg:.1f} at {ratio:.0%} "
                         f"({avg / ftr['distinct_experts_per_layer_step']:.0%} of full)")
    if not parts:
        return []
    return [f"- Decode traffic at batch size {report['generation']['batch_size']}: full touches "
            f"{ftr['distinct_experts_per_layer_step']:.1f} experts/layer/step (uniform-routing "
            f"expectation {ftr['uniform_expectation']:.1f}); SlimWise " + ", ".join(parts) + "."]


def _headline_lines(report: dict, ftr: dict) -> list[str]:
    """The headline plan's modes side by side."""
    crit, ratio, phase, head = headline_runs(report)
    if not head:
        return []
    parts = []
    for mode, r in head.items():
        m = r["metrics"]
        tr = m.get("traffic") or {}
        parts.append(f"{mode} {_pct(m['accuracy'])} (mean length {m['length_mean']:.1f}, ratio to full "
                     f"{m['length_ratio_mean']:.2f}, exact match {_pct(m['exact_match'], 0)}, KL "
                     f"{_num(m.get('kl_mean'), '.3f')}"
                     + (f", {tr['distinct_experts_per_layer_step']:.1f} experts/layer/step"
                        if tr.get("distinct_experts_per_layer_step") is not None else "") + ")")
    return [f"- Headline plan {crit} at {ratio:.0%} ({phase} calibration): " + "; ".join(parts)
            + (f"; full decode touches {ftr['distinct_experts_per_layer_step']:.1f} "
               "experts/layer/step."
               if ftr.get("distinct_experts_per_layer_step") is not None else ".")]


def _gates_note(cfg: dict) -> str:
    """The pruned rows' gates when not the plain (sliced-router) ones; empty for reports without them."""
    gates, fallback = cfg.get("gates", "renorm"), cfg.get("fallback")
    if gates == "renorm" and fallback is None:
        return ""
    return (f"; pruned rows' gates `{gates}`" + ("" if fallback is None else
            f", falling back to every expert above a pruned share of {fallback:g} (share of token-layer "
            "pairs that fell back: section Fallback)"))


def fallback_lines(report: dict) -> list[str]:
    """Per pruned run with gate counters: how often a pruned token's full top-k held a pruned expert, and how
    often it fell back to every expert (token-layer pairs)."""
    runs = [r for r in _sorted_runs(report) if r["metrics"].get("fallback")]
    if not runs:
        return []
    rows = [[r["mode"], r["criterion"], str(r["phase"]), f"{r['ratio']:.2f}",
             str(r["metrics"]["fallback"]["routed"]),
             _pct(r["metrics"]["fallback"]["touching_pruned_share"]),
             _pct(r["metrics"]["fallback"]["fallback_share"])] for r in runs]
    return ["", "## Fallback", "",
            "Token-layer pairs routed with the plan (decode tokens; every token in uniform), the share whose "
            "full top-k put weight on a pruned expert, and the share that fell back to every expert.", "",
            *_md_table(["mode", "criterion", "calib", "ratio", "pairs", "touching pruned", "fell back"],
                       rows)]


def write_markdown(report: dict, path: str | Path) -> Path:
    """report.md from report.json: a pure function of the report (committed reports re-render bit for bit)."""
    path = Path(path)
    lines = _header_lines(report)
    lines += ["", "## Summary", "", *summary_lines(report), "", *readme_table(report), ""]
    lines += ["## Main table", "",
              "Accuracy with a 95% bootstrap interval; Δ against the full model. Lengths in generated tokens "
              "(EOS included). Experts/layer/step: distinct routed experts per MoE layer per decode step "
              "over the batch's live rows (uniform-routing expectation E·(1−(1−k/E)^B) in brackets, E = "
              "experts decode can use); MiB/step: the expert weights those imply, summed over layers.", ""]
    lines += _md_table(TABLE_HEADER, main_table(report))
    lines += fallback_lines(report)
    for section in (_paired_lines, _other_domain_lines, _family_lines, _closing_lines):
        lines += section(report)
    atomic_write_text(path, "\n".join(lines))
    return path


def _header_lines(report: dict) -> list[str]:
    """The model, tasks, generation, runtime, baseline and sample-size lines under the title."""
    m, t, g, tm = report["model"], report["tasks"], report["generation"], report["timing"]
    env, cfg = report["environment"], report.get("config", {})
    lines = [f"# SlimWise evaluation: {m['name']}", ""]
    lines.append(f"Model `{m['name']}` ({m['family']}, {m['parameters'] / 1e6:.2f}M parameters, "
                 f"{m['num_experts']} routed experts, top-{m['top_k']}, {m['moe_layers']} MoE layers, "
                 f"{m['expert_bytes'] / 1024:.1f} KiB per expert).")
    fams = ", ".join(f"{f} {n}" for f, n in t["per_family"].items())
    lines.append(f"Tasks: {t['source']}" + (f" {t['split']} split" if t.get("split") else "")
                 + (f", domain {t['domain']}" if t.get("domain") else "")
                 + f"; {t['n']} problems ({fams}); grader `{t['grader']}`; test seed {cfg.get('seed', 0)}, "
                 # before calib_seed existed, the test seed drew the calibration split too
                 f"calibration seed {cfg.get('calib_seed', cfg.get('seed', 0))}.")
    lines.append(f"Generation: greedy, max {g['max_new_tokens']} new tokens, batch size {g['batch_size']}, "
                 f"engine `{g['engine']}`" + _gates_note(cfg) + ".")
    lines.append(f"Runtime: {tm.get('total_s', 0):.0f} s on {env['cpu_count']} CPUs ({env['torch_threads']} "
                 f"torch threads): load {tm.get('load_s', 0):.0f} s, calibration "
                 f"{tm.get('calibration_s', 0):.0f} s, full {tm.get('full_s', 0):.0f} s, pruned runs "
                 f"{tm.get('pruned_runs_s', 0):.0f} s; without the run cache about "
                 f"{tm.get('uncached_estimate_s', 0):.0f} s.")
    baseline = sorted({r["calibrated_on"] for r in report["runs"] if "calibrated_on" in r})
    if baseline:  # reports before --uniform-phase ran uniform on each plan itself
        lines.append(f"Uniform (classic pruning): each plan's criterion and ratio, calibrated on "
                     f"{', '.join(baseline)} tokens (`--uniform-phase`; all: whole sequences, as classic "
                     "pruners calibrate), not on the plan's own phase.")
    hw = report["summary"]["accuracy_ci_halfwidth_at_half"]
    lines.append(f"Sample size: n = {t['n']} gives a 95% interval of about ±{100 * hw:.0f} pp at 50% "
                 "accuracy (less near 0% or 100%); paired differences between modes on the same "
                 "problems are tighter.")
    return lines


def _paired_lines(report: dict) -> list[str]:
    """The paired-differences table (exact p, Holm-adjusted over the table, where the report has them)."""
    lines: list[str] = []
    if report["comparisons"]:
        keys = ["slimwise_minus_uniform", "slimwise_minus_full", "uniform_minus_full"]
        keys += [k for k in ("distilled_minus_slimwise", "distilled_minus_uniform", "distilled_minus_full")
                 if any(k in c for c in report["comparisons"])]
        cells = [c[k] for c in report["comparisons"] for k in c if "_minus_" in k]
        lines += ["", "## Paired accuracy differences", "",
                  f"Same problems, paired bootstrap 95% interval and McNemar's exact p, Holm-adjusted over "
                  f"the {len(cells)} differences of this table; **↑**/**↓** mark p < 0.05."
                  if all("p_holm" in d for d in cells) else
                  "Same problems, paired bootstrap 95% interval; **↑**/**↓** mark "
                  "intervals that exclude 0.", ""]
        rows = []
        for c in sorted(report["comparisons"], key=lambda c: (c["criterion"], str(c["phase"]), c["ratio"])):
            rows.append([c["criterion"], str(c["phase"]), f"{c['ratio']:.2f}",
                         *(signed_pp(c.get(k)) for k in keys)])
        lines += _md_table(["criterion", "calib", "ratio", *(k.replace("_minus_", " − ") for k in keys)],
                           rows)
    return lines


def _other_domain_lines(report: dict) -> list[str]:
    """What each plan costs on the other domains' problems (reports with other-domain runs)."""
    lines: list[str] = []
    cfg = report.get("config", {})
    if report.get("other_domains"):
        od = report["other_domains"]
        fams_o = ", ".join(f"{f} {n}" for f, n in od["per_family"].items())
        lines += ["", "## Other domains: what a plan costs outside its calibration domain", "",
                  f"Every plan is also run on {od['n']} problems of the other domains "
                  f"({', '.join(od['domains'])}: {fams_o}; same seed and split). Calibration `<phase>@<mix>` "
                  "is a mixed-domain calibration ("
                  + "; ".join(f"`{calib_mix_label(x)}`: "
                              f"{'every domain alike' if x == 'all' else 'weights ' + x}"
                              for x in cfg.get("calib_mixes") or ())
                  + "). SlimWise − uniform: paired bootstrap 95% interval on the other-domain problems.", ""]
        lines += transfer_table(report)
    return lines


def _family_lines(report: dict) -> list[str]:
    """Accuracy per task family for every run, then every metric per family at the headline plan."""
    lines: list[str] = []
    t = report["tasks"]
    lines += ["", "## Accuracy per task family", ""]
    fams = t["families"]
    rows = [["full", "–", "–", "–", *(_pct(report["full"]["by_family"][f]["accuracy"], 0) for f in fams)]]
    for r in _sorted_runs(report):
        rows.append([r["mode"], r["criterion"], str(r["phase"]), f"{r['ratio']:.2f}",
                     *(_pct(r["metrics"]["by_family"][f]["accuracy"], 0) for f in fams)])
    lines += _md_table(["mode", "criterion", "calib", "ratio", *fams], rows)
    crit, ratio, phase, head = headline_runs(report)
    if head:
        lines += ["", f"## Per family at the headline plan ({crit}, {ratio:.0%}, {phase} calibration)", ""]
        rows = []
        for f in fams:
            for mode, bf in [("full", report["full"]["by_family"][f])] + [
                    (mo, r["metrics"]["by_family"][f]) for mo, r in head.items()]:
                rows.append([f, mode, f"{_pct(bf['accuracy'], 0)} [{_pct(bf['accuracy_ci_low'], 0)}, "
                             f"{_pct(bf['accuracy_ci_high'], 0)}]", f"{bf['length_mean']:.1f}",
                             _pct(bf["eos_share"], 0), _pct(bf["truncated_share"], 0),
                             f"{bf['length_ratio_mean']:.2f}", _pct(bf["exact_match"], 0),
                             _num(bf.get("first_diff_mean"), ".1f"), _num(bf.get("kl_mean"), ".4f")])
        lines += _md_table(["family", "mode", "accuracy [95% CI]", "len mean", "EOS", "truncated",
                            "len ratio", "exact match", "first diff", "KL"], rows)
    return lines


def _closing_lines(report: dict) -> list[str]:
    """Plots, calibration runs and the metric definitions."""
    lines: list[str] = []
    if report.get("plots"):
        lines += ["", "## Plots", ""]
        titles = {"accuracy_vs_ratio.png": "Accuracy against pruning ratio",
                  "lengths.png": "Generated-length distributions",
                  "fidelity_vs_ratio.png": "Fidelity to the full model against pruning ratio",
                  "traffic_vs_ratio.png": "Decode expert traffic against pruning ratio",
                  "transfer.png": "Target-domain against other-domain accuracy, per calibration"}
        for p in report["plots"]:
            lines += [f"![{titles.get(p, p)}]({p})", ""]
    if report.get("calibration"):
        lines += ["## Calibration", ""]
        rows = [[ph, str(c.get("source")), str(c.get("prompts", "–")), f"{c.get('tokens_counted', 0):.0f}",
                 f"{c.get('seconds', 0):.1f}", "yes" if c.get("cached") else "no"]
                for ph, c in report["calibration"].items()]
        lines += _md_table(["phase", "data", "prompts", "tokens counted per layer", "seconds", "from cache"],
                           rows)
    lines += ["", "## Metric definitions", "",
              "- accuracy: graded final answer; interval: percentile bootstrap of the mean "
              "(resampling problems).",
              "- length: generated tokens including the final EOS; truncated: hit max_new_tokens without "
              "EOS; length ratio: per problem, mode length / full length.",
              "- exact match: whole generated token sequence equals the full model's; first diff pos: mean "
              "index of the first differing token over the outputs that differ.",
              "- KL(full‖mode): teacher-forced on the full model's own continuation — each mode prefills "
              "with its prefill model and scores the continuation in one forward with its decode model; mean "
              "over generated positions (0 at the first position for SlimWise, whose "
              "prefill is the full model's).",
              "- decode traffic: router hooks count distinct experts chosen by the live rows of each decode "
              "step, per MoE layer; bytes = distinct × bytes of one expert.", ""]
    return lines


def readme_table(report: dict) -> list[str]:
    """A compact Markdown table for the README: the headline criterion and phase at every ratio."""
    crit, _, phase, _ = headline_runs(report)
    full = report["full"]
    header = ["pruned", "full acc", "uniform acc", "SlimWise acc", "SlimWise − uniform (paired 95% CI)",
              "len ratio uniform / SlimWise", "KL uniform / SlimWise", "experts/layer/step full → SlimWise"]
    comps = {(c["criterion"], c["phase"], c["ratio"]): c for c in report["comparisons"]}
    distilled = any(r["mode"] == "distilled" for r in report["runs"])
    if distilled:
        header.insert(4, "distilled acc")
    rows = []
    for ratio in sorted({r["ratio"] for r in report["runs"]}):
        runs = {r["mode"]: r["metrics"] for r in report["runs"]
                if (r["criterion"], r["phase"], r["ratio"]) == (crit, phase, ratio)}
        if not runs:
            continue
        u, w = runs.get("uniform"), runs.get("slimwise")
        tr_f = (full.get("traffic") or {}).get("distinct_experts_per_layer_step")
        tr_w = ((w or {}).get("traffic") or {}).get("distinct_experts_per_layer_step")
        d = runs.get("distilled")
        rows.append([f"{ratio:.0%}", _pct(full["accuracy"]), _pct(u["accuracy"]) if u else "–",
                     _pct(w["accuracy"]) if w else "–",
                     *([_pct(d["accuracy"]) if d else "–"] if distilled else []),
                     signed_pp(comps.get((crit, phase, ratio), {}).get("slimwise_minus_uniform")),
                     f"{_num(u and u['length_ratio_mean'])} / {_num(w and w['length_ratio_mean'])}",
                     f"{_num(u and u.get('kl_mean'), '.3f')} / {_num(w and w.get('kl_mean'), '.3f')}",
                     f"{_num(tr_f, '.1f')} → {_num(tr_w, '.1f')}"])
    title = (f"{report['model']['name']} — {crit}, {phase} calibration, {report['tasks']['n']} problems "
             f"({report['tasks'].get('domain') or report['tasks']['source']})")
    return [f"**{title}**", "", *_md_table(header, rows)]


def transfer_table(report: dict, criterion: str | None = None) -> list[str]:
    """Target-domain and other-domain accuracy side by side, per plan (the headline criterion's plans: every
    calibration, including the mixed-domain ones), for the README and the report."""
    od = report.get("other_domains")
    if not od:
        return []
    crit = criterion or headline_runs(report)[0]
    full, ofull = report["full"], od["full"]
    comps = {c["label"]: c for c in od["comparisons"]}
    plans: dict[str, dict[str, dict]] = {}
    for r in report["runs"]:
        if r["criterion"] == crit and "other_metrics" in r:
            plans.setdefault(r["label"], {})[r["mode"]] = r
    domains = od["domains"]
    header = ["calibration", "pruned", "target: full / uniform / SlimWise",
              "other domains: full / uniform / SlimWise", *(f"{d}: SlimWise" for d in domains),
              "other: SlimWise − uniform"]
    rows = []
    for label, modes in sorted(plans.items(), key=lambda kv: (str(next(iter(kv[1].values()))["phase"]),
                                                              next(iter(kv[1].values()))["ratio"])):
        any_run = next(iter(modes.values()))
        u, w = modes.get("uniform"), modes.get("slimwise")

        def acc(r: dict | None, key: str) -> str:
            return _pct(r[key]["accuracy"]) if r else "–"

        rows.append([str(any_run["phase"]), f"{any_run['ratio']:.0%}",
                     f"{_pct(full['accuracy'])} / {acc(u, 'metrics')} / {acc(w, 'metrics')}",
                     f"{_pct(ofull['accuracy'])} / {acc(u, 'other_metrics')} / {acc(w, 'other_metrics')}",
                     *(_pct(w["other_metrics"]["by_domain"][d]["accuracy"]) if w else "–" for d in domains),
                     signed_pp(comps.get(label, {}).get("slimwise_minus_uniform"))])
    title = (f"{report['model']['name']} — {crit}: target ({report['tasks'].get('domain')}, "
             f"{report['tasks']['n']} problems) and other domains ({od['n']} problems)")
    return [f"**{title}**", "", *_md_table(header, rows)]


def write_index(reports: Sequence[dict], out_dir: str | Path, names: Sequence[str]) -> Path:
    """index.md over several models: the headline rows of each, linking to the per-model reports."""
    out_dir = Path(out_dir)
    lines = ["# SlimWise evaluation results", "", "## Summary (README table)", ""]
    for rep in reports:
        lines += [*readme_table(rep), ""]
    for rep, name in zip(reports, names, strict=True):
        crit, ratio, phase, head = headline_runs(rep)
        full = rep["full"]
        lines += [f"## {name}", "", f"[full report]({name}/report.md) · {rep['tasks']['n']} problems · "
                  f"runtime {rep['timing'].get('total_s', 0):.0f} s"
                  + (f" (from the run cache; about {rep['timing']['uncached_estimate_s']:.0f} s uncached)"
                     if rep["timing"].get("uncached_estimate_s", 0) > 2 * rep["timing"].get("total_s", 0)
                     else ""), ""]
        rows = [table_row("full", None, full, full)] + [table_row(mo, r, r["metrics"], full)
                                                        for mo, r in head.items()]
        lines += _md_table(TABLE_HEADER, rows)
        lines += ["", *summary_lines(rep), ""]
    path = out_dir / "index.md"
    atomic_write_text(path, "\n".join(lines))
    return path


def console_table(report: dict, title: str):
    """A compact rich Table of the full row and the headline plan's rows (the demo prints it)."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("mode", "accuracy [95% CI]", "Δ vs full", "len mean/med/p90", "EOS", "trunc", "len/full",
                "exact", "1st diff", "KL", "experts/step"):
        table.add_column(col, justify="right")
    _, _, _, head = headline_runs(report)
    full = report["full"]
    for mode, m in [("full", full)] + [(mo, r["metrics"]) for mo, r in head.items()]:
        tr = m.get("traffic") or {}
        table.add_row(
            mode, f"{_pct(m['accuracy'])} [{_pct(m['accuracy_ci_low'], 0)}-{_pct(m['accuracy_ci_high'], 0)}]",
            "–" if mode == "full" else f"{100 * (m['accuracy'] - full['accuracy']):+.1f} pp",
            f"{m['length_mean']:.0f}/{m['length_median']:.0f}/{m['length_p90']:.0f}", _pct(m["eos_share"], 0),
            _pct(m["truncated_share"], 0), f"{m['length_ratio_mean']:.2f}", _pct(m["exact_match"], 0),
            _num(m.get("first_diff_mean"), ".1f"), _num(m.get("kl_mean"), ".3f"),
            _num(tr.get("distinct_experts_per_layer_step"), ".1f"))
    return table
