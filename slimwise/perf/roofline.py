"""Analytic decode-step model: what pruning experts buys per decode step, against batch size.

Why a model at all: batched decode reads every touched expert's weights once per step, so its speed is set by
bytes moved, and the distinct experts a batch touches grow with batch size. With E experts, top-k routing and
B tokens per step, an expert is missed by one token with probability 1 - k/E, so the expected union is
E * (1 - (1 - k/E)^B) under uniform routing (exact for "each token picks k distinct experts uniformly").
Pruning to E' experts shrinks that union only once B is large enough to touch most of them, and leaves
attention, dense weights, shared experts, the lm_head and KV/state reads unchanged: the gain is below
bytes(full)/bytes(pruned) < 2 at 50%, near 1 at B=1, and fades again at very large B, where KV-cache and
recurrent-state reads (proportional to B) dominate and where FLOPs (unchanged by pruning) may bound the step.

Per decode step at batch B and context length L (all sequences at L):
    weights  = dense (attention/linear-attention mixers, norms, dense MLPs) + shared experts
               + router rows of kept experts + U * expert bytes per MoE layer
               + lm_head (the full table when tied) + min(B, V) embedding rows
    KV       = B * (L * kv bytes per token over full-attention layers + min(L, window) for sliding ones
               + one token written)
    state    = B * 2 * (recurrent + conv state of every linear-attention layer)   (read and written)
    FLOPs    = B * (2 * active params per token + 4 * heads * head_dim * L per full-attention layer
               + ~7 * dk * dv per value head per linear-attention layer)
    time     = max(bytes / bandwidth, FLOPs / peak) + fixed overhead;  throughput = B / time
U is the expected union of touched experts per MoE layer: uniform E'(1 - (1 - k/E')^B), or, from measured
usage shares p_j (renormalised over the kept experts), sum_j 1 - (1 - min(1, k p_j))^B: each token selects
expert j with probability k p_j (k distinct picks), independently across tokens. For uniform p this is the
uniform formula exactly; by concavity, skewed routing touches fewer experts than uniform at the same B.
Quantized linear layers (`--quant`, or a quantized checkpoint's stored bytes) count their bytes per parameter,
scales included; their dequantization arithmetic is not modelled.
Not modelled: activations, kernel launch gaps (use overhead), caches, MTP heads, vision.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from slimwise.errors import SlimWiseError
from slimwise.io import save_figure
from slimwise.stats import expected_union

DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "fp8": 1.0}
#: bytes per weight of the linear layers a quantized release stores quantized (routed and shared experts,
#: attention / linear-attention projections), scales included; embeddings, LM head, norms and routers stay in
#: the model dtype. fp8: e4m3 + one float32 `weight_scale_inv` per 128x128 block (the official FP8 releases);
#: w4a16: int4 packed + one bf16 scale per group of 128 (compressed-tensors `pack-quantized`, llm-compressor's
#: W4A16 preset).
QUANT_BYTES = {"fp8": 1.0 + 4.0 / (128 * 128), "w4a16": 0.5 + 2.0 / 128}


# ----- model description -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class RooflineConfig:
    """Parameter counts by role and per-token cache sizes of one model: everything a decode step reads."""

    name: str
    num_layers: int
    moe_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    vocab_size: int
    expert_params: int  # one routed expert, all its tensors
    router_params_per_expert: int  # router rows (and biases) per expert per MoE layer
    shared_params: int  # shared experts and their gates, all layers
    dense_params: int  # attention / linear-attention mixers, norms, dense MLP layers, final norm
    embed_params: int
    lm_head_params: int  # 0 when tied to the embedding table
    full_attention_layers: int = 0
    sliding_attention_layers: int = 0
    sliding_window: int = 0
    linear_attention_layers: int = 0
    kv_elems_per_token_layer: int = 0  # K+V (or MLA latent) elements one token adds per attention layer
    attn_flops_per_ctx_layer: float = 0.0  # per query token per context position per attention layer
    state_elems_per_seq_layer: int = 0  # recurrent state per sequence per linear-attention layer
    conv_elems_per_seq_layer: int = 0  # conv state per sequence per linear-attention layer
    state_flops_per_token_layer: float = 0.0
    weight_bytes: float = 2.0
    kv_bytes: float = 2.0
    state_bytes: float = 2.0  # recurrent state element (fp32 where the config says mamba_ssm_dtype float32)
    mixer_params: int = 0  # the part of dense_params in attention and linear-attention mixers (all layers)
    linear_bytes: float | None = None  # quantized linear weights (QUANT_BYTES); None: weight_bytes

    # ----- sizes -----
    @property
    def expert_bytes(self) -> float:
        """Bytes per parameter of the routed and shared experts and the mixers' projections."""
        return self.weight_bytes if self.linear_bytes is None else self.linear_bytes

    def _bytes(self, quantized: float, other: float) -> float:
        return quantized * self.expert_bytes + other * self.weight_bytes

    @property
    def tied(self) -> bool:
        return self.lm_head_params == 0

    @property
    def routed_params(self) -> int:
        return self.moe_layers * self.num_experts * self.expert_params

    @property
    def total_params(self) -> int:
        router = self.moe_layers * self.num_experts * self.router_params_per_expert
        return (self.routed_params + router + self.shared_params + self.dense_params + self.embed_params
                + self.lm_head_params)

    def active_params(self, kept: int | None = None) -> int:
        """Parameters one token multiplies with (embedding lookup excluded, the lm_head included)."""
        kept = self.num_experts if kept is None else kept
        head = self.lm_head_params or self.embed_params
        return (self.dense_params + self.shared_params + head
                + self.moe_layers * (kept * self.router_params_per_expert + self.top_k * self.expert_params))

    def kv_bytes_per_seq(self, context_len: int) -> float:
        per_layer = self.kv_elems_per_token_layer * self.kv_bytes
        window = min(context_len, self.sliding_window) if self.sliding_window else context_len
        return per_layer * (self.full_attention_layers * context_len + self.sliding_attention_layers * window)

    def state_bytes_per_seq(self) -> float:
        return self.linear_attention_layers * (self.state_elems_per_seq_layer * self.state_bytes
                                               + self.conv_elems_per_seq_layer * self.kv_bytes)

    # ----- one decode step -----
    def weight_bytes_step(self, batch: int, union: float, kept: int | None = None) -> float:
        """Weight bytes read in a step where `union` experts per MoE layer are touched."""
        kept = self.num_experts if kept is None else kept
        head = self.lm_head_params or self.embed_params
        rows = 0 if self.tied else min(batch, self.vocab_size) * self.hidden_size
        quantized = self.mixer_params + self.shared_params + self.moe_layers * union * self.expert_params
        other = (self.dense_params - self.mixer_params + head + rows
                 + self.moe_layers * kept * self.router_params_per_expert)
        return self._bytes(quantized, other)

    def cache_bytes_step(self, batch: int, context_len: int) -> float:
        """KV reads (+ the new token's write) and linear-attention state read + write, for the whole batch."""
        attn_layers = self.full_attention_layers + self.sliding_attention_layers
        new_token = attn_layers * self.kv_elems_per_token_layer * self.kv_bytes
        return batch * (self.kv_bytes_per_seq(context_len) + new_token + 2 * self.state_bytes_per_seq())

    def bytes_split(
        self, batch: int, context_len: int, union: float, kept: int | None = None
    ) -> dict[str, float]:
        """One decode step's bytes by what they are: routed expert weights, other weights (mixers, norms,
        shared experts, router rows, lm_head, embedding rows), KV cache (read + the new token's write) and the
        linear-attention conv + recurrent state (read and written). The four sum to weight + cache bytes."""
        attn_layers = self.full_attention_layers + self.sliding_attention_layers
        new_token = attn_layers * self.kv_elems_per_token_layer * self.kv_bytes
        weights = self.weight_bytes_step(batch, union, kept)
        experts = self.moe_layers * union * self.expert_params * self.expert_bytes
        return {"expert_weights": experts, "other_weights": weights - experts,
                "kv": batch * (self.kv_bytes_per_seq(context_len) + new_token),
                "state": batch * 2 * self.state_bytes_per_seq()}

    def flops_step(self, batch: int, context_len: int, kept: int | None = None) -> float:
        window = min(context_len, self.sliding_window) if self.sliding_window else context_len
        attn = self.attn_flops_per_ctx_layer * (self.full_attention_layers * context_len
                                                + self.sliding_attention_layers * window)
        linear = self.linear_attention_layers * self.state_flops_per_token_layer
        return batch * (2.0 * self.active_params(kept) + attn + linear)

    @classmethod
    def from_hf(cls, config, name: str | None = None, dtype: str = "bfloat16", kv_dtype: str | None = None,
                state_dtype: str | None = None, quant: str | None = None) -> RooflineConfig:
        """Count a transformers config's parameters by role (exact: built on the meta device, no memory);
        `quant` (QUANT_BYTES) stores the linear layers quantized, the rest in `dtype`."""
        counts = param_census(config)
        text = getattr(config, "text_config", None) or config
        cache = _cache_shapes(text)
        weight_bytes = DTYPE_BYTES[dtype]
        ssm = state_dtype or getattr(text, "mamba_ssm_dtype", None) or dtype
        return cls(
            name=name or str(getattr(text, "model_type", "model")),
            num_layers=int(text.num_hidden_layers), hidden_size=int(text.hidden_size),
            vocab_size=int(text.vocab_size), **counts, **cache, weight_bytes=weight_bytes,
            kv_bytes=DTYPE_BYTES[kv_dtype or dtype], state_bytes=DTYPE_BYTES[str(ssm).removeprefix("torch.")],
            linear_bytes=QUANT_BYTES[quant] if quant else None,
        )

    @classmethod
    def from_dir(cls, model_dir, dtype: str = "auto") -> RooflineConfig:
        """A local checkpoint's config, at `dtype` ("auto": bf16 weights). A quantized checkpoint (FP8,
        compressed-tensors) is counted as stored: its linear layers at the bytes per parameter its routed
        experts' tensors take in the files (quantized weights with their scales and zero points), which is
        what `slimwise bench` reports as expert bytes read per step."""
        from pathlib import Path

        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        rc = cls.from_hf(hf, name=Path(model_dir).name, dtype="bfloat16" if dtype == "auto" else dtype)
        stored = stored_expert_bytes(model_dir, hf)
        return rc if stored is None else replace(
            rc, linear_bytes=stored / (rc.moe_layers * rc.num_experts * rc.expert_params))


