"""Train the embedded testbed backbones: tiny MoE models that solve the task suite,
in under an hour on 2 CPU cores.

The backbones (a: Qwen3-MoE, b: Qwen2-MoE, c: hybrid Qwen3.5/3.6-MoE) are stock transformers architectures
(`backbones.py`), so transformers and vLLM load the result as is.

Recipe: data freshly generated from every task family of every domain (`make_split("train", ...)`, a new seed
per step, so batch `i` is a pure function of (seed, i)); samples packed first-fit-decreasing into rows with
position ids restarting at every sample (transformers turns that into a block-diagonal causal mask, so packed
samples never see each other). The torch Gated-DeltaNet kernels transformers runs on a CPU ignore sample
boundaries (the causal conv and the recurrent state would carry from one packed sample into the next), so
hybrid backbones are packed only with `--packing packed`, which swaps in segment-aware versions of the two
(`packed_linear_attention.py`: exact, a zero state at every sample; 1.22x the tokens/s of one sample per row
on testbed-c); by default (`auto`) every hybrid sample gets its own right-padded row, in a few length-sorted
micro-batches (`pack_rows`). Cross-entropy on the target tokens only (worked solution + EOS; the prompt is
masked, it is random numbers and words); a Switch-style load-balancing loss E * sum_j f_j * P_j per MoE layer
computed from the router logits captured by forward hooks; AdamW with linear warmup then cosine decay.
`--minutes` is a hard wall-clock budget and the cosine runs on progress = max(step / max_steps,
elapsed / budget), so a run always finishes its schedule inside the budget however busy the machine is.

Gated-DeltaNet on a CPU: flash-linear-attention and causal-conv1d (the fast kernels transformers looks for)
are CUDA/Triton packages, so transformers runs its torch fallbacks. For training it takes the chunked kernel
(`torch_chunk_gated_delta_rule`, chunk 64), which is faster than the per-token recurrent one with outputs
equal up to float rounding (figures: docs/history/testbeds.md, "Trainer kernels").

Training uses a fast CPU experts implementation (`fast_experts.py`, `slimwise_sorted`); the model is switched
back to the `eager` implementation before saving.

    python -m lab.testbed.train --backbone a --out runs/testbed-a --minutes 45 --seed 0
    python -m lab.testbed.train --backbone a --out runs/testbed-a --minutes 45 --seed 0 --resume
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM
from transformers import GenerationConfig as HFGenerationConfig
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from lab.testbed import cpu_parallel as dp
from lab.testbed.backbones import BACKBONES, backbone_config, moe_blocks
from lab.testbed.cpu_parallel import ThreadTuner
from lab.testbed.fast_experts import FAST_EXPERTS
from lab.testbed.muon import Muon, MuonAdamW, muon_parameters
from lab.testbed.packed_linear_attention import packed_sequences, segment_aware_linear_attention
from lab.testbed.tokenizer import build_tokenizer, encode_sample, load_saved_tokenizer
from lab.testbed.train_config import ENTRY, TRAIN_OPTIONS, TrainConfig
from slimwise.errors import SlimWiseError
from slimwise.hooks import ForwardWrappers
from slimwise.io import atomic_torch_save, atomic_write_text
from slimwise.models import is_hybrid
from slimwise.options import add_dataclass_options, config_from_args
from slimwise.testbed.long_tasks import LONG_FAMILIES, draw_long_samples
from slimwise.testbed.tasks import FAMILIES, make_split

STATE_FILE = "train_state.pt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
LOG_FILE = "train_log.jsonl"

# --------------------------------------------------------------------------------------------------------
# Data


def step_samples(config: TrainConfig, step: int) -> list:
    """The training samples of one step: a fresh make_split draw over every family, and the long families
    that have a weight, shuffled (seeded by step)."""
    seed = config.seed * 1_000_003 + step
    samples = []
    for name in FAMILIES:
        n = max(1, round(config.samples_per_family * config.family_weights.get(name, 1.0)))
        samples += make_split("train", n, seed=seed, families=[name])
    for name in LONG_FAMILIES:  # only those given a weight: a stream without them is the earlier runs' stream
        n = round(config.samples_per_family * config.family_weights.get(name, 0.0))
        if n > 0:
            samples += draw_long_samples(name, n, seed, config.long_max_length,
                                         top_share=config.long_top_share)
    random.Random(f"slimwise-train:{config.seed}:{step}").shuffle(samples)
    return samples


def pack(encoded: Sequence[tuple[list[int], list[int]]], seq_len: int, pad_id: int,
         prompt_weight: float = 0.0) -> dict[str, torch.Tensor]:
    """First-fit-decreasing packing of (prompt ids, target ids) pairs into rows of seq_len tokens.

    Returns input_ids, position_ids (restarting at 0 for every sample and for the padding tail), labels
    (next-token targets, -100 where not trained), loss weights, and `valid` (real tokens, for the aux loss).
    """
    items = sorted(range(len(encoded)), key=lambda i: -(len(encoded[i][0]) + len(encoded[i][1])))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in items:
        n = len(encoded[i][0]) + len(encoded[i][1])
        if n > seq_len:
            raise ValueError(f"a sample of {n} tokens does not fit a row of {seq_len}; raise seq_len")
        for r, space in enumerate(free):
            if space >= n:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(seq_len - n)
    shape = (len(rows), seq_len)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    labels = torch.full(shape, -100, dtype=torch.long)
    weights = torch.zeros(shape)
    valid = torch.zeros(shape, dtype=torch.bool)
    for r, members in enumerate(rows):
        pos = 0
        for i in members:
            prompt, target = encoded[i]
            ids = prompt + target
            n = len(ids)
            input_ids[r, pos:pos + n] = torch.tensor(ids)
            position_ids[r, pos:pos + n] = torch.arange(n)
            valid[r, pos:pos + n] = True
            # token t predicts ids[t + 1]; the first target token is predicted from the last prompt token
            labels[r, pos:pos + n - 1] = torch.tensor(ids[1:])
            weights[r, pos + len(prompt) - 1:pos + n - 1] = 1.0
            if prompt_weight > 0:
                weights[r, pos:pos + len(prompt) - 1] = prompt_weight
            pos += n
        if pos < seq_len:
            position_ids[r, pos:] = torch.arange(seq_len - pos)
    labels[weights == 0] = -100
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels, "weights": weights,
            "valid": valid}


def make_batch(config: TrainConfig, tokenizer, step: int) -> dict[str, torch.Tensor]:
    encoded = [encode_sample(tokenizer, s) for s in step_samples(config, step)]
    return pack(encoded, config.seq_len, tokenizer.pad_token_id, config.prompt_loss_weight)


def pack_rows(encoded: Sequence[tuple[list[int], list[int]]], pad_id: int, prompt_weight: float = 0.0,
              groups: int = 3) -> list[dict[str, torch.Tensor]]:
    """One sample per row, right-padded, in at most `groups` micro-batches of ceil(n / groups) samples
    sorted by length (longest first).

    Each micro-batch is as wide as its longest sample. Nothing of one sample reaches another, whatever the
    token mixer: the rows are separate sequences and the padding comes after the real tokens.
    """
    order = sorted(encoded, key=lambda e: -(len(e[0]) + len(e[1])))
    size = max(1, math.ceil(len(order) / max(1, groups)))
    out = []
    for start in range(0, len(order), size):
        chunk = order[start:start + size]
        width = len(chunk[0][0]) + len(chunk[0][1])
        rows = [pack([e], width, pad_id, prompt_weight) for e in chunk]
        out.append({k: torch.cat([r[k] for r in rows]) for k in rows[0]})
    return out


def packing_of(config: TrainConfig, model_config=None) -> str:
    if config.packing != "auto":
        if config.packing not in ("packed", "rows"):
            raise ValueError(f"packing must be auto, packed or rows, not {config.packing!r}")
        return config.packing
    # auto keeps the earlier hybrid runs reproducible from their cards; packed (segment-aware GDN) is opt-in
    return "rows" if model_config is not None and is_hybrid(model_config) else "packed"


def make_batches(config: TrainConfig, tokenizer, step: int,
                 packing: str = "packed") -> list[dict[str, torch.Tensor]]:
    """The micro-batches of one step: one packed batch, or `row_groups` batches of one sample per row (rounded
    up to a multiple of the data-parallel ranks, so each rank gets as many)."""
    if packing == "packed":
        return [make_batch(config, tokenizer, step)]
    encoded = [encode_sample(tokenizer, s) for s in step_samples(config, step)]
    groups = math.ceil(config.row_groups / config.ranks) * config.ranks
    return pack_rows(encoded, tokenizer.pad_token_id, config.prompt_loss_weight, groups)


# --------------------------------------------------------------------------------------------------------
# Losses


class RouterCapture:
    """Forward hooks on every MoE router: keeps (router logits, top-k indices) of the last forward per layer.

    In transformers v5 the routers return (router_logits, top_k_weights, top_k_indices); index 0 is the raw
    logits (softmax is taken inside the router).
    """

    def __init__(self, model: nn.Module):
        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._hooks = ForwardWrappers("router capture")
        for block in moe_blocks(model):
            self._hooks.hook(block.gate, self._hook)

    def _hook(self, module, args, output) -> None:
        self.records.append((output[0], output[2]))

    def clear(self) -> None:
        self.records = []

    def remove(self) -> None:
        self._hooks.remove()


def load_balancing_loss(router_logits: torch.Tensor, top_k_index: torch.Tensor, num_experts: int,
                        valid: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-style aux loss of one layer: E * sum_j f_j * P_j; exactly 1 for perfectly uniform routing.

    f_j: share of the routed (token, slot) assignments that went to expert j (sums to 1);
    P_j: mean router probability of expert j over the tokens. Only `valid` tokens count.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    if valid is not None:
        valid = valid.reshape(-1)
        probs, top_k_index = probs[valid], top_k_index[valid]
    f = torch.bincount(top_k_index.reshape(-1), minlength=num_experts).float() / top_k_index.numel()
    return num_experts * (f * probs.mean(dim=0)).sum()


def training_losses(model: nn.Module, capture: RouterCapture, batch: dict[str, torch.Tensor],
                    aux_loss_coef: float, weight_total: float | None = None,
                    valid_total: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(total loss, weighted cross-entropy, mean aux loss over MoE layers) of one packed batch.

    For one micro-batch of several: `weight_total` (the step's total loss weight) divides the cross-entropy
    sum and the aux loss is scaled by this batch's share of `valid_total` real tokens, so the micro-batches'
    losses add up to the step's loss.
    """
    capture.clear()
    # packed hybrid rows: the segment-aware linear attention (active in packed training) reads the samples
    # from here; elsewhere the context is inert
    with packed_sequences(batch["position_ids"]):
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=None,
                    use_cache=False)
    logits = out.logits.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), ignore_index=-100,
                         reduction="none")
    w = batch["weights"].reshape(-1)
    ce = (ce * w).sum() / (w.sum().clamp_min(1e-9) if weight_total is None else max(weight_total, 1e-9))
    num_experts = model.config.num_experts
    aux = torch.stack([load_balancing_loss(lg, idx, num_experts, batch["valid"])
                       for lg, idx in capture.records])
    aux = aux.mean()
    if valid_total is not None:
        aux = aux * (int(batch["valid"].sum()) / max(1, valid_total))
    return ce + aux_loss_coef * aux, ce, aux


