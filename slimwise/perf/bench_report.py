"""What `slimwise bench` prints and checks: predicted vs measured speedups, the bytes-per-step split, the
suggested policy threshold, the quality bars of a preset, the Markdown tables and the plot. Pure functions of
a bench result, so a finished bench.json re-renders without an engine."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from slimwise.io import save_figure
from slimwise.perf.roofline import expected_union


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def summarize_runs(runs: dict[str, dict[int, list]], batches) -> dict:
    """Per variant and batch: throughput and TPOT (median, min, max) and the paired speedup over full."""
    summary: dict[str, dict[int, dict]] = {}
    full = runs["full"]
    for name, per_batch in runs.items():
        summary[name] = {}
        for b in batches:
            ms = per_batch.get(b, [])
            if not ms:
                continue
            entry = {"tokens_per_s": _spread([m["tokens_per_s"] for m in ms]),
                     "tpot_ms": _spread([m["tpot_ms"] for m in ms]),
                     "prefill_spread_s": max(m["prefill_spread_s"] for m in ms)}
            base = {m["round"]: m["tokens_per_s"] for m in full.get(b, [])}
            pairs = [m["tokens_per_s"] / base[m["round"]] for m in ms if m["round"] in base]
            if pairs:
                entry["speedup"] = _spread(pairs)
            summary[name][b] = entry
    return summary



def compare_roofline(summary: dict, preds, tolerance: float = 0.15) -> list[dict]:
    """Predicted vs measured speedups (slimwise and pruned over full) and measured/predicted step times."""
    rows = []
    for p in preds:
        row = {
            "batch": p.batch,
            "predicted_speedup": p.speedup,
            "predicted_tokens_per_s_full": p.tokens_per_s_full,
            "predicted_tokens_per_s_pruned": p.tokens_per_s_pruned,
            # full/pruned when they differ: a pruned step that hits the compute roof caps the speedup
            "bound": p.bound_full if p.bound_full == p.bound_pruned else f"{p.bound_full}/{p.bound_pruned}",
            "union_full": p.union_full,
            "union_pruned": p.union_pruned,
        }
        full = summary["full"].get(p.batch)
        if full:
            row["measured_tokens_per_s_full"] = full["tokens_per_s"]["median"]
            row["step_time_measured_over_predicted"] = (full["tpot_ms"]["median"] / 1e3) / p.time_full_s
        for name in ("slimwise", "pruned"):
            s = summary.get(name, {}).get(p.batch, {}).get("speedup")
            if s:
                m = s["median"]
                row[f"measured_speedup_{name}"] = m
                row[f"predicted_over_measured_{name}"] = p.speedup / m
                row[f"within_{int(tolerance * 100)}pct_{name}"] = abs(p.speedup / m - 1) <= tolerance
        rows.append(row)
    return rows


def bytes_split_table(rc, top_k: int, num_experts: int, traffic: dict | None, batches, context_len: int,
                      kept: int | None) -> dict:
    """Bytes per decode step by kind (routed expert weights, other weights, KV, linear-attention state) for
    the full model and the pruned decoder, from the roofline's accounting at `context_len`. The experts
    touched per layer come from the traffic counters where they ran (full; slimwise, else pruned), else from
    the uniform expectation."""

    kept = kept or num_experts // 2
    out = {}
    for b in batches:
        row = {}
        for side, names, avail in (
            ("full", ("full",), num_experts),
            ("pruned", ("slimwise", "pruned"), kept),
        ):
            measured = next((batch_entry(traffic[n]["batches"], b) for n in names if traffic and n in traffic
                             and batch_entry(traffic[n]["batches"], b)), None)
            union = measured["touched_mean"] if measured else expected_union(avail, top_k, b)
            split = rc.bytes_split(b, context_len, union, None if side == "full" else avail)
            row[side] = {
                **split,
                "union": union,
                "union_source": "counters" if measured else "uniform expectation",
                "total": sum(split.values()),
            }
        out[b] = row
    return {"context_len": context_len, "batches": out}


# ----- thresholds and bars ----------------------------------------------------------------------------------

def suggest_threshold(summary: dict, min_speedup: float, variant: str = "slimwise") -> int | None:
    """Smallest batch from which on every measured batch reaches `min_speedup` (median paired speedup of
    `variant` over full); None when the largest batch does not. Requiring every larger batch too keeps a noisy
    small-batch point from setting a threshold below batches that lose."""
    best = None
    for b in sorted(summary.get(variant, {}), reverse=True):
        s = summary[variant][b].get("speedup")
        if not s or s["median"] < min_speedup:
            break
        best = b
    return best


def paired_ratio(runs: dict, a: str, b: str, batch) -> dict | None:
    """a's tokens/s over b's within each round (same machine state, so two noisy throughputs are not divided):
    median, min, max over the rounds both ran; None when they share no round."""
    per_a, per_b = (batch_entry(runs.get(v, {}), batch) or [] for v in (a, b))
    base = {m["round"]: m["tokens_per_s"] for m in per_b}
    pairs = [m["tokens_per_s"] / base[m["round"]] for m in per_a if m["round"] in base]
    return _spread(pairs) if pairs else None


def check_bars(summary: dict, preset: str | None, runs: dict | None = None) -> dict:
    """The issue's CPU bars, evaluated on this run's paired medians. With the per-round `runs`, colocated
    against pruned is paired within each round (slimwise / pruned tokens/s, which equals the ratio of their
    two speedups over that round's full run) and judged on that median; the ratio of the two median speedups
    stays beside it."""
    bars: dict = {}
    if "slimwise" in summary and "pruned" in summary:
        per = {}
        for b, e in summary["slimwise"].items():
            p = summary["pruned"].get(b, {}).get("speedup")
            if e.get("speedup") and p:
                ratio = e["speedup"]["median"] / p["median"]
                per[b] = {"slimwise": e["speedup"]["median"], "pruned": p["median"], "ratio": ratio,
                          "met": ratio >= 0.95}
                paired = paired_ratio(runs, "slimwise", "pruned", b) if runs else None
                if paired:
                    per[b]["paired"] = paired
                    per[b]["met"] = paired["median"] >= 0.95
        bars["colocated_reaches_95pct_of_pruned"] = per
    s32 = summary.get("slimwise", {}).get(32, {}).get("speedup")
    if s32:
        bars["slimwise_at_32_is_1.25x"] = {"speedup": s32["median"], "met": s32["median"] >= 1.25,
                                           "applies": preset == "cpu"}
    return bars


# ----- output -----------------------------------------------------------------------------------------------

def batch_entry(per: dict, b):
    """per[b] by int key (a run) or str key (a bench.json read back)."""
    return per.get(b) or per.get(str(b))


def _table(result: dict, title: str, names: list[str], cell) -> list[str]:
    lines = [f"### {title}", "", "| batch | " + " | ".join(names) + " |", "|" + "---|" * (1 + len(names))]
    for b in result["config"]["batches"]:
        lines.append(f"| {b} | " + " | ".join(cell(n, b) for n in names) + " |")
    return [*lines, ""]


def format_tables(result: dict) -> str:
    """Markdown: throughput, TPOT and speedup per batch and variant; engine starts; traffic; roofline."""
    summary = result["summary"]
    names = list(summary)

    def tput(n, b):
        e = batch_entry(summary[n], b)
        return (
            f"{e['tokens_per_s']['median']:.1f} "
            f"({e['tokens_per_s']['min']:.1f}-{e['tokens_per_s']['max']:.1f})"
            if e
            else ""
        )

    def tpot(n, b):
        e = batch_entry(summary[n], b)
        return (
            f"{e['tpot_ms']['median']:.1f} ({e['tpot_ms']['min']:.1f}-{e['tpot_ms']['max']:.1f})" if e else ""
        )

    def speed(n, b):
        s = (batch_entry(summary[n], b) or {}).get("speedup")
        return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})" if s else ""

    out = _table(result, "Decode throughput, tokens/s: median (min-max) over rounds", names, tput)
    out += _table(result, "Time per output token, ms: median (min-max)", names, tpot)
    out += _table(result, "Speedup over full, paired within each round: median (min-max)",
                  [n for n in names if n != "full"], speed)
    out += _colocated_section(result)
    out += ["### Engine start, s (excluded from the timing)", "", "| variant | start s |", "|---|---|"]
    out += [f"| {n} | {', '.join(f'{s:.1f}' for s in v)} |" for n, v in result["engine_start_s"].items()]
    out.append("")
    for part in (_traffic_section, _bytes_section, _kernel_roofline_section, _roofline_section):
        out += part(result)
    return "\n".join(out)


def _colocated_section(result: dict) -> list[str]:
    """The colocated engine against the pruned checkpoint, paired within each round (where measured)."""
    colocated = (result.get("bars") or {}).get("colocated_reaches_95pct_of_pruned") or {}
    if not any("paired" in e for e in colocated.values()):
        return []
    out: list[str] = []
    out += [
        "### Colocated SlimWise over the pruned checkpoint, tokens/s paired within each "
        "round (bar: >= 0.95)",
        "",
        "| batch | median (min-max) | ratio of the two median speedups | bar |",
        "|---|---|---|---|",
    ]
    for b in result["config"]["batches"]:
        e = batch_entry(colocated, b)
        if e and "paired" in e:
            q = e["paired"]
            out.append(f"| {b} | {q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f}) | {e['ratio']:.3f} | "
                       f"{'met' if e['met'] else 'not met'} |")
    out.append("")
    return out


def _traffic_section(result: dict) -> list[str]:
    """Experts touched per layer and step, and expert bytes read (from the routing counters)."""
    traffic = result.get("traffic")
    if not traffic:
        return []
    out: list[str] = []
    tn = list(traffic)

    def touched(n, b):
        e = batch_entry(traffic[n]["batches"], b)
        return f"{e['touched_mean']:.1f} / {e['expected_uniform']:.1f}" if e else ""

    def mb(n, b):
        e = batch_entry(traffic[n]["batches"], b)
        return f"{e['expert_bytes_per_step'] / 1e6:.1f}" if e else ""

    out += _table(
        result,
        "Distinct experts per MoE layer per decode step: measured / uniform expectation E'(1-(1-k/E')^B)",
        tn,
        touched,
    )
    out += _table(result, "Expert weights read per decode step, MB (all MoE layers)", tn, mb)
    return out


def _bytes_section(result: dict) -> list[str]:
    """Bytes per decode step by kind, full and pruned (roofline accounting)."""
    split = result.get("bytes_split")
    if not split:
        return []
    out: list[str] = []
    out += [
        f"### Bytes per decode step, MB (roofline accounting at context {split['context_len']}; experts "
        "touched from the counters)",
        "",
        "| batch | expert weights full → pruned | other weights | KV | linear-attention state (read + "
        "write) | total full → pruned | state share of the full step |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in result["config"]["batches"]:
        e = batch_entry(split["batches"], b)
        if not e:
            continue
        f, p = e["full"], e["pruned"]
        out.append(
            f"| {b} | {f['expert_weights'] / 1e6:.1f} → {p['expert_weights'] / 1e6:.1f} | "
            f"{f['other_weights'] / 1e6:.1f} | {f['kv'] / 1e6:.2f} | {f['state'] / 1e6:.1f} | "
            f"{f['total'] / 1e6:.1f} → {p['total'] / 1e6:.1f} | {100 * f['state'] / f['total']:.1f}% |"
        )
    out.append("")
    return out


def _kernel_roofline_section(result: dict) -> list[str]:
    """The fused-MoE kernel's fitted roofline and the speedup it predicts."""
    kr = result.get("kernel_roofline")
    if not kr:
        return []
    out: list[str] = []
    m = kr["model"]
    # a fit that puts no time on expert reads (noise on a tiny model) has an infinite bandwidth, None in
    # JSON
    bw = m.get("streaming_bandwidth")
    bw = f"{bw / 1e9:.1f} GB/s" if bw is not None and math.isfinite(bw) else "not resolved by the fit"
    out += [
        "### Kernel roofline: vLLM's fused-MoE op timed at this model's shapes, t = a U + b P + c per "
        f"call (a {m['per_expert_s'] * 1e6:.1f} us per expert read = {bw}, b {m['per_pair_s'] * 1e6:.2f} "
        f"us per pair, c {m['per_call_s'] * 1e6:.1f} us; R^2 {m['r2']:.3f}); pruned step = measured full "
        f"step - kernel time of the experts no longer read ({kr['unions']})",
        "",
        "| batch | experts read full → pruned | kernel share of the full step | pairs + call share, full "
        "→ pruned | predicted speedup | measured slimwise | measured pruned |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in kr["rows"]:
        pred = f"{r['predicted_speedup']:.3f}" if r["applies"] else "model does not apply"
        meas = [
            f"{r[k]:.3f}" if r.get(k) else ""
            for k in ("measured_speedup_slimwise", "measured_speedup_pruned")
        ]
        out.append(
            f"| {r['batch']} | {r['union_full']:.1f} → {r['union_pruned']:.1f} | "
            f"{r['kernel_share_full']:.0%} | {r['pair_share_full']:.0%} → {r['pair_share_pruned']:.0%} | "
            f"{pred} | {meas[0]} | {meas[1]} |"
        )
    out.append("")
    return out


def _roofline_section(result: dict) -> list[str]:
    """The analytic roofline's predicted speedups against the measured ones."""
    roof = result.get("roofline")
    if not roof:
        return []
    out: list[str] = []
    out += [f"### Roofline ({roof['hardware']}, context {roof['context_len']}) vs measured", "",
            "| batch | bound | predicted speedup | measured slimwise | predicted / measured | within 15% "
            "| measured pruned | predicted / measured | measured / predicted step time (full) |",
            "|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for r in roof["comparison"]:
        out.append(f"| {r['batch']} | {r['bound']} | {r['predicted_speedup']:.3f} | "
                   f"{r.get('measured_speedup_slimwise') or nan:.3f} | "
                   f"{r.get('predicted_over_measured_slimwise') or nan:.3f} | "
                   f"{'yes' if r.get('within_15pct_slimwise') else 'no'} | "
                   f"{r.get('measured_speedup_pruned') or nan:.3f} | "
                   f"{r.get('predicted_over_measured_pruned') or nan:.3f} | "
                   f"{r.get('step_time_measured_over_predicted') or nan:.2f} |")
    out.append("")
    return out


def plot_bench(result: dict, path: str | Path) -> Path:
    """Two panels against batch size (log2): decode throughput with min-max bars, and speedup over full."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    markers = "osD^vP*X"
    for i, (name, per) in enumerate(summary.items()):
        bs = sorted(int(b) for b in per)
        get = [per.get(b) or per.get(str(b)) for b in bs]
        med = [e["tokens_per_s"]["median"] for e in get]
        err = [[m - e["tokens_per_s"]["min"] for m, e in zip(med, get, strict=True)],
               [e["tokens_per_s"]["max"] - m for m, e in zip(med, get, strict=True)]]
        ax1.errorbar(bs, med, yerr=err, marker=markers[i % len(markers)], ms=4, capsize=2, label=name)
        if name != "full":
            sp = [(b, e["speedup"]) for b, e in zip(bs, get, strict=True) if e.get("speedup")]
            if sp:
                ys = [s["median"] for _, s in sp]
                ax2.errorbar(
                    [b for b, _ in sp],
                    ys,
                    yerr=[
                        [y - s["min"] for y, (_, s) in zip(ys, sp, strict=True)],
                        [s["max"] - y for y, (_, s) in zip(ys, sp, strict=True)],
                    ],
                    marker=markers[i % len(markers)],
                    ms=4,
                    capsize=2,
                    label=name,
                )
    roof = result.get("roofline")
    if roof:
        rows = roof["comparison"]
        ax2.plot([r["batch"] for r in rows], [r["predicted_speedup"] for r in rows], "k--", lw=1,
                 label=f"roofline ({roof['hardware']})")
    kernel = [r for r in (result.get("kernel_roofline") or {}).get("rows", []) if r["applies"]]
    if kernel:
        ax2.plot([r["batch"] for r in kernel], [r["predicted_speedup"] for r in kernel], "k:", lw=1.2,
                 label="kernel roofline (fused-MoE op measured)")
    ax2.axhline(1.0, color="grey", lw=0.8)
    for ax, ylabel in (
        (ax1, "decode tokens/s (median, min-max)"),
        (ax2, "speedup over full (paired, median)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("decode batch size")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    c = result["config"]
    fig.suptitle(
        f"{result['model_name']}: {int(round(result['plan']['ratio'] * 100))}% experts pruned, "
        f"prompt {c['prompt_len']}, output {c['output_len']}, {c['repetitions']} rounds",
        fontsize=10,
    )

    return save_figure(fig, path)


def jsonable(x):
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def threshold_report(result: dict, min_speedup: float, rc=None, hw=None, ctx: int | None = None,
                     ratio: float | None = None) -> dict:
    """Smallest batch reaching min_speedup: measured (slimwise over full) and, when available, the
    roofline's."""
    summary = {name: {int(b): e for b, e in per.items()} for name, per in result["summary"].items()}
    rep = {"min_speedup": min_speedup, "measured_batch": suggest_threshold(summary, min_speedup)}
    if rc is not None and hw is not None:
        from slimwise.perf.roofline import batch_reaching

        rep["roofline_batch"] = batch_reaching(rc, hw, ratio, min_speedup, ctx).first_batch
    return rep