def stored_expert_bytes(model_dir, hf_config) -> int | None:
    """Bytes the routed experts' tensors of a quantized checkpoint take in its safetensors files (per expert
    or fused; shared experts, named `shared_expert(s)`, and routers excluded); None for an unquantized one,
    whose bytes follow from its dtype."""
    from slimwise.quantized import quantization_config

    if not quantization_config(hf_config):
        return None
    from slimwise.safetensors_files import stored_tensors, weight_files

    stored = stored_tensors(weight_files(Path(model_dir)))
    return sum(s.nbytes for name, s in stored.items() if ".layers." in name and ".experts." in name)


#: module names of token mixers (softmax attention, Gated DeltaNet / linear attention) across the families
MIXER_NAMES = ("self_attn", "linear_attn", "attention")


def param_census(config) -> dict:
    """Parameters of the model built from `config`, split by what a decode step does with them.

    The model is instantiated on the meta device (no memory, ~1 s for 35B) and split with the family adapter,
    so every supported family is counted exactly, shared experts and dense layers included.
    """
    from transformers import AutoModelForCausalLM

    from slimwise.adapters import get_adapter

    adapter = get_adapter(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = adapter.moe_layers(model)
    if not layers:
        raise SlimWiseError(f"{getattr(config, 'model_type', '?')}: no MoE layers found")
    num_experts = layers[0].experts.num_experts if hasattr(layers[0].experts, "num_experts") else \
        adapter.num_experts(config)

    def numel(params) -> int:
        return sum(p.numel() for p in params)

    seen: set[int] = set()

    def take(params) -> list:
        out = [p for p in params if id(p) not in seen]
        seen.update(id(p) for p in out)
        return out

    routed = router = shared = 0
    for layer in layers:
        routed += numel(take(layer.experts.parameters()))
        router += numel(take(layer.router.parameters()))
        for attr in adapter.shared_attrs:
            module = getattr(layer.block, attr, None)
            if module is not None:
                shared += numel(take(module.parameters()))
    embed_w = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    embed = numel(take([embed_w]))
    lm_head = 0 if head is None or head.weight is embed_w else numel(take(head.parameters()))
    mixers = numel(take([p for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in MIXER_NAMES
                         for p in module.parameters()]))
    dense = mixers + numel(take(model.parameters()))
    n_moe, per = len(layers), num_experts * len(layers)
    if routed % per or router % per:
        raise SlimWiseError("expert tensors do not split evenly over experts: non-uniform layers unsupported")
    return dict(moe_layers=n_moe, num_experts=num_experts, top_k=adapter.top_k(config),
                expert_params=routed // per, router_params_per_expert=router // per, shared_params=shared,
                dense_params=dense, embed_params=embed, lm_head_params=lm_head, mixer_params=mixers)


def _cache_shapes(text) -> dict:
    """Per-layer KV / recurrent state sizes and attention FLOPs from config fields."""
    n_layers = int(text.num_hidden_layers)
    types = list(getattr(text, "layer_types", None) or ["full_attention"] * n_layers)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    out = dict(full_attention_layers=sum(t == "full_attention" for t in types),
               sliding_attention_layers=sum(t == "sliding_attention" for t in types),
               linear_attention_layers=sum(t == "linear_attention" for t in types),
               sliding_window=int(getattr(text, "sliding_window", 0) or 0))
    if not any(t == "sliding_attention" for t in types):
        out["sliding_window"] = 0
    if getattr(text, "kv_lora_rank", None):  # MLA (DeepSeek): the cache holds the latent + rope key
        latent, rope = int(text.kv_lora_rank), int(text.qk_rope_head_dim)
        out["kv_elems_per_token_layer"] = latent + rope
        out["attn_flops_per_ctx_layer"] = float(heads * (2 * (latent + rope) + 2 * latent))
    else:
        out["kv_elems_per_token_layer"] = 2 * kv_heads * head_dim
        out["attn_flops_per_ctx_layer"] = float(4 * heads * head_dim)
    if out["linear_attention_layers"]:
        nk, nv = int(text.linear_num_key_heads), int(text.linear_num_value_heads)
        dk, dv = int(text.linear_key_head_dim), int(text.linear_value_head_dim)
        out["state_elems_per_seq_layer"] = nv * dk * dv
        out["conv_elems_per_seq_layer"] = (2 * nk * dk + nv * dv) * (int(text.linear_conv_kernel_dim) - 1)
        out["state_flops_per_token_layer"] = float(7 * nv * dk * dv)
    return out


# ----- expected touched experts ----------------------------------------------------------------------------

def kept_experts(num_experts: int, ratio: float, top_k: int) -> int:
    """Experts kept per layer at `ratio`, rounded as slimwise.plan does."""
    if not 0.0 <= ratio < 1.0:
        raise SlimWiseError(f"ratio {ratio} is outside [0, 1)")
    kept = num_experts - int(math.floor(ratio * num_experts + 0.5))
    if kept < top_k:
        raise SlimWiseError(f"ratio {ratio} keeps {kept} experts, fewer than top-k {top_k}")
    return kept


def expected_union_skewed(shares: torch.Tensor, top_k: int, batch: int, kept: int | None = None) -> float:
    """Expected union from measured usage shares of one layer [E]; pruning keeps the `kept` most used.

    Pruned experts' share is assumed to move to the kept ones in proportion (renormalisation).
    """
    p = shares.to(torch.float64).flatten()
    if kept is not None and kept < p.numel():
        p = p.topk(kept).values
    total = p.sum()
    if total <= 0:
        return expected_union(p.numel(), top_k, batch)
    q = (top_k * p / total).clamp(max=1.0)
    return float((1.0 - (1.0 - q) ** batch).sum())


def _union(config: RooflineConfig, kept: int, batch: int, shares: torch.Tensor | None) -> float:
    if shares is None:
        return expected_union(kept, config.top_k, batch)
    rows = shares if shares.dim() == 2 else shares[None]
    return sum(expected_union_skewed(r, config.top_k, batch, kept) for r in rows) / rows.shape[0]


# ----- hardware --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hardware:
    """Peak memory bandwidth (bytes/s), dense peak FLOP/s for the weight dtype, and memory size (bytes)."""

    name: str
    bandwidth: float
    peak_flops: float
    memory: float = 0.0
    overhead_s: float = 0.0
    note: str = ""


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        "h100", 3.35e12, 989e12, 80e9, note="H100 SXM5 80 GB: HBM3 3.35 TB/s, ~989 TFLOP/s dense bf16"
    ),
    "h200": Hardware(
        "h200", 4.8e12, 989e12, 141e9, note="H200 SXM 141 GB: HBM3e 4.8 TB/s, ~989 TFLOP/s dense bf16"
    ),
}


