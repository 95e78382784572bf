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
import os
import resource
import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from slimwise.adapters import MoEAdapter, get_adapter
from slimwise.errors import SlimWiseError
from slimwise.generate import GenerationConfig, PhaseSplitEngine
from slimwise.io import atomic_torch_save, atomic_write_text
from slimwise.masking import ExpertMask, check_on_top
from slimwise.plan import PrunePlan, model_fingerprint

DELTA_FORMAT = "slimwise-delta/1"
CHECKPOINT_FORMAT = "slimwise-distill-checkpoint/1"
TEACHER_FORMAT = "slimwise-teacher/1"
TENSORS_FILE = "delta.safetensors"
MANIFEST_FILE = "delta.json"
PARAM_SETS = ("router", "norm", "lora")
LOSSES = ("fkl", "rkl", "jsd")
DELTA_MODES = ("slimwise", "uniform")
#: where decoder layers keep the norm whose output feeds the MoE block, by family naming
NORM_ATTRS = ("post_attention_layernorm", "ffn_norm", "pre_feedforward_layernorm")


# ----------------------------------------------------------------------------------------------------------
# Helpers


def plan_hash(plan: PrunePlan) -> str:
    """Hash of what a delta depends on in a plan: the kept experts of each layer and the weights they index."""
    key = {"family": plan.family, "num_experts": plan.num_experts, "fingerprint": plan.fingerprint,
           "kept": {str(k): v for k, v in sorted(plan.kept_experts.items())}}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _fingerprint(model: nn.Module) -> dict[str, str]:
    fp = getattr(model, "_slimwise_fingerprint", None) or model_fingerprint(model)
    model._slimwise_fingerprint = fp
    return fp


def moe_norm(model: nn.Module, layer_index: int, adapter: MoEAdapter | None = None) -> nn.Module:
    """The norm whose output feeds decoder layer `layer_index`'s MoE block."""
    adapter = adapter or get_adapter(model.config)
    layer = adapter.decoder_layers(model)[layer_index]
    for name in NORM_ATTRS:
        module = getattr(layer, name, None)
        if isinstance(module, nn.Module) and isinstance(getattr(module, "weight", None), torch.Tensor):
            return module
    raise SlimWiseError(f"decoder layer {layer_index} has none of {NORM_ATTRS}: the `norm` set does not support "
                        f"{type(layer).__name__}; use --params router or lora")


ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
DENSE_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")  # routed experts are fused 3-D weights: never matched


def resolve_lora_targets(model: nn.Module, targets: Sequence[str]) -> tuple[str, ...]:
    """`("auto",)`: the shared expert's gate/up/down where the model has one, else the attention projections.

    Every decode token runs the shared expert beside the pruned routed experts, so a LoRA there can stand in
    for what they computed: on testbed-b at 50% it recovers 87.7% against 86.5% for attention LoRA, in the same
    time and a similar share (docs/results/distillation.md, recipe probe). Models without one keep attention.
    """
    if tuple(targets) != ("auto",):
        return tuple(targets)
    shared = any(isinstance(m, nn.Linear) and ".shared_expert" in name and name.rsplit(".", 1)[-1] in DENSE_MLP_TARGETS
                 for name, m in model.named_modules())
    return DENSE_MLP_TARGETS if shared else ATTENTION_TARGETS


def lora_modules(model: nn.Module, targets: Sequence[str]) -> dict[str, nn.Linear]:
    """Linear modules whose last name component is in `targets` (e.g. q_proj), by full module name."""
    targets = resolve_lora_targets(model, targets)
    found = {name: m for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in set(targets)}
    if not found:
        raise SlimWiseError(f"no Linear module named {', '.join(targets)} in the model: pass --lora-targets with "
                            "module names it has (e.g. q_proj,v_proj,o_proj)")
    return found


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B @ A in W's dtype; the masked view and the export both use this exact expression."""
    return weight + ((b.float() @ a.float()) * scale).to(weight.dtype)


@contextmanager
def _swapped(module: nn.Module, name: str, tensor: torch.Tensor):
    """Let `module` see `tensor` as parameter `name` for one call (autograd flows to `tensor`)."""
    saved = module._parameters[name]
    module._parameters[name] = tensor
    try:
        yield
    finally:
        module._parameters[name] = saved


def peak_memory_mb() -> float:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------------------------------------
# The delta


