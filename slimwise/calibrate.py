"""Calibration: one pass of the full model over calibration prompts that records per-expert statistics.

The observer replaces each MoE layer's experts forward with an equivalent loop that also measures
||f_j(x)|| — only for the tokens routed to j, so it costs what the model's own forward costs (REAP's
observer runs every expert on every token: E/k times the work).

Phases: `prompt` counts prompt positions; `decode` lets the full model generate continuations and counts
only the tokens the decoder processes (the generated tokens fed back, i.e. what SlimWise prunes);
`all` counts both. Padding and finished rows never count.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
from torch import nn
from tqdm.auto import tqdm

from slimwise.adapters import MoEAdapter, MoELayer, get_adapter
from slimwise.argtypes import integer
from slimwise.devices import input_device, onloaded
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.errors import SlimWiseError
from slimwise.fingerprint import model_fingerprint
from slimwise.hooks import ForwardWrappers
from slimwise.load_options import LoadOptions, dry_run_field
from slimwise.stats import ExpertStats

Phase = Literal["prompt", "decode", "all"]
PHASES = ("prompt", "decode", "all")


@dataclass
class CalibrationConfig:
    """How a calibration pass counts, and the one declaration of those options of `slimwise calibrate` (a
    field with help in its metadata is an option: `slimwise.options`). `asdict` of it is recorded in the
    statistics' meta, so command-line plumbing lives in `CalibrateCommand`, not here."""

    phase: Phase = field(default="decode", metadata={
        "choices": list(PHASES),
        "help": "which positions count: prompt tokens, the model's own generated tokens, or both"})
    # continuation length for decode-aware calibration
    max_new_tokens: int = field(default=96, metadata={
        "type": integer(1), "help": "continuation length for --phase decode/all"})
    batch_size: int = field(default=16, metadata={"type": integer(1), "help": None})
    max_samples: int | None = field(default=None, metadata={"type": integer(1), "help": None})
    seed: int = field(default=0, metadata={"type": integer(0), "help": None})
    temperature: float = 0.0  # greedy continuations by default
    # also sum each expert's un-gated outputs (`--gates substitute`: their means)
    output_sums: bool = field(default=False, metadata={
        "help": "also sum each expert's outputs (layers x experts x hidden, float64): the vectors --gates "
                "substitute adds in place of pruned experts"})


ENGINE_HELP = ("who generates the decode-phase continuations: hf (the transformers model, observed as it "
               "generates) or vllm (vLLM generates, greedy; one teacher-forced pass of the transformers "
               "model then counts the same statistics). With vllm, unknown options (--tensor-parallel-size "
               "2, ...) go to vLLM")


@dataclass
class CalibrateCommand(LoadOptions):
    """`slimwise calibrate`'s own options, around `CalibrationConfig`'s: the model, the prompts, the output
    and who generates the continuations."""

    data: str = field(metadata={"required": True,
                                "help": "prompts: a .jsonl file ('prompt' field) or a directory of them"})
    out: str = field(metadata={"required": True, "help": "statistics file to write (.safetensors)"})
    dry_run: bool = dry_run_field()
    engine: str = field(default="hf", metadata={"choices": ["hf", "vllm"], "help": ENGINE_HELP})
    continuations: str | None = field(default=None, metadata={
        "metavar": "FILE",
        "help": "count over continuations made earlier instead of generating: JSONL with token_ids per "
                "prompt, in order (`slimwise generate --out`)"})