def measure_cpu(budget_s: float = 8.0, bandwidth_mb: int = 256,
                matmul_shapes: tuple[tuple[int, int, int], ...] = ((16, 1024, 4096), (64, 1024, 4096),
                                                                   (256, 1024, 4096), (1024, 1024, 4096)),
                dtype: str = "bfloat16") -> Hardware:
    """Measure this machine: streaming read bandwidth (sum of a tensor far larger than the caches) and the
    best matmul FLOP/s over decode-like shapes [tokens, hidden] x [hidden, out], medians of a few repetitions.

    Short on purpose (a few seconds on 2 cores); results move with background load, so the note reports them.
    The budget holds where a dtype is emulated: without bf16 matrix units a [1024, 1024] x [1024, 4096] bf16
    matmul takes 4-21 s, so a shape whose predicted call exceeds what is left of the budget is skipped (the
    peak is the best shape measured), and a call slower than its share is timed once (the warm-up).
    """
    deadline = time.perf_counter() + budget_s
    def timed(fn, reps: int, share: float) -> float:
        t = time.perf_counter()
        fn()  # warm-up, and the only sample when it alone spends the share
        warm_up = time.perf_counter() - t
        stop = time.perf_counter() + share * max(0.0, deadline - time.perf_counter())
        if time.perf_counter() + warm_up > stop:
            return warm_up
        times: list[float] = []
        while len(times) < reps and (len(times) < 3 or time.perf_counter() < stop):  # >= 3: a median
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    def stream() -> tuple[float, float]:
        x = torch.ones(bandwidth_mb * (1 << 20) // 4, dtype=torch.float32)
        y = torch.empty_like(x)
        read = x.numel() * 4 / timed(lambda: x.sum(), 7, 0.2)
        return read, 2 * x.numel() * 4 / timed(lambda: y.copy_(x), 5, 0.2)

    read, copy = stream()  # the 2 x bandwidth_mb buffers are freed before the matmuls
    rates: dict[str, dict[int, float]] = {"float32": {}, "bfloat16": {}}
    jobs = [(name, shape) for name in rates for shape in matmul_shapes]
    for i, (name, (m, k, nn_)) in enumerate(jobs):
        flops = 2 * m * k * nn_
        if rates[name] and flops / max(rates[name].values()) > max(0.0, deadline - time.perf_counter()) / 2:
            continue  # emulated or slow here: a bigger shape would spend the budget of the rest
        dt = getattr(torch, name)
        a, w = torch.randn(m, k, dtype=dt), torch.randn(k, nn_, dtype=dt)
        rates[name][m] = flops / timed(lambda a=a, w=w: a @ w, 5, 1.0 / (len(jobs) - i))
    try:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        memory = 0.0
    k, nn_ = matmul_shapes[0][1:]

    def fmt(r: dict[int, float]) -> str:
        return ", ".join(f"M={m}: {v / 1e9:.1f}" for m, v in r.items())

    note = (f"measured: read {read / 1e9:.1f} GB/s, copy {copy / 1e9:.1f} GB/s; matmul [M,{k}]x[{k},{nn_}] "
            f"GFLOP/s bf16 {fmt(rates['bfloat16'])}; fp32 {fmt(rates['float32'])}; "
            f"{torch.get_num_threads()} threads; peak = best shape")
    peak = max(rates.get(dtype, rates["float32"]).values())
    return Hardware("cpu-measured", read, peak, memory, note=note)


def get_hardware(name: str, dtype: str = "bfloat16", overhead_s: float = 0.0) -> Hardware:
    if name == "cpu-measured":
        hw = measure_cpu(dtype=dtype)
    elif name in HARDWARE:
        hw = HARDWARE[name]
    else:
        raise SlimWiseError(f"unknown hardware {name!r}; have: {', '.join([*HARDWARE, 'cpu-measured'])}")
    return (
        Hardware(hw.name, hw.bandwidth, hw.peak_flops, hw.memory, overhead_s, hw.note) if overhead_s else hw
    )


# ----- prediction ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepPrediction:
    """One batch size: bytes, FLOPs, time and throughput of a decode step, full vs pruned."""

    hardware: str
    batch: int
    context_len: int
    ratio: float
    kept: int
    union_full: float
    union_pruned: float
    bytes_full: float
    bytes_pruned: float
    cache_bytes: float  # KV + state part of both (unchanged by pruning)
    flops_full: float
    flops_pruned: float
    time_full_s: float
    time_pruned_s: float
    bound_full: str
    bound_pruned: str
    fits_memory: bool | None

    @property
    def tokens_per_s_full(self) -> float:
        return self.batch / self.time_full_s

    @property
    def tokens_per_s_pruned(self) -> float:
        return self.batch / self.time_pruned_s

    @property
    def speedup(self) -> float:
        return self.time_full_s / self.time_pruned_s

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s_full": self.tokens_per_s_full,
                "tokens_per_s_pruned": self.tokens_per_s_pruned, "speedup": self.speedup}