class Delta:
    """Decode-only parameters for one (model, plan): float32 safetensors + a JSON manifest, in a directory.

    Tensor names (layer index = decoder-layer index, as in plans):
      `layers.{i}.router.weight`    [E, H] the full-size router for decode; pruned rows equal the stock rows
      `layers.{i}.moe_norm.weight`  [H] the norm feeding layer i's MoE block (post_attention_layernorm)
      `lora.{module}.lora_A.weight` [r, in] and `lora.{module}.lora_B.weight` [out, r] for the Linear at the
                                    full module name {module} (e.g. model.layers.0.self_attn.q_proj); the decode
                                    weight is W + scale * B @ A with scale = manifest["lora"]["scale"]
    Manifest (`delta.json`): format, mode ("slimwise": decode only; "uniform": both phases of uniform pruning),
    params, plan_hash, plan_fingerprint, model_fingerprint, family, lora, trainable_params, trainable_share,
    steps, loss_history, seconds, peak_memory_mb, config. A delta applies only to the model and plan it was
    distilled for (`check`).
    """

    def __init__(self, tensors: dict[str, torch.Tensor], manifest: dict):
        self.tensors = tensors
        self.manifest = manifest
        self.path: Path | None = None

    # ----- queries -----------------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.manifest.get("mode", "slimwise")

    @property
    def params(self) -> list[str]:
        return list(self.manifest.get("params", []))

    @property
    def lora_scale(self) -> float:
        return float((self.manifest.get("lora") or {}).get("scale", 1.0))

    def routers(self) -> dict[int, torch.Tensor]:
        return {int(k.split(".")[1]): v for k, v in self.tensors.items() if k.endswith(".router.weight")}

    def norms(self) -> dict[int, torch.Tensor]:
        return {int(k.split(".")[1]): v for k, v in self.tensors.items() if k.endswith(".moe_norm.weight")}

    def lora_pairs(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        names = [k[len("lora."):-len(".lora_A.weight")] for k in self.tensors if k.endswith(".lora_A.weight")]
        return {n: (self.tensors[f"lora.{n}.lora_A.weight"], self.tensors[f"lora.{n}.lora_B.weight"]) for n in names}

    def summary(self) -> dict:
        """What an export manifest records about the delta folded into it."""
        keys = ("format", "mode", "params", "plan_hash", "model_fingerprint", "lora", "steps", "trainable_params",
                "trainable_share", "seconds")
        return {k: self.manifest.get(k) for k in keys} | {"source": str(self.path) if self.path else None}

    # ----- checks --------------------------------------------------------------------------------------------
    def check(self, model: nn.Module, plan: PrunePlan) -> None:
        """Refuse a delta made for another plan or other weights, or a plan that does not fit the model."""
        m = self.manifest
        if m.get("format") != DELTA_FORMAT:
            raise SlimWiseError(f"not a SlimWise delta (format {m.get('format')!r}, expected {DELTA_FORMAT})")
        adapter = get_adapter(model.config)
        plan.check_model(model, adapter)
        if m.get("model_fingerprint") != _fingerprint(model):
            raise SlimWiseError(f"delta was distilled on other weights (fingerprint {m.get('model_fingerprint')}, "
                                f"this model {_fingerprint(model)}): pass its source model, or distill again")
        if m.get("plan_hash") != plan_hash(plan):
            raise SlimWiseError(f"delta was distilled for another plan (hash {m.get('plan_hash')}, this plan "
                                f"{plan_hash(plan)}): pass the plan given to `slimwise distill`, or distill again")
        layers = {layer.index: layer for layer in adapter.moe_layers(model)}
        for i, w in self.routers().items():
            if i not in layers or tuple(w.shape) != tuple(layers[i].router.weight.shape):
                raise SlimWiseError(f"delta router of layer {i} {tuple(w.shape)} does not fit this model")
        for i, w in self.norms().items():
            if i not in layers or w.shape != moe_norm(model, i, adapter).weight.shape:
                raise SlimWiseError(f"delta norm of layer {i} {tuple(w.shape)} does not fit this model")
        for name, (a, b) in self.lora_pairs().items():
            try:
                lin = model.get_submodule(name)
            except AttributeError as exc:
                raise SlimWiseError(f"delta has LoRA for {name}, which this model does not have") from exc
            if not isinstance(lin, nn.Linear) or (b.shape[0], a.shape[1]) != tuple(lin.weight.shape):
                raise SlimWiseError(f"delta LoRA for {name} does not fit the module's weight")

    # ----- io --------------------------------------------------------------------------------------------------
    def save(self, path: str | Path, force: bool = False) -> Path:
        """Write the directory atomically (temporary directory, then rename): never half a delta."""
        path = Path(path)
        if path.exists() and (not path.is_dir() or any(path.iterdir())) and not force:
            raise SlimWiseError(f"output {path} exists and is not empty; choose a new path or pass --force")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir()
            tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in sorted(self.tensors.items())}
            save_file(tensors, str(tmp / TENSORS_FILE), metadata={"format": DELTA_FORMAT})
            manifest = self.manifest | {"tensors": sorted(tensors)}
            (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, default=str) + "\n")
            backup = path.with_name(f".{path.name}.old-{os.getpid()}")
            if path.exists():
                os.replace(path, backup)
            os.replace(tmp, path)
            if backup.exists():
                shutil.rmtree(backup) if backup.is_dir() else backup.unlink()
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.path = path
        return path

    @classmethod
    def load(cls, path: str | Path) -> Delta:
        """Load a delta directory (or either file inside it)."""
        path = Path(path)
        if path.is_file() and path.name in (TENSORS_FILE, MANIFEST_FILE):
            path = path.parent
        if not (path / MANIFEST_FILE).is_file() or not (path / TENSORS_FILE).is_file():
            raise SlimWiseError(f"{path} is not a SlimWise delta (needs {MANIFEST_FILE} and {TENSORS_FILE}); "
                                "make one with `slimwise distill`")
        try:
            manifest = json.loads((path / MANIFEST_FILE).read_text())
            tensors = load_file(str(path / TENSORS_FILE))
        except (OSError, ValueError) as exc:
            raise SlimWiseError(f"cannot read delta {path}: {exc}") from exc
        if not isinstance(manifest, dict) or manifest.get("format") != DELTA_FORMAT:
            raise SlimWiseError(f"{path} is not a SlimWise delta (format {DELTA_FORMAT})")
        delta = cls(tensors, manifest)
        delta.path = path
        return delta


# ----------------------------------------------------------------------------------------------------------
# Installing a delta next to an ExpertMask


