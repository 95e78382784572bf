"""Reference engine on transformers: full-model prefill, then decode with the full or the pruned model.

Modes (the three things SlimWise compares):
  full      the model as is;
  uniform   classic pruning: the pruned model prefills and decodes;
  slimwise  the full model prefills (prompt KV cache and first token are the full model's), the pruned
            model decodes on that same cache.
  distilled slimwise plus a distilled decode-only delta (`slimwise.distill`): the delta's parameters act only
            while the pruned decoder runs, so prefill is still exactly the full model (a delta distilled for
            the uniform baseline acts in both phases of uniform pruning instead).
The pruned model is either a masked view of the full model's weights (`ExpertMask`, one copy in memory) or
a separately loaded pruned checkpoint (`decode_model`); both give the same tokens.

The loop is gpt-fast style: left-padded batch, one prefill forward, then one forward per generated token.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from slimwise.adapters import get_adapter
from slimwise.argtypes import integer, number
from slimwise.decode_gates import PLAIN, DecodeGates, GateOptions
from slimwise.delta import apply_delta
from slimwise.devices import input_device
from slimwise.errors import SlimWiseError
from slimwise.fingerprint import fingerprints_match, model_fingerprint
from slimwise.load_options import LoadOptions
from slimwise.masking import ExpertMask
from slimwise.plan import PrunePlan

Mode = Literal["full", "uniform", "slimwise", "distilled"]
MODES: tuple[str, ...] = ("full", "uniform", "slimwise", "distilled")

# config fields that must agree for a decoder to read another model's cache
_CACHE_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "layer_types",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "v_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


@dataclass
class GenerationConfig:
    """Sampling and batching of one `generate` call, and the one declaration of those options of `slimwise
    generate` (a field with help in its metadata is an option: `slimwise.options`)."""

    max_new_tokens: int = field(default=128, metadata={"type": integer(1), "help": None})
    temperature: float = field(default=0.0, metadata={"type": number(0), "help": "0 = greedy"})
    top_p: float = field(default=1.0, metadata={"type": number(0, 1, lo_open=True), "help": None})
    top_k: int = field(default=0, metadata={"type": integer(0), "help": None})
    seed: int = field(default=0, metadata={"type": integer(0), "help": None})
    stop: tuple[str, ...] = field(default=(), metadata={
        "action": "append", "convert": tuple, "render": list, "help": "stop string (repeatable)"})
    batch_size: int = field(default=16, metadata={"type": integer(1), "help": None})
    eos_token_id: int | list[int] | None = None  # default: tokenizer's, else the model's
    progress: bool = False

    def __post_init__(self) -> None:
        problems = [
            f"{name} {value!r} must be {rule}"
            for name, value, ok, rule in (
                ("max_new_tokens", self.max_new_tokens, self.max_new_tokens >= 0, ">= 0 (0: prefill only)"),
                (
                    "temperature",
                    self.temperature,
                    math.isfinite(self.temperature) and self.temperature >= 0,
                    ">= 0",
                ),
                ("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]"),
                ("top_k", self.top_k, self.top_k >= 0, ">= 0 (0: off)"),
                ("batch_size", self.batch_size, self.batch_size >= 1, "at least 1"),
            )
            if not ok
        ]
        if problems:
            raise SlimWiseError(f"generation settings: {'; '.join(problems)}")


@dataclass
class GenerateCommand(GateOptions, LoadOptions):
    """`slimwise generate`'s own options, around `GenerationConfig`'s: the model, what prunes its decoder
    (a plan's masked view, or a pruned checkpoint), the mode, the gates, the prompts and the output."""

    plan: str | None = field(default=None, metadata={
        "help": "prune plan (the pruned decoder is a masked view of the model)"})
    decode_model: str | None = field(default=None, metadata={
        "help": "a pruned checkpoint to decode with instead of the masked view"})
    mode: str = field(default="slimwise", metadata={"choices": ["full", "uniform", "slimwise"], "help": None})
    prompts: str = field(kw_only=True, metadata={
        "required": True, "help": ".jsonl ('prompt' field) or .txt (one per line)"})
    out: str | None = field(default=None, metadata={
        "help": "write generations as JSONL here instead of printing"})


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens, the EOS that ended the output included
    finish_reason: str  # "eos" | "stop" | "length"
    text: str | None = None
    first_logits: torch.Tensor | None = field(default=None, repr=False)  # prefill logits (for tests/fidelity)


class StepObserver(Protocol):
    """Told which rows of the flattened batch are real tokens of each phase before every forward."""

    def before_forward(self, phase: str, rows: torch.Tensor) -> None: ...


def check_decode_compatible(prefill_model: nn.Module, decode_model: nn.Module) -> None:
    """Refuse a decoder that cannot read the prefill model's cache (attention shapes, vocabulary, layers)."""
    a = get_adapter(prefill_model.config).text_config(prefill_model.config)
    b = get_adapter(decode_model.config).text_config(decode_model.config)
    for name in _CACHE_FIELDS:
        va, vb = getattr(a, name, None), getattr(b, name, None)
        if va != vb:
            raise SlimWiseError(f"decode model differs from the prefill model in {name} ({vb!r} vs {va!r}): "
                                "it cannot read the prefill cache; pass a checkpoint pruned from this model")


def _eos_ids(config: GenerationConfig, tokenizer, model: nn.Module) -> set[int]:
    eos = config.eos_token_id
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        eos = getattr(model.generation_config, "eos_token_id", None) or model.config.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def sample_next(logits: torch.Tensor, config: GenerationConfig, generator: torch.Generator) -> torch.Tensor:
    """Greedy when temperature is 0, else temperature / top-k / top-p sampling from a seeded generator."""
    if config.temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / config.temperature
    if config.top_k > 0:
        kth = torch.topk(logits, min(config.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) > config.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    # drawn on the CPU from the seeded CPU generator: the same seed samples the same tokens on every device
    probs = torch.softmax(logits, dim=-1).float().cpu()
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)


@contextmanager
def _stacked(*factories):
    """Enter several context factories as one (phase mask + delta switch)."""
    with ExitStack() as stack:
        for factory in factories:
            stack.enter_context(factory())
        yield


def encode_prompts(tokenizer, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
    """Token ids of text prompts (no special tokens added) or of token-id prompts, as every engine feeds them;
    refuses text without a tokenizer and empty prompts (nothing to prefill)."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise SlimWiseError(
                    "text prompts need a tokenizer; pass token ids or a model dir with a tokenizer"
                )
            out.append(tokenizer(p, add_special_tokens=False)["input_ids"])
        else:
            out.append([int(t) for t in p])
        if not out[-1]:
            raise SlimWiseError(
                "an empty prompt cannot be prefilled; give every prompt at least one token"
            )
    return out


class PhaseSplitEngine:
    """Generate in `full`, `uniform`, `slimwise` or `distilled` mode with one full model and a plan (or a
    pruned checkpoint). `delta` (a `slimwise.delta.Delta` or its directory) needs `plan`; it is used by mode
    `distilled` only, so one engine compares training-free and distilled decoding. `gates`: what the pruned
    rows' gates do and when a token falls back to every expert (`slimwise.decode_gates`); anything but the
    plain masked routing needs the full router, so the masked view (`plan`), not a pruned checkpoint."""

    def __init__(self, model: nn.Module, tokenizer=None, plan: PrunePlan | None = None,
                 decode_model: nn.Module | None = None, delta=None, gates: DecodeGates = PLAIN):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.plan = plan
        self.gates = gates
        self.decode_model = decode_model.eval() if decode_model is not None else None
        self.mask: ExpertMask | None = None
        if not gates.plain and (decode_model is not None or plan is None):
            raise SlimWiseError(f"gates {gates.gates} with fallback {gates.fallback}"
                                f"{' and a batch budget' if gates.budgeted else ''} route from the full "
                                "router: give the plan (the masked view), not a pruned decode checkpoint")
        if not gates.plain and delta is not None:
            raise SlimWiseError("a distilled delta decodes with the plain gates it was trained with: drop "
                                "--gates/--fallback/--budget, or evaluate them without --distilled")
        if decode_model is not None:
            check_decode_compatible(model, decode_model)
            manifest = getattr(decode_model, "slimwise_manifest", None)
            if manifest and not fingerprints_match(
                manifest.get("source_fingerprint"), model_fingerprint(model)
            ):
                raise SlimWiseError("decode model was pruned from other weights than the prefill model "
                                    "(fingerprint mismatch): export it from this model")
            if plan is not None:
                plan.check_model(model)  # made for the prefill model's weights (family, layers, fingerprint)
                adapter = get_adapter(decode_model.config)
                if plan.num_kept != adapter.num_experts(decode_model.config):
                    raise SlimWiseError(
                        f"decode model has {adapter.num_experts(decode_model.config)} experts but the "
                        f"plan keeps {plan.num_kept}: pass the checkpoint exported from this plan"
                    )
        elif plan is not None:
            self.mask = ExpertMask(model, plan, gates=gates)
        self.delta = None  # an installed delta (slimwise.delta.InstalledDelta), switched on by mode distilled
        if delta is not None:
            if self.mask is None:
                raise SlimWiseError(
                    "a distilled delta needs plan= (the plan it was distilled for) and no decode "
                    "model; a pruned checkpoint takes the delta at export (export_pruned(delta=))"
                )
            try:
                self.delta = apply_delta(model, delta, self.mask, plan)
            except BaseException:
                self.mask.remove()  # a refused delta leaves the model as it was
                raise

    def __enter__(self) -> PhaseSplitEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Take the delta and the mask off the model (engines sharing one model close in reverse order)."""
        if self.delta is not None:
            self.delta.remove()  # before the mask: the delta wraps the mask's routers
            self.delta = None
        if self.mask is not None:
            self.mask.remove()

    # ----- phases --------------------------------------------------------------------------------------
    def _phase(self, mode: str, phase: str):
        """(model, context factory) that runs `phase` ("prefill" or "decode") of `mode`."""
        if mode not in MODES:
            raise SlimWiseError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if mode == "distilled":
            if self.delta is None:
                raise SlimWiseError(
                    "mode 'distilled' needs a delta: pass delta= (the output of `slimwise distill`)"
                )
            model, ctx = self._phase(self.delta.mode, phase)
            return model, lambda: _stacked(ctx, self.delta.switched_on)
        pruned = mode == "uniform" or (mode == "slimwise" and phase == "decode")
        if not pruned:
            return self.model, (lambda: self.mask.pruned(False)) if self.mask else nullcontext
        if self.decode_model is not None:
            return self.decode_model, nullcontext
        if self.mask is None:
            raise SlimWiseError(f"mode {mode!r} needs a plan or a decode model")
        # a batch budget chooses decode steps' experts; uniform pruning keeps the static plan
        budgeted = mode == "slimwise" and self.gates.budgeted
        return self.model, lambda: self.mask.pruned(True, budgeted=budgeted)

    @property
    def pad_id(self) -> int:
        """The id that pads batches: the tokenizer's pad token, else 0 (padding is masked or never read)."""
        tok = self.tokenizer
        return tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0

    def encode(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        """`encode_prompts` with this engine's tokenizer."""
        return encode_prompts(self.tokenizer, prompts)

    # ----- generation ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], mode: Mode = "slimwise",
                 config: GenerationConfig | None = None, observer: StepObserver | None = None,
                 keep_first_logits: bool = False) -> list[Generation]:
        config = config or GenerationConfig()
        ids = self.encode(prompts)
        _warn_past_positions(self.model, max(map(len, ids), default=0) + config.max_new_tokens)
        eos = _eos_ids(config, self.tokenizer, self.model)
        generator = torch.Generator().manual_seed(config.seed)
        results: list[Generation] = []
        bar = tqdm(total=len(ids), desc=f"generate[{mode}]", unit="seq",
                   # None: a terminal only (errors stay one line in logs)
                   disable=None if config.progress else True)
        for start in range(0, len(ids), config.batch_size):
            batch = ids[start:start + config.batch_size]
            results += self._generate_batch(batch, mode, config, eos, generator, observer, keep_first_logits)
            bar.update(len(batch))
        bar.close()
        return results

    def prefill(
        self, batch: Sequence[Sequence[int]], mode: Mode = "slimwise", observer: StepObserver | None = None
    ):
        """Left-padded prefill of token-id prompts with `mode`'s prefill model.

        Returns (cache, last-position logits [B, V] float32, attention mask, position ids).
        """
        device = input_device(self.model)
        width = max(len(p) for p in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long, device=device)
        attention = torch.zeros((len(batch), width), dtype=torch.long, device=device)
        for i, p in enumerate(batch):
            input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention[i, width - len(p):] = 1
        positions = (attention.cumsum(-1) - 1).clamp_min(0)
        model, ctx = self._phase(mode, "prefill")
        if observer is not None:
            observer.before_forward("prompt", attention.reshape(-1).bool())
        with ctx():
            out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                        logits_to_keep=1)
        return out.past_key_values, out.logits[:, -1, :].float(), attention, positions

    def decode(self, tokens: torch.Tensor, cache, attention: torch.Tensor, positions: torch.Tensor,
               mode: Mode = "slimwise") -> torch.Tensor:
        """One forward of `mode`'s decode model over `tokens` [B, T], continuing `cache` (updated in place).

        `attention` covers the cache and the new tokens; `positions` [B, T] are the new tokens' position ids.
        Returns logits [B, T, V] in float32. Generation calls it with T = 1, teacher-forced scoring and
        training (`slimwise.scoring`) with a whole continuation: both run the same decoder on the same cache.
        """
        model, ctx = self._phase(mode, "decode")
        with ctx():
            out = model(
                input_ids=tokens,
                attention_mask=attention,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
        return out.logits.float()

    @contextmanager
    def _budget_rows(self, alive: torch.Tensor):
        """A batch budget weighs the live rows only: finished rows stay in the batch as padding."""
        if self.mask is None:
            yield
            return
        previous, self.mask.budget_rows = self.mask.budget_rows, alive
        try:
            yield
        finally:
            self.mask.budget_rows = previous

    def _generate_batch(self, batch, mode, config, eos, generator, observer, keep_first_logits):
        device = input_device(self.model)
        cache, logits, attention, positions = self.prefill(batch, mode, observer)
        first_logits = logits.clone() if keep_first_logits else None

        generated: list[list[int]] = [[] for _ in batch]
        reasons: list[str | None] = [None] * len(batch)
        texts: list[str | None] = [None] * len(batch)
        next_pos = positions[:, -1:] + 1
        for step in range(config.max_new_tokens):
            tokens = sample_next(logits, config, generator)
            for i, t in enumerate(tokens.tolist()):
                if reasons[i] is not None:
                    continue
                generated[i].append(t)
                if t in eos:
                    reasons[i] = "eos"
                elif config.stop and self.tokenizer is not None:
                    text = self.tokenizer.decode(generated[i])
                    hit = [text.index(s) for s in config.stop if s in text]
                    if hit:
                        reasons[i], texts[i] = "stop", text[:min(hit)]
            if all(r is not None for r in reasons) or step == config.max_new_tokens - 1:
                break
            alive = torch.tensor([r is None for r in reasons], device=device)
            if observer is not None:
                observer.before_forward("decode", alive)
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            with self._budget_rows(alive):
                logits = self.decode(tokens[:, None], cache, attention, next_pos, mode)[:, -1, :]
            next_pos = next_pos + 1

        results = []
        for i, p in enumerate(batch):
            reason = reasons[i] or "length"
            text = texts[i]
            if text is None and self.tokenizer is not None:
                body = generated[i][:-1] if reason == "eos" else generated[i]
                text = self.tokenizer.decode(body)
            results.append(Generation(p, generated[i], reason, text,
                                      first_logits[i] if first_logits is not None else None))
        return results


def _warn_past_positions(model: nn.Module, positions: int) -> None:
    """transformers runs positions past the config's max_position_embeddings (RoPE is computed, not looked
    up), but the model never trained there and vLLM refuses such prompts (max_model_len): say so once per
    call."""
    text = getattr(model.config, "text_config", None) or model.config
    limit = getattr(text, "max_position_embeddings", None)
    if limit and positions > limit:
        warnings.warn(f"prompt + max_new_tokens reach {positions} positions, past the model's "
                      f"max_position_embeddings ({limit}): positions beyond it were never trained, and vLLM "
                      "refuses such requests", stacklevel=3)
