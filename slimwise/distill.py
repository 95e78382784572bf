"""Decode-only distillation: train a few parameters so the pruned decoder continues full-model caches faithfully.

Why decode-only: SlimWise's prefill must stay exactly the full model (prompt KV cache and first token), and the
pruned decoder shares its weights with it (`ExpertMask`, one copy). So the trainable parameters are *overrides*
installed next to the mask: they act only while the mask is active and the delta is switched on (mode
`distilled`), and the stock weights never change. Prefill cannot see them, by construction.

Trainable sets (combinable, `DistillConfig.params`):
  router  a copy of each MoE layer's router weight used by the masked route; only the kept rows train (pruned
          rows are unselectable, get no gradient and are restored after every step)
  norm    a copy of the norm that feeds each MoE block (`post_attention_layernorm` in Qwen families)
  lora    low-rank adapters W + scale * B @ A on chosen Linear modules (attention projections by default),
          used as a merged weight, so a folded export computes exactly the same weights

Training (`distill`): the full model generates greedy continuations of the prompts once (EOS kept, so the
decoder learns when to stop) and its teacher-forced log-probs on them are cached. Each step, the full model
prefills a batch (no grad) and the student (mask + overrides) runs the continuation teacher-forced in one
forward on that cache; the loss is KL(full || student) over the continuation positions the decoder predicts
(padding masked; the first token comes from the full prefill and is never trained). AdamW on the overrides
only; batches, LoRA init and the schedule are functions of (seed, step), so a resumed run ends with the same
delta as an uninterrupted one. Mode `uniform` distils the classic uniform-pruned model instead (prefill pruned
and trained too): the honest baseline for the same budget.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from slimwise.adapters import get_adapter
from slimwise.delta import (
    DELTA_FORMAT,
    DELTA_MODES,
    PARAM_SETS,
    Delta,
    InstalledDelta,
    fingerprint_of,
    lora_modules,
    moe_norm,
    plan_hash,
    resolve_lora_targets,
)
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.errors import SlimWiseError
from slimwise.fingerprint import memory_fingerprint
from slimwise.io import atomic_torch_save, atomic_write_text
from slimwise.plan import PrunePlan
from slimwise.scoring import DIVERGENCES, continue_on_cache, divergence, logprobs_along, teacher_logprobs

CHECKPOINT_FORMAT = "slimwise-distill-checkpoint/1"
TEACHER_FORMAT = "slimwise-teacher/1"
LOSSES = DIVERGENCES


def peak_memory_mb() -> float:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------------------------------------
# Configuration


@dataclass
class DistillConfig:
    """Knobs of `distill`. The defaults are the cheapest recipe that met the accuracy bar on both testbed backbones
    (router + norm alone, 0.26% of the parameters, recovered 9.0 of 20.7 and 4.6 of 14.7 points at 50%: not enough;
    docs/results/distillation.md), with the LoRA where it recovers most: on the shared expert if there is one."""

    params: tuple[str, ...] = ("router", "norm", "lora")
    mode: str = "slimwise"  # "uniform": distil the uniform-pruned model (prefill pruned and trained too)
    steps: int = 1200
    max_minutes: float | None = None  # hard wall-clock cap on the training loop (the delta keeps the steps done)
    batch_size: int = 16
    # the teacher data's generation and log-prob batches. 64 runs the testbed's greedy decode 1.9x faster than 16
    # on one thread; 16 stays the default so the published bars regenerate bit for bit (padding changes rounding)
    teacher_batch_size: int = 16
    lr: float = 3e-3
    lora_lr: float | None = None  # default: lr
    weight_decay: float = 0.0  # LoRA only; routers and norms never decay
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    loss: str = "fkl"  # fkl = KL(full || student); rkl; jsd
    ce_weight: float = 0.0  # + cross-entropy on the full model's continuation tokens
    on_policy: float = 0.0  # share of steps that train on the student's own greedy continuations
    max_new_tokens: int = 128  # continuation length the full model generates per prompt
    max_samples: int | None = None
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("auto",)  # shared expert gate/up/down if any, else q/k/v/o (resolve_lora_targets)
    seed: int = 0
    checkpoint: str | None = None  # resumable state file (written atomically every checkpoint_every steps)
    checkpoint_every: int = 25
    resume: bool = False
    teacher_cache_mb: float = 1024.0  # cache the full model's log-probs below this size, else recompute per step
    progress: bool = True

    def validate(self) -> None:
        bad = [p for p in self.params if p not in PARAM_SETS]
        if not self.params or bad:
            raise SlimWiseError(f"unknown trainable set(s) {bad or '(none)'}; choose among {', '.join(PARAM_SETS)}")
        if self.mode not in DELTA_MODES:
            raise SlimWiseError(f"distill mode {self.mode!r} is not one of {', '.join(DELTA_MODES)}")
        if self.loss not in LOSSES:
            raise SlimWiseError(f"loss {self.loss!r} is not one of {', '.join(LOSSES)}")
        if self.steps < 1 or self.batch_size < 1 or self.teacher_batch_size < 1 or self.max_new_tokens < 2:
            raise SlimWiseError("steps and batch sizes must be at least 1 and max_new_tokens at least 2")
        if not 0.0 <= self.on_policy <= 1.0:
            raise SlimWiseError(f"on_policy {self.on_policy} is outside [0, 1]")
        if "lora" in self.params and (self.lora_rank < 1 or not self.lora_targets):
            raise SlimWiseError("lora needs a rank >= 1 and at least one target module")


def init_delta(model: nn.Module, plan: PrunePlan, config: DistillConfig) -> Delta:
    """The starting point: stock routers and norms (so step 0 is training-free SlimWise), LoRA B = 0."""
    adapter = get_adapter(model.config)
    tensors: dict[str, torch.Tensor] = {}
    layers = [layer for layer in adapter.moe_layers(model) if layer.index in plan.kept_experts]
    if "router" in config.params:
        for layer in layers:
            tensors[f"layers.{layer.index}.router.weight"] = layer.router.weight.detach().float().clone()
    if "norm" in config.params:
        for layer in layers:
            tensors[f"layers.{layer.index}.moe_norm.weight"] = moe_norm(model, layer.index, adapter).weight.detach().float().clone()
    lora = None
    if "lora" in config.params:
        gen = torch.Generator().manual_seed(config.seed)
        targets = resolve_lora_targets(model, config.lora_targets)
        modules = lora_modules(model, targets)
        for name, lin in sorted(modules.items()):
            bound = 1.0 / math.sqrt(lin.in_features)  # PEFT's default A init (kaiming-uniform, a=sqrt(5))
            a = (torch.rand(config.lora_rank, lin.in_features, generator=gen) * 2 - 1) * bound
            tensors[f"lora.{name}.lora_A.weight"] = a
            tensors[f"lora.{name}.lora_B.weight"] = torch.zeros(lin.out_features, config.lora_rank)
        lora = {"rank": config.lora_rank, "alpha": config.lora_alpha, "scale": config.lora_alpha / config.lora_rank,
                "targets": list(targets), "modules": sorted(modules)}
    manifest = {"format": DELTA_FORMAT, "mode": config.mode, "params": list(config.params), "family": adapter.family,
                "plan_hash": plan_hash(plan), "plan_fingerprint": plan.fingerprint,
                "model_fingerprint": fingerprint_of(model), "num_experts": plan.num_experts, "lora": lora}
    return Delta(tensors, manifest)


# ----------------------------------------------------------------------------------------------------------
# Training


@dataclass
class TeacherData:
    """The full model's greedy continuations of the distillation prompts (EOS kept) and its log-probs on them.

    Why a value of its own: it depends on the model, the prompts and the generation settings only, never on the
    plan or the mode, so one is built once and shared by every ratio, plan and baseline distilled on the same
    prompts (`distill(..., teacher=...)`, `slimwise distill --teacher FILE`). `logprobs` is None when the
    cache would exceed `teacher_cache_mb`; training then recomputes them per step."""

    key: dict  # model fingerprint, prompt hash and generation settings: what the data is a function of
    continuations: list[list[int]]
    logprobs: list[torch.Tensor] | None
    seconds: float

    def check(self, key: dict) -> None:
        if self.key != key:
            labels = {"model_fingerprint": "model", "data": "prompt set", "max_new_tokens": "--max-new-tokens",
                      "teacher_batch_size": "--teacher-batch-size"}
            diff = [labels.get(k, k) for k in sorted(set(self.key) | set(key)) if self.key.get(k) != key.get(k)]
            raise SlimWiseError(f"teacher data was built for a different {' and '.join(diff)}: rebuild it (delete "
                                "the file) or pass the one built for this run")

    def save(self, path: str | Path) -> Path:
        return atomic_torch_save({"format": TEACHER_FORMAT, "key": self.key, "continuations": self.continuations,
                                  "logprobs": self.logprobs, "seconds": self.seconds}, path)

    @classmethod
    def load(cls, path: str | Path) -> TeacherData:
        try:
            state = torch.load(Path(path), map_location="cpu", weights_only=True)  # no code from shared files
        except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same one-line answer
            raise SlimWiseError(f"teacher data {path} is unreadable ({type(exc).__name__}): delete it to rebuild") from exc
        if not isinstance(state, dict) or state.get("format") != TEACHER_FORMAT:
            raise SlimWiseError(f"{path} is not SlimWise teacher data ({TEACHER_FORMAT}): delete it to rebuild")
        key = dict(state["key"])
        if "batch_size" in key:  # written by older releases, whose training batch built the teacher data too
            key["teacher_batch_size"] = key.pop("batch_size")
        return cls(key, state["continuations"], state["logprobs"], state["seconds"])


def _teacher_key(model: nn.Module, ids: list[list[int]], config: DistillConfig) -> dict:
    return {"model_fingerprint": memory_fingerprint(fingerprint_of(model)), "data": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16],
            "max_new_tokens": config.max_new_tokens, "teacher_batch_size": config.teacher_batch_size}


def _build_teacher(engine: PhaseSplitEngine, ids: list[list[int]], config: DistillConfig,
                   continuations: list[list[int]] | None = None) -> TeacherData:
    t0 = time.perf_counter()
    if continuations is None:
        gen_cfg = GenerationConfig(max_new_tokens=config.max_new_tokens, batch_size=config.teacher_batch_size,
                                   progress=config.progress)
        continuations = [g.token_ids for g in engine.generate(ids, mode="full", config=gen_cfg)]
    vocab = engine.model.get_output_embeddings().weight.shape[0]
    logprobs: list[torch.Tensor] | None = None
    if sum(len(c) for c in continuations) * vocab * 4 <= config.teacher_cache_mb * 2**20 and config.on_policy < 1.0:
        logprobs = logprobs_along(engine, ids, continuations, config.teacher_batch_size)
    return TeacherData(_teacher_key(engine.model, ids, config), continuations, logprobs,
                       round(time.perf_counter() - t0, 2))


def build_teacher(model: nn.Module, prompts: Sequence[str] | Sequence[Sequence[int]], tokenizer=None,
                  config: DistillConfig | None = None) -> TeacherData:
    """The teacher data `distill` would build for (model, prompts, config), to share between several runs."""
    config = config or DistillConfig()
    prompts = list(prompts)[:config.max_samples] if config.max_samples else list(prompts)
    if not prompts:
        raise SlimWiseError("distillation data is empty: pass calibration prompts (JSONL with a 'prompt' field)")
    engine = PhaseSplitEngine(model, tokenizer)
    try:
        with torch.no_grad():
            return _build_teacher(engine, engine.encode(prompts), config)
    finally:
        engine.close()


def _batch_indices(n: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Step `step`'s samples: a seeded permutation per epoch, so a batch is a pure function of (seed, step)."""
    per_epoch = math.ceil(n / batch_size)
    epoch, k = divmod(step, per_epoch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
    return order[k * batch_size:(k + 1) * batch_size]


def _is_on_policy(share: float, step: int) -> bool:
    return share > 0 and math.floor((step + 1) * share) > math.floor(step * share)


def _lr_factor(config: DistillConfig, step: int) -> float:
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _run_key(config: DistillConfig, plan: PrunePlan, fingerprint: dict, data_hash: str) -> dict:
    """What a checkpoint must share with the run resuming it (everything the trajectory depends on)."""
    keep = ("params", "mode", "steps", "batch_size", "lr", "lora_lr", "weight_decay", "warmup_steps", "min_lr_ratio",
            "grad_clip", "loss", "ce_weight", "on_policy", "max_new_tokens", "teacher_batch_size", "lora_rank",
            "lora_alpha", "lora_targets", "seed")
    cfg = {k: v for k, v in asdict(config).items() if k in keep}
    return json.loads(json.dumps({"config": cfg, "plan_hash": plan_hash(plan), "model_fingerprint": memory_fingerprint(fingerprint),
                                  "data": data_hash}, default=list))


def _atomic_write(path: Path, text: str) -> None:
    atomic_write_text(path, text if text.endswith("\n") else text + "\n")


def trainable_cache(cache):
    """Make a prefill cache safe to backpropagate through: transformers writes each linear-attention layer's new
    recurrent state into the previous state tensor in place (`copy_`, to keep a static address for CUDA graphs), but
    that tensor was the layer's initial state, saved for the backward pass of the same forward (Qwen3-Next,
    Qwen3.5/3.6-MoE: "modified by an inplace operation"). On this cache only, the new state is assigned instead; the
    values are the same. Attention-only caches are returned unchanged."""
    for layer in getattr(cache, "layers", []):
        if not hasattr(layer, "update_recurrent_state"):
            continue

        def update(recurrent_states, state_idx=0, _layer=layer, **kwargs):
            if not _layer.is_recurrent_states_initialized[state_idx]:
                _layer.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
            _layer.recurrent_states[state_idx] = recurrent_states
            return recurrent_states

        layer.update_recurrent_state = update
    return cache


def _step_loss(engine: PhaseSplitEngine, installed: InstalledDelta, prompts: list[list[int]],
               conts: list[list[int]], teacher: torch.Tensor | None, config: DistillConfig) -> torch.Tensor | None:
    """One batch: student logits on the full model's prefill cache vs the teacher's log-probs (None: nothing
    to train, every continuation is one token, which the full prefill produced)."""
    width = max(len(c) for c in conts)
    lengths = torch.tensor([len(c) for c in conts])
    if installed.mode == "slimwise":
        if width < 2:
            return None
        with torch.no_grad():
            cache, _, attention, positions = engine.prefill(prompts, "full")
        if teacher is None:  # on the fly: the full model continues a copy of the same cache
            teacher_cache = copy.deepcopy(cache)
            with torch.no_grad():
                logits = continue_on_cache(engine, "full", teacher_cache, attention, positions, conts, width)
            teacher = torch.log_softmax(logits, dim=-1)
        else:
            teacher = teacher[:, 1:]
        student = continue_on_cache(engine, "distilled", trainable_cache(cache), attention, positions, conts, width)
        first = 1  # position 0 is the full prefill's token: never trained
    else:
        if teacher is None:
            teacher = teacher_logprobs(engine, prompts, conts)
        cache, last, attention, positions = engine.prefill(prompts, "distilled")
        student = torch.cat([last[:, None, :], continue_on_cache(engine, "distilled", trainable_cache(cache),
                                                                attention, positions, conts, width)], dim=1)
        first = 0
    span = torch.arange(first, width)
    valid = (span[None, :] < lengths[:, None]).to(student.device)
    loss = (divergence(teacher, student, config.loss) * valid).sum() / valid.sum()
    if config.ce_weight:
        target = torch.zeros(len(conts), width, dtype=torch.long)
        for i, c in enumerate(conts):
            target[i, :len(c)] = torch.tensor(c)
        nll = -torch.log_softmax(student, dim=-1).gather(-1, target[:, first:, None].to(student.device)).squeeze(-1)
        loss = loss + config.ce_weight * (nll * valid).sum() / valid.sum()
    return loss


def distill(model: nn.Module, plan: PrunePlan, prompts: Sequence[str] | Sequence[Sequence[int]], tokenizer=None,
            config: DistillConfig | None = None, *, teacher: TeacherData | None = None,
            callback: Callable[[int, float], None] | None = None) -> Delta:
    """Distil a decode-only delta for `plan` on `prompts`; `model` is the (frozen) teacher and the student's base.

    `callback(step, loss)` runs after every step (and after its checkpoint). The model's weights and
    requires_grad flags are left as they were. With `config.checkpoint`, a resumable state is written
    atomically every `checkpoint_every` steps; `config.resume` continues from it (same final delta as an
    uninterrupted run). Deleting the checkpoint once the delta is saved is the caller's job. `teacher` (from
    `build_teacher` on the same model, prompts and settings) skips building the teacher data; the delta is the
    same as without it.
    """
    config = config or DistillConfig()
    config.validate()
    t_start = time.perf_counter()
    prompts = list(prompts)[:config.max_samples] if config.max_samples else list(prompts)
    if not prompts:
        raise SlimWiseError("distillation data is empty: pass calibration prompts (JSONL with a 'prompt' field)")
    adapter = get_adapter(model.config)
    plan.validate(adapter.min_kept_per_group(model.config))
    plan.check_model(model, adapter)
    if plan.is_empty:
        raise SlimWiseError("the plan prunes nothing, so there is nothing to distil: pass a plan with ratio > 0")
    fingerprint = fingerprint_of(model)
    ckpt = Path(config.checkpoint) if config.checkpoint else None
    flags = [(p, p.requires_grad) for p in model.parameters()]
    engine = PhaseSplitEngine(model, tokenizer, plan=plan)
    installed: InstalledDelta | None = None
    say = tqdm.write if config.progress else (lambda *_: None)
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        ids = engine.encode(prompts)
        data_hash = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]
        key = _run_key(config, plan, fingerprint, data_hash)
        state = None
        if config.resume and ckpt is not None and ckpt.is_file():
            try:
                state = torch.load(ckpt, map_location="cpu", weights_only=True)  # no code from user files
            except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same one-line answer
                raise SlimWiseError(f"checkpoint {ckpt} is unreadable ({type(exc).__name__}): delete it or run "
                                    "without --resume") from exc
            if state.get("format") != CHECKPOINT_FORMAT or state.get("key") != key:
                raise SlimWiseError(f"checkpoint {ckpt} belongs to another run (model, plan, data or settings "
                                    "differ): delete it or run without --resume")
            say(f"distill: resuming from {ckpt} at step {state['step']}")
        # teacher data: the full model's greedy continuations (EOS included) and its log-probs, built once
        shared_teacher = teacher is not None
        if teacher is not None:
            teacher.check(_teacher_key(model, ids, config))
        elif state is not None:  # the continuations are in the checkpoint; the log-probs are recomputed
            teacher = _build_teacher(engine, ids, config, state["continuations"])
        else:
            teacher = _build_teacher(engine, ids, config)
        conts = teacher.continuations
        if all(len(c) < 2 for c in conts) and config.mode == "slimwise":
            raise SlimWiseError("every continuation is a single token, so the decoder has nothing to learn: use "
                                "longer max_new_tokens or other prompts")
        vocab = model.get_output_embeddings().weight.shape[0]
        teacher_cache = teacher.logprobs
        delta0 = Delta(state["tensors"], state["manifest"]) if state is not None else init_delta(model, plan, config)
        installed = InstalledDelta(model, delta0, engine.mask, plan, trainable=True)
        engine.delta = installed
        optimizer = torch.optim.AdamW(installed.param_groups(config.lr, config.lora_lr, config.weight_decay),
                                      betas=(0.9, 0.999))
        if state is not None:
            optimizer.load_state_dict(state["optimizer"])
        trainable = installed.trainable_count()
        total = sum(p.numel() for p in model.parameters())
        lora = delta0.manifest.get("lora")
        lora_on = f" on {','.join(lora['targets'])}" if lora else ""
        say(f"distill: {trainable:,} trainable parameters ({'+'.join(config.params)}{lora_on}) = "
            f"{100 * trainable / total:.3f}% of {total:,}; {len(ids)} prompts, "
            f"{sum(len(c) for c in conts)} continuation tokens; mode {config.mode}")
        step = state["step"] if state is not None else 0
        history: list[float] = list(state["history"]) if state is not None else []
        elapsed0 = float(state["elapsed"]) if state is not None else 0.0
        t_train = time.perf_counter()
        stopped_early = False
        bar = tqdm(total=config.steps, initial=step, desc=f"distill[{'+'.join(config.params)}]", unit="step",
                   disable=None if config.progress else True)  # a terminal only
        while step < config.steps:
            if config.max_minutes is not None and time.perf_counter() - t_train + elapsed0 > 60 * config.max_minutes:
                stopped_early = True
                say(f"distill: time budget of {config.max_minutes} min reached at step {step}")
                break
            idx = _batch_indices(len(ids), config.batch_size, config.seed, step)
            batch_prompts = [ids[i] for i in idx]
            batch_teacher = None
            if _is_on_policy(config.on_policy, step):  # the student's own greedy continuations (mode distilled)
                gen_cfg = GenerationConfig(max_new_tokens=config.max_new_tokens, batch_size=config.batch_size)
                batch_conts = [g.token_ids for g in engine.generate(batch_prompts, mode="distilled", config=gen_cfg)]
            else:
                batch_conts = [conts[i] for i in idx]
                if teacher_cache is not None:
                    width = max(len(c) for c in batch_conts)
                    batch_teacher = torch.zeros(len(idx), width, vocab)
                    for row, i in enumerate(idx):
                        batch_teacher[row, :len(conts[i])] = teacher_cache[i]
            factor = _lr_factor(config, step)
            for group in optimizer.param_groups:
                group["lr"] = group["base_lr"] * factor
            loss = _step_loss(engine, installed, batch_prompts, batch_conts, batch_teacher, config)
            if loss is not None:  # None: no position to train in this batch (single-token continuations)
                loss.backward()
                if config.grad_clip:
                    torch.nn.utils.clip_grad_norm_(installed.parameters(), config.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                installed.restore_pruned_rows()
            step += 1
            history.append(round(float(loss.detach()), 6) if loss is not None else float("nan"))
            bar.update(1)
            bar.set_postfix(loss=f"{history[-1]:.4f}", lr=f"{config.lr * factor:.1e}")
            if ckpt is not None and (step % config.checkpoint_every == 0 or step == config.steps):
                atomic_torch_save({"format": CHECKPOINT_FORMAT, "key": key, "step": step,
                                    "tensors": installed.tensors(), "manifest": installed.manifest,
                                    "optimizer": optimizer.state_dict(), "history": history,
                                    "elapsed": elapsed0 + time.perf_counter() - t_train,
                                    "continuations": conts}, ckpt)
            if callback is not None:
                callback(step, history[-1])
        bar.close()
        train_seconds = elapsed0 + time.perf_counter() - t_train
        manifest = {"steps": step, "stopped_early": stopped_early, "loss_history": history,
                    "teacher_seconds": teacher.seconds, "teacher_shared": shared_teacher,
                    "trainable_params": trainable, "model_params": total,
                    "trainable_share": trainable / total, "seconds": round(time.perf_counter() - t_start, 2),
                    "train_seconds": round(train_seconds, 2), "peak_memory_mb": round(peak_memory_mb(), 1),
                    "num_prompts": len(ids), "continuation_tokens": sum(len(c) for c in conts),
                    "config": {k: v for k, v in asdict(config).items()
                               if k not in ("checkpoint", "resume", "progress")}}
        delta = installed.to_delta(manifest)
        say(f"distill: {step} steps in {train_seconds:.1f}s (total {manifest['seconds']:.1f}s), loss "
            f"{history[0] if history else float('nan'):.4f} -> {history[-1] if history else float('nan'):.4f}, "
            f"peak memory {manifest['peak_memory_mb']:.0f} MB")
        return delta
    finally:
        if installed is not None:
            installed.remove()
        engine.delta = None
        engine.close()
        for p, flag in flags:
            p.requires_grad_(flag)
