"""The decode-only delta: its file format, its checks, and how it acts on a model.

A delta is a few parameters trained by `slimwise.distill` (router rows, the norm feeding each MoE block, LoRA
factors) that act only while the pruned decoder runs. This module is what every consumer needs and nothing more:
the reference engine installs it next to an `ExpertMask` (`apply_delta`), the export folds it into a pruned
checkpoint (`fold_delta`), and the vLLM plugin reads it (`Delta`, `plan_hash`, `merged_weight`). None of them loads
the trainer.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from slimwise.adapters import MoEAdapter, get_adapter
from slimwise.errors import SlimWiseError
from slimwise.fingerprint import fingerprints_match, model_fingerprint
from slimwise.hooks import ForwardWrappers
from slimwise.io import atomic_dir, refuse_existing
from slimwise.masking import ExpertMask
from slimwise.plan import PrunePlan

DELTA_FORMAT = "slimwise-delta/1"
TENSORS_FILE = "delta.safetensors"
MANIFEST_FILE = "delta.json"
PARAM_SETS = ("router", "norm", "lora")
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


def fingerprint_of(model: nn.Module) -> dict[str, str]:
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
        if not fingerprints_match(m.get("model_fingerprint"), fingerprint_of(model)):
            raise SlimWiseError(f"delta was distilled on other weights (fingerprint {m.get('model_fingerprint')}, "
                                f"this model {fingerprint_of(model)}): pass its source model, or distill again")
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
        refuse_existing(path, force)
        with atomic_dir(path) as tmp:
            tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in sorted(self.tensors.items())}
            save_file(tensors, str(tmp / TENSORS_FILE), metadata={"format": DELTA_FORMAT})
            manifest = self.manifest | {"tensors": sorted(tensors)}
            (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, default=str) + "\n")
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
        self._wrappers = ForwardWrappers("delta")
        layers = {layer.index: layer for layer in self.adapter.moe_layers(model)}
        try:
            for i, w in sorted(delta.routers().items()):
                router = layers[i].router
                param = nn.Parameter(w.to(router.weight.device, router.weight.dtype).clone(), trainable)
                self.routers[i] = param
                self.pruned[i] = plan.pruned_mask(i, device=router.weight.device)
                self._stock_routers[i] = router.weight.detach()
                self._wrappers.wrap(router, self._router_forward(router, param, self.pruned[i]))
            for i, w in sorted(delta.norms().items()):
                norm = moe_norm(model, i, self.adapter)
                param = nn.Parameter(w.to(norm.weight.device, norm.weight.dtype).clone(), trainable)
                self.norms[i] = param
                self._wrappers.wrap(norm, self._swap_forward(norm, lambda p=param: p))
            for name, (a, b) in sorted(delta.lora_pairs().items()):
                lin = model.get_submodule(name)
                pa = nn.Parameter(a.to(lin.weight.device, torch.float32).clone(), trainable)
                pb = nn.Parameter(b.to(lin.weight.device, torch.float32).clone(), trainable)
                self.lora[name] = (pa, pb)
                self._wrappers.wrap(lin, self._swap_forward(
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
    def _router_forward(self, router: nn.Module, weight: nn.Parameter, pruned: torch.Tensor):
        """A wrapper factory: `previous` is ExpertMask's wrapper, or the stock forward for a layer that prunes
        nothing."""
        adapter = self.adapter

        def make(previous):
            return self._routed(router, weight, pruned, adapter, previous)

        return make

    def _routed(self, router, weight, pruned, adapter, previous):
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
        """A wrapper factory: the module's own forward with `weight()` as its weight while active."""
        return lambda previous: self._swapping(module, weight, previous)

    def _swapping(self, module, weight, previous):
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
        self._wrappers.remove()

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