class InstalledDelta:
    """A delta's overrides on a model. They act only while switched on AND the mask is active (pruned rows).

    The engine switches it on for mode `distilled`; with a `slimwise` delta the mask is active on decode steps
    only, so prefill runs the stock weights (bit-identical to the full model). Each override wraps the module's
    forward (router, MoE-feeding norm, LoRA Linear) and lends it the trained tensor for one call.
    """

    def __init__(self, model: nn.Module, delta: Delta, mask: ExpertMask, plan: PrunePlan, trainable: bool = False):
        self.model, self.mask, self.plan = model, mask, plan
        self.adapter = mask.adapter
        self.mode = delta.mode
        self.manifest = dict(delta.manifest)
        self.scale = delta.lora_scale
        self.on = False
        self.routers: dict[int, nn.Parameter] = {}
        self.norms: dict[int, nn.Parameter] = {}
        self.lora: dict[str, tuple[nn.Parameter, nn.Parameter]] = {}
        self.pruned: dict[int, torch.Tensor] = {}
        self._stock_routers: dict[int, torch.Tensor] = {}
        self._wrapped: list[tuple[nn.Module, object, object]] = []  # (module, previous instance forward, ours)
        layers = {layer.index: layer for layer in self.adapter.moe_layers(model)}
        try:
            for i, w in sorted(delta.routers().items()):
                router = layers[i].router
                param = nn.Parameter(w.to(router.weight.device, router.weight.dtype).clone(), trainable)
                self.routers[i] = param
                self.pruned[i] = plan.pruned_mask(i, device=router.weight.device)
                self._stock_routers[i] = router.weight.detach()
                self._wrap(router, self._router_forward(router, param, self.pruned[i]))
            for i, w in sorted(delta.norms().items()):
                norm = moe_norm(model, i, self.adapter)
                param = nn.Parameter(w.to(norm.weight.device, norm.weight.dtype).clone(), trainable)
                self.norms[i] = param
                self._wrap(norm, self._swap_forward(norm, lambda p=param: p))
            for name, (a, b) in sorted(delta.lora_pairs().items()):
                lin = model.get_submodule(name)
                pa = nn.Parameter(a.to(lin.weight.device, torch.float32).clone(), trainable)
                pb = nn.Parameter(b.to(lin.weight.device, torch.float32).clone(), trainable)
                self.lora[name] = (pa, pb)
                self._wrap(lin, self._swap_forward(
                    lin, lambda lin=lin, pa=pa, pb=pb: merged_weight(lin.weight, pa, pb, self.scale)))
        except BaseException:
            self.remove()
            raise

    # ----- switching -----------------------------------------------------------------------------------------
    @contextmanager
    def switched_on(self):
        previous, self.on = self.on, True
        try:
            yield self
        finally:
            self.on = previous

    def _active(self) -> bool:
        return self.on and self.mask.active

    # ----- wrappers ------------------------------------------------------------------------------------------
    def _wrap(self, module: nn.Module, forward) -> None:
        self._wrapped.append((module, module.__dict__.get("forward"), forward))
        module.forward = forward

    def _router_forward(self, router: nn.Module, weight: nn.Parameter, pruned: torch.Tensor):
        previous = router.forward  # ExpertMask's wrapper, or the stock forward for a layer that prunes nothing
        adapter = self.adapter

        def forward(hidden_states, *args, **kwargs):
            if not self._active():
                return previous(hidden_states, *args, **kwargs)
            with _swapped(router, "weight", weight):
                masked = adapter.route(router, hidden_states, pruned)
            if self.mask.token_mask is None:
                return masked
            other = previous(hidden_states, *args, **kwargs)  # stock route for the rows that stay unpruned
            rows = self.mask.token_mask.reshape(-1, 1)
            return tuple(torch.where(rows, m, o) for o, m in zip(other, masked, strict=True))

        return forward

    def _swap_forward(self, module: nn.Module, weight: Callable[[], torch.Tensor]):
        """Forward that runs the module's own forward with `weight()` as its weight while active."""
        previous = module.forward

        def forward(x, *args, **kwargs):
            if not self._active():
                return previous(x, *args, **kwargs)
            with _swapped(module, "weight", weight()):
                out = previous(x, *args, **kwargs)
            if self.mask.token_mask is None:
                return out
            stock = previous(x, *args, **kwargs)
            rows = self.mask.token_mask.reshape(*out.shape[:-1], 1)
            return torch.where(rows, out, stock)

        return forward

    def remove(self) -> None:
        check_on_top(self._wrapped, "delta")
        for module, previous, _ in reversed(self._wrapped):
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        self._wrapped.clear()

    # ----- training support ----------------------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        return [*self.routers.values(), *self.norms.values(), *(p for ab in self.lora.values() for p in ab)]

    def param_groups(self, lr: float, lora_lr: float | None, weight_decay: float) -> list[dict]:
        groups = []
        dense = [*self.routers.values(), *self.norms.values()]
        if dense:
            groups.append({"params": dense, "lr": lr, "base_lr": lr, "weight_decay": 0.0})
        lora = [p for ab in self.lora.values() for p in ab]
        if lora:
            groups.append({"params": lora, "lr": lora_lr or lr, "base_lr": lora_lr or lr, "weight_decay": weight_decay})
        return groups

    def trainable_count(self) -> int:
        """Parameters that actually train: kept router rows, norm weights, LoRA factors."""
        rows = sum(int((~self.pruned[i]).sum()) * w.shape[1] for i, w in self.routers.items())
        return rows + sum(p.numel() for p in self.norms.values()) + sum(a.numel() + b.numel()
                                                                       for a, b in self.lora.values())

    @torch.no_grad()
    def restore_pruned_rows(self) -> None:
        """Pruned router rows never train (they cannot be selected); keep them bit-equal to the stock rows."""
        for i, w in self.routers.items():
            w[self.pruned[i]] = self._stock_routers[i][self.pruned[i]].to(w.dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"layers.{i}.router.weight": w.detach().float().clone() for i, w in self.routers.items()}
        out |= {f"layers.{i}.moe_norm.weight": w.detach().float().clone() for i, w in self.norms.items()}
        for name, (a, b) in self.lora.items():
            out[f"lora.{name}.lora_A.weight"] = a.detach().float().clone()
            out[f"lora.{name}.lora_B.weight"] = b.detach().float().clone()
        return out

    def to_delta(self, manifest: dict | None = None) -> Delta:
        return Delta(self.tensors(), self.manifest | (manifest or {}))


def apply_delta(model: nn.Module, delta: Delta | str | Path, mask: ExpertMask, plan: PrunePlan) -> InstalledDelta:
    """Install a delta (or a delta directory) on `model` next to `mask`, after checking it fits model and plan."""
    if isinstance(delta, (str, os.PathLike)):
        delta = Delta.load(delta)
    delta.check(model, plan)
    return InstalledDelta(model, delta, mask, plan)


@torch.no_grad()
def fold_delta(model: nn.Module, delta: Delta | str | Path, plan: PrunePlan) -> dict:
    """Write the delta into the model's weights in place (trained routers and norms replace the stock ones,
    LoRA merged), for exporting a pruned-and-distilled decoder. Returns the delta's summary for the manifest."""
    if isinstance(delta, (str, os.PathLike)):
        delta = Delta.load(delta)
    delta.check(model, plan)
    adapter = get_adapter(model.config)
    layers = {layer.index: layer for layer in adapter.moe_layers(model)}
    for i, w in delta.routers().items():
        layers[i].router.weight.copy_(w.to(layers[i].router.weight.dtype))
    for i, w in delta.norms().items():
        norm = moe_norm(model, i, adapter)
        norm.weight.copy_(w.to(norm.weight.dtype))
    for name, (a, b) in delta.lora_pairs().items():
        lin = model.get_submodule(name)
        lin.weight.copy_(merged_weight(lin.weight, a.to(lin.weight.device), b.to(lin.weight.device), delta.lora_scale))
    if hasattr(model, "_slimwise_fingerprint"):
        del model._slimwise_fingerprint  # the weights changed
    return delta.summary()


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
                "model_fingerprint": _fingerprint(model), "num_experts": plan.num_experts, "lora": lora}
    return Delta(tensors, manifest)


