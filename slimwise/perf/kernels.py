"""The fused-MoE kernel vLLM runs on a CPU, measured and modelled.

Why: the byte roofline (`roofline.py`) prices a decode step by the expert bytes it reads, but on a CPU vLLM's
`cpu_fused_moe` also spends time per (token, expert) pair it computes, and that part does not shrink when the
decode tokens are routed to fewer experts. This times the op itself at a model's expert shapes, with random
routing over a varied number of available experts so that the experts read (U) and the pairs computed (P) vary
independently, and fits per call

    t = a * U + b * P + c

by least squares. `bytes_per_expert / a` is the kernel's streaming rate (compare the machine's read
bandwidth); the byte model holds where a * U dominates (small batches, many experts) and over-predicts
pruning's gain where b * P does. The layout of the kept experts in the weight tensor does not enter: at the
`cpu` preset's shapes a scattered half of a 64-expert tensor and a packed 32-expert tensor time the same
(experiments/moe_layout.py).

Run the measurement with the threads bound as vLLM's CPU worker binds them (GOMP_CPU_AFFINITY, OMP_NUM_THREADS
set before torch starts); experiments/kernel_roofline.py does. `slimwise bench --kernel-roofline` measures it
at the benchmarked model's shapes and predicts each batch's pruned step from the measured full one
(`predict_from_full`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class KernelSample:
    """One timed configuration: mean per fused-MoE call over `calls` calls (distinct layers' weights)."""

    batch: int
    available: int  # experts the routing draws from
    experts_read: float  # mean distinct experts per call
    pairs: int  # batch x top_k
    seconds: float  # median over rounds of the mean time per call
    calls: int


@dataclass(frozen=True)
class MoEKernelModel:
    """t = per_expert_s * experts_read + per_pair_s * pairs + per_call_s, fitted to measured calls."""

    per_expert_s: float
    per_pair_s: float
    per_call_s: float
    bytes_per_expert: int
    r2: float
    max_rel_error: float  # of the fit on its own samples

    def seconds(self, experts_read: float, pairs: float) -> float:
        return self.per_expert_s * experts_read + self.per_pair_s * pairs + self.per_call_s

    @property
    def streaming_bandwidth(self) -> float:
        """Bytes/s at which the kernel reads one more expert's weights."""
        return self.bytes_per_expert / self.per_expert_s if self.per_expert_s > 0 else float("inf")

    def pair_share(self, experts_read: float, pairs: float) -> float:
        """Share of a call's time that the byte model does not see (per-pair compute and the fixed cost)."""
        return 1.0 - self.per_expert_s * experts_read / self.seconds(experts_read, pairs)

    def as_dict(self) -> dict:
        return {**asdict(self), "streaming_bandwidth": self.streaming_bandwidth}


def fit_moe_kernel(samples: Sequence[KernelSample], bytes_per_expert: int) -> MoEKernelModel:
    """Least-squares fit of t = a U + b P + c, weighted by 1/t so that small calls count as much as large
    ones. No cost is negative: a coefficient the free fit puts below zero (the kernel is not exactly linear,
    so a noisy run can trade the per-call cost against the others) is fixed at 0 and the others refitted."""
    if len(samples) < 3:
        raise ValueError(f"need at least 3 samples to fit 3 coefficients, got {len(samples)}")
    x = np.array([[s.experts_read, s.pairs, 1.0] for s in samples])
    t = np.array([s.seconds for s in samples])
    w = 1.0 / t
    free = [0, 1, 2]
    while True:  # t > 0, so some coefficient stays positive before `free` runs out
        coef = np.zeros(3)
        sol, *_ = np.linalg.lstsq(x[:, free] * w[:, None], t * w, rcond=None)
        coef[free] = sol
        if (sol >= 0).all():
            break
        free.pop(int(np.argmin(sol)))
    fitted = x @ coef
    r2 = 1.0 - float(((t - fitted) ** 2).sum() / ((t - t.mean()) ** 2).sum())
    return MoEKernelModel(float(coef[0]), float(coef[1]), float(coef[2]), int(bytes_per_expert), r2,
                          float(np.abs(fitted / t - 1).max()))


def kernel_isa(dtype: str = "bfloat16") -> str:
    """The ISA vLLM's CPU backend picks for unquantized experts: its AMX class where that class supports the
    device and the activations are bf16 (vLLM's own checks; its grouped-GEMM shape check is not repeated),
    else vector."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import X86CPUUnquantizedExperts

    return "amx" if dtype == "bfloat16" and X86CPUUnquantizedExperts._supports_current_device() else "vec"


def measure_fused_moe(
    hidden: int,
    inter: int,
    experts: int,
    top_k: int,
    batches: Sequence[int],
    available: Sequence[int] | None = None,
    layers: int = 8,
    dtype: str = "bfloat16",
    rounds: int = 5,
    steps: int = 10,
    seed: int = 0,
    progress: bool = True,
) -> list[KernelSample]:
    """Time vLLM's `cpu_fused_moe` at these expert shapes: per batch size and number of available experts,
    `steps` x `layers` calls per round (each layer its own prepacked weights, so the set exceeds the caches as
    a model's does), routing drawn uniformly without replacement per token, rounds after one warm-up round;
    the sample is the median over rounds of the mean time per call."""
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    available = sorted({a for a in (available or (experts // 8, experts // 4, experts // 2, experts))
                        if top_k <= a <= experts})
    dt = getattr(torch, dtype)
    isa = kernel_isa(dtype)
    g = torch.Generator().manual_seed(seed)
    w13 = [cpu_prepack_moe_weight((torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02).to(dt), isa)
           for _ in range(layers)]
    w2 = [cpu_prepack_moe_weight((torch.randn(experts, hidden, inter, generator=g) * 0.02).to(dt), isa)
          for _ in range(layers)]
    configs = [(b, a) for b in batches for a in available]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(configs) * (rounds + 1), desc="fused-MoE kernel", unit="config")
    out = []
    for batch, avail in configs:
        x = (torch.randn(batch, hidden, generator=g) * 0.1).to(dt)
        weights = torch.full((batch, top_k), 1.0 / top_k)
        result = torch.empty_like(x)
        per_round, reads = [], []
        for r in range(rounds + 1):
            ids = [
                torch.stack([torch.randperm(avail, generator=g)[:top_k] for _ in range(batch)]).to(
                    torch.int32
                )
                for _ in range(steps * layers)
            ]
            t0 = time.perf_counter()
            for i, pick in enumerate(ids):
                cpu_fused_moe(
                    result, x, w13[i % layers], w2[i % layers], None, None, weights, pick, "silu", isa
                )
            elapsed = (time.perf_counter() - t0) / len(ids)
            if r:  # round 0 warms up
                per_round.append(elapsed)
                reads.extend(len(torch.unique(p)) for p in ids)
            if bar is not None:
                bar.update()
        out.append(
            KernelSample(
                batch, avail, float(np.mean(reads)), batch * top_k, float(np.median(per_round)), len(ids)
            )
        )
    if bar is not None:
        bar.close()
    return out


def predict_from_full(model: MoEKernelModel, moe_layers: int, top_k: int, batch: int, full_step_s: float,
                      union_full: float, union_pruned: float) -> dict:
    """The pruned decode step the kernel model predicts from a measured full step: the same step less the
    kernel time of the experts it no longer reads, moe_layers x a x (U_full - U_pruned). The pairs, the
    per-call cost and everything outside the kernel stay as measured. The model does not apply where its own
    full-step kernel time exceeds the measured step (another thread layout, a compiled graph, another kernel):
    `applies` is False."""
    pairs = batch * top_k
    kernel_full = moe_layers * model.seconds(union_full, pairs)
    kernel_pruned = moe_layers * model.seconds(union_pruned, pairs)
    pruned = full_step_s - (kernel_full - kernel_pruned)
    applies = kernel_full <= full_step_s and pruned > 0
    return {
        "batch": batch,
        "union_full": union_full,
        "union_pruned": union_pruned,
        "full_step_s": full_step_s,
        "kernel_full_s": kernel_full,
        "kernel_pruned_s": kernel_pruned,
        "kernel_share_full": kernel_full / full_step_s,
        "pair_share_full": model.pair_share(union_full, pairs),
        "pair_share_pruned": model.pair_share(union_pruned, pairs),
        "pruned_step_s": pruned,
        "predicted_speedup": full_step_s / pruned if applies else None,
        "applies": applies,
    }


def bench_kernel_roofline(
    rc, kept: int, batches: Sequence[int], summary: dict, traffic: dict | None, dtype: str, seed: int, log
) -> dict:
    """`slimwise bench --kernel-roofline`: time the fused-MoE op at the model's expert shapes (`rc`, a
    `RooflineConfig`; up to 8 layers' weights, so they exceed the caches as the model's do), fit it, and
    predict each batch's pruned step from the bench's measured full step. Experts read per step from the
    traffic counters where they ran (slimwise, else pruned), else the uniform expectation over all / `kept`
    experts."""
    from slimwise.perf.bench_report import batch_entry
    from slimwise.perf.roofline import expected_union

    inter = rc.expert_params // (3 * rc.hidden_size)
    log(
        f"kernel roofline: timing the fused-MoE op (hidden {rc.hidden_size}, experts of "
        f"{inter}, top-{rc.top_k})"
    )
    samples = measure_fused_moe(rc.hidden_size, inter, rc.num_experts, rc.top_k, batches,
                                layers=min(rc.moe_layers, 8), dtype=dtype, rounds=3, steps=5, seed=seed)
    model = fit_moe_kernel(samples, int(rc.expert_params * rc.expert_bytes))
    counted = traffic or {}
    pruned_counter = next((n for n in ("slimwise", "pruned") if n in counted), None)
    rows = []
    for b in batches:
        full = summary["full"].get(b)
        if not full:
            continue
        union_full = (batch_entry(counted["full"]["batches"], b)["touched_mean"] if "full" in counted
                      else expected_union(rc.num_experts, rc.top_k, b))
        union_pruned = (batch_entry(counted[pruned_counter]["batches"], b)["touched_mean"] if pruned_counter
                        else expected_union(kept, rc.top_k, b))
        row = predict_from_full(
            model, rc.moe_layers, rc.top_k, b, full["tpot_ms"]["median"] / 1e3, union_full, union_pruned
        )
        for name in ("slimwise", "pruned"):
            measured = summary.get(name, {}).get(b, {}).get("speedup")
            if measured:
                row[f"measured_speedup_{name}"] = measured["median"]
        rows.append(row)
    return {"model": model.as_dict(), "samples": [vars(s) for s in samples], "rows": rows,
            "unions": "traffic counters" if counted else "uniform expectation"}