class ExpertObserver:
    """Accumulates ExpertStats while installed; counts only rows the engine marks for the chosen phase."""

    def __init__(self, model: nn.Module, phase: Phase, adapter: MoEAdapter | None = None,
                 output_sums: bool = False):
        if phase not in PHASES:
            raise SlimWiseError(f"phase {phase!r} is not one of {', '.join(PHASES)}")
        self.adapter = adapter or get_adapter(model.config)
        self.phase = phase
        self.layers = self.adapter.moe_layers(model)
        self._stats = ExpertStats.zeros(
            [layer.index for layer in self.layers], self.adapter.num_experts(model.config)
        )
        self._output_sums: dict[int, torch.Tensor] | None = {} if output_sums else None
        # per-layer sums kept on the layer's own device while the model runs (no host copy per token);
        # `stats` folds them into the float64 ExpertStats on the host
        self._pending: dict[int, torch.Tensor] = {}
        self.rows: torch.Tensor | None = None
        self._rows_on: dict[torch.device, torch.Tensor] = {}
        self._counted: torch.Tensor | int = 0
        self._wrappers = ForwardWrappers("calibration observer")
        for row, layer in enumerate(self.layers):
            # replaces the experts forward (an equivalent loop that measures)
            self._wrappers.wrap(
                layer.experts, lambda _stock, row=row, layer=layer: self._make_forward(row, layer)
            )

    def before_forward(self, phase: str, rows: torch.Tensor) -> None:
        """phase is "prompt" or "decode"; rows marks real (non-padding, unfinished) tokens, flattened."""
        counts = self.phase == "all" or self.phase == phase
        self.set_rows(rows if counts else torch.zeros_like(rows))
        self._counted = self._counted + self.rows.sum()

    def set_rows(self, rows: torch.Tensor) -> None:
        """The counted rows of the next forward, without adding them to `counted_tokens` (the layer-streamed
        pass runs one batch through the layers one call at a time: `before_forward` once, then this)."""
        self.rows = rows
        self._rows_on = {rows.device: rows}

    @property
    def counted_tokens(self) -> int:
        """Tokens counted so far (reading it waits for the device)."""
        return int(self._counted)

    @property
    def stats(self) -> ExpertStats:
        """The statistics so far, on the host (folds in what the layers' devices hold)."""
        fields = ("count", "gate_sum", "norm_sum", "norm_sq_sum", "gate_norm_sum")
        for row, sums in self._pending.items():
            sums = sums.cpu()
            for i, name in enumerate(fields):
                getattr(self._stats, name)[row] += sums[i]
            self._stats.tokens[row] += sums[len(fields), 0]
        self._pending.clear()
        if self._output_sums is not None:
            hidden = next((s.shape[-1] for s in self._output_sums.values()), 0)
            if self._stats.output_sum is None:
                self._stats.output_sum = torch.zeros(len(self.layers), self._stats.num_experts, hidden,
                                                     dtype=torch.float64)
            for row, sums in self._output_sums.items():
                self._stats.output_sum[row] += sums.cpu()
            self._output_sums.clear()
        return self._stats

    def _rows_for(self, device: torch.device) -> torch.Tensor | None:
        """The counted-rows mask on a layer's device (a spread model's layers sit on several)."""
        if self.rows is None:
            return None
        if device not in self._rows_on:
            self._rows_on[device] = self.rows.to(device)
        return self._rows_on[device]

    def _make_forward(self, row: int, layer: MoELayer):
        experts = layer.experts
        num_experts = self._stats.num_experts

        def forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            # Sorted by expert: one gather, one grouped matmul per projection, one scatter, and the statistics
            # of all experts from a handful of bincounts. No per-expert Python work and no host sync: EP and
            # padding sentinels (ids outside [0, E)) sort last, as an extra group whose rows count nowhere.
            top_k = top_k_index.shape[-1]
            flat = top_k_index.reshape(-1)
            valid = (flat >= 0) & (flat < num_experts)
            keyed = torch.where(valid, flat, num_experts)
            expert_of, order = torch.sort(keyed)  # transformers' own sort: the same rows in each group's GEMM
            token_of = order // top_k
            real = valid[order]
            counts = torch.bincount(expert_of, minlength=num_experts + 1)[:num_experts]
            rows = self._rows_for(hidden_states.device)
            if rows is not None and rows.numel() != hidden_states.shape[0]:
                rows = None
            with onloaded(experts):  # an offloaded layer's experts are only there while it runs
                y, norms = self._expert_outputs(row, experts, hidden_states, token_of, counts, rows)
            y = torch.where(real[:, None], y, 0)  # a sentinel's row is undefined
            gate = top_k_weights.reshape(-1)[order] * real
            # back to (token, slot) order and summed over the slots: transformers' own reduction, so the
            # layer's output is bit-identical to the stock experts forward
            # (y's dtype unless the experts are stored in another dtype than the model computes in:
            # transformers decompresses compressed-tensors experts into bf16 whatever it loads the rest in)
            weighted = torch.empty(y.shape, dtype=torch.promote_types(y.dtype, gate.dtype), device=y.device)
            weighted[order] = y * gate[:, None]
            out = weighted.view(-1, top_k, weighted.shape[-1]).sum(dim=1).to(hidden_states.dtype)
            if rows is not None:
                counted = rows[token_of] & real
                self._accumulate(row, expert_of, rows, counted, gate, norms, num_experts)
                if self._output_sums is not None:
                    self._accumulate_outputs(row, expert_of, counted, y, num_experts)
            return out

        return forward

    def _accumulate(self, row: int, expert_of: torch.Tensor, rows: torch.Tensor, counted: torch.Tensor,
                    gate: torch.Tensor, norms: torch.Tensor, num_experts: int) -> None:
        """Add one forward's counted assignments (`counted`, in expert order) of the counted tokens (`rows`)
        to layer `row`'s sums, on the layer's device (float64)."""
        keep = counted.double()
        g = gate.double()
        norms = torch.where(counted, norms, 0)  # a sentinel's norm is undefined
        sums = torch.stack([torch.bincount(expert_of, weights=w, minlength=num_experts + 1)[:num_experts]
                            for w in (keep, g * keep, norms * keep, norms * norms * keep, g * norms * keep)])
        tokens = rows.sum().double().expand(1, num_experts)
        update = torch.cat([sums, tokens])
        pending = self._pending.get(row)
        self._pending[row] = update if pending is None else pending + update

    def _accumulate_outputs(self, row: int, expert_of: torch.Tensor, counted: torch.Tensor, y: torch.Tensor,
                            num_experts: int) -> None:
        """Add the counted assignments' un-gated outputs to their experts' sums (float64, in row blocks)."""
        sums = torch.zeros(num_experts + 1, y.shape[-1], dtype=torch.float64, device=y.device)
        for start in range(0, y.shape[0], 4096):
            block = torch.where(counted[start:start + 4096, None], y[start:start + 4096].double(), 0.0)
            sums.index_add_(0, expert_of[start:start + 4096], block)
        pending = self._output_sums.get(row)
        self._output_sums[row] = sums[:num_experts] if pending is None else pending + sums[:num_experts]

    def _expert_outputs(
        self,
        row: int,
        experts: nn.Module,
        hidden_states: torch.Tensor,
        token_of: torch.Tensor,
        counts: torch.Tensor,
        rows: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """f_e(x) and ||f_e(x)|| (float64) for every (token, expert) assignment, sorted by expert
        (`counts[e]` rows of expert e, then any sentinel rows, whose values are undefined)."""
        y = self.adapter.grouped_expert_outputs(experts, hidden_states[token_of], counts)
        # in row blocks: a float64 copy of every routed output at once would cost more than the matmuls
        norms = [torch.linalg.vector_norm(block, dim=-1, dtype=torch.float64) for block in y.split(4096)]
        return y, torch.cat(norms) if norms else y.new_zeros(0, dtype=torch.float64)

    def remove(self) -> None:
        self._wrappers.remove()


def calibrate(model: nn.Module, prompts: Sequence[str] | Sequence[Sequence[int]], tokenizer=None,
              config: CalibrationConfig | None = None, progress: bool = True) -> ExpertStats:
    """Run the full model over `prompts` and return expert statistics for `config.phase`."""
    config = config or CalibrationConfig()
    prompts = list(prompts)[: config.max_samples] if config.max_samples else list(prompts)
    if not prompts:
        raise SlimWiseError("calibration data is empty: pass a JSONL file (or directory) with prompts")
    observer = ExpertObserver(model, config.phase, output_sums=config.output_sums)
    engine = PhaseSplitEngine(model, tokenizer)
    new_tokens = 0 if config.phase == "prompt" else config.max_new_tokens
    gen_cfg = GenerationConfig(max_new_tokens=new_tokens, temperature=config.temperature, seed=config.seed,
                               batch_size=config.batch_size)
    t0 = time.perf_counter()
    processed = 0
    bar = tqdm(total=len(prompts), desc=f"calibrate[{config.phase}]", unit="seq",
               disable=None if progress else True)  # None: a terminal only (an error stays one line in logs)
    try:
        for start in range(0, len(prompts), config.batch_size):
            batch = prompts[start:start + config.batch_size]
            outs = engine.generate(batch, mode="full", config=gen_cfg, observer=observer)
            processed += sum(len(o.prompt_ids) + max(len(o.token_ids) - 1, 0) for o in outs)
            bar.update(len(batch))
            bar.set_postfix(
                tok_s=f"{processed / (time.perf_counter() - t0):.0f}", counted=observer.counted_tokens
            )
    finally:
        bar.close()
        observer.remove()
    if observer.counted_tokens == 0:
        raise SlimWiseError(
            f"no {config.phase} tokens were counted (max_new_tokens={config.max_new_tokens}); "
            "use longer continuations or another phase"
        )
    return finished_stats(observer, model, config, len(prompts), processed, t0)


def finished_stats(observer: ExpertObserver, model: nn.Module, config: CalibrationConfig, prompts: int,
            processed: int, t0: float) -> ExpertStats:
    stats = observer.stats
    adapter = observer.adapter
    stats.meta.update({"fingerprint": model_fingerprint(model), "family": adapter.family,
                       "top_k": adapter.top_k(model.config), "num_groups": adapter.num_groups(model.config),
                       "min_kept_per_group": adapter.min_kept_per_group(model.config),
                       "config": asdict(config), "num_prompts": prompts, "tokens_processed": processed,
                       "seconds": round(time.perf_counter() - t0, 3)})
    return stats


def checked_continuations(model: nn.Module, continuations: Sequence[Sequence[int]]) -> list[list[int]]:
    """The continuations as lists; refused unless every id is in the model's vocabulary (an empty one, a
    sequence that generated nothing, counts nothing)."""
    vocab = model.get_input_embeddings().num_embeddings
    out = [list(c) for c in continuations]
    for i, c in enumerate(out):
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in c):
            raise SlimWiseError(f"continuation {i + 1}: expected token ids in [0, {vocab}) (this model's "
                                "vocabulary)")
    return out


