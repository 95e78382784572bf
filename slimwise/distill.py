"""Decode-only distillation: train a few parameters so the pruned decoder
continues full-model caches faithfully.

Why decode-only: SlimWise's prefill must stay exactly the full model (prompt KV cache and first token), and
the pruned decoder shares its weights with it (`ExpertMask`, one copy). So the trainable parameters are
*overrides* installed next to the mask: they act only while the mask is active and the delta is switched on
(mode `distilled`), and the stock weights never change. Prefill cannot see them, by construction.

Trainable sets (combinable, `DistillConfig.params`): `router` (the kept rows of each MoE router), `norm` (the
norm feeding each MoE block) and `lora` (low-rank adapters used as a merged weight), each a `TrainableSet` in
`slimwise.trainable`, which says what it trains, how it starts and how it acts; this
module never branches on them.

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
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from slimwise.adapters import get_adapter
from slimwise.argtypes import comma_list, integer, number
from slimwise.checkpointing import checkpointed_moe_blocks
from slimwise.delta import DELTA_FORMAT, DELTA_MODES, Delta, InstalledDelta, fingerprint_of, plan_hash
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.errors import SlimWiseError
from slimwise.fingerprint import memory_fingerprint
from slimwise.io import atomic_torch_save, atomic_write_text
from slimwise.plan import PrunePlan
from slimwise.scoring import DIVERGENCES, continue_on_cache, divergence, logprobs_along, teacher_logprobs
from slimwise.trainable import trainable_sets

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
    """Knobs of `distill`, and the one declaration of their defaults (the CLI reads them). The defaults are
    the recipe the published bars were run with (docs/results/distillation.md): all three sets, because
    router + norm alone did not meet the accuracy bar on both testbed backbones, with the LoRA where it
    recovered most: on the shared expert if there is one. Every knob but the run's plumbing (`max_minutes`,
    `max_samples`, `checkpoint`, `checkpoint_every`, `resume`, `teacher_cache_mb`, `activation_checkpointing`,
    `progress`) is in a checkpoint's run key (`_run_key`): a run resumed with another value is refused."""

    # slimwise.trainable's sets
    params: tuple[str, ...] = field(default=("router", "norm", "lora"), metadata={
        "type": comma_list(str),
        "help": "comma-separated trainable sets among router,norm,lora (default: router,norm,lora, the "
                "cheapest set that met the accuracy bar on both testbed backbones)"})
    # "uniform": the uniform-pruned model, prefill trained too
    mode: str = field(default="slimwise", metadata={
        "choices": DELTA_MODES,
        "help": "slimwise: full prefill, decode-only delta; uniform: the uniform-pruned baseline"})
    # each on `batch_size` prompts
    steps: int = field(default=1200, metadata={"type": integer(1), "help": None})
    max_minutes: float | None = field(default=None, metadata={  # a hard cap on the training loop
        "flag": "--minutes", "type": number(0, lo_open=True),
        "help": "wall-clock cap on training (keeps the steps done)"})
    # prompts per training step
    batch_size: int = field(default=16, metadata={"type": integer(1), "help": None})
    # the teacher data's generation and log-prob batches. Larger batches build it faster on CPU (results
    # page); 16 stays the default so the published bars regenerate bit for bit (padding changes rounding)
    teacher_batch_size: int = field(default=16, metadata={
        "type": integer(1), "help": "batch of the full model's continuations and log-probs (the teacher "
                                    "data); 64 builds it about 1.9x faster on CPU"})
    # peak AdamW learning rate of routers and norms (and of LoRA unless lora_lr)
    lr: float = field(default=3e-3, metadata={"type": number(0, lo_open=True), "help": None})
    lora_lr: float | None = field(default=None, metadata={
        "type": number(0, lo_open=True), "help": "LoRA learning rate (default: --lr)"})
    weight_decay: float = 0.0  # LoRA only; routers and norms never decay
    warmup_steps: int = 10  # linear warm-up to lr, then a cosine decay towards min_lr_ratio * lr (_lr_factor)
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # max global gradient norm over every trained parameter; 0 turns clipping off
    loss: str = field(default="fkl", metadata={  # fkl = KL(full || student); rkl; jsd
        "choices": LOSSES, "help": "fkl = KL(full || student)"})
    # + cross-entropy on the full model's continuation tokens
    ce_weight: float = field(default=0.0, metadata={
        "type": number(0), "help": "add cross-entropy on the full model's tokens"})
    on_policy: float = field(default=0.0, metadata={  # on the student's own greedy continuations
        "type": number(0, 1), "help": "share of steps on the student's own samples"})
    max_new_tokens: int = field(default=128, metadata={  # per prompt
        "type": integer(1), "help": "length of the full model's continuations"})
    max_samples: int | None = None  # use the first N prompts only (None: all)
    lora_rank: int = field(default=8, metadata={"type": integer(1), "help": None})  # r of B @ A
    lora_alpha: float = field(default=16.0, metadata={  # LoRA scale = alpha / rank, as in PEFT
        "type": number(0, lo_open=True), "help": None})
    lora_targets: tuple[str, ...] = field(default=("auto",), metadata={  # resolve_lora_targets
        "type": comma_list(str),
        "help": "comma-separated Linear module names for LoRA (default: auto = the shared expert's "
                "gate_proj,up_proj,down_proj where the model has one, else q_proj,k_proj,v_proj,o_proj)"})
    # batches and the LoRA init are functions of (seed, step): what makes resume exact
    seed: int = field(default=0, metadata={"type": integer(0), "help": None})
    checkpoint: str | None = None  # resumable state file (written atomically every checkpoint_every steps)
    checkpoint_every: int = field(default=25, metadata={
        "type": integer(1),
        "help": "steps between resumable checkpoints (OUT.ckpt.pt, removed once the delta is written)"})
    resume: bool = field(default=False, metadata={  # refused if the checkpoint belongs to another run
        "help": "continue an interrupted run from OUT.ckpt.pt"})
    # cache the full model's log-probs below this size, else recompute per step
    teacher_cache_mb: float = 1024.0
    # slimwise.checkpointing: the same gradients (bit for bit on the CPU, tests/test_checkpointing.py)
    activation_checkpointing: bool = field(default=False, metadata={
        "help": "recompute the MoE blocks in the backward pass instead of keeping their activations (less "
                "memory, one more MoE forward per step)"})
    progress: bool = True  # progress bar and one-line reports (tqdm.write)

    def validate(self) -> None:
        sets = trainable_sets(self.params)  # refuses none or an unknown name
        if self.mode not in DELTA_MODES:
            raise SlimWiseError(f"distill mode {self.mode!r} is not one of {', '.join(DELTA_MODES)}")
        if self.loss not in LOSSES:
            raise SlimWiseError(f"loss {self.loss!r} is not one of {', '.join(LOSSES)}")
        if self.steps < 1 or self.batch_size < 1 or self.teacher_batch_size < 1 or self.max_new_tokens < 2:
            raise SlimWiseError("steps and batch sizes must be at least 1 and max_new_tokens at least 2")
        if not 0.0 <= self.on_policy <= 1.0:
            raise SlimWiseError(f"on_policy {self.on_policy} is outside [0, 1]")
        for trainable_set in sets:
            trainable_set.validate(self)


