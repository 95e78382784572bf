"""Teacher-forced passes one decoder layer at a time, for models larger than memory (llm-compressor's
sequential pipeline).

The model is loaded spread with `--max-memory` (`slimwise.devices.placement`): what does not fit the
budgets stays in accelerate's offload (host memory or disk) and has only meta tensors in the module tree. A
whole-model forward would bring each offloaded layer over once per batch. Here every batch goes through
layer 1, then every batch through layer 2, and so on, with the batches' hidden states carried from layer to
layer; each layer's weights are brought over once per pass and released before the next layer's
(`resident`).

1. Capture. Each batch runs through the model with every decoder layer replaced by a catcher that records
   the arguments the model's forward gives that layer (attention mask of its kind, position embeddings,
   position ids) and returns its input; the last catcher stops the forward. Hybrids' linear-attention layers
   get their own mask this way, as in the full forward.
2. Layers. For each decoder layer, with its weights resident, each batch's hidden states go through it.
   `use_cache=False`: a layer sees whole sequences, so a Gated-DeltaNet layer runs its convolution and
   recurrence over the sequence inside the call, exactly as in the full forward; no state crosses layers.
3. Head. The final norm and the output head, once, at the positions asked for.

Invariant: per batch, each layer computes what the whole-model forward computes for that batch (same inputs,
same call, same shapes), so the results equal the in-memory pass over the same batches: the statistics bit
for bit in float32 (tests/test_sequential.py), whatever the budget. Generation cannot be streamed this way:
every token needs every layer; continuations come from vLLM or an earlier run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from slimwise.adapters import get_adapter
from slimwise.calibrate import (
    CalibrationConfig,
    ExpertObserver,
    checked_continuations,
    finished_stats,
    teacher_forced_batches,
)
from slimwise.devices import input_device, is_offloaded
from slimwise.engines.reference import PhaseSplitEngine
from slimwise.errors import SlimWiseError
from slimwise.hooks import ForwardWrappers
from slimwise.plan import PrunePlan
from slimwise.stats import ExpertStats


def offloaded_share(model: nn.Module) -> tuple[int, int]:
    """(decoder layers with offloaded weights, decoder layers): whether the streamed pass pays."""
    layers = get_adapter(model.config).decoder_layers(model)
    return sum(any(is_offloaded(m) for m in layer.modules()) for layer in layers), len(layers)


def _offload_hooks(module: nn.Module) -> list:
    """accelerate's offloading hooks on `module` and below (a SequentialHook holds several)."""
    out = []
    for m in module.modules():
        hook = getattr(m, "_hf_hook", None)
        for h in getattr(hook, "hooks", [hook]) if hook is not None else []:
            if getattr(h, "offload", False):
                out.append((m, h))
    return out


@contextlib.contextmanager
def resident(module: nn.Module) -> Iterator[None]:
    """Every offloaded weight of `module` and its submodules on its execution device for the block, read
    once: accelerate's own onload (`pre_forward`), then its hooks stand down (no reload per call) until the
    block ends and the weights go back to the meta device (`post_forward`)."""
    hooks = _offload_hooks(module)
    done = []
    try:
        for m, h in hooks:
            h.pre_forward(m)
            h.offload = False
            done.append((m, h))
        yield
    finally:
        for m, h in reversed(done):
            h.offload = True
            h.post_forward(m, None)


class _Captured(Exception):
    """Raised by the last catcher: the rest of the forward (norm, head) is not needed."""


@dataclass
class _Batch:
    rows: list[int]  # indices of the prompts in this batch, in row order
    input_ids: torch.Tensor
    attention: torch.Tensor
    counted: torch.Tensor  # bool [B, T]: positions the statistics count (phase decode: the decoder's tokens)
    hidden: torch.Tensor | None = None
    calls: list | None = None  # per layer: (args after hidden_states, kwargs)


def _capture(model: nn.Module, layers: nn.ModuleList, batches: list[_Batch]) -> None:
    """Fill each batch's input hidden states and every layer's call arguments (step 1)."""
    device = input_device(model)
    wrappers = ForwardWrappers("layer-streamed capture")
    current: list = []

    def catcher(index: int):
        def make(_previous):
            def forward(hidden_states, *args, **kwargs):
                current.append((args, kwargs))
                if index == len(layers) - 1:
                    raise _Captured
                return hidden_states
            return forward
        return make

    try:
        for i, layer in enumerate(layers):
            wrappers.wrap(layer, catcher(i))
        embeddings = model.get_input_embeddings()
        seen: list[torch.Tensor] = []
        wrappers.hook(embeddings, lambda _m, _i, out: seen.append(out))
        with resident(embeddings):
            for batch in batches:
                current.clear()
                seen.clear()
                with contextlib.suppress(_Captured):
                    positions = (batch.attention.cumsum(-1) - 1).clamp_min(0)  # as in generation
                    model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention.to(device),
                          position_ids=positions.to(device), use_cache=False, logits_to_keep=1)
                batch.hidden, batch.calls = seen[0], list(current)
    finally:
        wrappers.remove()


def _run_layers(layers: nn.ModuleList, streams: dict[str, list[torch.Tensor]], batches: list[_Batch],
                before: Callable[[str, int], contextlib.AbstractContextManager], desc: str,
                progress: bool) -> None:
    """Step 2: every stream's hidden states of every batch through each layer in turn, the layer resident
    once. `before(stream, batch index)` is the context each call runs in (observer rows, mask)."""
    bar = tqdm(total=len(layers), desc=desc, unit="layer", disable=None if progress else True)
    try:
        for i, layer in enumerate(layers):
            with resident(layer):
                for name, hidden in streams.items():
                    for b, batch in enumerate(batches):
                        args, kwargs = batch.calls[i]
                        with before(name, b):
                            hidden[b] = layer(hidden[b], *args, **kwargs)
            bar.update(1)
    finally:
        bar.close()


