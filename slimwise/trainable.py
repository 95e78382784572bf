"""The trainable sets of a decode-only delta (`router`, `norm`, `lora`): one
object per set, registered by name.

A set owns what differs between sets, for every consumer of a delta:
  `validate`        refuse distillation settings the set cannot train with (before any work)
  `init`            the starting tensors of a new delta (training-free SlimWise: step 0 changes nothing)
  `check`           refuse a delta whose tensors of this set do not fit a model
  `install`         the reference engine's overrides (`InstalledDelta`): trained tensors lent to the model's
                    modules while the pruned decoder runs; the parameters the trainer optimises
  `fold`            merge into the model's weights, for a pruned-and-distilled export
  `memory`          what training it holds, by kind, for the footprint (`slimwise.footprint`, `--dry-run`)
Code that handles a delta loops over `TRAINABLE_SETS` instead of branching on set names; a new set is one
registered subclass here. Its vLLM side (handing its tensors to the served decode routing, and vLLM's fused
module names) is its installer in `slimwise/serving/delta_hooks.py`, found by the set's name.

Invariants:
- Registry order is the order everywhere (tensors, parameters, optimizer groups, gradient clipping): it is
  part of what makes a resumed run repeat its losses bit for bit, so new sets go after the existing ones.
- Every set acts on the delta's tensors of its own kind only, and an absent kind is a no-op: a delta is
  applied by what it holds, whatever its manifest's `params` says.
- vLLM workers import this module (through `slimwise.serving.delta_hooks`), so it imports neither the trainer
  (`slimwise.distill`, torch optimizers) nor vLLM, and names no vLLM module; nothing from `slimwise.serving`
  either (the layers point down: serving imports the sets); and `slimwise.delta` imports it, so it imports
  nothing from there either (the objects it acts on are passed in).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from slimwise.adapters import MoEAdapter, MoELayer, get_adapter
from slimwise.errors import SlimWiseError

#: where decoder layers keep the norm whose output feeds the MoE block, by family naming
NORM_ATTRS = ("post_attention_layernorm", "ffn_norm", "pre_feedforward_layernorm")
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# routed experts are fused 3-D weights: never matched
DENSE_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


# ----------------------------------------------------------------------------------------------------------
# What the sets need from a model


def moe_norm(model: nn.Module, layer_index: int, adapter: MoEAdapter | None = None) -> nn.Module:
    """The norm whose output feeds decoder layer `layer_index`'s MoE block."""
    adapter = adapter or get_adapter(model.config)
    layer = adapter.decoder_layers(model)[layer_index]
    for name in NORM_ATTRS:
        module = getattr(layer, name, None)
        if isinstance(module, nn.Module) and isinstance(getattr(module, "weight", None), torch.Tensor):
            return module
    raise SlimWiseError(f"decoder layer {layer_index} has none of {NORM_ATTRS}: the `norm` set does not "
                        f"support {type(layer).__name__}; use --params router or lora")


def resolve_lora_targets(model: nn.Module, targets: Sequence[str]) -> tuple[str, ...]:
    """`("auto",)`: the shared expert's gate/up/down where the model has one, else the attention projections.

    Every decode token runs the shared expert beside the pruned routed experts, so a LoRA there can stand in
    for what they computed; on the testbed it recovers more than attention LoRA in the same time and a similar
    share of the parameters (docs/results/distillation.md, recipe probe). Models without one keep attention.
    """
    if tuple(targets) != ("auto",):
        return tuple(targets)
    shared = any(isinstance(m, nn.Linear) and ".shared_expert" in name
                 and name.rsplit(".", 1)[-1] in DENSE_MLP_TARGETS
                 for name, m in model.named_modules())
    return DENSE_MLP_TARGETS if shared else ATTENTION_TARGETS