def _step(config: RooflineConfig, hw: Hardware, batch: int, context_len: int, kept: int,
          shares: torch.Tensor | None) -> tuple[float, float, float, float, str]:
    union = _union(config, kept, batch, shares)
    moved = config.weight_bytes_step(batch, union, kept) + config.cache_bytes_step(batch, context_len)
    flops = config.flops_step(batch, context_len, kept)
    t_mem, t_flop = moved / hw.bandwidth, flops / hw.peak_flops
    return union, moved, flops, max(t_mem, t_flop) + hw.overhead_s, "memory" if t_mem >= t_flop else "compute"


def predict(
    config: RooflineConfig,
    hardware: Hardware,
    ratio: float,
    batches: list[int],
    context_len: int = 1024,
    usage_shares: torch.Tensor | None = None,
) -> list[StepPrediction]:
    """Decode-step predictions, full model vs `ratio` of the routed experts pruned, for each batch size."""
    kept = kept_experts(config.num_experts, ratio, config.top_k)
    if usage_shares is not None and usage_shares.shape[-1] != config.num_experts:
        raise SlimWiseError(f"usage shares cover {usage_shares.shape[-1]} experts, the model has "
                            f"{config.num_experts}")
    resident = resident_bytes(config)
    out = []
    for b in batches:
        if b < 1:
            raise SlimWiseError(f"batch sizes must be >= 1, got {b}")
        uf, bf, ff, tf, boundf = _step(config, hardware, b, context_len, config.num_experts, usage_shares)
        up, bp, fp, tp, boundp = _step(config, hardware, b, context_len, kept, usage_shares)
        per_seq = config.kv_bytes_per_seq(context_len) + config.state_bytes_per_seq()
        fits = None if not hardware.memory else resident + b * per_seq <= 0.9 * hardware.memory
        out.append(
            StepPrediction(
                hardware.name,
                b,
                context_len,
                ratio,
                kept,
                uf,
                up,
                bf,
                bp,
                config.cache_bytes_step(b, context_len),
                ff,
                fp,
                tf,
                tp,
                boundf,
                boundp,
                fits,
            )
        )
    return out


