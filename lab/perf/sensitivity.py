"""Sensitivity of a roofline prediction: which assumptions move the predicted speedup to a target, which
cannot.

Why: the roofline for Qwen3.6-35B-A3B on an H200 peaks at 1.58x at 50% pruning, against the paper's 1.81x. The
gap could come from the recurrent-state dtype, the context length, the batch, a PD-disaggregated decode
instance's larger batch, or bytes the model reads besides the routed experts (shared expert, attention and
Gated-DeltaNet projections, lm_head, KV cache, state). Each scenario here changes one (or a named combination)
of those and recomputes the whole curve over batch 1..max_batch with the same formulas as `roofline.predict`.

The byte budget makes the "cannot" exact. At batch B a step reads U_f(B) (full) or U_p(B) (pruned) experts per
MoE layer of e bytes over L MoE layers, plus X(B) bytes pruning does not change (other weights + KV + state).
The memory-bound speedup is (X + L·e·U_f) / (X + L·e·U_p), which reaches a target t only while

    X(B) <= budget(B) = L·e·(U_f(B) - t·U_p(B)) / (t - 1)

so no batch with U_f/U_p < t can reach t whatever X is (the batch floor), and above the floor the other bytes
must fit the budget. Compute bounds and fixed per-step overheads only lower the speedup further.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slimwise.perf.roofline import (
    Hardware,
    RooflineConfig,
    capacity_comparison,
    expected_union,
    kept_experts,
    predict,
    save_figure,
    weights_only_limit,
)


@dataclass(frozen=True)
class Scenario:
    """One set of assumptions: a change to the model's byte accounting, a context length, a per-step
    overhead."""

    key: str
    label: str
    change: Callable[[RooflineConfig], RooflineConfig] | None = None
    context_len: int | None = None  # None: the base context
    overhead_s: float = 0.0


def scaled(rc: RooflineConfig, *, shared: float = 1.0, mixers: float = 1.0, other: float = 1.0,
           state_bytes: float | None = None, kv_bytes: float | None = None) -> RooflineConfig:
    """rc with the shared experts' and the mixers' (attention + Gated-DeltaNet projections) parameters scaled,
    or every non-expert weight (`other`: mixers, norms, shared experts, routers, embedding and lm_head)
    scaled, and the state / KV element sizes replaced (0 removes that traffic)."""
    dense = rc.dense_params - round((1.0 - mixers) * rc.mixer_params)
    out = dataclasses.replace(
        rc,
        shared_params=round(rc.shared_params * shared * other),
        dense_params=round(dense * other),
        mixer_params=round(rc.mixer_params * mixers * other),
        embed_params=round(rc.embed_params * other),
        lm_head_params=round(rc.lm_head_params * other),
        router_params_per_expert=round(rc.router_params_per_expert * other),
    )
    if state_bytes is not None:
        out = dataclasses.replace(out, state_bytes=state_bytes)
    if kv_bytes is not None:
        out = dataclasses.replace(out, kv_bytes=kv_bytes)
    return out


def default_scenarios(base_context: int = 1024) -> list[Scenario]:
    """The roofline's assumptions varied one at a time, then combined."""
    bf16 = dict(state_bytes=2.0)
    return [
        Scenario("base", f"as published: fp32 state, context {base_context}"),
        Scenario("state-bf16", "recurrent state bf16", lambda r: scaled(r, **bf16)),
        Scenario("state-0", "no state traffic at all", lambda r: scaled(r, state_bytes=0.0)),
        Scenario("ctx-256", "context 256", context_len=256),
        Scenario("ctx-256-bf16", "context 256, state bf16", lambda r: scaled(r, **bf16), context_len=256),
        Scenario("ctx-4096", "context 4096", context_len=4096),
        Scenario("ctx-16384", "context 16384", context_len=16384),
        Scenario("kv-fp8", "KV cache (and conv state) fp8", lambda r: scaled(r, kv_bytes=1.0)),
        Scenario("shared-half", "shared expert bytes halved", lambda r: scaled(r, shared=0.5)),
        Scenario("shared-0", "shared expert bytes zero", lambda r: scaled(r, shared=0.0)),
        Scenario("mixers-half", "attention + Gated-DeltaNet weights halved", lambda r: scaled(r, mixers=0.5)),
        Scenario("mixers-0", "attention + Gated-DeltaNet weights zero", lambda r: scaled(r, mixers=0.0)),
        Scenario("other-0", "every non-expert weight zero (incl. lm_head)", lambda r: scaled(r, other=0.0)),
        Scenario(
            "shared-mixers-half-bf16",
            "shared + mixers halved, state bf16",
            lambda r: scaled(r, shared=0.5, mixers=0.5, **bf16),
        ),
        Scenario(
            "ctx-256-bf16-shared-0",
            "context 256, state bf16, shared expert zero",
            lambda r: scaled(r, shared=0.0, **bf16),
            context_len=256,
        ),
        Scenario(
            "state-0-ctx-256",
            "no state traffic, context 256",
            lambda r: scaled(r, state_bytes=0.0),
            context_len=256,
        ),
        Scenario(
            "no-cache", "no KV and no state traffic", lambda r: scaled(r, state_bytes=0.0, kv_bytes=0.0)
        ),
        Scenario("overhead-1ms", "1 ms fixed overhead per step", overhead_s=1e-3),
    ]