def lora_modules(model: nn.Module, targets: Sequence[str]) -> dict[str, nn.Linear]:
    """Linear modules whose last name component is in `targets` (e.g. q_proj), by full module name."""
    targets = resolve_lora_targets(model, targets)
    found = {name: m for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in set(targets)}
    if not found:
        raise SlimWiseError(f"no Linear module named {', '.join(targets)} in the model: pass --lora-targets "
                            "with module names it has (e.g. q_proj,v_proj,o_proj)")
    return found


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B @ A in W's dtype; the masked view, the export and vLLM all use this exact expression."""
    return weight + ((b.float() @ a.float()) * scale).to(weight.dtype)


# ----------------------------------------------------------------------------------------------------------
# The protocol


class InitOptions(Protocol):
    """The distillation settings a set's `init` and `validate` read (`DistillConfig` has them all; typed here
    so that this module never imports the trainer)."""

    seed: int
    lora_rank: int
    lora_alpha: float
    lora_targets: tuple[str, ...]


class Delta(Protocol):
    """What the sets read of a delta (`slimwise.delta.Delta`; typed here, since `slimwise.delta` imports this
    module and the import graph, `if TYPE_CHECKING:` included, has no loops)."""

    @property
    def lora_scale(self) -> float: ...

    def routers(self) -> dict[int, torch.Tensor]: ...

    def norms(self) -> dict[int, torch.Tensor]: ...

    def lora_pairs(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]: ...


class InstalledDelta(Protocol):
    """What `install` uses of the reference engine's installed delta (`slimwise.delta.InstalledDelta`)."""

    model: nn.Module
    adapter: MoEAdapter
    plan: Any  # the `PrunePlan` the delta is installed under
    scale: float

    def override_router(self, router: nn.Module, weight: nn.Parameter, pruned: torch.Tensor) -> None: ...

    def override_weight(self, module: nn.Module, weight: Any) -> None: ...


@dataclass
class SetState:
    """One set's overrides installed on one model.

    `params`: the trained tensors as Parameters, by delta tensor name, in the order the optimizer and the
    gradient clip see them. `frozen`: per tensor name, (rows that never train, their stock values): restored
    after every optimizer step and not counted as trainable."""

    params: dict[str, nn.Parameter] = field(default_factory=dict)
    frozen: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass(frozen=True)
class SetMemory:
    """What training one set holds, in elements, by how the footprint prices them: `dense` trained tensors at
    the model dtype (with their gradients, AdamW moments and float32 starting copy), `lora` float32 LoRA
    factors (the same four, all float32), `merged` weights autograd keeps for the backward (model dtype);
    `targets` the modules it adapts (LoRA), for the footprint's note."""

    dense: int = 0
    lora: int = 0
    merged: int = 0
    targets: tuple[str, ...] = ()


Layers = dict[int, MoELayer]  # the model's MoE layers by decoder-layer index


class TrainableSet:
    """Base class of the sets: the operations every consumer of a delta calls, one per consumer."""

    name: ClassVar[str] = ""
    #: the optimizer group its parameters join: "dense" (lr, no weight decay) or
    #: "lora" (lora_lr, weight decay)
    group: ClassVar[str] = "dense"

    def validate(self, config: InitOptions) -> None:
        """Refuse settings this set cannot train with; most sets read none."""

    def memory(self, census, config: InitOptions) -> SetMemory:
        """What training this set holds on the model `census` counts (a `slimwise.footprint.Census`, built on
        the meta device), for `config`; refuses settings the model cannot take, as `init` would."""
        raise NotImplementedError

    def init(self, model: nn.Module, adapter: MoEAdapter, layers: Layers,
             config: InitOptions) -> tuple[dict[str, torch.Tensor], dict]:
        """(starting tensors by delta tensor name, manifest entries); `layers`: the MoE layers the plan keeps
        experts for (the other consumers get every MoE layer of the model)."""
        raise NotImplementedError

    def check(self, delta: Delta, model: nn.Module, adapter: MoEAdapter, layers: Layers) -> None:
        raise NotImplementedError

    def install(self, installed: InstalledDelta, delta: Delta, layers: Layers, trainable: bool) -> SetState:
        raise NotImplementedError

    def fold(self, model: nn.Module, delta: Delta, adapter: MoEAdapter, layers: Layers) -> None:
        raise NotImplementedError