def weights_only_limit(config: RooflineConfig, ratio: float) -> float:
    """Speedup when every expert is touched and cache reads and FLOPs are ignored: the ceiling (< 2 at
    50%)."""
    kept = kept_experts(config.num_experts, ratio, config.top_k)
    full = config.weight_bytes_step(1, config.num_experts)
    return full / config.weight_bytes_step(1, kept, kept)


@dataclass(frozen=True)
class Reach:
    """Where a speedup curve meets a target: first batch reaching it, the curve's peak, and the peak among
    batches whose KV/state still fits next to the full model's weights (None when memory is unknown)."""

    target: float
    first_batch: int | None
    peak_speedup: float
    peak_batch: int
    weights_limit: float
    fitting_peak_speedup: float | None = None
    fitting_peak_batch: int | None = None


def batch_reaching(config: RooflineConfig, hardware: Hardware, ratio: float, target: float,
                   context_len: int = 1024, usage_shares: torch.Tensor | None = None,
                   max_batch: int = 4096) -> Reach:
    """Smallest batch (1..max_batch) whose predicted speedup reaches `target`, plus the peak of the curve."""
    preds = predict(config, hardware, ratio, list(range(1, max_batch + 1)), context_len, usage_shares)
    first = next((p.batch for p in preds if p.speedup >= target), None)
    peak = max(preds, key=lambda p: p.speedup)
    fitting = [p for p in preds if p.fits_memory]
    fit_peak = max(fitting, key=lambda p: p.speedup) if fitting else None
    return Reach(target, first, peak.speedup, peak.batch, weights_only_limit(config, ratio),
                 fit_peak.speedup if fit_peak else None, fit_peak.batch if fit_peak else None)


