"""The decode-only delta: its file format, its checks, and how it acts on a model.

A delta is a few parameters trained by `slimwise.distill` (router rows, the norm feeding each MoE block, LoRA
factors) that act only while the pruned decoder runs. This module is what every consumer needs and nothing
more: the reference engine installs it next to an `ExpertMask` (`apply_delta`), the export folds it into a
pruned checkpoint (`fold_delta`), and the vLLM plugin reads it (`Delta`, `plan_hash`). None of them loads the
trainer. What each trainable set (router, norm, LoRA) does in each of these places is its `TrainableSet` in
`slimwise.trainable`; this module only loops over them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from slimwise.adapters import get_adapter
from slimwise.errors import SlimWiseError
from slimwise.fingerprint import fingerprints_match, model_fingerprint
from slimwise.hooks import ForwardWrappers
from slimwise.io import atomic_dir, refuse_existing
from slimwise.masking import ExpertMask
from slimwise.plan import PrunePlan
from slimwise.trainable import TRAINABLE_SETS, SetState

DELTA_FORMAT = "slimwise-delta/1"
TENSORS_FILE = "delta.safetensors"
MANIFEST_FILE = "delta.json"
DELTA_MODES = ("slimwise", "uniform")

# ----------------------------------------------------------------------------------------------------------
# Helpers


def delta_dir(path: str | Path) -> Path:
    """The delta a path names: a delta named by one of its two files is its directory; any other path is
    itself. Content keys hash this (`slimwise.fingerprint.content_sha256`), so naming a delta by its directory
    or by a file in it gives one key."""
    path = Path(path)
    if path.name in (TENSORS_FILE, MANIFEST_FILE) and (path.parent / MANIFEST_FILE).is_file():
        return path.parent
    return path


def plan_hash(plan: PrunePlan) -> str:
    """Hash of what a delta depends on in a plan: each layer's kept experts and the weights they index."""
    key = {"family": plan.family, "num_experts": plan.num_experts, "fingerprint": plan.fingerprint,
           "kept": {str(k): v for k, v in sorted(plan.kept_experts.items())}}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint_of(model: nn.Module) -> dict[str, str]:
    fp = getattr(model, "_slimwise_fingerprint", None) or model_fingerprint(model)
    model._slimwise_fingerprint = fp
    return fp


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
                                    full module name {module} (e.g. model.layers.0.self_attn.q_proj); the
                                    decode weight is W + scale * B @ A with scale = manifest["lora"]["scale"]
    Manifest (`delta.json`): format, mode ("slimwise": decode only; "uniform": both phases of uniform
    pruning), params, plan_hash, plan_fingerprint, model_fingerprint, family, lora, trainable_params,
    trainable_share, steps, loss_history, seconds, peak_memory_mb, config. A delta applies only to the model
    and plan it was distilled for (`check`).
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
        return {n: (self.tensors[f"lora.{n}.lora_A.weight"], self.tensors[f"lora.{n}.lora_B.weight"])
                for n in names}

    def summary(self) -> dict:
        """What an export manifest records about the delta folded into it."""
        keys = ("format", "mode", "params", "plan_hash", "model_fingerprint", "lora", "steps",
                "trainable_params", "trainable_share", "seconds")
        return {k: self.manifest.get(k) for k in keys} | {"source": str(self.path) if self.path else None}

    # ----- checks -------------------------------------------------------------------------------------------
    def check(self, model: nn.Module, plan: PrunePlan) -> None:
        """Refuse a delta made for another plan or other weights, or a plan that does not fit the model."""
        m = self.manifest
        if m.get("format") != DELTA_FORMAT:
            raise SlimWiseError(f"not a SlimWise delta (format {m.get('format')!r}, expected {DELTA_FORMAT})")
        adapter = get_adapter(model.config)
        plan.check_model(model, adapter)
        if not fingerprints_match(m.get("model_fingerprint"), fingerprint_of(model)):
            raise SlimWiseError("delta was distilled on other weights (fingerprint "
                                f"{m.get('model_fingerprint')}, this model {fingerprint_of(model)}): pass "
                                "its source model, or distill again")
        if m.get("plan_hash") != plan_hash(plan):
            raise SlimWiseError(f"delta was distilled for another plan (hash {m.get('plan_hash')}, this plan "
                                f"{plan_hash(plan)}): pass the plan given to "
                                "`slimwise distill`, or distill again")
        layers = {layer.index: layer for layer in adapter.moe_layers(model)}
        for trainable_set in TRAINABLE_SETS.values():  # each set checks its own tensors' shapes
            trainable_set.check(self, model, adapter, layers)

    # ----- io -----------------------------------------------------------------------------------------------
    def save(self, path: str | Path, force: bool = False) -> Path:
        """Write the directory atomically (temporary directory, then rename): never half a delta."""
        path = Path(path)
        refuse_existing(path, force)
        with atomic_dir(path) as tmp:
            tensors = {k: v.detach().to("cpu", torch.float32).contiguous()
                       for k, v in sorted(self.tensors.items())}
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
    only, so prefill runs the stock weights (bit-identical to the full model). Each override wraps the
    module's forward (router, MoE-feeding norm, LoRA Linear) and lends it the trained tensor for one call.
    """

    def __init__(self, model: nn.Module, delta: Delta, mask: ExpertMask, plan: PrunePlan,
                 trainable: bool = False):
        from slimwise.devices import is_offloaded

        if any(is_offloaded(m) for m in model.modules()):
            raise SlimWiseError("a distilled delta needs every weight resident on a device, and accelerate "
                                "offloads part of this model: raise --max-memory (or add GPUs)")
        self.model, self.mask, self.plan = model, mask, plan
        self.adapter = mask.adapter
        self.mode = delta.mode
        self.manifest = dict(delta.manifest)
        self.scale = delta.lora_scale
        self.on = False
        # set name -> its overrides, in registry order (slimwise.trainable)
        self.sets: dict[str, SetState] = {}
        self._wrappers = ForwardWrappers("delta")
        layers = {layer.index: layer for layer in self.adapter.moe_layers(model)}
        try:
            for name, trainable_set in TRAINABLE_SETS.items():
                self.sets[name] = trainable_set.install(self, delta, layers, trainable)
        except BaseException:
            self.remove()
            raise

    def override_router(self, router: nn.Module, weight: nn.Parameter, pruned: torch.Tensor) -> None:
        """Route with `weight` (pruned experts unselectable) while active; the stock route otherwise."""
        self._wrappers.wrap(router, self._router_forward(router, weight, pruned))

    def override_weight(self, module: nn.Module, weight: Callable[[], torch.Tensor]) -> None:
        """Run `module` with `weight()` as its weight while active (called per
        forward: autograd reaches it)."""
        self._wrappers.wrap(module, self._swap_forward(module, weight))

    # ----- switching ----------------------------------------------------------------------------------------
    @contextmanager
    def switched_on(self):
        previous, self.on = self.on, True
        try:
            yield self
        finally:
            self.on = previous

    def _active(self) -> bool:
        return self.on and self.mask.active

    # ----- wrappers -----------------------------------------------------------------------------------------
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

    # ----- training support ---------------------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        """Every set's parameters in registry order: the order the gradient clip sums them in."""
        return [p for state in self.sets.values() for p in state.params.values()]

    def param_groups(self, lr: float, lora_lr: float | None, weight_decay: float) -> list[dict]:
        """Dense sets (routers, norms) train at `lr` without weight decay; LoRA at `lora_lr` (default `lr`)
        with `weight_decay`. Group order and parameter order are what an optimizer checkpoint indexes by."""
        groups = []
        dense = self._group_params("dense")
        if dense:
            groups.append({"params": dense, "lr": lr, "base_lr": lr, "weight_decay": 0.0})
        lora = self._group_params("lora")
        if lora:
            groups.append({"params": lora, "lr": lora_lr or lr, "base_lr": lora_lr or lr,
                           "weight_decay": weight_decay})
        return groups

    def _group_params(self, group: str) -> list[nn.Parameter]:
        return [p for name, state in self.sets.items() if TRAINABLE_SETS[name].group == group
                for p in state.params.values()]

    def trainable_count(self) -> int:
        """Parameters that actually train: kept router rows, norm weights, LoRA
        factors (frozen rows excluded)."""
        frozen = sum(int(rows.sum()) * state.params[key].shape[1]
                     for state in self.sets.values() for key, (rows, _) in state.frozen.items())
        return sum(p.numel() for p in self.parameters()) - frozen

    @torch.no_grad()
    def restore_pruned_rows(self) -> None:
        """Pruned router rows never train (they cannot be selected); keep them bit-equal to the stock rows."""
        for state in self.sets.values():
            for key, (rows, stock) in state.frozen.items():
                w = state.params[key]
                w[rows] = stock[rows].to(w.dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {key: p.detach().float().clone() for state in self.sets.values()
                for key, p in state.params.items()}

    def to_delta(self, manifest: dict | None = None) -> Delta:
        return Delta(self.tensors(), self.manifest | (manifest or {}))


def apply_delta(model: nn.Module, delta: Delta | str | Path, mask: ExpertMask,
                plan: PrunePlan) -> InstalledDelta:
    """Install a delta (or a delta directory) on `model` next to `mask`, after
    checking it fits model and plan."""
    if isinstance(delta, (str, os.PathLike)):
        delta = Delta.load(delta)
    delta.check(model, plan)
    return InstalledDelta(model, delta, mask, plan)


@torch.no_grad()
def fold_delta(model: nn.Module, delta: Delta | str | Path, plan: PrunePlan) -> dict:
    """Write the delta into the model's weights in place (trained routers and norms replace the stock ones,
    LoRA merged), for exporting a pruned-and-distilled decoder. Returns the
    delta's summary for the manifest."""
    if isinstance(delta, (str, os.PathLike)):
        delta = Delta.load(delta)
    delta.check(model, plan)
    adapter = get_adapter(model.config)
    layers = {layer.index: layer for layer in adapter.moe_layers(model)}
    for trainable_set in TRAINABLE_SETS.values():
        trainable_set.fold(model, delta, adapter, layers)
    if hasattr(model, "_slimwise_fingerprint"):
        del model._slimwise_fingerprint  # the weights changed
    return delta.summary()