TRAINABLE_SETS: dict[str, TrainableSet] = {}


def register_set(cls: type[TrainableSet]) -> type[TrainableSet]:
    """Register one instance of `cls` under `cls.name`; a name already taken is
    refused (no silent replacement)."""
    if cls.name in TRAINABLE_SETS and type(TRAINABLE_SETS[cls.name]) is not cls:
        raise SlimWiseError(f"trainable set {cls.name!r} is already registered "
                            f"({type(TRAINABLE_SETS[cls.name]).__name__}); choose another name")
    TRAINABLE_SETS[cls.name] = cls()
    return cls


def trainable_sets(names: Sequence[str]) -> list[TrainableSet]:
    """The sets named, in registry order; none, or an unknown name, is refused in one line."""
    bad = [n for n in names if n not in TRAINABLE_SETS]
    if not names or bad:
        raise SlimWiseError(f"unknown trainable set(s) {bad or '(none)'}; choose among "
                            f"{', '.join(TRAINABLE_SETS)}")
    return [s for n, s in TRAINABLE_SETS.items() if n in names]


# ----------------------------------------------------------------------------------------------------------
# The sets (registry order: router, norm, lora)


@register_set
class RouterSet(TrainableSet):
    """A copy of each MoE layer's router weight used by the masked route. Only the kept rows train: pruned
    rows are unselectable, get no gradient, and are restored to the stock rows after every step."""

    name = "router"

    def memory(self, census, config):
        return SetMemory(dense=census.router_params)

    def init(self, model, adapter, layers, config):
        return {f"layers.{i}.router.weight": layer.router.weight.detach().float().clone()
                for i, layer in layers.items()}, {}

    def check(self, delta, model, adapter, layers):
        for i, w in delta.routers().items():
            if i not in layers or tuple(w.shape) != tuple(layers[i].router.weight.shape):
                raise SlimWiseError(f"delta router of layer {i} {tuple(w.shape)} does not fit this model")

    def install(self, installed, delta, layers, trainable):
        state = SetState()
        for i, w in sorted(delta.routers().items()):
            router = layers[i].router
            key = f"layers.{i}.router.weight"
            param = nn.Parameter(w.to(router.weight.device, router.weight.dtype).clone(), trainable)
            state.params[key] = param
            pruned = installed.plan.pruned_mask(i, device=router.weight.device)
            state.frozen[key] = (pruned, router.weight.detach())
            installed.override_router(router, param, pruned)
        return state

    @torch.no_grad()
    def fold(self, model, delta, adapter, layers):
        for i, w in delta.routers().items():
            layers[i].router.weight.copy_(w.to(layers[i].router.weight.dtype))


@register_set
class NormSet(TrainableSet):
    """A copy of the norm that feeds each MoE block (`post_attention_layernorm` in Qwen families)."""

    name = "norm"

    def memory(self, census, config):
        return SetMemory(dense=census.norm_params)

    def init(self, model, adapter, layers, config):
        return {f"layers.{i}.moe_norm.weight": moe_norm(model, i, adapter).weight.detach().float().clone()
                for i in layers}, {}

    def check(self, delta, model, adapter, layers):
        for i, w in delta.norms().items():
            if i not in layers or w.shape != moe_norm(model, i, adapter).weight.shape:
                raise SlimWiseError(f"delta norm of layer {i} {tuple(w.shape)} does not fit this model")

    def install(self, installed, delta, layers, trainable):
        state = SetState()
        for i, w in sorted(delta.norms().items()):
            norm = moe_norm(installed.model, i, installed.adapter)
            param = nn.Parameter(w.to(norm.weight.device, norm.weight.dtype).clone(), trainable)
            state.params[f"layers.{i}.moe_norm.weight"] = param
            installed.override_weight(norm, lambda p=param: p)
        return state

    @torch.no_grad()
    def fold(self, model, delta, adapter, layers):
        for i, w in delta.norms().items():
            norm = moe_norm(model, i, adapter)
            norm.weight.copy_(w.to(norm.weight.dtype))


