"""PNG plots of an evaluation (`slimwise.evaluation` report dict -> files): accuracy, lengths,
fidelity and decode traffic against the pruning ratio, and the transfer trade-off (target-domain
against other-domain accuracy).

Every number is read back from the report JSON, as in the Markdown (`report`).
matplotlib's Agg backend: no display.
"""

from __future__ import annotations

from pathlib import Path

from slimwise.evaluation.report import headline_runs, run_criteria, run_modes, run_phases
from slimwise.io import save_figure

MODE_COLORS = {"full": "black", "uniform": "tab:red", "slimwise": "tab:blue", "distilled": "tab:green"}
PHASE_STYLES = {"decode": ("-", "o"), "prompt": ("--", "s"), "all": (":", "^"), None: ("-.", "D")}
# calibrations "<phase>@<mix>", in order of appearance
MIX_STYLES = ((":", "^"), ("-.", "v"), ((0, (1, 3)), "P"))
PLOTS = ("accuracy_vs_ratio.png", "lengths.png", "fidelity_vs_ratio.png",
         "traffic_vs_ratio.png", "transfer.png")


def _phase_style(report: dict, phase) -> tuple:
    if phase in PHASE_STYLES:
        return PHASE_STYLES[phase]
    mixes = [p for p in run_phases(report) if p not in PHASE_STYLES]
    return MIX_STYLES[mixes.index(phase) % len(MIX_STYLES)] if phase in mixes else ("-", "o")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(report: dict, criterion: str, mode: str, phase) -> list[dict]:
    return sorted((r for r in report["runs"] if r["criterion"] == criterion and r["mode"] == mode
                   and r["phase"] == phase), key=lambda r: r["ratio"])


def _legend_below(fig, axes) -> None:
    handles, labels = {}, {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles[lab], labels[lab] = h, lab
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), 3),
               frameon=False, fontsize=9)


def plot_accuracy(report: dict, path: Path) -> None:
    plt = _plt()
    crits, phases, modes = run_criteria(report), run_phases(report), run_modes(report)
    full = report["full"]
    fig, axes = plt.subplots(1, len(crits), figsize=(max(4.2 * len(crits), 9.0), 4.8),
                             sharey=True, squeeze=False)
    ratios = sorted({r["ratio"] for r in report["runs"]})
    for ax, crit in zip(axes[0], crits, strict=True):
        ax.axhline(full["accuracy"], color="black", lw=1.2, label="full")
        ax.axhspan(full["accuracy_ci_low"], full["accuracy_ci_high"], color="gray",
                   alpha=0.15, label="full 95% CI")
        for mode in modes:
            for phase in phases:
                runs = _series(report, crit, mode, phase)
                if not runs:
                    continue
                ls, marker = _phase_style(report, phase)
                x = [r["ratio"] + (0.006 if mode == "slimwise" else -0.006) for r in runs]
                y = [r["metrics"]["accuracy"] for r in runs]
                err = [[yy - r["metrics"]["accuracy_ci_low"] for yy, r in zip(y, runs, strict=True)],
                       [r["metrics"]["accuracy_ci_high"] - yy for yy, r in zip(y, runs, strict=True)]]
                ax.errorbar(x, y, yerr=err, color=MODE_COLORS.get(mode), ls=ls, marker=marker, capsize=3,
                            ms=5, label=f"{mode} ({phase} calib)")
        ax.set_title(f"criterion: {crit}")
        ax.set_xlabel("share of experts pruned")
        ax.set_xticks(ratios)
        ax.grid(alpha=0.3)
    lows = [full["accuracy_ci_low"]] + [r["metrics"]["accuracy_ci_low"] for r in report["runs"]]
    highs = [full["accuracy_ci_high"]] + [r["metrics"]["accuracy_ci_high"] for r in report["runs"]]
    # zoom on the data, within [0, 1]
    axes[0][0].set_ylim(max(0.0, min(lows) - 0.05), min(1.0, max(highs) + 0.05))
    axes[0][0].set_ylabel("accuracy (95% bootstrap CI)")
    fig.suptitle(f"{report['model']['name']}: accuracy vs pruning ratio ({report['tasks']['n']} problems)")
    _legend_below(fig, axes[0])
    save_figure(fig, path, dpi=110, rect=(0, 0.16, 1, 1))