def init_delta(model: nn.Module, plan: PrunePlan, config: DistillConfig) -> Delta:
    """The starting point: stock routers and norms (so step 0 is training-free SlimWise), LoRA B = 0."""
    adapter = get_adapter(model.config)
    tensors: dict[str, torch.Tensor] = {}
    layers = {layer.index: layer for layer in adapter.moe_layers(model) if layer.index in plan.kept_experts}
    manifest = {"format": DELTA_FORMAT, "mode": config.mode, "params": list(config.params),
                "family": adapter.family, "plan_hash": plan_hash(plan), "plan_fingerprint": plan.fingerprint,
                "model_fingerprint": fingerprint_of(model), "num_experts": plan.num_experts, "lora": None}
    for trainable_set in trainable_sets(config.params):
        set_tensors, entries = trainable_set.init(model, adapter, layers, config)
        tensors |= set_tensors
        manifest |= entries
    return Delta(tensors, manifest)


# ----------------------------------------------------------------------------------------------------------
# Training


@dataclass
class TeacherData:
    """The full model's greedy continuations of the distillation prompts (EOS kept) and its log-probs on them.

    Why a value of its own: it depends on the model, the prompts and the generation settings only, never on
    the plan or the mode, so one is built once and shared by every ratio, plan and baseline distilled on the
    same prompts (`distill(..., teacher=...)`, `slimwise distill --teacher FILE`). `logprobs` is None when the
    cache would exceed `teacher_cache_mb`; training then recomputes them per step."""

    key: dict  # model fingerprint, prompt hash and generation settings: what the data is a function of
    continuations: list[list[int]]
    logprobs: list[torch.Tensor] | None
    seconds: float
    # who computed it: {} for the transformers model, {"engine": "vllm", ...} for `vllm_teacher`; not part of
    # the key, since both give the same data within rounding (docs/results/distillation.md)
    source: dict = field(default_factory=dict)

    def check(self, key: dict) -> None:
        if self.key != key:
            labels = {"model_fingerprint": "model", "data": "prompt set",
                      "max_new_tokens": "--max-new-tokens", "teacher_batch_size": "--teacher-batch-size"}
            diff = [labels.get(k, k) for k in sorted(set(self.key) | set(key))
                    if self.key.get(k) != key.get(k)]
            raise SlimWiseError(f"teacher data was built for a different {' and '.join(diff)}: rebuild it "
                                "(delete the file) or pass the one built for this run")

    def save(self, path: str | Path) -> Path:
        return atomic_torch_save({"format": TEACHER_FORMAT, "key": self.key,
                                  "continuations": self.continuations, "logprobs": self.logprobs,
                                  "seconds": self.seconds, "source": self.source}, path)

    @classmethod
    def load(cls, path: str | Path) -> TeacherData:
        try:
            state = torch.load(Path(path), map_location="cpu", weights_only=True)  # no code from shared files
        except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same one-line answer
            raise SlimWiseError(f"teacher data {path} is unreadable ({type(exc).__name__}): delete it "
                                "to rebuild") from exc
        if not isinstance(state, dict) or state.get("format") != TEACHER_FORMAT:
            raise SlimWiseError(f"{path} is not SlimWise teacher data ({TEACHER_FORMAT}): "
                                "delete it to rebuild")
        key = dict(state["key"])
        if "batch_size" in key:  # written by older releases, whose training batch built the teacher data too
            key["teacher_batch_size"] = key.pop("batch_size")
        return cls(key, state["continuations"], state["logprobs"], state["seconds"],
                   state.get("source") or {})