def teacher_forced_batch(prompts: list[list[int]], conts: list[list[int]], phase: str,
                          pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompt + continuation[:-1] (the last generated token is never fed back), its attention
    mask, and which positions `phase` counts; positions then run as in generation (cumsum of the mask)."""
    seqs = [p + c[:-1] for p, c in zip(prompts, conts, strict=True)]
    width = max(len(q) for q in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    counted = torch.zeros((len(seqs), width), dtype=torch.bool)
    for row, (p, q) in enumerate(zip(prompts, seqs, strict=True)):
        begin = width - len(q)
        input_ids[row, begin:] = torch.tensor(q, dtype=torch.long)
        attention[row, begin:] = 1
        if phase in ("prompt", "all"):
            counted[row, begin:begin + len(p)] = True
        if phase in ("decode", "all"):
            counted[row, begin + len(p):] = True
    return input_ids, attention, counted


def teacher_forced_batches(ids: list[list[int]], conts: list[list[int]], phase: str, pad_id: int,
                           batch_size: int) -> list[tuple[list[int], torch.Tensor, torch.Tensor,
                                                          torch.Tensor]]:
    """(row indices, input ids, attention mask, counted positions) per batch of `teacher_forced_batch`,
    longest sequences first (less padding). The teacher-forced and the layer-streamed passes both batch this
    way: the same shapes give the same sums."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]) + len(conts[i]), reverse=True)
    out = []
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        out.append((rows, *teacher_forced_batch([ids[i] for i in rows], [conts[i] for i in rows], phase,
                                                pad_id)))
    return out


@torch.inference_mode()
def continuation_stats(model: nn.Module, prompts: Sequence[str] | Sequence[Sequence[int]],
                       continuations: Sequence[Sequence[int]], tokenizer=None,
                       config: CalibrationConfig | None = None, progress: bool = True) -> ExpertStats:
    """The statistics `calibrate` counts, from given continuations: one teacher-forced forward of prompt +
    continuation per batch, counting the positions `config.phase` names.

    What counts in phase `decode`: the continuation tokens the decoder is fed, i.e. every generated token but
    the last (generation feeds a token back only to produce the next one), which is exactly what `calibrate`
    counts while the full model generates. So for the same continuations the two agree: counts exactly and
    the float sums within rounding (a causal forward over the whole sequence computes each position from the
    same inputs, in other batch shapes). `prompt` counts prompt positions, `all` both. Batches are sorted by
    length (less padding) and only the last position's logits are computed (no vocabulary-wide head per
    token). This is how `slimwise calibrate --engine vllm` counts: vLLM generates, this pass observes."""
    config = config or CalibrationConfig()
    prompts = list(prompts)[: config.max_samples] if config.max_samples else list(prompts)
    if len(continuations) < len(prompts):
        raise SlimWiseError(f"{len(continuations)} continuations for {len(prompts)} prompts: give one each")
    engine = PhaseSplitEngine(model, tokenizer)
    ids = engine.encode(prompts)
    conts = checked_continuations(model, continuations[:len(ids)])
    observer = ExpertObserver(model, config.phase, output_sums=config.output_sums)
    device = input_device(model)
    t0, processed = time.perf_counter(), 0
    bar = tqdm(total=len(ids), desc=f"statistics[{config.phase}]", unit="seq",
               disable=None if progress else True)
    try:
        for batch, input_ids, attention, counted in teacher_forced_batches(ids, conts, config.phase,
                                                                           engine.pad_id, config.batch_size):
            input_ids, attention = input_ids.to(device), attention.to(device)
            observer.before_forward(config.phase, counted.reshape(-1).to(device))
            model(input_ids=input_ids, attention_mask=attention,
                  position_ids=(attention.cumsum(-1) - 1).clamp_min(0), use_cache=False, logits_to_keep=1)
            processed += int(attention.sum())
            bar.update(len(batch))
    finally:
        bar.close()
        observer.remove()
        engine.close()
    if observer.counted_tokens == 0:
        raise SlimWiseError(f"no {config.phase} tokens were counted: the continuations are too short")
    stats = finished_stats(observer, model, config, len(ids), processed, t0)
    stats.meta["pass"] = "teacher-forced"
    return stats


def vllm_continuations(model_dir, prompts: Sequence[str] | Sequence[Sequence[int]], tokenizer,
                       config: CalibrationConfig, dtype: str = "auto",
                       engine_kwargs: dict | None = None) -> list[list[int]]:
    """The full model's greedy continuations of `prompts`, generated by vLLM (one engine, closed on return):
    the generation half of `slimwise calibrate --engine vllm`; `continuation_stats` counts them. Token ids
    include the EOS where a sequence stopped on it, as the reference engine's do. vLLM spawns workers: call
    this under an `if __name__ == "__main__":` guard."""
    from slimwise.engines.vllm_engine import VllmEngine
    from slimwise.hardware import resolve_dtype
    from slimwise.serving.platform import vllm_on_cpu

    prompts = list(prompts)[: config.max_samples] if config.max_samples else list(prompts)
    if config.phase == "prompt":
        return [[] for _ in prompts]
    engine = VllmEngine(model_dir, None, tokenizer, dtype=resolve_dtype(dtype, model_dir, vllm_on_cpu())[0],
                        engine_kwargs=engine_kwargs)
    try:
        gen = GenerationConfig(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                               seed=config.seed, batch_size=config.batch_size)
        return [g.token_ids for g in engine.generate(prompts, mode="full", config=gen)]
    finally:
        engine.close()
