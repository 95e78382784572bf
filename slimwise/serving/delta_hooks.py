"""A distilled delta inside vLLM: each trainable set's tensors handed to the decode routing, and the hooks
that apply them to decode rows only (a router per gate, the MoE-input norm, LoRA as a merged-weight buffer
per vLLM projection).

The vLLM side of `slimwise.trainable`: one installer per trainable set, found by the set's name in
`VLLM_INSTALLERS` (`@vllm_installer("name")`), and vLLM's fused module names (`VLLM_LORA_TARGETS`), so the
trainable sets name no vLLM module. A set without an installer cannot be served colocated.

Invariants: installers run in the sets' registry order (`TRAINABLE_SETS`); every hook selects its rows with
the routing's fixed-address `decode_mask` (graph-safe: `tests/test_graph_safety.py`), so prompt rows keep the
stock output. `routing` is the `DecodeRouting` (`slimwise.serving.routing`, which imports this module).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from slimwise.errors import SlimWiseError
from slimwise.hooks import first_output, with_first_output

logger = logging.getLogger("vllm.slimwise")  # printed by vLLM's log config, as serving/routing.py

NORM_NAME = re.compile(r"layers\.(\d+)\.post_attention_layernorm$")
#: transformers' projection -> (vLLM module name, block of its fused output): q/k/v are fused in vLLM's
#: QKVParallelLinear (output blocks q, k, v), o_proj is one RowParallelLinear; a dense MLP's -- the shared
#: expert's (Qwen2-MoE, Qwen3-Next) or a dense layer's -- gate/up are fused in MergedColumnParallelLinear
#: (blocks gate, up) and down_proj is one RowParallelLinear. Routed experts are fused 3-D weights in both
#: libraries, never LoRA targets.
VLLM_LORA_TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                     "o_proj": ("o_proj", None),
                     "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                     "down_proj": ("down_proj", None)}

#: trainable set name -> installer(routing, delta): hands the set's tensors of `delta` to the routing
VLLM_INSTALLERS: dict[str, Callable] = {}


def vllm_installer(name: str) -> Callable[[Callable], Callable]:
    """Register the vLLM installer of the trainable set `name` (`slimwise.trainable.register_set`)."""

    def register(fn: Callable) -> Callable:
        VLLM_INSTALLERS[name] = fn
        return fn

    return register


@vllm_installer("router")
def _install_routers(routing, delta) -> None:
    # the gate hook that masks the plan's pruned experts applies the router too (one hook per gate, so the
    # distilled logits are masked like the stock ones): the gate loop takes these per layer
    routing.pending_routers.update(delta.routers())


@vllm_installer("norm")
def _install_norms(routing, delta) -> None:
    routing.pending_norms.update(delta.norms())  # hooked where the module walk finds each layer's norm


@vllm_installer("lora")
def _install_lora_blocks(routing, delta) -> None:
    # vLLM fuses q/k/v and gate/up: each pair goes to its fused module's output block, merged into that
    # module's weight copy once the checkpoint is loaded (`merge_lora`)
    routing.lora_scale = delta.lora_scale
    for name, (a, b) in sorted(delta.lora_pairs().items()):
        prefix, _, leaf = name.rpartition(".")
        if leaf not in VLLM_LORA_TARGETS:
            raise SlimWiseError(f"LoRA on {name} is not served colocated (only "
                                f"{', '.join(VLLM_LORA_TARGETS)}): export the folded checkpoint with "
                                "`slimwise prune --distilled` and serve it as the "
                                "--disaggregated decode model")
        target, block = VLLM_LORA_TARGETS[leaf]
        routing.lora_blocks.setdefault(f"{prefix}.{target}", []).append((block, a, b))


def load_delta(routing, value) -> None:
    """Load a distilled delta and let each trainable set hand its tensors over (`pending_routers`,
    `pending_norms`, `lora_blocks`: decode tokens only). Refuses a delta with several plans, made for
    another plan, or made for uniform pruning."""
    if not value:
        return
    if len(routing.plans) > 1:
        raise SlimWiseError("a distilled delta is tied to one plan: serve it with that plan alone (one "
                            "engine per delta), not with several plans")
    from slimwise.delta import Delta, plan_hash
    from slimwise.trainable import TRAINABLE_SETS

    delta = Delta.load(value)
    if delta.manifest.get("plan_hash") != plan_hash(routing.plan):
        raise SlimWiseError(f"delta {value} was distilled for another plan: serve it with its own plan")
    if delta.mode == "uniform" and routing.mode != "uniform":
        raise SlimWiseError("this delta was distilled for uniform pruning (prefill "
                            "pruned too), not SlimWise")
    routing.has_delta = True
    for name in TRAINABLE_SETS:
        install = VLLM_INSTALLERS.get(name)
        if install is None:
            raise NotImplementedError(f"trainable set {name!r} has no vLLM installer: register one with "
                                      "@vllm_installer in slimwise/serving/delta_hooks.py")
        install(routing, delta)
    logger.info("SlimWise: decode-only delta %s (%s)", value, ", ".join(delta.params))


def vllm_name(modules: dict[str, nn.Module], name: str) -> str:
    """The vLLM module for a transformers module name. Names agree up to the language model's prefix: a
    delta made on the text-only transformers model (`model.layers.3...`) targets
    `language_model.model.layers.3...` in vLLM's multimodal Qwen3.5/3.6-MoE class. An exact name wins; else
    the one module ending in the same `layers.` path."""
    if name in modules or "layers." not in name:
        return name
    tail = name[name.index("layers."):]
    hits = [m for m in modules if m.endswith("." + tail)]
    return hits[0] if len(hits) == 1 else name


def install_lora(routing, model: nn.Module) -> None:
    """Decode rows of each LoRA-targeted projection are recomputed with the merged weight
    W + scale * B @ A -- the reference engine's and the exporter's exact expression -- and selected by the
    decode mask; prompt rows keep the stock output. The merged weight is a fixed-address buffer filled by
    `merge_lora` once the checkpoint is loaded (it costs one more copy of the targeted projections: the
    attention weights, a few percent of an MoE model)."""
    if not routing.lora_blocks:
        return
    from vllm.distributed import get_tensor_model_parallel_world_size

    if get_tensor_model_parallel_world_size() != 1:
        raise SlimWiseError("colocated LoRA deltas need tensor_parallel_size 1: export the folded "
                            "checkpoint with `slimwise prune --distilled` and serve it as the "
                            "--disaggregated decode model")
    modules = dict(model.named_modules())
    routing.lora_blocks = {vllm_name(modules, name): blocks for name, blocks in routing.lora_blocks.items()}
    for name in routing.lora_blocks:
        module = modules.get(name)
        if module is None or getattr(module, "weight", None) is None:
            raise SlimWiseError(f"the delta's LoRA targets {name}, which this vLLM model does not have: "
                                "use the delta made for this model")
        module.register_buffer("slimwise_lora_weight",
                               torch.zeros_like(module.weight, requires_grad=False), persistent=False)

        def hook(module, args, output):
            out = first_output(output)
            bias = module.bias if getattr(module, "bias", None) is not None \
                and not module.skip_bias_add else None
            merged = F.linear(args[0], module.slimwise_lora_weight, bias).to(out.dtype)
            out = torch.where(routing.decode_mask[: out.shape[0], None], merged, out)
            return with_first_output(output, out)

        module.register_forward_hook(hook)
        routing.lora_modules[name] = module
        routing.hooked["lora"].append(name)


@torch.no_grad()
def merge_lora(routing) -> None:
    """After the weights are loaded (before vLLM may repack them):
    W + scale * B @ A per targeted block."""
    from slimwise.trainable import merged_weight

    for name, module in routing.lora_modules.items():
        merged = module.weight.detach().clone()
        sizes = list(getattr(module, "output_sizes", None) or [merged.shape[0]])
        starts = np.cumsum([0, *sizes]).tolist()
        for block, a, b in routing.lora_blocks[name]:
            lo, hi = (0, merged.shape[0]) if block is None else (starts[block], starts[block + 1])
            if b.shape[0] != hi - lo or a.shape[1] != merged.shape[1]:
                raise SlimWiseError(f"LoRA for {name} (block {block}) has shape B {tuple(b.shape)} A "
                                    f"{tuple(a.shape)}, not rows {hi - lo} x {merged.shape[1]}: use the "
                                    "delta made for this model")
            merged[lo:hi] = merged_weight(merged[lo:hi], a.to(merged.device), b.to(merged.device),
                                          routing.lora_scale)
        module.slimwise_lora_weight.copy_(merged)
    if routing.lora_modules:
        logger.info("SlimWise: decode-only LoRA merged into %d projections", len(routing.lora_modules))


def install_norm(routing, norm: nn.Module, weight: torch.Tensor) -> None:
    """Decode tokens get the distilled MoE-input norm; recomputed from the (residual-added) input.
    Gemma-style norms (vLLM's GemmaRMSNorm: Qwen3.5/3.6-MoE) scale by 1 + weight, as transformers' do, and
    the delta holds the transformers parameter, so the offset is added here."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    gemma = isinstance(norm, GemmaRMSNorm)
    norm.register_buffer("slimwise_norm", (weight.float() + 1.0 if gemma else weight).to(
        norm.weight.device, torch.float32 if gemma else norm.weight.dtype), persistent=False)

    def hook(module, args, output):
        normed = first_output(output)
        # fused add: output[1] = x + residual
        source = output[1] if isinstance(output, tuple) else args[0]
        x = source.float()
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
        y = (y * module.slimwise_norm).to(normed.dtype) if gemma \
            else module.slimwise_norm * y.to(normed.dtype)
        out = torch.where(routing.decode_mask[: normed.shape[0], None], y, normed)
        return with_first_output(output, out)

    norm.register_forward_hook(hook)