def _prepare(engine: PhaseSplitEngine, prompts, continuations, phase: str, batch_size: int, max_samples):
    """Token ids, continuations and the batches of `calibrate.continuation_stats` (the same shapes, so the
    same sums)."""
    model = engine.model
    prompts = list(prompts)[:max_samples] if max_samples else list(prompts)
    ids = engine.encode(prompts)
    if continuations is None:
        conts = [[engine.pad_id] for _ in ids]  # one placeholder token, never fed: the prompt alone
    else:
        if len(continuations) < len(ids):
            raise SlimWiseError(f"{len(continuations)} continuations for {len(ids)} prompts: give one each")
        conts = checked_continuations(model, continuations[:len(ids)])
    parts = teacher_forced_batches(ids, conts, phase, engine.pad_id, batch_size)
    return ids, conts, [_Batch(*batch) for batch in parts]


@torch.inference_mode()
def streamed_statistics(model: nn.Module, prompts: Sequence[str] | Sequence[Sequence[int]],
                        continuations: Sequence[Sequence[int]] | None = None, tokenizer=None,
                        config: CalibrationConfig | None = None, progress: bool = True) -> ExpertStats:
    """What `calibrate.continuation_stats` counts (phase `decode` or `all`: over given continuations), or
    the prompt phase (`continuations` None), one decoder layer at a time."""
    config = config or CalibrationConfig()
    if continuations is None and config.phase != "prompt":
        raise SlimWiseError(f"the layer-streamed pass counts phase {config.phase!r} over given continuations "
                            "(from vLLM or an earlier run): generation needs every layer for every token")
    t0 = time.perf_counter()
    engine = PhaseSplitEngine(model, tokenizer)
    observer = ExpertObserver(model, config.phase, output_sums=config.output_sums)
    try:
        ids, _, batches = _prepare(engine, prompts, continuations, config.phase, config.batch_size,
                                   config.max_samples)
        layers = get_adapter(model.config).decoder_layers(model)
        _capture(model, layers, batches)
        for batch in batches:  # counts each batch's tokens once, as one forward per batch does
            observer.before_forward(config.phase, batch.counted.reshape(-1).to(batch.hidden.device))

        @contextlib.contextmanager
        def rows(_stream: str, b: int):
            observer.set_rows(batches[b].counted.reshape(-1))
            yield

        streams = {"full": [batch.hidden for batch in batches]}
        _run_layers(layers, streams, batches, rows, f"statistics[{config.phase}] by layer", progress)
    finally:
        observer.remove()
        engine.close()
    if observer.counted_tokens == 0:
        raise SlimWiseError(f"no {config.phase} tokens were counted: the continuations are too short")
    processed = sum(int(b.attention.sum()) for b in batches)
    stats = finished_stats(observer, model, config, len(ids), processed, t0)
    stats.meta["pass"] = "layer-streamed"
    return stats


@torch.inference_mode()
def streamed_logprobs(model: nn.Module, prompts: Sequence[str] | Sequence[Sequence[int]],
                      continuations: Sequence[Sequence[int]], modes: Sequence[str] = ("full",),
                      plan: PrunePlan | None = None, tokenizer=None, batch_size: int = 16,
                      progress: bool = True) -> dict[str, list[torch.Tensor]]:
    """Per mode, the teacher-forced log-probs [len(c), V] (float32, on the host) along each continuation, as
    `scoring.continuation_logprobs` defines them: position t is the distribution of token t given prompt +
    continuation[:t]. `slimwise` prunes the continuation positions only (the decoder's tokens; the last prompt
    position, which gives token 0, stays full), `uniform` every position. All modes share one read of each
    layer. KL between modes: `scoring.kl_divergence`."""
    if any(m != "full" for m in modes) and plan is None:
        raise SlimWiseError("a pruned mode needs a plan")
    engine = PhaseSplitEngine(model, tokenizer, plan=plan)
    try:
        ids, conts, batches = _prepare(engine, prompts, continuations, "decode", batch_size, None)
        layers = get_adapter(model.config).decoder_layers(model)
        _capture(model, layers, batches)

        def masked(stream: str, b: int):
            if stream == "full":
                return contextlib.nullcontext()
            # slimwise: the counted (decode-phase) positions are the ones the pruned decoder runs
            token_mask = batches[b].counted.reshape(-1).to(batches[b].hidden.device) if stream == "slimwise" \
                else None
            return engine.mask.pruned(True, token_mask)

        streams = {m: [batch.hidden for batch in batches] for m in modes}
        _run_layers(layers, streams, batches, masked, "log-probs by layer", progress)
        return {m: _head(model, streams[m], batches, conts) for m in modes}
    finally:
        engine.close()


def _head(model, hidden, batches, conts) -> list[torch.Tensor]:
    """Step 3: final norm and output head at each sequence's continuation positions, log-softmax."""
    inner = getattr(model, "model", model)
    norm, head = inner.norm, model.get_output_embeddings()
    out: list[torch.Tensor | None] = [None] * len(conts)
    with resident(norm), resident(head):
        for b, batch in enumerate(batches):
            width = batch.input_ids.shape[1]
            for r, i in enumerate(batch.rows):
                n = len(conts[i])
                # positions of prompt[-1] .. prompt + cont[:-1][-1]: the last n positions of the row
                h = hidden[b][r, width - n:]
                out[i] = torch.log_softmax(head(norm(h[None]))[0].float(), dim=-1).cpu()
    return out


__all__ = ["offloaded_share", "resident", "streamed_logprobs", "streamed_statistics"]