def step_losses(model: nn.Module, capture: RouterCapture, batches: Sequence[dict[str, torch.Tensor]],
                aux_loss_coef: float, rank: int = 0, world: int = 1,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward and backward over a step's micro-batches (gradients accumulate); the step's detached losses.

    With `world` > 1 only data-parallel rank `rank`'s share (`rank_batches`) runs, normalised
    by the whole step's totals, so the ranks' gradients and losses add up to the step's; a
    rank with no share returns zeros.
    """
    if len(batches) == 1 and world == 1:
        loss, ce, aux = training_losses(model, capture, batches[0], aux_loss_coef)
        loss.backward()
        return loss.detach(), ce.detach(), aux.detach()
    weight_total = float(sum(b["weights"].sum() for b in batches))
    valid_total = int(sum(b["valid"].sum() for b in batches))
    totals = torch.zeros(3)
    for b in dp.rank_batches(batches, rank, world):
        loss, ce, aux = training_losses(model, capture, b, aux_loss_coef, weight_total, valid_total)
        loss.backward()
        totals += torch.stack([loss.detach(), ce.detach(), aux.detach()])
    return totals[0], totals[1], totals[2]


# --------------------------------------------------------------------------------------------------------
# Schedule, optimizer, state


def lr_at(config: TrainConfig, step: int, progress: float) -> float:
    """Linear warmup over warmup_steps, times a cosine from lr to min_lr over progress in [0, 1]."""
    warm = min(1.0, (step + 1) / max(1, config.warmup_steps))
    p = min(max(progress, 0.0), 1.0)
    floor = config.lr * config.min_lr_ratio
    return warm * (floor + (config.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * p)))


def progress_of(config: TrainConfig, step: int, elapsed: float) -> float:
    parts = []
    if config.max_steps:
        parts.append(step / config.max_steps)
    if config.minutes:
        parts.append(elapsed / (60.0 * config.minutes))
    if not parts:
        raise ValueError("set minutes or max_steps (or both)")
    return max(parts)


def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (with `optimizer="muon"`: Muon on the matrices `muon.muon_parameters` picks, AdamW on the rest);
    weight decay on matrices and expert tensors, none on norms, biases and embeddings.

    Fused (one kernel over all tensors): a small share of a data-parallel step, a fraction of foreach's; same
    update up to float rounding (figures: docs/history/testbeds.md, "Trainer kernels")."""
    if config.optimizer not in ("adamw", "muon"):
        raise ValueError(f"unknown optimizer {config.optimizer!r}; choose adamw or muon")
    on_muon = muon_parameters(model) if config.optimizer == "muon" else {}
    decay, no_decay, by_blocks = [], [], {}
    for name, p in model.named_parameters():
        if name in on_muon:
            by_blocks.setdefault(on_muon[name], []).append(p)
        else:
            (decay if p.ndim >= 2 and "embed_tokens" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
    adamw = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=1e-8, fused=fused or None)
    if not on_muon:
        return adamw
    muon = Muon([{"params": ps, "blocks": b} for b, ps in sorted(by_blocks.items())], lr=config.lr,
                weight_decay=config.weight_decay)
    return MuonAdamW(muon, adamw)


def save_state(path: Path, model, optimizer, config: TrainConfig, step: int, elapsed: float, tokens: int,
               history: list[dict]) -> None:
    atomic_torch_save({
        "model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "elapsed": elapsed,
        "tokens": tokens, "config": config.to_dict(), "history": history,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }, path)


_ARCH_KEYS = ("backbone", "init_from", "model_overrides", "seed", "samples_per_family", "family_weights",
              "long_max_length", "long_top_share", "seq_len")


def load_state(path: Path, model, optimizer, config: TrainConfig) -> dict:
    # weights_only: a crafted state file must not run code (tensors, numbers, strings, lists, dicts, tuples)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        raise SlimWiseError(f"training state {path} is unreadable ({type(exc).__name__}): delete it to start "
                            "the run again, or resume from the directory that wrote it") from exc
    saved, now = state["config"], config.to_dict()
    defaults = TrainConfig.__dataclass_fields__
    for key in _ARCH_KEYS:
        was = saved.get(key, defaults[key].default)  # a state saved before a key existed ran with its default
        if was != now[key]:
            raise ValueError(f"cannot resume: {key} was {was!r}, now {now[key]!r}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return state


# --------------------------------------------------------------------------------------------------------
# Training


def word_pairs(tokenizer) -> list[tuple[int, int]]:
    """(id of "word", id of " word") for every word the vocabulary holds in both forms (the qa names)."""
    vocab = tokenizer.get_vocab()
    return sorted((vocab[w[1:]], i)
                  for w, i in vocab.items() if w.startswith(" ") and len(w) > 2 and w[1:] in vocab)


@torch.no_grad()
def tie_pair_rows(model: nn.Module, pairs: Sequence[tuple[int, int]]) -> None:
    """Copy the bare word's input-embedding and output rows onto the spaced form (an initialisation only).

    The qa passages spell names " Bob" (mid-sentence) while the worked solution starts lines with "Bob": two
    unrelated random tokens at init, so matching the question's name against the passage first needs a
    token-to-token association learnt from qa data alone. Equal starting rows give it for free.
    """
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    for bare, spaced in pairs:
        emb[spaced] = emb[bare]
        if head is not emb:
            head[spaced] = head[bare]


def build_model(config: TrainConfig, tokenizer) -> nn.Module:
    torch.manual_seed(config.seed)
    # documents the recipe
    overrides = {"router_aux_loss_coef": config.aux_loss_coef, **config.model_overrides}
    if config.init_from:
        src = init_dir(config)
        model_config = AutoConfig.from_pretrained(src, **overrides)
        model = AutoModelForCausalLM.from_pretrained(src, config=model_config, dtype=torch.float32)
    else:
        model_config = backbone_config(config.backbone, tokenizer, **overrides)
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
        if config.pair_init:
            tie_pair_rows(model, word_pairs(tokenizer))
    model.set_experts_implementation(config.experts_implementation)
    return model


def save_model(model: nn.Module, tokenizer, out: Path) -> None:
    """bf16 safetensors + config + generation config + tokenizer, loadable by stock transformers and vLLM."""
    model.set_experts_implementation("eager")
    export = type(model)(model.config)
    export.load_state_dict(model.state_dict())
    export = export.to(torch.bfloat16)
    export.config.dtype = torch.bfloat16
    export.generation_config = HFGenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, do_sample=False, max_new_tokens=256)
    export.save_pretrained(out)  # the tokenizer files are already there (build_tokenizer wrote them)
    # Newer transformers may write only the attribute-mapped expert-count key; keep the family's own keys too.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_experts"] = model.config.num_experts
    cfg.pop("experts_implementation", None)
    cfg.pop("_experts_implementation", None)
    atomic_write_text(cfg_path, json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    model.set_experts_implementation(FAST_EXPERTS if FAST_EXPERTS in ALL_EXPERTS_FUNCTIONS else "eager")


@functools.lru_cache(maxsize=2)
def _built_tokenizer_dir(spaced_pairs: bool = True) -> Path:
    """build_tokenizer is deterministic (seed 0) but takes seconds: build once per process, then copy."""
    path = Path(tempfile.mkdtemp(prefix="slimwise-testbed-tok-"))
    build_tokenizer(path, spaced_pairs=spaced_pairs)
    return path


def init_dir(config: TrainConfig) -> Path:
    """The model directory `init_from` names (a path or an embedded name), checked against the backbone."""
    from slimwise.embedded import embedded_model_dir

    src = embedded_model_dir(config.init_from) or Path(config.init_from)
    if not (src / "config.json").is_file():
        raise SlimWiseError(f"--init-from {config.init_from}: no config.json there; pass a trained model "
                            "directory or an embedded name")
    model_type = json.loads((src / "config.json").read_text()).get("model_type")
    expected = BACKBONES[config.backbone]["model_type"]
    if model_type != expected:
        raise SlimWiseError(f"--init-from {config.init_from} is a {model_type} model; backbone "
                            f"{config.backbone} is {expected}")
    return src


def prepare_tokenizer(out: Path, spaced_pairs: bool = True, init_from: Path | None = None):
    """Write the testbed tokenizer files into `out` (those of `init_from` when continuing a trained model)
    and load them from there."""
    if init_from:  # a model directory holds more than the tokenizer
        src, names = init_from, TOKENIZER_FILES
    else:
        src = _built_tokenizer_dir(spaced_pairs)
        names = tuple(f.name for f in sorted(src.iterdir()))
    for name in names:
        shutil.copy2(src / name, out / name)
    return load_saved_tokenizer(out)


def train(config: TrainConfig) -> Path:
    """Train one backbone into config.out (model files, log, resumable state); returns the output directory.

    With `ranks` > 1 the loop runs in that many single-thread processes (cpu_parallel.py); this one waits.
    """
    if config.ranks < 1:
        raise SlimWiseError(f"--ranks must be 1 or more, got {config.ranks}")
    unknown = sorted(set(config.family_weights) - set(FAMILIES) - set(LONG_FAMILIES))
    if unknown:
        raise SlimWiseError(f"--family-weights: unknown families {unknown}; known: {sorted(FAMILIES)} and "
                            f"the long ones {sorted(LONG_FAMILIES)}")
    if config.init_from:
        init_dir(config)
    if config.ranks > 1:
        Path(config.out).mkdir(parents=True, exist_ok=True)
        dp.spawn(_train_rank, config.ranks, config)
        return Path(config.out)
    return _train_rank(0, 1, config)


@dataclasses.dataclass
class _Progress:
    """Where a run is: restored from the state file on resume (`positions` counts this process only)."""

    step: int = 0
    elapsed: float = 0.0
    tokens: int = 0
    history: list = dataclasses.field(default_factory=list)
    positions: int = 0  # token positions processed, padding included


def _start_rank(lead: bool, config: TrainConfig, out: Path):
    """Tokenizer, model, optimizer and progress of one rank, resumed from the state file when asked; rank 0
    writes the tokenizer and train_config.json. The RNG is seeded before the state is restored."""
    tokenizer = (prepare_tokenizer(out, config.spaced_pairs, init_dir(config) if config.init_from else None)
                 if lead else None)
    dp.barrier()  # the other ranks read the files rank 0 wrote
    if tokenizer is None:
        tokenizer = load_saved_tokenizer(out)
    model = build_model(config, tokenizer)
    optimizer = make_optimizer(model, config)
    state_path = out / STATE_FILE
    progress = _Progress()
    random.seed(config.seed)
    if config.resume and state_path.is_file():
        state = load_state(state_path, model, optimizer, config)
        progress = _Progress(state["step"], state["elapsed"], state["tokens"], state["history"])
        print(f"resumed from {state_path} at step {progress.step} ({progress.elapsed / 60:.1f} min, "
              f"{progress.tokens} tokens)", flush=True)
    elif lead and not config.resume and (out / LOG_FILE).exists():
        (out / LOG_FILE).unlink()
    if lead:
        atomic_write_text((out / "train_config.json"), json.dumps(config.to_dict(), indent=2) + "\n")
    return tokenizer, model, optimizer, progress


def _train_step(model, optimizer, capture, batches, config: TrainConfig, lr: float, rank: int, world: int):
    """One optimizer step on this rank's batches, gradients summed over the ranks:
    (loss, ce, aux, grad norm)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    losses = step_losses(model, capture, batches, config.aux_loss_coef, rank, world)
    dp.sum_gradients(model)  # no-ops on one process
    loss, ce, aux = dp.all_sum(torch.stack(losses))
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()
    return loss, ce, aux, grad_norm


def _train_rank(rank: int, world: int, config: TrainConfig) -> Path:
    """The training loop of one data-parallel rank (rank 0 of 1 without data
    parallelism); rank 0 writes files."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    lead = rank == 0
    tuner = ThreadTuner() if config.threads <= 0 and world == 1 else None
    fixed_threads = 1 if world > 1 else max(1, config.threads)
    torch.set_num_threads(fixed_threads)
    tokenizer, model, optimizer, run = _start_rank(lead, config, out)
    state_path = out / STATE_FILE

    model.train()
    packing = packing_of(config, model.config)
    capture = RouterCapture(model)
    mixers = contextlib.ExitStack()
    # several samples per row: reset the GDN state at each
    if packing == "packed" and is_hybrid(model.config):
        mixers.enter_context(segment_aware_linear_attention())
    log = open(out / LOG_FILE if lead else os.devnull, "a")  # noqa: SIM115
    bar = tqdm(desc=f"train[{config.backbone}]", total=100, unit="%", disable=not (config.progress and lead),
               bar_format="{l_bar}{bar}| {n:.1f}/{total}% [{elapsed}<{remaining}{postfix}]", mininterval=2.0)
    t_start = time.perf_counter() - run.elapsed
    last_ckpt = time.perf_counter()
    seg_tokens, seg_start = 0, time.perf_counter()
    try:
        while progress_of(config, run.step, run.elapsed) < 1.0:
            if config.stop_at_step is not None and run.step >= config.stop_at_step:
                break
            lr = lr_at(config, run.step, progress_of(config, run.step, run.elapsed))
            threads = tuner.threads_for(run.step) if tuner else fixed_threads
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
            t_step = time.perf_counter()
            batches = make_batches(config, tokenizer, run.step, packing)
            loss, ce, aux, grad_norm = _train_step(model, optimizer, capture,
                                                   batches, config, lr, rank, world)
            run.step += 1
            n_tok = sum(int(b["valid"].sum()) for b in batches)
            run.positions += sum(b["input_ids"].numel() for b in batches)
            if tuner:
                tuner.record(threads, (time.perf_counter() - t_step) / max(1, n_tok))
            run.tokens += n_tok
            seg_tokens += n_tok
            run.elapsed = dp.from_rank0(time.perf_counter() - t_start)  # every rank stops at rank 0's step
            rate = seg_tokens / max(1e-9, time.perf_counter() - seg_start)
            record = {"step": run.step, "loss": loss.item(), "ce": ce.item(), "aux": aux.item(), "lr": lr,
                      "grad_norm": grad_norm.item(), "tokens": run.tokens, "tok_s": rate,
                      "elapsed": run.elapsed, "threads": threads}
            _report_step(config, run, record, log, bar)
            due = time.perf_counter() - last_ckpt > 60 * config.checkpoint_minutes
            if lead and (due or (config.checkpoint_every_steps
                                 and run.step % config.checkpoint_every_steps == 0)):
                save_state(state_path, model, optimizer, config, run.step, run.elapsed,
                           run.tokens, run.history)
                last_ckpt = time.perf_counter()
        dp.check_in_sync(model)
        if lead:
            save_state(state_path, model, optimizer, config, run.step, run.elapsed, run.tokens, run.history)
    finally:
        bar.close()
        log.close()
        capture.remove()
        mixers.close()
    if not lead or (config.stop_at_step is not None and run.step >= config.stop_at_step
                    and progress_of(config, run.step, run.elapsed) < 1):
        return out  # another rank, or interrupted on purpose: no final export
    summary = {"steps": run.step, "wall_seconds": run.elapsed, "tokens": run.tokens,
               "tokens_per_second": run.tokens / max(run.elapsed, 1e-9), "packing": packing,
               "positions": run.positions if not config.resume else None,
               "final_loss": final_loss(run.history), "entry": ENTRY}
    atomic_write_text((out / "train_summary.json"), json.dumps(summary, indent=2) + "\n")
    model.eval()
    save_model(model, tokenizer, out)
    return out


def _report_step(config: TrainConfig, run: _Progress, record: dict, log, bar) -> None:
    """The log line (every `log_every` steps and the first), kept in the history too, and the progress bar."""
    if run.step % config.log_every == 0 or run.step == 1:
        run.history.append(record)
        log.write(json.dumps(record) + "\n")
        log.flush()
    bar.set_postfix_str(f"step {run.step} loss {record['ce']:.3f} aux {record['aux']:.3f} lr "
                        f"{record['lr']:.2e} {record['tok_s']:.0f} tok/s", refresh=False)
    bar.n = round(100 * min(1.0, progress_of(config, run.step, run.elapsed)), 1)
    if run.step % config.log_every == 0:
        bar.refresh()


def final_loss(history: list[dict]) -> dict:
    """Mean training loss over the last 10% of logged steps (at least one record)."""
    if not history:
        return {}
    tail = history[-max(1, len(history) // 10):]
    return {k: sum(r[k] for r in tail) / len(tail) for k in ("loss", "ce", "aux")}


# --------------------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    """The options of `python -m lab.testbed.train`, from TrainConfig's fields (TRAIN_OPTIONS)."""
    p = argparse.ArgumentParser(prog="python -m lab.testbed.train",
                                description="train a testbed backbone")
    add_dataclass_options(p, TrainConfig, TRAIN_OPTIONS)
    p.add_argument("--no-eval", action="store_true", help="skip the final evaluation and model card")
    add_dataclass_options(p, TrainConfig, ("progress",))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m lab.testbed.train`: train a backbone, then (unless --no-eval) evaluate it and write its
    card."""
    from lab.testbed.evaluate import evaluate_and_write_card

    args = build_parser().parse_args(argv)
    config = config_from_args(TrainConfig, args)
    out = train(config)
    if not args.no_eval:
        evaluate_and_write_card(out, config)
    print(out)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
