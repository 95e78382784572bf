"""Roofline of expert-parallel decode: the slowest rank's expert bytes plus the all-to-all, full vs pruned
plans that are free (unequal kept experts per rank) or EP-balanced.

Layout modelled: vLLM's wide-EP deployment, data-parallel attention and expert-parallel MoE over `ep` GPUs
(`--data-parallel-size ep --enable-expert-parallel`). Each GPU holds B/ep of the B sequences, all dense
weights (attention, shared expert, router, lm_head: replicated) and E/ep routed experts. Per decode step and
GPU:

* bytes read: dense weights + its sequences' KV/state + the union of its experts that the whole batch's tokens
  touch (uniform routing over the kept experts: kept_r x (1 - (1 - k/K)^B)); a layer waits for its busiest
  GPU, so a plan with `imbalance` i (busiest GPU's kept experts / mean) reads i x the mean per layer;
* all-to-all: per MoE layer a dispatch and a combine, each sending B/ep tokens x k x hidden x bytes x
  (ep-1)/ep at the link bandwidth plus a fixed latency; not overlapped with compute (conservative);
* time = max(bytes / HBM bandwidth, FLOPs / peak) + all-to-all.

What it leaves out (say so next to any figure): routing skew (uniform routing assumed), load imbalance of
tokens rather than experts, overlap of communication with compute, kernel efficiency. The link figures are
assumptions (`Interconnect`), not measurements.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from slimwise.perf.roofline import Hardware, RooflineConfig, kept_experts
from slimwise.stats import expected_union


@dataclass(frozen=True)
class Interconnect:
    name: str
    bandwidth: float  # bytes/s per GPU per direction
    latency_s: float  # fixed cost of one all-to-all
    note: str = ""


INTERCONNECTS = {
    "nvlink4": Interconnect(
        "nvlink4",
        450e9,
        15e-6,
        "H100/H200 SXM NVLink 4: 900 GB/s bidirectional = 450 GB/s "
        "each way per GPU; 15 us per all-to-all assumed (small-message latency, not measured)",
    ),
}


def random_plan_imbalance(
    num_experts: int, kept: int, ep_size: int, draws: int = 4000, seed: int = 0
) -> float:
    """Expected busiest-rank / mean kept experts per layer for plans keeping a uniformly random `kept` of
    `num_experts` (contiguous blocks of num_experts / ep_size per rank): the imbalance that chance alone
    gives."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.rand(draws, num_experts, generator=g).argsort(dim=1)[:, :kept]
    counts = torch.zeros(draws, ep_size)
    counts.scatter_add_(1, picks // (num_experts // ep_size), torch.ones_like(picks, dtype=torch.float32))
    return float((counts.max(dim=1).values / (kept / ep_size)).mean())


@dataclass(frozen=True)
class EpPrediction:
    batch: int
    ep_size: int
    ratio: float
    imbalance: float
    time_full_s: float
    time_pruned_s: float
    a2a_s: float
    expert_bytes_full: float  # busiest GPU, per step
    expert_bytes_pruned: float

    @property
    def speedup(self) -> float:
        return self.time_full_s / self.time_pruned_s

    def as_dict(self) -> dict:
        return {**asdict(self), "speedup": self.speedup}


def _gpu_step(config: RooflineConfig, hw: Hardware, link: Interconnect, batch: int, context_len: int, ep: int,
              experts_on_busiest: float, kept_total: int) -> tuple[float, float, float]:
    """(time, all-to-all time, busiest GPU's expert bytes) of one decode step on the busiest GPU."""
    per_gpu = batch / ep
    touched = experts_on_busiest * (expected_union(kept_total, config.top_k, batch) / kept_total)
    expert_bytes = config.moe_layers * touched * config.expert_params * config.expert_bytes
    dense = config.weight_bytes_step(per_gpu, 0.0, kept_total)  # replicated weights, this GPU's lm_head rows
    cache = config.cache_bytes_step(1, context_len) * per_gpu
    flops = 2.0 * per_gpu * config.active_params(kept_total)
    a2a = config.moe_layers * 2 * (link.latency_s + per_gpu * config.top_k * config.hidden_size
                                   * config.weight_bytes * (ep - 1) / ep / link.bandwidth)
    t = max((dense + cache + expert_bytes) / hw.bandwidth, flops / hw.peak_flops) + a2a + hw.overhead_s
    return t, a2a, expert_bytes


def predict_ep(config: RooflineConfig, hw: Hardware, link: Interconnect, ratio: float, batches: list[int],
               ep_size: int, imbalance: float, context_len: int = 1024) -> list[EpPrediction]:
    """Decode step, full model vs a plan pruning `ratio` whose busiest rank keeps `imbalance` x the mean (1.0:
    an EP-balanced plan), at each global batch size."""
    kept = kept_experts(config.num_experts, ratio, config.top_k)
    out = []
    for b in batches:
        tf, a2a, bf = _gpu_step(config, hw, link, b, context_len, ep_size, config.num_experts / ep_size,
                                config.num_experts)
        tp, _, bp = _gpu_step(config, hw, link, b, context_len, ep_size, imbalance * kept / ep_size, kept)
        out.append(EpPrediction(b, ep_size, ratio, imbalance, tf, tp, a2a, bf, bp))
    return out