def _teacher_key(model: nn.Module, ids: list[list[int]], config: DistillConfig) -> dict:
    return {"model_fingerprint": memory_fingerprint(fingerprint_of(model)),
            "data": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16],
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
    if sum(len(c) for c in continuations) * vocab * 4 <= config.teacher_cache_mb * 2**20 \
            and config.on_policy < 1.0:
        logprobs = logprobs_along(engine, ids, continuations, config.teacher_batch_size)
    return TeacherData(_teacher_key(engine.model, ids, config), continuations, logprobs,
                       round(time.perf_counter() - t0, 2))


def vllm_teacher(model_dir: str | Path, ids: list[list[int]], config: DistillConfig, vocab_size: int,
                 tokenizer=None, *, dtype: str = "float32", engine_kwargs: dict | None = None,
                 top_k: int = -1) -> tuple[list[list[int]], list[torch.Tensor], dict]:
    """The teacher data's two parts from vLLM: the full model's greedy continuations of `ids` (EOS kept) and
    its log-probs along them (one teacher-forced prefill of prompt + continuation per sequence). `top_k` -1
    takes the whole vocabulary (exact); K > 0 keeps vLLM's top K per position and spreads the remaining
    probability evenly over the other tokens (a bounded approximation that keeps the dense loss). Returns
    (continuations, dense log-probs [len, vocab] per sequence, source record). vLLM spawns workers: call it
    under an `if __name__ == "__main__":` guard."""
    from slimwise.engines.vllm_engine import VllmEngine

    t0 = time.perf_counter()
    kwargs = {"max_logprobs": -1 if top_k < 0 else max(top_k, 20), **(engine_kwargs or {})}
    engine = VllmEngine(model_dir, None, tokenizer, dtype=dtype, engine_kwargs=kwargs)
    try:
        gen = GenerationConfig(max_new_tokens=config.max_new_tokens, batch_size=config.teacher_batch_size,
                               progress=config.progress)
        continuations = [g.token_ids for g in engine.generate(ids, mode="full", config=gen)]
        sparse = engine.prompt_logprobs([p + c for p, c in zip(ids, continuations, strict=True)],
                                        [len(p) for p in ids], top_k=top_k)
    finally:
        engine.close()
    logprobs = [_dense_logprobs(rows, values, vocab_size) for rows, values in sparse]
    source = {"engine": "vllm", "dtype": dtype, "top_k": top_k, "engine_kwargs": engine_kwargs or {},
              "seconds": round(time.perf_counter() - t0, 2)}
    return continuations, logprobs, source