def plot_lengths(report: dict, path: Path) -> None:
    plt = _plt()
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullFormatter

    crit, ratio, phase, head = headline_runs(report)
    max_new = report["generation"]["max_new_tokens"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.4))
    series = [("full", report["full"]["lengths"])] + [(mo, r["metrics"]["lengths"]) for mo, r in head.items()]
    top = max(max(v) for _, v in series if v)
    bins = list(range(0, top + 6, max(1, (top + 5) // 40)))
    for mode, lengths in series:
        ax1.hist(lengths, bins=bins, histtype="step", lw=1.8, color=MODE_COLORS.get(mode),
                 label=f"{mode} (mean {sum(lengths) / max(len(lengths), 1):.1f})")
    ax1.axvline(max_new, color="gray", ls=":", label=f"max_new_tokens = {max_new}")
    ax1.set_xlabel("generated tokens per problem")
    ax1.set_ylabel("problems")
    ax1.set_title(f"length distribution at {crit} {ratio:.0%} ({phase} calib)")
    ax1.legend(fontsize=9)
    ax1.grid(alpha=0.3)
    # per-sample length ratio to full across ratios, headline criterion and phase
    data, labels, colors = [], [], []
    for mode in [m for m in run_modes(report) if m != "full"]:
        for r in _series(report, crit, mode, phase):
            data.append(r["metrics"]["length_ratios"])
            labels.append(f"{mode}\n{r['ratio']:.2f}")
            colors.append(MODE_COLORS.get(mode, "gray"))
    if data:
        box = ax2.boxplot(data, tick_labels=labels, showfliers=True, patch_artist=True,
                          flierprops={"markersize": 3}, medianprops={"color": "black"})
        for patch, c in zip(box["boxes"], colors, strict=True):
            patch.set_facecolor(c)
            patch.set_alpha(0.35)
    ax2.axhline(1.0, color="black", lw=1)
    ax2.set_yscale("log")
    ax2.yaxis.set_major_locator(FixedLocator([2.0**e for e in range(-8, 9)]))
    ax2.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax2.yaxis.set_minor_formatter(NullFormatter())
    ax2.set_ylabel("length / full model's length (log scale)")
    ax2.set_xlabel("mode and share of experts pruned")
    ax2.set_title(f"per-problem length ratio vs full ({crit}, {phase} calib)")
    ax2.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{report['model']['name']}: generated length")
    save_figure(fig, path, dpi=110)


def plot_fidelity(report: dict, path: Path) -> None:
    plt = _plt()
    crits, phases = run_criteria(report), run_phases(report)
    modes = [m for m in run_modes(report) if m != "full"]
    metrics = [("exact_match", "exact match with full"),
               ("first_diff_mean", "first differing token (mean pos.)"),
               ("kl_mean", "KL(full ‖ mode) per token")]
    fig, axes = plt.subplots(len(metrics), len(crits),
                             figsize=(max(4.2 * len(crits), 9.0), 3.0 * len(metrics)),
                             sharey="row", squeeze=False)
    ratios = sorted({r["ratio"] for r in report["runs"]})
    for j, crit in enumerate(crits):
        for i, (key, label) in enumerate(metrics):
            ax = axes[i][j]
            for mode in modes:
                for phase in phases:
                    runs = [r for r in _series(report, crit, mode, phase)
                            if r["metrics"].get(key) is not None]
                    if not runs:
                        continue
                    ls, marker = PHASE_STYLES.get(phase, ("-", "o"))
                    ax.plot([r["ratio"] for r in runs], [r["metrics"][key] for r in runs], ls=ls,
                            marker=marker, color=MODE_COLORS.get(mode), label=f"{mode} ({phase} calib)")
            if i == 0:
                ax.set_title(f"criterion: {crit}")
            if j == 0:
                ax.set_ylabel(label)
            if i == len(metrics) - 1:
                ax.set_xlabel("share of experts pruned")
            ax.set_xticks(ratios)
            ax.grid(alpha=0.3)
    fig.suptitle(f"{report['model']['name']}: fidelity to the full model vs pruning ratio")
    _legend_below(fig, axes[0])
    save_figure(fig, path, dpi=110, rect=(0, 0.07, 1, 1))


def plot_traffic(report: dict, path: Path) -> None:
    plt = _plt()
    full_tr = report["full"].get("traffic") or {}
    fig, ax = plt.subplots(figsize=(7, 4.4))
    if full_tr.get("distinct_experts_per_layer_step") is not None:
        ax.axhline(full_tr["distinct_experts_per_layer_step"], color="black", lw=1.5, label="full (measured)")
        ax.axhline(full_tr["uniform_expectation"], color="black", lw=1, ls=":",
                   label="full (uniform-routing expectation)")
    markers = "osD^v<>"
    expect: dict[float, float] = {}
    for n, crit in enumerate(run_criteria(report)):
        for phase in run_phases(report):
            runs = [r for r in _series(report, crit, "slimwise", phase)
                    if (r["metrics"].get("traffic") or {}).get("distinct_experts_per_layer_step") is not None]
            if not runs:
                continue
            ls, _ = PHASE_STYLES.get(phase, ("-", "o"))
            ax.plot([r["ratio"] for r in runs], [r["metrics"]["traffic"]["distinct_experts_per_layer_step"]
                                                  for r in runs],
                    ls=ls, marker=markers[n % len(markers)], label=f"slimwise {crit} ({phase} calib)")
            for r in runs:
                expect[r["ratio"]] = r["metrics"]["traffic"]["uniform_expectation"]
    if expect:
        xs = sorted(expect)
        ax.plot(xs, [expect[x] for x in xs], color="gray", ls=":", marker="x",
                label="pruned (uniform-routing exp.)")
    ax.set_xlabel("share of experts pruned")
    ax.set_ylabel("distinct experts per MoE layer per decode step")
    ax.set_title(f"{report['model']['name']}: decode expert traffic (batch size "
                 f"{report['generation']['batch_size']})")
    ax.set_ylim(bottom=0)
    ax.set_xticks(sorted({r["ratio"] for r in report["runs"]}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    save_figure(fig, path, dpi=110)


def plot_transfer(report: dict, path: Path) -> None:
    """The trade-off: target-domain accuracy against other-domain accuracy, one line per calibration over the
    ratios (headline criterion; SlimWise filled, uniform hollow, full a star)."""
    plt = _plt()
    od = report["other_domains"]
    crit = headline_runs(report)[0]
    fig, ax = plt.subplots(figsize=(7.4, 5.6))
    ax.plot([od["full"]["accuracy"]], [report["full"]["accuracy"]], "*", color="black", ms=14, label="full")
    phases = [p for p in run_phases(report)
              if any(r["criterion"] == crit and r["phase"] == p and "other_metrics" in r
                     for r in report["runs"])]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, phase in enumerate(phases):
        marker = _phase_style(report, phase)[1]  # color and marker: the calibration; line: the mode
        for mode, fill in (("slimwise", True), ("uniform", False)):
            runs = [r for r in _series(report, crit, mode, phase) if "other_metrics" in r]
            if not runs:
                continue
            x = [r["other_metrics"]["accuracy"] for r in runs]
            y = [r["metrics"]["accuracy"] for r in runs]
            color = colors[i % len(colors)]
            ax.plot(x, y, ls="-" if fill else ":", lw=1.8 if fill else 1.0, marker=marker, color=color, ms=7,
                    markerfacecolor=color if fill else "none", label=f"{mode}, {phase} calib")
            if fill:
                for xx, yy, r in zip(x, y, runs, strict=True):
                    ax.annotate(f"{r['ratio']:.0%}", (xx, yy), textcoords="offset points",
                                xytext=(5, 4), fontsize=8)
    ax.set_xlabel(f"other-domain accuracy ({', '.join(od['domains'])}; {od['n']} problems)")
    ax.set_ylabel(f"target-domain accuracy ({report['tasks'].get('domain')}; "
                  f"{report['tasks']['n']} problems)")
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(f"{report['model']['name']}: what a plan keeps, in and outside its calibration ({crit}; "
                 "labels: share pruned)", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    save_figure(fig, path, dpi=110)


def write_plots(report: dict, out_dir: str | Path) -> list[str]:
    """Every plot the report has data for; returns file names relative to out_dir."""
    out_dir = Path(out_dir)
    written = []
    if not report["runs"]:
        return written
    for name, fn in zip(PLOTS, (plot_accuracy, plot_lengths, plot_fidelity, plot_traffic, plot_transfer),
                        strict=True):
        if name == "traffic_vs_ratio.png" and not (report["full"].get("traffic") or {}).get("decode_steps"):
            continue
        if name == "transfer.png" and not report.get("other_domains"):
            continue
        fn(report, out_dir / name)
        written.append(name)
    return written
