"""What a command needs in memory, computed from the model's config on the meta device, before anything loads.

Why: the first sign that a 35 B-parameter run does not fit should be a table printed in a second, not an
out-of-memory error after minutes of loading. Everything here is a function of the config (parameters counted
on the meta device: no weights read, no memory) and of the command's settings; nothing is measured.

What each row is, and how exact:
- exact: weights (every parameter of the text model the CLI loads, `AutoModelForCausalLM.from_config`, at
  `dtype`), KV cache and linear-attention state (the same arithmetic as `models.kv_bytes_per_token` and
  `models.state_bytes_per_layer`, from a config object), statistics accumulators, the trainable delta and its
  AdamW state, the teacher log-prob cache, the pruned checkpoint's bytes.
- rough, with the constant stated in a note: activations. One inference forward holds about
  `INFERENCE_ACTIVATION` hidden-sized vectors per token for the one layer in flight; a backward holds about
  `TRAINING_ACTIVATION` per token for every layer between the first trainable parameter and the loss.

Invariants: rows add up to `total`; rows whose names are in `host_rows` live in host RAM, the rest on the
accelerator(s); rows of phases that do not overlap in time (a prefill, a backward) are added anyway, so the
total bounds the peak from above (as far as the rough activation rows hold) rather than equals it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from slimwise.errors import SlimWiseError
from slimwise.models import (
    kv_bytes_per_token_of,
    linear_attention_layers,
    state_bytes_per_layer_of,
)
from slimwise.models import text_config_dict as _text_dict

COMMANDS = ("calibrate", "distill", "prune", "generate", "eval")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: hidden-sized vectors per token alive in one layer's inference forward: residual, norm output, q/k/v/gate
#: (or the linear-attention projections), and the routed experts' gathered inputs, gate/up outputs and outputs
#: at top-8 (about 24 of them); rounded up
INFERENCE_ACTIVATION = 32
#: hidden-sized vectors per token per layer that autograd keeps for the backward: the tensors above, saved,
#: plus the float32 copies RMSNorm makes and the router's logits and softmax
TRAINING_ACTIVATION = 48
#: per log-prob element of a teacher-forced loss or KL: the model's logits and their log-softmax at the
#: model dtype (2 x dtype bytes), plus float32 teacher log-probs, their exp, the difference and the product
#: (16 bytes)
LOGPROB_FLOAT32_BYTES = 16
#: float64 sums per (MoE layer, expert) the calibration observer keeps: count, gate, norm, norm^2,
#: gate x norm, and the per-layer token count broadcast to the expert width
STAT_FIELDS = 6
GIB = 2**30

DEFAULT_BATCH = 16  # CalibrationConfig.batch_size
DEFAULT_NEW_TOKENS = 96  # CalibrationConfig.max_new_tokens


# ----- the result ------------------------------------------------------------------------------------------

@dataclass
class Footprint:
    """Bytes by what they hold, for one command on one model.

    `per_device` assumes every accelerator-side row splits evenly over `devices` (tensor parallelism splits
    each layer; accelerate's `--max-memory` spread puts whole layers on each device, so one device can hold up
    to a layer's weights more, and the last one the logits): it is an average, not the busiest device."""

    command: str
    model: str
    dtype: str
    rows: list[tuple[str, int]]
    devices: int = 1
    notes: list[str] = field(default_factory=list)
    host_rows: tuple[str, ...] = ()  # names of the rows held in host RAM, not on an accelerator
    settings: dict = field(default_factory=dict)  # batch, prompt and continuation lengths the rows assume
    step_bytes: int = 0  # weight bytes every decode step reads at least: all but routed experts, + top-k

    @property
    def total(self) -> int:
        return sum(b for _, b in self.rows)

    @property
    def host_total(self) -> int:
        return sum(b for what, b in self.rows if what in self.host_rows)

    @property
    def device_total(self) -> int:
        return self.total - self.host_total

    @property
    def per_device(self) -> int:
        return math.ceil(self.device_total / self.devices)

    def bytes_of(self, what: str) -> int:
        """One row's bytes; a row this command does not have is refused (a typo must not read as 0)."""
        for name, b in self.rows:
            if name == what:
                return b
        raise SlimWiseError(f"footprint of {self.command} has no row {what!r}; rows: "
                            f"{', '.join(n for n, _ in self.rows)}")

    def table(self) -> str:
        """A Markdown table in GiB (2 decimals): the rows, where each lives, the total and the per-device
        figure."""
        s = self.settings
        head = f"slimwise {self.command} {self.model} ({self.dtype}" + "".join(
            f", {k.replace('_', ' ')} {v}" for k, v in s.items()) + ")"
        lines = [head, "", "| what | GiB | where |", "|---|---:|---|"]
        lines += [f"| {what} | {b / GIB:.2f} | {'host RAM' if what in self.host_rows else 'accelerator'} |"
                  for what, b in self.rows]
        lines.append(f"| **total** | **{self.total / GIB:.2f}** | |")
        if self.device_total:
            lines.append(f"| per device ({self.devices} device{'s' * (self.devices > 1)}, even split) | "
                         f"{self.per_device / GIB:.2f} | accelerator |")
        if self.host_total:
            lines.append(f"| host RAM | {self.host_total / GIB:.2f} | host RAM |")
        return "\n".join(lines)

    def report(self) -> str:
        """The table followed by its notes, one per line."""
        return self.table() + "\n\n" + "\n".join(f"- {n}" for n in self.notes)


# ----- parameter census on the meta device -----------------------------------------------------------------

@dataclass(frozen=True)
class Census:
    """Parameter counts of the model built from a config on the meta device (exact; tied weights once)."""

    params: int
    moe_layers: int
    num_experts: int
    top_k: int
    routed_params: int  # every routed expert's tensors, all MoE layers
    router_params: int  # router weights (+ biases), all MoE layers
    norm_params: int  # the norms feeding the MoE blocks (the `norm` set)
    embed_params: int  # the input embedding table
    tied: bool  # lm_head shares the embedding table (counted once in params)
    auto_lora_targets: tuple[str, ...]  # what `resolve_lora_targets(model, ("auto",))` picks
    linear_io: dict = field(default_factory=dict)  # Linear leaf name -> sum of in + out features
    linear_weights: dict = field(default_factory=dict)  # Linear leaf name -> sum of in x out


_CENSUS: dict[str, Census] = {}


def census(config) -> Census:
    """Count `config`'s model by role on the meta device; cached per config (a 35 B model takes seconds)."""
    key = config.to_json_string()
    if key not in _CENSUS:
        _CENSUS[key] = _count(config)
    return _CENSUS[key]


def _count(config) -> Census:
    from torch import nn
    from transformers import AutoModelForCausalLM

    from slimwise.adapters import get_adapter
    from slimwise.trainable import moe_norm, resolve_lora_targets

    adapter = get_adapter(config)  # dense or unknown families are refused here
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = adapter.moe_layers(model)
    try:
        norm_params = sum(moe_norm(model, layer.index, adapter).weight.numel() for layer in layers)
    except SlimWiseError:  # a family without such a norm: distill refuses the `norm` set for it
        norm_params = 0
    io: dict[str, int] = {}
    weights: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            leaf = name.rsplit(".", 1)[-1]
            io[leaf] = io.get(leaf, 0) + module.in_features + module.out_features
            weights[leaf] = weights.get(leaf, 0) + module.in_features * module.out_features
    return Census(
        params=sum(p.numel() for p in model.parameters()), moe_layers=len(layers),
        num_experts=adapter.num_experts(config), top_k=adapter.top_k(config),
        routed_params=sum(p.numel() for layer in layers for p in layer.experts.parameters()),
        router_params=sum(p.numel() for layer in layers for p in layer.router.parameters()),
        norm_params=norm_params, embed_params=model.get_input_embeddings().weight.numel(),
        tied=model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        auto_lora_targets=tuple(resolve_lora_targets(model, ("auto",))), linear_io=io, linear_weights=weights)


# ----- resolving the model ---------------------------------------------------------------------------------

def resolve_config(model: str | Path):
    """(name, config) of a checkpoint directory, an embedded testbed name or a `perf.presets` name (full
    size), in that order, so a local directory is never shadowed by a preset of the same name."""
    from slimwise.embedded import EMBEDDED
    from slimwise.models import load_config
    from slimwise.perf.presets import PRESETS, preset_config

    text = str(model)
    if Path(text).is_dir() or text in EMBEDDED:
        return Path(text).name if Path(text).is_dir() else text, load_config(text)
    if text in PRESETS:
        return text, preset_config(text)
    raise SlimWiseError(f"unknown model {text!r}: pass a checkpoint directory, an embedded testbed "
                        f"({', '.join(EMBEDDED)}) or a preset ({', '.join(PRESETS)})")


# ----- the rows --------------------------------------------------------------------------------------------

@dataclass
class _Job:
    """Everything the row builders read."""

    config: object
    census: Census
    dtype: str
    batch: int
    prompt_len: int
    new_tokens: int
    ratio: float
    prompts: int | None
    distill: object = None  # DistillConfig for `distill`
    in_memory: bool = False  # `prune`: the in-memory export (--distilled) instead of the streamed one

    @property
    def bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def text(self) -> dict:
        return _text_dict(self.config)

    @property
    def hidden(self) -> int:
        return int(self.text["hidden_size"])

    @property
    def vocab(self) -> int:
        return int(self.text["vocab_size"])

    @property
    def layers(self) -> int:
        return int(self.text["num_hidden_layers"])


def _cache_rows(job: _Job, batch: int, tokens: int) -> list[tuple[str, int]]:
    rows = [("KV cache", batch * tokens * kv_bytes_per_token_of(job.config, job.dtype))]
    linear = linear_attention_layers(job.config)
    if linear:
        rows.append(("linear-attention state", batch * linear * state_bytes_per_layer_of(job.config)))
    return rows


def _forward_rows(job: _Job, batch: int) -> list[tuple[str, int]]:
    """Weights, caches and one inference forward (the prefill, the largest): what every command but prune
    holds on the accelerator."""
    act = batch * job.prompt_len * job.hidden * INFERENCE_ACTIVATION * job.bytes
    return [("weights", job.census.params * job.bytes),
            *_cache_rows(job, batch, job.prompt_len + job.new_tokens),
            ("activations (one layer)", act), ("last-position logits", batch * job.vocab * 4)]


def _forward_notes(job: _Job, batch: int) -> list[str]:
    linear = linear_attention_layers(job.config)
    full = job.layers - linear if linear else job.layers
    kv = kv_bytes_per_token_of(job.config, job.dtype)
    notes = [f"weights: {job.census.params:,} parameters at {job.bytes} bytes (the text model the CLI loads)",
             f"KV cache: {full} attention layers, {kv:,} bytes per token, {batch} sequences of "
             f"{job.prompt_len} + {job.new_tokens} tokens"]
    if linear:
        notes.append(f"linear-attention state: {linear} layers x {state_bytes_per_layer_of(job.config):,} "
                     "bytes per sequence (conv + recurrent), whatever the length")
    notes.append(f"activations: rough bound, batch x prompt x hidden x {INFERENCE_ACTIVATION} elements for "
                 "the one layer in flight (attention through SDPA: no prompt x prompt score matrix); prefill "
                 "keeps only the last position's logits, in float32")
    return notes


def _calibrate(job: _Job) -> tuple[list, list[str], tuple[str, ...]]:
    rows = _forward_rows(job, job.batch)
    rows.append(("statistics accumulators", STAT_FIELDS * job.census.moe_layers * job.census.num_experts * 8))
    tokens = job.prompt_len + job.new_tokens
    vllm_act = job.batch * tokens * job.hidden * INFERENCE_ACTIVATION * job.bytes
    notes = _forward_notes(job, job.batch) + [
        f"statistics: {STAT_FIELDS} float64 sums x {job.census.moe_layers} MoE layers x "
        f"{job.census.num_experts} experts, once more on the host",
        "--engine hf (decode phase): the model generates while observed, as in the rows; --engine vllm: vLLM "
        "generates first (its own memory, released before the transformers model loads), then one forward "
        "without a KV cache over prompt + continuation counts: no KV rows, activations "
        f"{vllm_act / GIB:.2f} GiB"]
    return rows, notes, ()


def _generate(job: _Job) -> tuple[list, list[str], tuple[str, ...]]:
    notes = _forward_notes(job, job.batch) + ["--decode-model DIR adds a second, pruned model: "
                                   f"{_pruned_params(job) * job.bytes / GIB:.2f} GiB at ratio {job.ratio}"]
    return _forward_rows(job, job.batch), notes, ()


def _eval(job: _Job) -> tuple[list, list[str], tuple[str, ...]]:
    rows = _forward_rows(job, job.batch)
    per_elem = 2 * job.bytes + LOGPROB_FLOAT32_BYTES
    rows.append(("teacher-forced KL log-probs", job.batch * job.new_tokens * job.vocab * per_elem))
    notes = _forward_notes(job, job.batch) + [
        f"KL log-probs: batch x {job.new_tokens} positions x vocab {job.vocab:,} x {per_elem} bytes (the "
        "full and the mode's log-probs, and their float32 difference), when the sweep measures "
        "teacher-forced KL"]
    ref = job.new_tokens * job.vocab * job.bytes
    notes.append(f"the sweep keeps the full model's log-probs across plans: {ref / 2**20:,.0f} MiB per prompt"
                 + (f", {job.prompts * ref / GIB:.2f} GiB for {job.prompts} prompts" if job.prompts else ""))
    return rows, notes, ()


def _pruned_params(job: _Job) -> int:
    c = job.census
    kept = c.num_experts - math.floor(job.ratio * c.num_experts + 0.5)  # as plan.make_plan rounds
    gone = (c.num_experts - kept) / c.num_experts
    return c.params - round(gone * (c.routed_params + c.router_params))


def _prune(job: _Job) -> tuple[list, list[str], tuple[str, ...]]:
    c, b = job.census, job.bytes
    kept_share = _pruned_routed_share(job)
    pruned = _pruned_params(job) * b
    disk = (f"disk: the pruned checkpoint's tensors are {pruned:,} bytes ({pruned / GIB:.2f} GiB, "
            f"{pruned / 1e9:.1f} GB): {kept_share:.0%} of the routed experts and every other tensor, "
            "written to a temporary sibling of --out first")
    if not job.in_memory:
        from slimwise.export_stream import CHUNK_BYTES

        rows = [("tensor data in flight (streamed export)", 2 * CHUNK_BYTES)]
        notes = ["the default streamed export reads the safetensors files tensor by tensor and never builds "
                 "the model: at most two chunks of tensor data are held at once, whatever the model's size; "
                 "the process itself (Python, torch, transformers) comes on top",
                 "--distilled, or a checkpoint the streamed export cannot reproduce exactly, exports in "
                 f"memory instead (the whole model on the CPU: {c.params * b / GIB:.2f} GiB of host RAM and "
                 "more; footprint(..., in_memory=True))", disk]
        return rows, notes, tuple(name for name, _ in rows)
    rows = [("weights (whole model)", c.params * b),
            ("sliced copies of the kept experts", round(kept_share * c.routed_params) * b),
            ("reloaded pruned checkpoint (export check)", pruned)]
    notes = [f"the rows are the in-memory export (--distilled, or a checkpoint the streamed export cannot "
             f"reproduce exactly): it loads the whole model on the CPU ({c.params * b / GIB:.2f} GiB of host "
             "RAM) whatever --device, and the source experts stay referenced until the export check has "
             "compared them; the default streamed export holds two 64 MiB chunks of tensor data at most",
             disk]
    return rows, notes, tuple(name for name, _ in rows)


def _quantized_prune_notes(model, job: _Job) -> list[str] | None:
    """`prune`'s notes for a quantized checkpoint directory: its output's size from the stored bytes
    (quantized weights with their scales: the config's parameter count at a dtype would be wrong), and no
    in-memory fallback. None for an unquantized model."""
    from slimwise.models import resolve_model_dir
    from slimwise.quantized import quantization_config

    found = quantization_config(job.config)
    if not found:
        return None
    from slimwise.export_stream import CHUNK_BYTES
    from slimwise.safetensors_files import stored_tensors, weight_files

    stored = stored_tensors(weight_files(resolve_model_dir(model)))
    total = sum(s.nbytes for s in stored.values())
    # routed experts' tensors, per expert or fused, with their scales (shared experts are `shared_expert(s)`),
    # and the router rows that go with them
    experts = sum(s.nbytes for name, s in stored.items() if ".layers." in name and (
        ".experts." in name or name.endswith((".mlp.gate.weight", ".e_score_correction_bias"))))
    share = _pruned_routed_share(job)
    pruned = total - round((1 - share) * experts)
    method = found.get("quant_method")
    return [f"the streamed export reads the {method} checkpoint's files tensor by tensor and never builds "
            f"the model: at most two {CHUNK_BYTES // 2**20} MiB chunks of tensor data are held at once",
            f"a {method} checkpoint is never exported in memory (it would be written dequantized): what "
            "the files do not describe exactly is refused, and so is --distilled",
            f"disk: the pruned checkpoint's tensors are about {pruned:,} bytes ({pruned / GIB:.2f} GiB) "
            f"as stored: {share:.0%} of the routed experts' tensors (weights and scales) and every other "
            "tensor, written to a temporary sibling of --out first"]


def _pruned_routed_share(job: _Job) -> float:
    n = job.census.num_experts
    return (n - math.floor(job.ratio * n + 0.5)) / n


# ----- distill ---------------------------------------------------------------------------------------------

def _trainable_rows(job: _Job) -> tuple[list, list[str]]:
    """The delta as the trainer holds it: parameters, gradients and AdamW's two moments (router rows and norms
    at the model dtype, as installed; LoRA in float32), plus the delta's float32 starting copy; and the merged
    LoRA weights autograd keeps for the backward."""
    from slimwise.trainable import TRAINABLE_SETS

    d = job.distill
    # each chosen set says what it holds (an unknown name holds nothing here: the run itself refuses it)
    held = [s.memory(job.census, d) for name, s in TRAINABLE_SETS.items() if name in d.params]
    dense, lora, merged = (sum(getattr(m, kind) for m in held) for kind in ("dense", "lora", "merged"))
    targets = tuple(t for m in held for t in m.targets)
    dense_sets = "/".join(s.name for s in TRAINABLE_SETS.values() if s.group == "dense")
    rows = [("trainable delta + grads + AdamW", dense * (4 + 4 * job.bytes) + lora * (4 + 4 * 4))]
    if merged:
        rows.append(("LoRA merged weights kept for backward", merged * job.bytes))
    notes = [f"trainable: {dense:,} {dense_sets} elements at {4 * job.bytes + 4} bytes, {lora:,} LoRA "
             f"elements (rank {d.lora_rank} on {','.join(targets) or 'nothing'}) at 20 bytes"]
    return rows, notes


def _teacher_rows(job: _Job, per_prompt: int) -> tuple[list, list[str], bool]:
    """The teacher log-prob cache in host RAM: all of the prompts' continuations when that fits under
    teacher_cache_mb, else none (recomputed per step). Unknown prompt count: the cap, an upper bound."""
    cap = int(job.distill.teacher_cache_mb * 2**20)
    fit = cap // per_prompt
    line = (f"teacher cache: {per_prompt / 2**20:,.0f} MiB per prompt ({job.new_tokens} tokens x vocab "
            f"{job.vocab:,} x 4 bytes); held only when all prompts fit under teacher_cache_mb "
            f"{job.distill.teacher_cache_mb:g} ({fit} prompts here), else recomputed every step")
    if job.prompts is None:
        unknown = line + "; prompt count unknown: the cap, an upper bound"
        return [("teacher log-prob cache", min(cap, fit * per_prompt))], [unknown], True
    size = job.prompts * per_prompt
    cached = size <= cap
    return [("teacher log-prob cache", size if cached else 0)], [line], cached


def _teacher_batch_row(job: _Job, per_prompt: int) -> tuple[str, int]:
    """A step's teacher log-probs, zero-padded on the host before they move to the device (cached path); a
    batch never holds more prompts than there are (unknown count: as many as the cache can hold)."""
    fit = int(job.distill.teacher_cache_mb * 2**20) // per_prompt
    rows = min(job.distill.batch_size, job.prompts if job.prompts is not None else fit)
    return "teacher log-probs of one batch", rows * per_prompt


def _distill(job: _Job) -> tuple[list, list[str], tuple[str, ...]]:
    d = job.distill
    batch = max(d.batch_size, d.teacher_batch_size)
    rows = _forward_rows(job, batch)
    notes = _forward_notes(job, batch)
    trainable, more = _trainable_rows(job)
    rows += trainable
    notes += more
    trained = d.max_new_tokens - 1 + (job.prompt_len if d.mode == "uniform" else 0)
    tokens = d.batch_size * trained
    act = tokens * job.hidden * TRAINING_ACTIVATION * job.bytes
    per_elem = 2 * job.bytes + LOGPROB_FLOAT32_BYTES
    rows += [("training activations (every layer)", act * job.layers),
             ("loss log-probs", tokens * job.vocab * per_elem)]
    ckpt = tokens * job.hidden * job.bytes * job.layers + act
    notes += [f"training activations: rough, {tokens:,} trained positions x hidden x "
              f"{TRAINING_ACTIVATION} elements x {job.layers} layers; --activation-checkpointing "
              f"recomputes the MoE blocks, which keep most of them (measured on an H200: "
              f"docs/results/gpu.md); whole layers checkpointed would keep {ckpt / GIB:.2f} GiB",
              f"loss: {tokens:,} positions x vocab {job.vocab:,} x {per_elem} bytes"]
    per_prompt = d.max_new_tokens * job.vocab * 4
    teacher, tnotes, cached = _teacher_rows(job, per_prompt)
    rows += teacher
    notes += tnotes
    if cached:
        rows.append(_teacher_batch_row(job, per_prompt))
    else:  # the full model continues a deep copy of the batch's prefill cache every step
        copy = _cache_rows(job, d.batch_size, job.prompt_len + d.max_new_tokens)
        rows += [(f"teacher's copy of the {name}", b) for name, b in copy]
    return rows, notes, ("teacher log-prob cache", "teacher log-probs of one batch")


_BUILDERS = {"calibrate": _calibrate, "distill": _distill, "prune": _prune, "generate": _generate,
             "eval": _eval}


# ----- the entry point -------------------------------------------------------------------------------------

def _check_numbers(dtype: str, batch_size: int | None, prompt_len: int, max_new_tokens: int | None,
                   devices: int, ratio: float) -> None:
    if dtype not in DTYPE_BYTES:
        raise SlimWiseError(f"footprint dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    for name, value in (("batch_size", batch_size), ("prompt_len", prompt_len),
                        ("max_new_tokens", max_new_tokens), ("devices", devices)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise SlimWiseError(f"footprint {name} must be an integer >= 1, got {value!r}")
    if not 0.0 <= ratio < 1.0:
        raise SlimWiseError(f"ratio {ratio} is outside [0, 1): pass the share of experts to prune, e.g. 0.5")


def _distill_config(distill, batch_size: int | None, max_new_tokens: int | None):
    from slimwise.distill import DistillConfig

    config = distill if distill is not None else DistillConfig()
    overrides = {k: v for k, v in (("batch_size", batch_size), ("max_new_tokens", max_new_tokens))
                 if v is not None}
    config = replace(config, **overrides)
    config.validate()
    return config


def footprint(model: str | Path, command: str, *, dtype: str = "bfloat16", batch_size: int | None = None,
              prompt_len: int = 512, max_new_tokens: int | None = None, devices: int = 1, distill=None,
              ratio: float = 0.5, prompts: int | None = None, in_memory: bool = False) -> Footprint:
    """What `slimwise COMMAND MODEL` holds in memory at `dtype`, from the config alone.

    `model`: a checkpoint directory, an embedded testbed name or a `perf.presets` name (full size). The
    batch and continuation length default to 16 and 96 (calibration's defaults), and for `distill` to the
    `DistillConfig`'s (`distill`, or its defaults: 16 and 128); passed explicitly, they override both.
    `prompts` (the data file's prompt count) decides whether distill's teacher cache is held; None gives
    its cap. `ratio` sizes prune's output and generate's --decode-model; `in_memory` sizes prune's in-memory
    export (`--distilled`) instead of the default streamed one. Every refusal is one line."""
    if command not in COMMANDS:
        raise SlimWiseError(f"unknown command {command!r} for a footprint; choose one of "
                            f"{', '.join(COMMANDS)}")
    _check_numbers(dtype, batch_size, prompt_len, max_new_tokens, devices, ratio)
    if prompts is not None and (not isinstance(prompts, int) or prompts < 1):
        raise SlimWiseError(f"footprint prompts must be an integer >= 1, got {prompts!r}")
    name, config = resolve_config(model)
    d = _distill_config(distill, batch_size, max_new_tokens) if command == "distill" else None
    job = _Job(config, census(config), dtype, d.batch_size if d else batch_size or DEFAULT_BATCH, prompt_len,
               d.max_new_tokens if d else max_new_tokens or DEFAULT_NEW_TOKENS, ratio, prompts, d, in_memory)
    rows, notes, host = _BUILDERS[command](job)
    settings = {"batch": job.batch, "prompt": prompt_len, "new tokens": job.new_tokens}
    if command == "prune":
        settings = {"ratio": ratio, "export": "in memory" if in_memory else "streamed"}
        notes = _quantized_prune_notes(model, job) or notes
    return Footprint(command, name, dtype, rows, devices, notes, host, settings, _step_bytes(job))


def _step_bytes(job: _Job) -> int:
    """Weight bytes any decode step reads, whatever the batch and the routing: every weight but the routed
    experts and (untied) the embedding table, of which a step reads one row per sequence, plus top-k routed
    experts per MoE layer. A lower bound: a batch touches at least one token's experts."""
    c = job.census
    per_expert = c.routed_params // max(1, c.moe_layers * c.num_experts)
    embed = 0 if c.tied else c.embed_params
    return (c.params - c.routed_params - embed + c.moe_layers * c.top_k * per_expert) * job.bytes


def estimate_seconds(fp: Footprint, bandwidth_gb_s: float, tokens: int) -> float:
    """A LOWER BOUND, not an estimate of what a run takes: `tokens` decode steps, each reading at least
    `fp.step_bytes` of weights (the weights one token uses) from memory at `bandwidth_gb_s` (GB/s, 1e9 bytes)
    per device, all `fp.devices` reading at once (tensor parallelism; accelerate's `--max-memory` spread runs
    one device at a time: bound it with devices=1). Ignores KV and state reads, launches, the prefill and
    every other cost; a batch touching more experts reads more. Not for `prune` (no decode)."""
    if bandwidth_gb_s <= 0 or tokens < 0:
        raise SlimWiseError("estimate_seconds needs a bandwidth > 0 GB/s and tokens >= 0")
    if fp.command == "prune":
        raise SlimWiseError("prune decodes nothing: no decode-step bound to give")
    return tokens * fp.step_bytes / (bandwidth_gb_s * 1e9 * fp.devices)


__all__ = ["COMMANDS", "Census", "Footprint", "census", "estimate_seconds", "footprint",
           "kv_bytes_per_token_of", "linear_attention_layers", "resolve_config", "state_bytes_per_layer_of"]