def _dense_logprobs(ids: torch.Tensor, values: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[T, K] top-K log-probs → [T, vocab]: the K given, the rest sharing the remaining probability evenly
    (exactly the given ones when K is the whole vocabulary)."""
    finite = torch.isfinite(values)
    mass = torch.where(finite, values.exp(), 0.0).sum(-1)
    others = (vocab_size - finite.sum(-1)).clamp_min(1)
    tail = torch.log((1.0 - mass).clamp_min(1e-12) / others)
    dense = torch.cat([tail[:, None].expand(-1, vocab_size), tail[:, None]], dim=1)  # + a column for padding
    dense.scatter_(1, torch.where(finite, ids, vocab_size), torch.where(finite, values, tail[:, None]))
    return dense[:, :vocab_size].contiguous()


def teacher_from_parts(model: nn.Module, ids: list[list[int]], continuations: list[list[int]],
                       logprobs: list[torch.Tensor], source: dict, config: DistillConfig) -> TeacherData:
    """Teacher data computed elsewhere (`vllm_teacher`), keyed to `model` like the transformers teacher's."""
    vocab = model.get_output_embeddings().weight.shape[0]
    if logprobs and logprobs[0].shape[-1] != vocab:
        raise SlimWiseError(f"the teacher's log-probs cover {logprobs[0].shape[-1]} tokens but the model's "
                            f"head has {vocab}: build the teacher from the same checkpoint")
    return TeacherData(_teacher_key(model, ids, config), continuations, logprobs, source.get("seconds", 0.0),
                       source)


def _distill_prompts(prompts: Sequence[str] | Sequence[Sequence[int]], config: DistillConfig) -> list:
    prompts = list(prompts)[:config.max_samples] if config.max_samples else list(prompts)
    if not prompts:
        raise SlimWiseError("distillation data is empty: pass calibration prompts "
                            "(JSONL with a 'prompt' field)")
    return prompts


def build_teacher(model: nn.Module, prompts: Sequence[str] | Sequence[Sequence[int]], tokenizer=None,
                  config: DistillConfig | None = None) -> TeacherData:
    """The teacher data `distill` would build for (model, prompts, config), to share between several runs."""
    config = config or DistillConfig()
    prompts = _distill_prompts(prompts, config)
    engine = PhaseSplitEngine(model, tokenizer)
    try:
        with torch.no_grad():
            return _build_teacher(engine, engine.encode(prompts), config)
    finally:
        engine.close()


def _batch_indices(n: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Step `step`'s samples: a seeded permutation per epoch, so a batch is a
    pure function of (seed, step)."""
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
    return config.min_lr_ratio \
        + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _run_key(config: DistillConfig, plan: PrunePlan, fingerprint: dict, data_hash: str) -> dict:
    """What a checkpoint must share with the run resuming it (everything the trajectory depends on)."""
    keep = ("params", "mode", "steps", "batch_size", "lr", "lora_lr", "weight_decay", "warmup_steps",
            "min_lr_ratio", "grad_clip", "loss", "ce_weight", "on_policy", "max_new_tokens",
            "teacher_batch_size", "lora_rank", "lora_alpha", "lora_targets", "seed")
    cfg = {k: v for k, v in asdict(config).items() if k in keep}
    return json.loads(json.dumps({"config": cfg, "plan_hash": plan_hash(plan),
                                  "model_fingerprint": memory_fingerprint(fingerprint), "data": data_hash},
                                 default=list))


def _atomic_write(path: Path, text: str) -> None:
    atomic_write_text(path, text if text.endswith("\n") else text + "\n")


def trainable_cache(cache):
    """Make a prefill cache safe to backpropagate through: transformers writes each linear-attention layer's
    new recurrent state into the previous state tensor in place (`copy_`, to keep a static address for CUDA
    graphs), but that tensor was the layer's initial state, saved for the backward pass of the same forward
    (Qwen3-Next, Qwen3.5/3.6-MoE: "modified by an inplace operation"). On this cache only, the new state is
    assigned instead; the values are the same. Attention-only caches are returned unchanged."""
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
               conts: list[list[int]], teacher: torch.Tensor | None,
               config: DistillConfig) -> torch.Tensor | None:
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
        student = continue_on_cache(engine, "distilled", trainable_cache(cache), attention,
                                    positions, conts, width)
        first = 1  # position 0 is the full prefill's token: never trained
    else:
        if teacher is None:
            teacher = teacher_logprobs(engine, prompts, conts)
        cache, last, attention, positions = engine.prefill(prompts, "distilled")
        student = torch.cat([last[:, None, :], continue_on_cache(engine, "distilled", trainable_cache(cache),
                                                                attention, positions, conts, width)], dim=1)
        first = 0
    teacher = teacher.to(student.device)  # cached teacher log-probs live on the host
    span = torch.arange(first, width)
    valid = (span[None, :] < lengths[:, None]).to(student.device)
    loss = (divergence(teacher, student, config.loss) * valid).sum() / valid.sum()
    if config.ce_weight:
        target = torch.zeros(len(conts), width, dtype=torch.long)
        for i, c in enumerate(conts):
            target[i, :len(c)] = torch.tensor(c)
        nll = -(torch.log_softmax(student, dim=-1).gather(-1, target[:, first:, None].to(student.device))
                .squeeze(-1))
        loss = loss + config.ce_weight * (nll * valid).sum() / valid.sum()
    return loss


def _check_plan(model: nn.Module, plan: PrunePlan) -> None:
    adapter = get_adapter(model.config)
    plan.validate(adapter.min_kept_per_group(model.config))
    plan.check_model(model, adapter)
    if plan.is_empty:
        raise SlimWiseError("the plan prunes nothing, so there is nothing to distil: "
                            "pass a plan with ratio > 0")


def _resume_state(ckpt: Path | None, key: dict, config: DistillConfig,
                  say: Callable[[str], None]) -> dict | None:
    """The checkpoint to continue from, checked to belong to this run (`key`); None: start at step 0 (no
    --resume, or no checkpoint written yet)."""
    if not (config.resume and ckpt is not None and ckpt.is_file()):
        return None
    try:
        state = torch.load(ckpt, map_location="cpu", weights_only=True)  # no code from user files
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        raise SlimWiseError(f"checkpoint {ckpt} is unreadable ({type(exc).__name__}): delete it or run "
                            "without --resume") from exc
    if state.get("format") != CHECKPOINT_FORMAT or state.get("key") != key:
        raise SlimWiseError(f"checkpoint {ckpt} belongs to another run (model, plan, data or settings "
                            "differ): delete it or run without --resume")
    say(f"distill: resuming from {ckpt} at step {state['step']}")
    return state


def _teacher_data(engine: PhaseSplitEngine, ids: list[list[int]], config: DistillConfig,
                  teacher: TeacherData | None, state: dict | None) -> TeacherData:
    """The full model's greedy continuations (EOS included) and log-probs, built once: the shared `teacher`
    (checked), or rebuilt from a checkpoint's continuations (the log-probs are recomputed), or built here."""
    if teacher is not None:
        teacher.check(_teacher_key(engine.model, ids, config))
    elif state is not None:
        teacher = _build_teacher(engine, ids, config, state["continuations"])
    else:
        teacher = _build_teacher(engine, ids, config)
    if all(len(c) < 2 for c in teacher.continuations) and config.mode == "slimwise":
        raise SlimWiseError("every continuation is a single token, so the decoder has nothing to learn: use "
                            "longer max_new_tokens or other prompts")
    return teacher


@dataclass
class _Run:
    """What a checkpoint saves and a resumed run restores: the installed delta (its tensors), the optimizer,
    the steps done and their losses, and the training seconds spent before this process."""

    installed: InstalledDelta
    optimizer: torch.optim.Optimizer
    step: int = 0
    history: list[float] = field(default_factory=list)
    elapsed0: float = 0.0
    stopped_early: bool = False
    t_train: float = field(default_factory=time.perf_counter)  # this process's training clock

    @classmethod
    def begin(cls, installed: InstalledDelta, config: DistillConfig, state: dict | None) -> _Run:
        optimizer = torch.optim.AdamW(installed.param_groups(config.lr, config.lora_lr, config.weight_decay),
                                      betas=(0.9, 0.999))
        if state is None:
            return cls(installed, optimizer)
        optimizer.load_state_dict(state["optimizer"])
        return cls(installed, optimizer, state["step"], list(state["history"]), float(state["elapsed"]))

    def elapsed(self) -> float:
        """Training seconds, this process's and those before a resume."""
        return self.elapsed0 + time.perf_counter() - self.t_train

    def time_is_up(self, config: DistillConfig, say: Callable[[str], None]) -> bool:
        """Whether `max_minutes` of training are spent (then the run stops early, keeping the steps done)."""
        if config.max_minutes is None or self.elapsed() <= 60 * config.max_minutes:
            return False
        self.stopped_early = True
        say(f"distill: time budget of {config.max_minutes} min reached at step {self.step}")
        return True


def _batch(engine: PhaseSplitEngine, ids: list[list[int]], teacher: TeacherData, config: DistillConfig,
           step: int) -> tuple[list[list[int]], list[list[int]], torch.Tensor | None]:
    """Step `step`'s (prompts, continuations, teacher log-probs padded to the longest continuation or None:
    computed in the step). On-policy steps continue with the student's own greedy tokens (mode distilled)."""
    idx = _batch_indices(len(ids), config.batch_size, config.seed, step)
    prompts = [ids[i] for i in idx]
    if _is_on_policy(config.on_policy, step):
        gen_cfg = GenerationConfig(max_new_tokens=config.max_new_tokens, batch_size=config.batch_size)
        return (prompts, [g.token_ids for g in engine.generate(prompts, mode="distilled", config=gen_cfg)],
                None)
    conts = [teacher.continuations[i] for i in idx]
    if teacher.logprobs is None:
        return prompts, conts, None
    vocab = engine.model.get_output_embeddings().weight.shape[0]
    logprobs = torch.zeros(len(idx), max(len(c) for c in conts), vocab)
    for row, i in enumerate(idx):
        logprobs[row, :len(conts[row])] = teacher.logprobs[i]
    return prompts, conts, logprobs


def _train_step(engine: PhaseSplitEngine, run: _Run, ids: list[list[int]], teacher: TeacherData,
                config: DistillConfig) -> float:
    """One optimizer step at `run.step` (not advanced here); returns the loss recorded in the history (NaN: no
    position to train in this batch, every continuation a single token)."""
    prompts, conts, logprobs = _batch(engine, ids, teacher, config, run.step)
    factor = _lr_factor(config, run.step)
    for group in run.optimizer.param_groups:
        group["lr"] = group["base_lr"] * factor
    loss = _step_loss(engine, run.installed, prompts, conts, logprobs, config)
    if loss is None:
        return float("nan")
    loss.backward()
    if config.grad_clip:
        torch.nn.utils.clip_grad_norm_(run.installed.parameters(), config.grad_clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.installed.restore_pruned_rows()
    return round(float(loss.detach()), 6)


def _save_checkpoint(ckpt: Path, key: dict, run: _Run, continuations: list[list[int]]) -> None:
    """The resumable state, written atomically; the teacher's continuations ride along (the log-probs are
    recomputed on resume: cheaper than storing them)."""
    atomic_torch_save({"format": CHECKPOINT_FORMAT, "key": key, "step": run.step,
                       "tensors": run.installed.tensors(), "manifest": run.installed.manifest,
                       "optimizer": run.optimizer.state_dict(), "history": run.history,
                       "elapsed": run.elapsed(), "continuations": continuations}, ckpt)


def _start_line(trainable: int, total: int, installed: InstalledDelta, ids: list[list[int]],
                teacher: TeacherData, config: DistillConfig) -> str:
    lora = installed.manifest.get("lora")
    lora_on = f" on {','.join(lora['targets'])}" if lora else ""
    return (f"distill: {trainable:,} trainable parameters ({'+'.join(config.params)}{lora_on}) = "
            f"{100 * trainable / total:.3f}% of {total:,}; {len(ids)} prompts, "
            f"{sum(len(c) for c in teacher.continuations)} continuation tokens; mode {config.mode}")


def distill(model: nn.Module, plan: PrunePlan, prompts: Sequence[str] | Sequence[Sequence[int]],
            tokenizer=None, config: DistillConfig | None = None, *, teacher: TeacherData | None = None,
            callback: Callable[[int, float], None] | None = None) -> Delta:
    """Distil a decode-only delta for `plan` on `prompts`; `model` is the (frozen)
    teacher and the student's base.

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
    prompts = _distill_prompts(prompts, config)
    _check_plan(model, plan)
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
        key = _run_key(config, plan, fingerprint, hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16])
        state = _resume_state(ckpt, key, config, say)
        shared_teacher = teacher is not None
        teacher = _teacher_data(engine, ids, config, teacher, state)
        delta0 = Delta(state["tensors"], state["manifest"]) if state is not None \
            else init_delta(model, plan, config)
        installed = InstalledDelta(model, delta0, engine.mask, plan, trainable=True)
        engine.delta = installed
        trainable, total = installed.trainable_count(), sum(p.numel() for p in model.parameters())
        say(_start_line(trainable, total, installed, ids, teacher, config))
        run = _Run.begin(installed, config, state)
        blocks = [layer.block for layer in get_adapter(model.config).moe_layers(model)]
        switches = [(engine.mask, ("active", "token_mask")), (installed, ("on",))]
        recompute = (lambda: checkpointed_moe_blocks(blocks, switches)) if config.activation_checkpointing \
            else nullcontext
        bar = tqdm(total=config.steps, initial=run.step, desc=f"distill[{'+'.join(config.params)}]",
                   unit="step", disable=None if config.progress else True)  # a terminal only
        while run.step < config.steps:
            if run.time_is_up(config, say):
                break
            lr = config.lr * _lr_factor(config, run.step)
            with recompute():
                run.history.append(_train_step(engine, run, ids, teacher, config))
            run.step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{run.history[-1]:.4f}", lr=f"{lr:.1e}")
            if ckpt is not None and (run.step % config.checkpoint_every == 0 or run.step == config.steps):
                _save_checkpoint(ckpt, key, run, teacher.continuations)
            if callback is not None:
                callback(run.step, run.history[-1])
        bar.close()
        train_seconds = run.elapsed()
        manifest = {"steps": run.step, "stopped_early": run.stopped_early, "loss_history": run.history,
                    "teacher_seconds": teacher.seconds, "teacher_shared": shared_teacher,
                    "trainable_params": trainable, "model_params": total,
                    "trainable_share": trainable / total, "seconds": round(time.perf_counter() - t_start, 2),
                    "train_seconds": round(train_seconds, 2), "peak_memory_mb": round(peak_memory_mb(), 1),
                    "num_prompts": len(ids),
                    "continuation_tokens": sum(len(c) for c in teacher.continuations),
                    "config": {k: v for k, v in asdict(config).items()
                               if k not in ("checkpoint", "resume", "progress")}}
        say(f"distill: {run.step} steps in {train_seconds:.1f}s (total {manifest['seconds']:.1f}s), loss "
            f"{run.history[0] if run.history else float('nan'):.4f} -> "
            f"{run.history[-1] if run.history else float('nan'):.4f}, peak memory "
            f"{manifest['peak_memory_mb']:.0f} MB")
        return installed.to_delta(manifest)
    finally:
        if installed is not None:
            installed.remove()
        engine.delta = None
        engine.close()
        for p, flag in flags:
            p.requires_grad_(flag)