@dataclass(frozen=True)
class SensitivityRow:
    key: str
    label: str
    context_len: int
    peak_speedup: float
    peak_batch: int
    first_batch: int | None  # first batch reaching the target, same batch for both models
    fitting_peak_speedup: float | None  # peak among batches fitting beside the full weights
    fitting_peak_batch: int | None
    speedup_64: float
    speedup_128: float
    capacity_batch_full: int | None  # each side at its max batch (PD-disaggregated decode instance)
    capacity_batch_pruned: int | None
    capacity_speedup: float | None
    other_bytes_gb_at_peak: float  # bytes pruning leaves unchanged at the peak batch
    budget_gb_at_peak: float  # what they may be for the target at that batch (< 0: impossible)

    @property
    def reaches(self) -> str:
        if self.first_batch is not None:
            return f"yes, from batch {self.first_batch}"
        if not self.capacity_unbounded and (self.capacity_speedup or 0.0) >= self.target_hint:
            return "only PD at max batch"
        return "no"

    target_hint: float = 0.0
    capacity_unbounded: bool = False  # nothing per sequence in memory: max_batch hits its search limit


def other_bytes(rc: RooflineConfig, batch: int, context_len: int) -> float:
    """Bytes a step reads that pruning does not change: non-expert weights (router rows of all experts, a
    slight overstatement for the pruned side), KV and state."""
    split = rc.bytes_split(batch, context_len, 0.0)
    return split["other_weights"] + split["kv"] + split["state"]


def budget(rc: RooflineConfig, ratio: float, target: float, batch: int) -> float:
    """Largest other_bytes for which the memory-bound speedup at `batch` still reaches `target` (negative:
    none)."""
    kept = kept_experts(rc.num_experts, ratio, rc.top_k)
    uf, up = expected_union(rc.num_experts, rc.top_k, batch), expected_union(kept, rc.top_k, batch)
    expert = rc.moe_layers * rc.expert_params * rc.expert_bytes
    return expert * (uf - target * up) / (target - 1.0)


def batch_floor(rc: RooflineConfig, ratio: float, target: float, limit: int = 1 << 16) -> int | None:
    """Smallest batch whose expected expert union ratio U_f/U_p reaches `target`: below it no byte saving
    elsewhere can reach the target (None: never, e.g. a target above the experts-only ratio E/E')."""
    kept = kept_experts(rc.num_experts, ratio, rc.top_k)
    b = 1
    while b <= limit:
        if expected_union(rc.num_experts, rc.top_k, b) >= target * expected_union(kept, rc.top_k, b):
            lo, hi = b // 2 + 1, b  # the ratio rises with b: bisect the last doubling step
            while lo < hi:
                mid = (lo + hi) // 2
                if expected_union(rc.num_experts, rc.top_k, mid) >= target * expected_union(
                    kept, rc.top_k, mid
                ):
                    hi = mid
                else:
                    lo = mid + 1
            return lo
        b *= 2
    return None


def run_sensitivity(
    rc: RooflineConfig,
    hardware: Hardware,
    ratio: float,
    target: float,
    context_len: int = 1024,
    scenarios: list[Scenario] | None = None,
    max_batch: int = 2048,
) -> tuple[list[SensitivityRow], dict[str, list]]:
    """Rows for the table and per-scenario curves (StepPredictions over 1..max_batch) for the plot."""
    rows, curves = [], {}
    batches = list(range(1, max_batch + 1))
    for sc in scenarios or default_scenarios(context_len):
        model = sc.change(rc) if sc.change else rc
        ctx = sc.context_len or context_len
        hw = dataclasses.replace(hardware, overhead_s=sc.overhead_s) if sc.overhead_s else hardware
        preds = predict(model, hw, ratio, batches, ctx)
        curves[sc.key] = preds
        peak = max(preds, key=lambda p: p.speedup)
        fitting = [p for p in preds if p.fits_memory]
        fit_peak = max(fitting, key=lambda p: p.speedup) if fitting else None
        first = next((p.batch for p in preds if p.speedup >= target), None)
        cap = capacity_comparison(model, hw, ratio, ctx)
        rows.append(SensitivityRow(
            sc.key, sc.label, ctx, peak.speedup, peak.batch, first,
            fit_peak.speedup if fit_peak else None, fit_peak.batch if fit_peak else None,
            preds[63].speedup, preds[127].speedup,
            cap.batch_full if cap else None, cap.batch_pruned if cap else None, cap.speedup if cap else None,
            other_bytes(model, peak.batch, ctx) / 1e9, budget(model, ratio, target, peak.batch) / 1e9,
            target_hint=target,
            capacity_unbounded=bool(cap) and cap.batch_pruned >= CAPACITY_LIMIT))
    return rows, curves