@register_set
class LoraSet(TrainableSet):
    """Low-rank adapters W + scale * B @ A on chosen Linear modules (the shared expert's
    gate/up/down, else the attention projections, by default), used as a merged weight, so a folded
    export computes the same weights."""

    name = "lora"
    group = "lora"

    def memory(self, census, config):
        targets = tuple(config.lora_targets)
        if targets == ("auto",):
            targets = census.auto_lora_targets
        missing = [t for t in targets if t not in census.linear_io]
        if missing:
            raise SlimWiseError(f"no Linear module named {', '.join(missing)} in the model: pass "
                                "--lora-targets with module names it has (e.g. q_proj,v_proj,o_proj)")
        return SetMemory(lora=config.lora_rank * sum(census.linear_io.get(t, 0) for t in targets),
                         merged=sum(census.linear_weights.get(t, 0) for t in targets), targets=targets)

    def validate(self, config):
        if config.lora_rank < 1 or not config.lora_targets:
            raise SlimWiseError("lora needs a rank >= 1 and at least one target module")

    def init(self, model, adapter, layers, config):
        gen = torch.Generator().manual_seed(config.seed)  # its own stream: B = 0, A a function of the seed
        targets = resolve_lora_targets(model, config.lora_targets)
        modules = lora_modules(model, targets)
        tensors = {}
        for name, lin in sorted(modules.items()):
            bound = 1.0 / math.sqrt(lin.in_features)  # PEFT's default A init (kaiming-uniform, a=sqrt(5))
            tensors[f"lora.{name}.lora_A.weight"] = (torch.rand(config.lora_rank, lin.in_features,
                                                                generator=gen) * 2 - 1) * bound
            tensors[f"lora.{name}.lora_B.weight"] = torch.zeros(lin.out_features, config.lora_rank)
        lora = {"rank": config.lora_rank, "alpha": config.lora_alpha,
                "scale": config.lora_alpha / config.lora_rank, "targets": list(targets),
                "modules": sorted(modules)}
        return tensors, {"lora": lora}

    def check(self, delta, model, adapter, layers):
        for name, (a, b) in delta.lora_pairs().items():
            try:
                lin = model.get_submodule(name)
            except AttributeError as exc:
                raise SlimWiseError(f"delta has LoRA for {name}, which this model does not have") from exc
            if not isinstance(lin, nn.Linear) or (b.shape[0], a.shape[1]) != tuple(lin.weight.shape):
                raise SlimWiseError(f"delta LoRA for {name} does not fit the module's weight")

    def install(self, installed, delta, layers, trainable):
        state = SetState()
        for name, (a, b) in sorted(delta.lora_pairs().items()):
            lin = installed.model.get_submodule(name)
            pa = nn.Parameter(a.to(lin.weight.device, torch.float32).clone(), trainable)
            pb = nn.Parameter(b.to(lin.weight.device, torch.float32).clone(), trainable)
            state.params[f"lora.{name}.lora_A.weight"] = pa
            state.params[f"lora.{name}.lora_B.weight"] = pb
            installed.override_weight(lin, lambda lin=lin, pa=pa, pb=pb: merged_weight(lin.weight, pa, pb,
                                                                                         installed.scale))
        return state

    @torch.no_grad()
    def fold(self, model, delta, adapter, layers):
        for name, (a, b) in delta.lora_pairs().items():
            lin = model.get_submodule(name)
            lin.weight.copy_(merged_weight(lin.weight, a.to(lin.weight.device), b.to(lin.weight.device),
                                           delta.lora_scale))


PARAM_SETS = tuple(TRAINABLE_SETS)  # the built-in sets, in registry order