# ----------------------------------------------------------------------------------------------------------
# Forward passes


def _pad_id(engine: PhaseSplitEngine) -> int:
    tok = engine.tokenizer
    return tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0


def continue_on_cache(engine: PhaseSplitEngine, mode: str, cache, attention: torch.Tensor, positions: torch.Tensor,
                      continuations: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    """Logits [B, width-1, V] of one teacher-forced forward of continuation[:-1] on a prefill cache, with
    `mode`'s decode model (right padding; causal attention keeps it out of the real positions)."""
    ids = torch.full((len(continuations), width - 1), _pad_id(engine), dtype=torch.long, device=attention.device)
    for i, c in enumerate(continuations):
        if len(c) > 1:
            ids[i, :len(c) - 1] = torch.tensor(list(c[:-1]), dtype=torch.long)
    attention = torch.cat([attention, torch.ones_like(ids)], dim=1)
    pos = positions[:, -1:] + 1 + torch.arange(width - 1, device=ids.device)[None, :]
    model, ctx = engine._phase(mode, "decode")
    with ctx():
        out = model(input_ids=ids, attention_mask=attention, position_ids=pos, past_key_values=cache, use_cache=True)
    return out.logits.float()


@torch.no_grad()
def teacher_logprobs(engine: PhaseSplitEngine, prompts: Sequence[Sequence[int]],
                     continuations: Sequence[Sequence[int]]) -> torch.Tensor:
    """The full model's log-probs [B, W, V] at every continuation position (position 0 from its prefill)."""
    width = max(len(c) for c in continuations)
    cache, first, attention, positions = engine.prefill(prompts, "full")
    parts = [first[:, None, :]]
    if width > 1:
        parts.append(continue_on_cache(engine, "full", cache, attention, positions, continuations, width))
    return torch.log_softmax(torch.cat(parts, dim=1), dim=-1)


@torch.no_grad()
def logprobs_along(engine: PhaseSplitEngine, prompts: Sequence[Sequence[int]],
                   continuations: Sequence[Sequence[int]], batch_size: int) -> list[torch.Tensor]:
    """The full model's log-probs [len, V] along each continuation, computed `batch_size` prompts at a time."""
    out: list[torch.Tensor] = []
    for start in range(0, len(prompts), batch_size):
        chunk = continuations[start:start + batch_size]
        lp = teacher_logprobs(engine, prompts[start:start + batch_size], chunk)
        out += [lp[i, :len(c)].clone() for i, c in enumerate(chunk)]
    return out


def divergence(teacher_lp: torch.Tensor, student_logits: torch.Tensor, kind: str = "fkl") -> torch.Tensor:
    """Per-position divergence [..., T] between the teacher's log-probs and the student's logits."""
    s = torch.log_softmax(student_logits, dim=-1)
    t = teacher_lp
    if kind == "fkl":
        return (t.exp() * (t - s)).sum(-1)
    if kind == "rkl":
        return (s.exp() * (s - t)).sum(-1)
    m = torch.logsumexp(torch.stack([t, s]), dim=0) - math.log(2.0)
    return 0.5 * (t.exp() * (t - m)).sum(-1) + 0.5 * (s.exp() * (s - m)).sum(-1)


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
        if "batch_size" in key:  # written before session 7, when the training batch built the teacher data too
            key["teacher_batch_size"] = key.pop("batch_size")
        return cls(key, state["continuations"], state["logprobs"], state["seconds"])


def _teacher_key(model: nn.Module, ids: list[list[int]], config: DistillConfig) -> dict:
    return {"model_fingerprint": _fingerprint(model), "data": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16],
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
            return _build_teacher(engine, engine._encode(prompts), config)
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
    return json.loads(json.dumps({"config": cfg, "plan_hash": plan_hash(plan), "model_fingerprint": fingerprint,
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
    fingerprint = _fingerprint(model)
    ckpt = Path(config.checkpoint) if config.checkpoint else None
    flags = [(p, p.requires_grad) for p in model.parameters()]
    engine = PhaseSplitEngine(model, tokenizer, plan=plan)
    installed: InstalledDelta | None = None
    say = tqdm.write if config.progress else (lambda *_: None)
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        ids = engine._encode(prompts)
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
                   disable=not config.progress)
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


# ----------------------------------------------------------------------------------------------------------
# The testbed bars experiment: `python -m slimwise.distill bars testbed-a testbed-b --out runs/distill-bars`


@dataclass
class BarsConfig:
    """The issue's bars run: REAP, decode-aware calibration on the target domain, ratios, five modes."""

    ratios: tuple[float, ...] = (0.25, 0.5)
    calib_per_family: int = 32
    calib_max_new_tokens: int = 128
    # 160 prompts/family (1200 steps x 16 = 24 epochs) overfit: final train loss 0.0004 against a test KL of
    # 0.017; 1000/family (under 4 epochs) end at 0.005 against 0.006 and recover twice as much on testbed-b;
    # 2000/family (base conversions have 1,447) lower the test KL by 4-11% and move pooled accuracy by -0.4 to
    # +0.8 points: within the run-to-run spread, so not the default (docs/results/distillation.md, session 7)
    distill_per_family: int = 1000
    test_per_family: int = 200
    heldout_per_family: int = 50
    max_new_tokens: int = 160
    batch_size: int = 32
    threads: int = 2
    distill: DistillConfig = field(default_factory=DistillConfig)


@torch.no_grad()
def teacher_forced_fidelity(engine: PhaseSplitEngine, prompts: list[list[int]], continuations: list[list[int]],
                            mode: str, batch_size: int = 32) -> dict[str, float]:
    """Mean KL(full || mode) and argmax disagreement (%) per token over the full model's continuations: a
    low-noise view of what accuracy on a few hundred problems shows noisily."""
    kl = flips = count = 0.0
    for start in range(0, len(prompts), batch_size):
        p, c = prompts[start:start + batch_size], continuations[start:start + batch_size]
        width = max(len(x) for x in c)
        teacher = teacher_logprobs(engine, p, c)
        cache, last, attention, positions = engine.prefill(p, mode)
        parts = [last[:, None, :]]
        if width > 1:
            parts.append(continue_on_cache(engine, mode, cache, attention, positions, c, width))
        student = torch.cat(parts, dim=1)
        valid = torch.arange(width)[None, :] < torch.tensor([len(x) for x in c])[:, None]
        kl += float((divergence(teacher, student) * valid).sum())
        flips += float(((teacher.argmax(-1) != student.argmax(-1)) & valid).sum())
        count += float(valid.sum())
    return {"kl": kl / count, "flip_pct": 100 * flips / count}


def evaluate_run(engine: PhaseSplitEngine, samples: list, mode: str, config: BarsConfig,
                 reference: list[list[int]] | None = None) -> dict:
    """Accuracy (testbed grader), generated lengths and (given the full model's tokens) fidelity of one mode."""
    from slimwise.testbed import grade

    gen = GenerationConfig(max_new_tokens=config.max_new_tokens, batch_size=config.batch_size)
    t0 = time.perf_counter()
    ids = engine._encode([s.prompt for s in samples])
    outs = engine.generate(ids, mode=mode, config=gen)
    correct = [grade(s, o.text or "", o.finish_reason == "eos").correct for s, o in zip(samples, outs, strict=True)]
    lengths = [len(o.token_ids) for o in outs]
    result = {"accuracy": 100 * sum(correct) / len(correct), "mean_length": sum(lengths) / len(lengths),
              "seconds": round(time.perf_counter() - t0, 1)}
    if reference is not None:
        result |= teacher_forced_fidelity(engine, ids, reference, mode, config.batch_size)
    result |= {"correct": [int(c) for c in correct], "lengths": lengths, "families": [s.family for s in samples]}
    if reference is None:
        result["token_ids"] = [o.token_ids for o in outs]  # the full model's, kept for the fidelity metrics
    return result


def run_bars(model_name: str, out_dir: str | Path, config: BarsConfig) -> dict:
    """Full / uniform / SlimWise / distilled / uniform-distilled on the target domain's test and held-out splits."""
    from slimwise.calibrate import CalibrationConfig, calibrate
    from slimwise.criteria import plan_from_stats
    from slimwise.models import load_model, load_tokenizer
    from slimwise.testbed import TARGET_DOMAIN, make_split

    torch.set_num_threads(config.threads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(model_name, dtype="float32")
    tok = load_tokenizer(model_name)
    calib = make_split("calib", config.calib_per_family, domain=TARGET_DOMAIN)
    stats = calibrate(model, [s.prompt for s in calib], tok,
                      CalibrationConfig(phase="decode", max_new_tokens=config.calib_max_new_tokens), progress=False)
    distill_prompts = [s.prompt for s in make_split("calib", config.distill_per_family, domain=TARGET_DOMAIN,
                                                    allow_fewer=True)]
    splits = {"test": make_split("test", config.test_per_family, domain=TARGET_DOMAIN),
              "heldout": make_split("heldout", config.heldout_per_family, domain=TARGET_DOMAIN)}
    report: dict = {"model": model_name, "config": asdict(config), "ratios": {}}
    engine = PhaseSplitEngine(model, tok)
    report["full"] = {name: evaluate_run(engine, s, "full", config) for name, s in splits.items()}
    engine.close()
    reference = {name: report["full"][name].pop("token_ids") for name in splits}
    # one teacher for every ratio and both modes: it depends on the model and prompts only
    teacher = build_teacher(model, distill_prompts, tok, DistillConfig(**(asdict(config.distill) | {"progress": False})))
    report["teacher"] = {"seconds": teacher.seconds, "prompts": len(teacher.continuations),
                         "continuation_tokens": sum(len(c) for c in teacher.continuations)}
    for ratio in config.ratios:
        plan = plan_from_stats(stats, "reap", ratio)
        plan.save(out / f"plan-{ratio}.json")
        row: dict = {}
        engine = PhaseSplitEngine(model, tok, plan=plan)
        for mode in ("uniform", "slimwise"):
            row[mode] = {name: evaluate_run(engine, s, mode, config, reference[name]) for name, s in splits.items()}
        engine.close()
        for mode, label in (("slimwise", "distilled"), ("uniform", "uniform_distilled")):
            cfg = DistillConfig(**(asdict(config.distill) | {"mode": mode, "progress": False}))
            delta = distill(model, plan, distill_prompts, tok, cfg, teacher=teacher)
            delta.save(out / f"delta-{label}-{ratio}", force=True)
            engine = PhaseSplitEngine(model, tok, plan=plan, delta=delta)
            row[label] = {name: evaluate_run(engine, s, "distilled", config, reference[name])
                          for name, s in splits.items()}
            row[label]["distill"] = {k: delta.manifest[k] for k in ("seconds", "train_seconds", "steps", "teacher_shared",
                                                                    "trainable_params", "trainable_share",
                                                                    "peak_memory_mb")}
            row[label]["distill"]["loss_first_last"] = [delta.manifest["loss_history"][0],
                                                        delta.manifest["loss_history"][-1]]
            engine.close()
        report["ratios"][str(ratio)] = row
        report["bars"] = bars_check(report)
        _atomic_write(out / "report.json", json.dumps(report, indent=1))
        _atomic_write(out / "report.md", bars_table(report))
        tqdm.write(f"{model_name} ratio {ratio}: " + ", ".join(
            f"{m} {row[m]['test']['accuracy']:.1f}%/{row[m]['test']['mean_length']:.1f}tok"
            for m in ("uniform", "slimwise", "distilled", "uniform_distilled"))
            + f" (full {report['full']['test']['accuracy']:.1f}%/{report['full']['test']['mean_length']:.1f}tok)")
    return report


BARS_MODES = ("full", "uniform", "slimwise", "distilled", "uniform_distilled")


def _length_dev(run: dict, full: dict) -> float:
    return 100 * (run["mean_length"] / full["mean_length"] - 1)


def length_drift(run: dict, full: dict) -> dict:
    """Per-problem length drift against the full model (paired): the mean difference with its standard error,
    the mean absolute difference and the share of problems whose length changed. The mean-length bar compares
    means; these say how far apart the runs really are and what difference the split can resolve."""
    diffs = np.asarray(run["lengths"], dtype=float) - np.asarray(full["lengths"], dtype=float)
    se = float(diffs.std(ddof=1) / math.sqrt(len(diffs))) if len(diffs) > 1 else float("nan")
    return {"mean_diff": float(diffs.mean()), "mean_diff_se": se, "mean_abs_diff": float(np.abs(diffs).mean()),
            "changed_pct": float(100 * (diffs != 0).mean())}


#: |z| from which a per-family mean-length difference counts as drift rather than sampling noise
DRIFT_Z = 2.0


def family_drift(run: dict, full: dict) -> dict[str, dict]:
    """Paired length drift per task family: mean difference (tokens and % of the family's full-model length),
    its standard error and z. Why: drifts of opposite sign in different families cancel in the domain mean
    (testbed-b 50%: sub +1.9%, base -3.0%, domain +0.4%), so the mean length alone hides them."""
    families = run.get("families") or full.get("families")
    if not families:
        return {}
    diffs = np.asarray(run["lengths"], dtype=float) - np.asarray(full["lengths"], dtype=float)
    base = np.asarray(full["lengths"], dtype=float)
    out = {}
    for fam in dict.fromkeys(families):
        sel = np.asarray([f == fam for f in families])
        d = diffs[sel]
        se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
        mean = float(d.mean())
        out[fam] = {"mean_diff": mean, "se": se, "z": mean / se if se > 0 else 0.0,
                    "pct": 100 * mean / float(base[sel].mean()), "n": int(sel.sum())}
    return out


def family_length_check(sw: dict, d: dict, full: dict) -> dict:
    """The length bar per family and noise-aware: every family where SlimWise drifts (|z| >= DRIFT_Z) has its
    drift at least halved by distillation, and distillation creates no drift of its own (|z| >= DRIFT_Z where
    SlimWise had none). None when the runs carry no family labels."""
    a, b = family_drift(sw, full), family_drift(d, full)
    if not a:
        return {"drifting": [], "halved": None, "new_drift": [], "families": {}}
    drifting = [f for f, x in a.items() if abs(x["z"]) >= DRIFT_Z]
    halved = all(abs(b[f]["mean_diff"]) <= abs(a[f]["mean_diff"]) / 2 for f in drifting)
    new = [f for f, x in b.items() if abs(x["z"]) >= DRIFT_Z and f not in drifting]
    return {"drifting": drifting, "halved": halved, "new_drift": new,
            "families": {f: {"slimwise": a[f], "distilled": b[f]} for f in a}}


def bars_check(report: dict, split: str = "test") -> dict:
    """The issue's bars per ratio: recovery of half the gap (when SlimWise loses >= 3 points), length within the
    stricter of +-5% and half SlimWise's deviation, never worse than SlimWise; plus the total distillation cost."""
    full = report["full"][split]
    # the backbone's cost: every ratio's SlimWise distillation, plus the teacher data once when they shared it
    shared = report.get("teacher", {}).get("seconds", 0.0)
    out: dict = {"cost_seconds": shared + sum(r["distilled"]["distill"]["seconds"] for r in report["ratios"].values())}
    for ratio, row in report["ratios"].items():
        out[ratio] = cell_bars(row["slimwise"][split], row["distilled"][split], full)
    return out


def cell_bars(sw: dict, d: dict, full: dict) -> dict:
    """The bars of one (ratio, sample): SlimWise `sw` and distilled `d` runs against the full model's."""
    gap = full["accuracy"] - sw["accuracy"]
    dev_sw, dev_d = abs(_length_dev(sw, full)), abs(_length_dev(d, full))
    applies = gap >= 3
    return {"gap": gap, "recovered": d["accuracy"] - sw["accuracy"], "applies": applies,
            "recovery_bar": (d["accuracy"] - sw["accuracy"] >= gap / 2) if applies else None,
            "length_bar": (dev_d <= min(5.0, dev_sw / 2)) if applies else None,
            "never_worse": d["accuracy"] >= sw["accuracy"] and dev_d <= dev_sw,
            "within_3_points": full["accuracy"] - d["accuracy"] <= 3,
            "length_drift": {"slimwise": length_drift(sw, full), "distilled": length_drift(d, full)},
            "family_length": family_length_check(sw, d, full)}


def replicate_bars(model_name: str, run_dir: str | Path, seeds: Sequence[int] = (1, 2), per_family: int = 200,
                   threads: int = 2) -> dict:
    """Re-test a finished bars run's plans and SlimWise deltas on fresh test samples (other seeds of the test
    split, still disjoint from calibration): how much of each bar's outcome is the sample. Writes
    replicate.json / replicate.md beside the report."""
    from slimwise.models import load_model, load_tokenizer
    from slimwise.testbed import TARGET_DOMAIN, make_split

    torch.set_num_threads(threads)
    run_dir = Path(run_dir)
    report = json.loads((run_dir / "report.json").read_text())
    model = load_model(model_name, dtype="float32")
    tok = load_tokenizer(model_name)
    config = BarsConfig()
    out: dict = {"model": model_name, "run": str(run_dir), "per_family": per_family, "seeds": {}}
    for seed in tqdm(seeds, desc="seeds"):
        samples = make_split("test", per_family, seed=seed, domain=TARGET_DOMAIN)
        full = evaluate_run(PhaseSplitEngine(model, tok), samples, "full", config)
        full.pop("token_ids")
        entry: dict = {"full": full}
        for ratio in report["ratios"]:
            plan = PrunePlan.load(run_dir / f"plan-{ratio}.json")
            delta = Delta.load(run_dir / f"delta-distilled-{ratio}")
            with PhaseSplitEngine(model, tok, plan=plan) as engine:
                sw = evaluate_run(engine, samples, "slimwise", config)
            with PhaseSplitEngine(model, tok, plan=plan, delta=delta) as engine:
                d = evaluate_run(engine, samples, "distilled", config)
            entry[ratio] = {"slimwise": sw, "distilled": d}
        out["seeds"][str(seed)] = entry
    _atomic_write(run_dir / "replicate.json", json.dumps(out))
    text = replicate_table(backfill_families(report), out)
    _atomic_write(run_dir / "replicate.md", text)
    print(text)
    return out


def replicate_table(report: dict, rep: dict) -> str:
    """Markdown of a replication: each sample's bars, then all samples pooled (the bars report's sample 0 and the
    fresh ones): accuracy, the literal length bar and the per-family drift."""
    for seed, entry in rep["seeds"].items():  # replications written before runs carried family labels
        if not entry["full"].get("families"):
            fams = split_families("test", rep["per_family"], int(seed))
            for run in [entry["full"], *(m for r in report["ratios"] for m in entry[r].values())]:
                run["families"] = fams
    lines = [f"## {rep['model']}: fresh test samples ({rep['per_family']} per family)", "",
             "| seed | ratio | full % | SlimWise % | distilled % | recovered / gap | length Δ tokens SlimWise → "
             "distilled (± se) | length bar | never worse |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for seed, entry in rep["seeds"].items():
        full = entry["full"]
        for ratio in report["ratios"]:
            sw, d = entry[ratio]["slimwise"], entry[ratio]["distilled"]
            lines.append(f"| {seed} " + _bars_row(ratio, sw, d, full, cell_bars(sw, d, full), pooled=False))
    has_0 = "full" in report  # the bars run's own sample (seed 0) joins the pool when its report is complete
    full = pooled_run(report, rep)
    n = len(full["lengths"])
    label = ("sample 0 and seeds " if has_0 else "seeds ") + ", ".join(rep["seeds"])
    lines += ["", f"### Pooled: {label} ({n:,} problems)", "",
              "| ratio | full % | SlimWise % | distilled % | recovered / gap | recovery bar | length Δ tokens SlimWise → "
              "distilled (± se) | mean-length bar | never worse |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    fam_rows, verdicts = [], []
    for ratio in report["ratios"]:
        sw, d = pooled_run(report, rep, ratio, "slimwise"), pooled_run(report, rep, ratio, "distilled")
        c = cell_bars(sw, d, full)
        lines.append(_bars_row(ratio, sw, d, full, c, pooled=True))
        fam_rows += [(f"{ratio} slimwise", sw), (f"{ratio} distilled", d)]
        verdicts.append(f"- {ratio}: {family_verdict(c['family_length'])}")
    table = family_table(fam_rows, full)
    if table:
        lines += ["", "Length drift per family, pooled: paired mean difference from full, tokens (% of the family's "
                  "length, z)", "", *table, "", *verdicts]
    return "\n".join(lines)


def _bars_row(ratio: str, sw: dict, d: dict, full: dict, c: dict, pooled: bool) -> str:
    """One replication table row from `ratio` on; the pooled table adds the recovery bar's verdict."""
    a, b = c["length_drift"]["slimwise"], c["length_drift"]["distilled"]
    verdict = (lambda ok: "met" if ok else "not met") if c["applies"] else (lambda ok: "n/a (gap < 3)")
    recovery = f" {verdict(c['recovery_bar'])} |" if pooled else ""
    return (f"| {ratio} | {full['accuracy']:.1f} | {sw['accuracy']:.1f} | {d['accuracy']:.1f} | "
            f"{c['recovered']:+.1f} / {c['gap']:.1f} |{recovery} {a['mean_diff']:+.3f} ± {a['mean_diff_se']:.3f} → "
            f"{b['mean_diff']:+.3f} ± {b['mean_diff_se']:.3f} | {verdict(c['length_bar'])} | "
            f"{'yes' if c['never_worse'] else 'no'} |")


def pooled_run(report: dict, rep: dict, ratio: str | None = None, mode: str = "full") -> dict:
    """One mode's test runs over every sample of a replication as one run: the bars report's own sample 0 (when
    its report is complete) and the fresh seeds. ratio None: the full model."""
    first = []
    if "full" in report:
        first = [report["full"]["test"] if ratio is None else report["ratios"][ratio][mode]["test"]]
    return pool_runs([*first, *(e["full"] if ratio is None else e[ratio][mode] for e in rep["seeds"].values())])


def split_families(split: str, per_family: int, seed: int = 0) -> list[str]:
    """The family of each problem of a target-domain split, in order (splits are deterministic)."""
    from slimwise.testbed import TARGET_DOMAIN, make_split

    return [x.family for x in make_split(split, per_family, seed=seed, domain=TARGET_DOMAIN)]


def backfill_families(report: dict) -> dict:
    """Family labels for reports written before runs carried them: the splits are deterministic, so they are
    regenerated from the run's settings (test: seed 0; held-out: seed 0) and checked against the run's size."""
    for split, key in (("test", "test_per_family"), ("heldout", "heldout_per_family")):
        full, per_family = report.get("full", {}).get(split), report.get("config", {}).get(key)
        if full is None or full.get("families") or not per_family:
            continue
        fams = split_families(split, per_family)
        if len(fams) == len(full["lengths"]):
            full["families"] = fams
    return report


def pool_runs(runs: Sequence[dict]) -> dict:
    """Several samples' runs of one mode as one run (accuracy and lengths over all their problems)."""
    correct = [c for r in runs for c in r["correct"]]
    lengths = [n for r in runs for n in r["lengths"]]
    families = [f for r in runs for f in r.get("families") or []]
    return {"accuracy": 100 * sum(correct) / len(correct), "mean_length": sum(lengths) / len(lengths),
            "correct": correct, "lengths": lengths, "families": families if len(families) == len(lengths) else []}


def family_table(rows: Sequence[tuple[str, dict]], full: dict) -> list[str]:
    """Markdown: per-family paired length difference from full (tokens, z) for each (label, run)."""
    fams = list(family_drift(rows[0][1], full)) if rows else []
    if not fams:
        return []
    lines = ["| run | " + " | ".join(fams) + " |", "|---|" + "---|" * len(fams)]
    for label, run in rows:
        drift = family_drift(run, full)
        lines.append(f"| {label} | " + " | ".join(f"{drift[f]['mean_diff']:+.2f} ({drift[f]['pct']:+.1f}%, "
                                                  f"z {drift[f]['z']:+.1f})" for f in fams) + " |")
    return lines


def family_verdict(check: dict) -> str:
    if check["halved"] is None:
        return "no family labels"
    new = ", ".join(check["new_drift"]) or "none"
    if not check["drifting"]:
        return f"SlimWise drifts (|z| >= {DRIFT_Z:g}) in no family, nothing to halve; new drift from distillation: {new}"
    return (f"SlimWise drifts (|z| >= {DRIFT_Z:g}) in: {', '.join(check['drifting'])}; distillation halves every "
            f"one: {'yes' if check['halved'] else 'no'}; new drift from distillation: {new}")


def bars_table(report: dict) -> str:
    """Markdown tables of a bars report: accuracy, mean length (deviation from full), teacher-forced KL."""
    lines = [f"## {report['model']}", ""]
    for split in ("test", "heldout"):
        full = report["full"][split]
        lines += [f"### {split} split (target domain, {len(full['correct'])} problems)", "",
                  "| ratio | mode | accuracy % | mean length (vs full) | length Δ per problem: mean ± se / mean abs / "
                  "changed % | KL(full‖mode) /token | argmax flips % |",
                  "| --- | --- | --- | --- | --- | --- | --- |",
                  f"| 0 | full | {full['accuracy']:.1f} | {full['mean_length']:.2f} | 0 | 0 | 0 |"]
        for ratio, row in report["ratios"].items():
            for mode in BARS_MODES[1:]:
                r = row[mode][split]
                drift = length_drift(r, full)
                lines.append(f"| {ratio} | {mode} | {r['accuracy']:.1f} | {r['mean_length']:.2f} "
                             f"({_length_dev(r, full):+.2f}%) | {drift['mean_diff']:+.3f} ± {drift['mean_diff_se']:.3f}"
                             f" / {drift['mean_abs_diff']:.2f} / {drift['changed_pct']:.1f} | {r['kl']:.5f} | "
                             f"{r['flip_pct']:.2f} |")
        lines.append("")
    full = report["full"]["test"]
    fam_rows = [(f"{ratio} {mode}", row[mode]["test"]) for ratio, row in report["ratios"].items()
                for mode in BARS_MODES[1:]]
    table = family_table(fam_rows, full)
    if table:
        lines += ["### Length drift per family (test split): paired mean difference from full, tokens (% of the "
                  "family's length, z)", "", *table, ""]
        for ratio, row in report["ratios"].items():
            check = family_length_check(row["slimwise"]["test"], row["distilled"]["test"], full)
            lines.append(f"- {ratio}: {family_verdict(check)}")
        lines.append("")
    lines += ["| ratio | distill s | trainable (share) | peak MB | loss first -> last |", "| --- | --- | --- | --- | --- |"]
    for ratio, row in report["ratios"].items():
        for mode in ("distilled", "uniform_distilled"):
            c = row[mode]["distill"]
            lines.append(f"| {ratio} {mode} | {c['seconds']:.0f} | {c['trainable_params']:,} "
                         f"({100 * c['trainable_share']:.3f}%) | {c['peak_memory_mb']:.0f} | "
                         f"{c['loss_first_last'][0]:.5f} -> {c['loss_first_last'][1]:.5f} |")
    if "teacher" in report:
        t = report["teacher"]
        lines += ["", f"Teacher data (full-model continuations and log-probs, shared by every run above): "
                  f"{t['prompts']} prompts, {t['continuation_tokens']:,} tokens, {t['seconds']:.0f} s, counted once "
                  "in the cost."]
    bars = {k: ({**v, "family_length": {x: y for x, y in v["family_length"].items() if x != "families"}}
                if isinstance(v, dict) and "family_length" in v else v) for k, v in report.get("bars", {}).items()}
    lines += ["", "Bars (test split; per-family figures in the table above): " + json.dumps(bars), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m slimwise.distill", description="distillation bars on the testbed")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bars", help="full / uniform / slimwise / distilled / uniform-distilled, per backbone")
    b.add_argument("models", nargs="+")
    b.add_argument("--out", default="runs/distill-bars")
    b.add_argument("--params", default="router,norm,lora")
    b.add_argument("--steps", type=int, default=1200)
    b.add_argument("--lr", type=float, default=3e-3)
    b.add_argument("--minutes", type=float, default=7.0, help="cap per distillation run (2 ratios: <= 15 min)")
    b.add_argument("--test-per-family", type=int, default=200)
    b.add_argument("--heldout-per-family", type=int, default=50)
    b.add_argument("--distill-per-family", type=int, default=1000,
                   help="distillation prompts per task family (a family with fewer gives all it has)")
    b.add_argument("--teacher-batch-size", type=int, default=16, help="64 builds the teacher data ~1.9x faster")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--loss", default="fkl", choices=["fkl", "rkl", "jsd"])
    b.add_argument("--ce-weight", type=float, default=0.0)
    b.add_argument("--on-policy", type=float, default=0.0, help="share of steps on the student's own samples")
    r = sub.add_parser("report", help="re-render report.md and the bars of finished bars runs (report.json)")
    r.add_argument("reports", nargs="+", help="report.json files")
    rp = sub.add_parser("replicate", help="re-test a finished bars run's plans and deltas on fresh test samples")
    rp.add_argument("model")
    rp.add_argument("run_dir", help="the bars output folder holding report.json, plan-*.json, delta-distilled-*")
    rp.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    rp.add_argument("--per-family", type=int, default=200)
    rp.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.command == "replicate":
        replicate_bars(args.model, args.run_dir, args.seeds, args.per_family, args.threads)
        return 0
    if args.command == "report":
        for path in map(Path, args.reports):
            report = backfill_families(json.loads(path.read_text()))
            report["bars"] = bars_check(report)
            _atomic_write(path, json.dumps(report, indent=1))
            _atomic_write(path.with_name("report.md"), bars_table(report))
            print(bars_table(report))
            rep_path = path.with_name("replicate.json")
            if rep_path.is_file():  # a replication beside it: its tables (pooled, per family) too
                text = replicate_table(report, json.loads(rep_path.read_text()))
                _atomic_write(path.with_name("replicate.md"), text)
                print(text)
        return 0
    dcfg = DistillConfig(params=tuple(x for x in args.params.split(",") if x), steps=args.steps, lr=args.lr,
                         max_minutes=args.minutes, loss=args.loss, ce_weight=args.ce_weight, on_policy=args.on_policy,
                         teacher_batch_size=args.teacher_batch_size)
    cfg = BarsConfig(test_per_family=args.test_per_family, heldout_per_family=args.heldout_per_family,
                     distill_per_family=args.distill_per_family, threads=args.threads, distill=dcfg)
    for name in args.models:
        run_bars(name, Path(args.out) / Path(str(name)).name, cfg)
    return 0


if __name__ == "__main__":
    from slimwise.distill import main as _main  # the package's classes, not __main__'s copies

    raise SystemExit(_main())