def format_sensitivity(rows: list[SensitivityRow], target: float) -> str:
    head = (
        f"| scenario | context | peak speedup (batch) | speedup at B=64 / 128 | first batch ≥ {target:.2f}x "
        f"| PD decode instance at max batch: full → pruned B, speedup | other bytes at peak / budget for "
        f"{target:.2f}x, GB | reaches {target:.2f}x? |"
    )
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        if r.capacity_speedup is None:
            cap = "–"
        elif r.capacity_unbounded:
            cap = f"both beyond the {CAPACITY_LIMIT}-sequence search limit"
        else:
            cap = f"{r.capacity_batch_full} → {r.capacity_batch_pruned}, {r.capacity_speedup:.3f}x"
        bud = f"{r.budget_gb_at_peak:.2f}" if r.budget_gb_at_peak >= 0 else "none (below the floor)"
        lines.append(f"| {r.label} | {r.context_len} | {r.peak_speedup:.3f}x ({r.peak_batch}) | "
                     f"{r.speedup_64:.3f} / {r.speedup_128:.3f} | {r.first_batch or 'never'} | {cap} | "
                     f"{r.other_bytes_gb_at_peak:.2f} / {bud} | {r.reaches} |")
    return "\n".join(lines)


#: roofline.max_batch's search limit: a side reaching it is not bounded by memory in the searched range
CAPACITY_LIMIT = 4096

#: the curves drawn (the table has them all)
PLOTTED = ("base", "state-bf16", "state-0", "ctx-256-bf16", "ctx-16384", "shared-0", "mixers-0",
           "state-0-ctx-256", "no-cache", "overhead-1ms")


def plot_sensitivity(rc: RooflineConfig, curves: dict[str, list], rows: list[SensitivityRow], ratio: float,
                     target: float, path: str | Path, title: str = "", context_len: int = 1024) -> Path:
    """Left: predicted speedup against batch for the main scenarios, the target and the PD points. Right: the
    bytes pruning leaves unchanged per step against the budget that the target allows (the target needs X ≤
    budget)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {r.key: r for r in rows}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6), dpi=120)
    for i, key in enumerate(k for k in PLOTTED if k in curves):
        preds = curves[key]
        xs = [p.batch for p in preds]
        line, = ax.plot(xs, [p.speedup for p in preds], ls=["-", "--", ":", "-."][i % 4], lw=1.5,
                        label=labels[key].label)
        r = labels[key]
        if r.capacity_speedup is not None and key in ("base", "state-bf16"):
            ax.plot(r.capacity_batch_pruned, r.capacity_speedup, "D", color=line.get_color(), ms=6,
                    label=f"PD at max batch ({r.label.split(':')[0]}): {r.capacity_speedup:.2f}x")
    ax.axhline(target, color="black", ls="--", lw=1, label=f"paper {target:.2f}x")
    ax.axhline(weights_only_limit(rc, ratio), color="tab:red", ls=":", lw=1,
               label=f"weights-only ceiling {weights_only_limit(rc, ratio):.2f}x")
    ax.axhline(1.0, color="grey", lw=0.8)
    floor = batch_floor(rc, ratio, target)
    if floor:
        ax.axvline(floor, color="black", lw=0.8, alpha=0.6)
        ax.text(floor * 1.05, 1.02, f"B={floor}: below, {target:.2f}x impossible", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch size (same for both models)")
    ax.set_ylabel("predicted decode speedup (pruned / full)")
    ax.set_ylim(0.95, 2.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6.5, loc="upper left")

    batches = [b for b in range(1, len(curves["base"]) + 1)]
    bud = [budget(rc, ratio, target, b) / 1e9 for b in batches]
    bx.plot(batches, [max(0.0, v) for v in bud], color="black", lw=2, label=f"budget for {target:.2f}x")
    for key, style in (("base", "-"), ("state-bf16", "--"), ("state-0", "-."), ("state-0-ctx-256", ":")):
        r = labels[key]
        model = next((sc.change for sc in default_scenarios(context_len) if sc.key == key), None)
        m = model(rc) if model else rc
        bx.plot(batches, [other_bytes(m, b, r.context_len) / 1e9 for b in batches], ls=style, lw=1.4,
                label=f"unchanged bytes: {r.label}")
    bx.set_xscale("log", base=2)
    bx.set_yscale("log")
    bx.set_ylim(0.5, 200)
    bx.set_xlabel("decode batch size")
    bx.set_ylabel("GB per step that pruning does not change")
    bx.set_title(f"{target:.2f}x needs the unchanged bytes below the black budget", fontsize=9)
    bx.grid(alpha=0.3, which="both")
    bx.legend(fontsize=6.5, loc="upper left")
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


__all__ = ["Scenario", "SensitivityRow", "batch_floor", "budget", "default_scenarios", "format_sensitivity",
           "other_bytes", "plot_sensitivity", "run_sensitivity", "scaled"]