def resident_bytes(config: RooflineConfig, kept: int | None = None) -> float:
    """Weight bytes held in memory with `kept` experts per MoE layer (all by default)."""
    kept = config.num_experts if kept is None else kept
    experts = config.moe_layers * kept * config.expert_params
    routers = config.moe_layers * kept * config.router_params_per_expert
    quantized = experts + config.shared_params + config.mixer_params
    other = config.dense_params - config.mixer_params + config.embed_params + config.lm_head_params + routers
    return config._bytes(quantized, other)


def max_batch(config: RooflineConfig, hardware: Hardware, context_len: int, kept: int | None = None,
              utilization: float = 0.9, limit: int = 4096) -> int:
    """Largest batch whose KV/state fits beside the weights in `utilization` of memory (0: weights don't
    fit)."""
    per_seq = config.kv_bytes_per_seq(context_len) + config.state_bytes_per_seq()
    free = utilization * hardware.memory - resident_bytes(config, kept)
    if free <= 0:
        return 0
    return limit if per_seq <= 0 else min(limit, int(free // per_seq))


@dataclass(frozen=True)
class Capacity:
    """Each model at the largest batch its memory allows: a PD-disaggregated decode instance holds only the
    pruned weights, so it can batch more sequences than the full model, on top of the per-step gain."""

    batch_full: int
    batch_pruned: int
    tokens_per_s_full: float
    tokens_per_s_pruned: float

    @property
    def speedup(self) -> float:
        return self.tokens_per_s_pruned / self.tokens_per_s_full if self.tokens_per_s_full else math.inf


def capacity_comparison(
    config: RooflineConfig,
    hardware: Hardware,
    ratio: float,
    context_len: int = 1024,
    usage_shares: torch.Tensor | None = None,
    utilization: float = 0.9,
) -> Capacity | None:
    """Full model at its max batch vs the pruned-only decoder at its max batch (None: memory unknown)."""
    if not hardware.memory:
        return None
    kept = kept_experts(config.num_experts, ratio, config.top_k)
    bf = max_batch(config, hardware, context_len, None, utilization)
    bp = max_batch(config, hardware, context_len, kept, utilization)
    tf = bf / _step(config, hardware, bf, context_len, config.num_experts, usage_shares)[3] if bf else 0.0
    tp = bp / _step(config, hardware, bp, context_len, kept, usage_shares)[3] if bp else 0.0
    return Capacity(bf, bp, tf, tp)


# ----- reporting -------------------------------------------------------------------------------------------

def format_table(preds: list[StepPrediction]) -> str:
    """A Markdown table of a speedup curve."""
    head = ("| batch | experts touched / layer (full → pruned) | GB/step full | GB/step pruned | KV+state GB "
            "| ms/step full | ms/step pruned | tok/s full | tok/s pruned | speedup | bound | fits |")
    lines = [head, "|" + "---|" * 12]
    for p in preds:
        bound = p.bound_full if p.bound_full == p.bound_pruned else f"{p.bound_full}/{p.bound_pruned}"
        fits = "" if p.fits_memory is None else ("yes" if p.fits_memory else "no")
        lines.append(
            f"| {p.batch} | {p.union_full:.1f} → {p.union_pruned:.1f} | {p.bytes_full / 1e9:.2f} | "
            f"{p.bytes_pruned / 1e9:.2f} | {p.cache_bytes / 1e9:.2f} | {p.time_full_s * 1e3:.3f} | "
            f"{p.time_pruned_s * 1e3:.3f} | {p.tokens_per_s_full:,.0f} | {p.tokens_per_s_pruned:,.0f} | "
            f"{p.speedup:.3f} | {bound} | {fits} |"
        )
    return "\n".join(lines)


def plot_speedup(curves: dict[str, list[StepPrediction]], path: str | Path, title: str = "",
                 reference: float | None = None, reference_label: str = "paper",
                 ceiling: float | None = None) -> Path:
    """PNG of predicted speedup (pruned / full decode throughput) against batch size, one line per curve.

    Hollow markers: the batch's KV/state does not fit beside the full model's weights on that hardware.
    While memory-bound without overhead, curves of different GPUs coincide (the ratio of bytes is the same).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    styles = ["-", "--", ":", "-."]
    for i, (label, preds) in enumerate(curves.items()):
        xs, ys = [p.batch for p in preds], [p.speedup for p in preds]
        line, = ax.plot(xs, ys, ls=styles[i % len(styles)], lw=1.6 if i else 2.2, label=label)
        for p in preds:
            hollow = p.fits_memory is False
            ax.plot(p.batch, p.speedup, "os^D"[i % 4], ms=max(3.0, 8.0 - 3.0 * i), color=line.get_color(),
                    mfc="white" if hollow else line.get_color(), zorder=3 + i)
    if ceiling is not None:
        ax.axhline(ceiling, color="tab:red", ls=":", lw=1, label=f"weights-only ceiling {ceiling:.2f}x")
    if reference is not None:
        ax.axhline(reference, color="black", ls="--", lw=1, label=f"{reference_label} {reference:.2f}x")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch size (sequences per step); hollow = does not fit in memory")
    ax.set_ylabel("predicted decode speedup (pruned / full)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)
