"""Decode-only routing inside a vLLM model (PD-colocated SlimWise): one weight copy, exact token classes.

A token is a *generated* (decode) token iff its position is at or past its request's prompt length; every
prompt token — chunked-prefill chunks of any length, one-token prompts, prompt tokens recomputed after a
prefix-cache hit — has a position below it. The model runner patch (`plugin.py`) computes that per-token
flag on the CPU before each forward and copies it into a persistent buffer; each MoE gate's output is
then always passed through `logits.masked_fill(pruned_table[row_plan[:n]], -inf)`. Because the mask is data,
not a Python branch, the same graph serves eager mode, torch.compile and CUDA graphs (the buffers have fixed
addresses; only their contents change per step).

A batch budget (`slimwise.decode_gates`: budget / budget_share / extra) replaces a plan row's static pruned
set by the step's own S, chosen per plan group inside each gate hook from the stock routing of the step's
rows (`decode_gate_ops.budget_allowed`: fixed shapes, no host read, so graph-safe like the static mask).
Uniform mode keeps the static plan (`budget_on` is a buffer, so a mode switch needs no re-trace).

Several plans in one engine: `row_plan` holds, per token, the index of the plan it is routed with (0: every
expert); row k of each gate's `pruned_table` is plan k's pruned set in that layer, row 0 all False. A request
chooses its plan by name in `SamplingParams.extra_args["slimwise_plan"]` (the OpenAI server's `vllm_xargs`;
`slimwise serve` maps model names to it); without one it gets the default plan. One plan is the case P = 1.
"""

from __future__ import annotations

import json
import logging
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from slimwise.adapters.deepseek_v3 import grouped_topk_ids
from slimwise.decode_gate_ops import (
    budget_allowed,
    decode_prerouted,
    encode_prerouted,
    falls_back,
    substitution,
    within,
)
from slimwise.decode_gates import PLAIN, DecodeGates
from slimwise.errors import SlimWiseError
from slimwise.fingerprint import config_fingerprint
from slimwise.plan import PrunePlan

logger = logging.getLogger("vllm.slimwise")  # under "vllm": printed by vLLM's log config in every process

#: hf_overrides / config keys the SlimWise model classes read.
PLAN_KEY = "slimwise_plan"          # path to a plan JSON (or the plan as a dict)
MASK_ALL_KEY = "slimwise_mask_all"  # prune prompt tokens too (uniform pruning inside one engine)
MODES = ("full", "slimwise", "uniform")  # what `DecodeRouting.set_mode` switches between
MIN_BATCH_KEY = "slimwise_min_decode_batch"  # load-aware: prune only when >= this many decode tokens
LOG_EVERY_KEY = "slimwise_log_every"  # log counters every N steps (0 = never)
COUNT_EXPERTS_KEY = "slimwise_count_experts"  # count distinct experts per layer on decode steps (eager only)
DELTA_KEY = "slimwise_delta"  # path to a `slimwise distill` delta: decode-only router / norm / LoRA overrides
PLANS_KEY = "slimwise_plans"  # several named plans in one engine: {name: plan path or dict}
# the plan of requests that name none: a name of PLANS_KEY, or "full"
DEFAULT_PLAN_KEY = "slimwise_default_plan"
REQUEST_PLAN_ARG = "slimwise_plan"  # a request's plan: SamplingParams.extra_args key (OpenAI: vllm_xargs)
DEFAULT_PLAN_NAME = "default"  # the name of a lone PLAN_KEY plan
GATES_KEY = "slimwise_gates"  # the pruned rows' gate variant (slimwise.decode_gates.GATES)
SUBSTITUTES_KEY = "slimwise_substitutes"  # `substitute`: the statistics file with expert output sums
PRUNED_GATES_KEY = "slimwise_pruned_gates"  # a pruned checkpoint's gates file (slimwise.gate_sidecar)
FALLBACK_KEY = "slimwise_fallback"  # route a decode token with every expert above this pruned share
BUDGET_KEY = "slimwise_budget"  # a batch budget: {"budget": E} | {"budget_share": s} | {"extra": M}

_GATE_NAME = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe|feed_forward)\.(?:gate|router)$")
_NORM_NAME = re.compile(r"layers\.(\d+)\.post_attention_layernorm$")
# a LoRA target's vLLM module and fused block: slimwise.trainable.VLLM_LORA_TARGETS, beside the targets


@dataclass
class RoutingCounters:
    """Tokens routed with the pruned set and with the full set, in total and for recent steps."""

    steps: int = 0
    pruned_tokens: int = 0
    full_tokens: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))  # (step, pruned, full)
    # with COUNT_EXPERTS_KEY: steps with decode tokens; per layer, distinct experts the decode tokens selected
    # (summed over steps) and the steps counted (0 when the hook never ran, e.g. a compiled model); per decode
    # batch size, [layer-steps, distinct experts summed]
    decode_steps: int = 0
    experts_touched_sum: dict = field(default_factory=dict)
    experts_counted_steps: dict = field(default_factory=dict)
    touched_by_batch: dict = field(default_factory=dict)
    # steps where the host-side token positions (what classifies tokens) disagreed with the
    # positions vLLM passed to the model; checked only where both are on the host (the CPU
    # backend), so it costs no device sync
    position_mismatch_steps: int = 0
    # pruned-routed tokens per plan name (several plans in one engine); requests naming
    # an unknown plan (full-routed)
    plan_tokens: dict = field(default_factory=dict)
    unknown_plan_requests: int = 0
    # with COUNT_EXPERTS_KEY and a fallback threshold, per layer: [pruned-routed rows, rows whose full top-k
    # held a pruned expert, rows that fell back to every expert]
    fallback: dict = field(default_factory=dict)
    # forwards run with a dummy step (profiling, warm-up, CUDA-graph capture, DP padding): every row full
    dummy_steps: int = 0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "pruned_tokens": self.pruned_tokens, "full_tokens": self.full_tokens,
                "position_mismatch_steps": self.position_mismatch_steps,
                "plan_tokens": dict(self.plan_tokens),
                "unknown_plan_requests": self.unknown_plan_requests,
                "recent": list(self.recent), "decode_steps": self.decode_steps,
                "experts_touched_sum": dict(self.experts_touched_sum),
                "experts_counted_steps": dict(self.experts_counted_steps),
                "touched_by_batch": {b: list(v) for b, v in self.touched_by_batch.items()},
                "fallback": {layer: list(v) for layer, v in self.fallback.items()},
                "dummy_steps": self.dummy_steps}


def load_plan_setting(value) -> PrunePlan | None:
    if value is None or value == "":
        return None
    if isinstance(value, PrunePlan):
        return value
    if isinstance(value, dict):
        return PrunePlan.from_dict(value, "the slimwise_plan override")
    return PrunePlan.load(Path(value))


def _setting(hf_config, text_config, key: str):
    return getattr(hf_config, key, None) or getattr(text_config, key, None)


def check_plan_name(name: str) -> None:
    """A plan name becomes part of a model name (MODEL:NAME): plain characters,
    and not the reserved "full"."""
    if name == "full" or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise SlimWiseError(f"plan name {name!r}: use letters, digits, '_', '.', '-' (and not 'full')")


def load_plans(hf_config, text_config) -> tuple[dict[str, PrunePlan], str]:
    """The engine's named plans and the default plan's name ("full": requests that name none keep every
    expert). PLAN_KEY alone is one plan named DEFAULT_PLAN_NAME; PLANS_KEY holds several (not both)."""
    one, many = _setting(hf_config, text_config, PLAN_KEY), _setting(hf_config, text_config, PLANS_KEY)
    if one and many:
        raise SlimWiseError(f"give either {PLAN_KEY} (one plan) or {PLANS_KEY} (named plans), not both")
    if one:
        plans = {DEFAULT_PLAN_NAME: load_plan_setting(one)}
    else:
        plans = {str(k): load_plan_setting(v) for k, v in (many or {}).items()}
    for name in plans:
        check_plan_name(name)
    sizes = {p.num_experts for p in plans.values()}
    if len(sizes) > 1:
        raise SlimWiseError(f"the plans are for models with {sorted(sizes)} experts: every plan of one "
                            "engine must be made for the served model")
    default = _setting(hf_config, text_config, DEFAULT_PLAN_KEY) or (next(iter(plans)) if plans else "full")
    if default != "full" and default not in plans:
        raise SlimWiseError(f"default plan {default!r} is not among the plans ({', '.join(plans)}) or 'full'")
    return plans, default


def read_gates(hf_config, text_config) -> DecodeGates:
    """The gate variant, fallback and batch budget the overrides set (`slimwise_overrides`)."""
    fallback = getattr(hf_config, FALLBACK_KEY, None)  # 0.0 is a threshold: no `or` chain here
    fallback = getattr(text_config, FALLBACK_KEY, None) if fallback is None else fallback
    budget = _setting(hf_config, text_config, BUDGET_KEY) or {}
    return DecodeGates(_setting(hf_config, text_config, GATES_KEY) or PLAIN.gates,
                       None if fallback is None or fallback == "" else float(fallback),
                       _setting(hf_config, text_config, SUBSTITUTES_KEY) or None,
                       **{k: budget.get(k) for k in ("budget", "budget_share", "extra")})


class DecodeRouting(nn.Module):
    """Owns the per-step decode mask and the pruned-expert masks; installed on a vLLM model's gates."""

    def __init__(self, model: nn.Module, hf_config, max_tokens: int):
        super().__init__()
        text_config = getattr(hf_config, "text_config", hf_config)
        self.plans, self.default_plan = load_plans(hf_config, text_config)
        # row k of every gate's pruned table is plan_names[k] (row 0: every expert, the "full" routing)
        self.plan_names = ["full", *self.plans]
        self.plan_index = {name: i for i, name in enumerate(self.plan_names)}
        # the plan checks, the delta and the log refer to the default plan (the only one with a delta)
        self.plan = self.plans.get(self.default_plan) or next(iter(self.plans.values()), None)
        self._request_plans: dict[str, int] = {}  # req_id -> plan index, refreshed each step (multi-plan)
        # "uniform" with MASK_ALL_KEY (every token pruned), else "slimwise";
        # switched at run time by `set_mode`
        self.mode = "uniform" if getattr(hf_config, MASK_ALL_KEY, False) else "slimwise"
        self.min_decode_batch = int(getattr(hf_config, MIN_BATCH_KEY, 0) or 0)
        self.log_every = int(getattr(hf_config, LOG_EVERY_KEY, 0) or 0)
        self.count_experts = bool(getattr(hf_config, COUNT_EXPERTS_KEY, False))
        self.gates = read_gates(hf_config, text_config)
        self.top_k = int(getattr(text_config, "num_experts_per_tok", 0)
                         or getattr(text_config, "experts_per_token", 0) or 0)
        self.has_delta = False
        self._count_batch = 0  # decode tokens in the current step (expert counting)
        self.counters = RoutingCounters()
        # fixed-address step buffer: True where the token is routed to the kept experts only
        self.register_buffer("decode_mask", torch.zeros(max_tokens, dtype=torch.bool), persistent=False)
        # per token: the plan it is routed with (0: every expert); indexes each gate's pruned table
        self.register_buffer("row_plan", torch.zeros(max_tokens, dtype=torch.long), persistent=False)
        # whether a batch budget chooses the plan rows' experts (off in uniform mode: the static plan)
        self.register_buffer("budget_on", torch.tensor(self.mode != "uniform"), persistent=False)
        # rows the forward itself saw, counted inside one gate hook (`row_counts.install_row_counter`): what
        # the start-up self-check compares with the rows it scheduled, so a runner that never set the step
        # state is caught even where no Python runs per step (CUDA-graph replay)
        self.register_buffer("rows_seen", torch.zeros(2, len(self.plan_names), dtype=torch.long),
                             persistent=False)
        self.counted_layer: int | None = None  # the gate whose hook counts rows_seen
        self.counted_prunes: list[bool] = []  # per plan row: whether it prunes an expert in counted_layer
        # set by `set_step` / `set_dummy_step`, taken by `take_step` before each forward (fail closed)
        self._step_ready = False
        self.runner = "unknown"  # the vLLM model runner whose seam sets the steps (serving/runners.py)
        self.gates_by_layer: dict[int, nn.Module] = {}
        # module names
        self.hooked: dict[str, list[str]] = {"gates": [], "norms": [], "lora": [], "selection": [],
                                             "substitution": []}
        # vLLM module name -> module whose decode rows use W + sBA
        self.lora_modules: dict[str, nn.Module] = {}
        # a delta's tensors, handed over by each trainable set (slimwise.trainable `install_in_vllm`): routers
        # and norms by layer, taken as the module walk hooks them (any left over is refused); LoRA factors by
        # vLLM module name and fused output block, merged by `merge_lora`
        self.pending_routers: dict[int, torch.Tensor] = {}
        self.pending_norms: dict[int, torch.Tensor] = {}
        self.lora_blocks: dict[str, list[tuple[int | None, torch.Tensor, torch.Tensor]]] = {}
        self.lora_scale = 1.0
        if self.plan is None:
            pruned_gates = _setting(hf_config, text_config, PRUNED_GATES_KEY)
            if pruned_gates:  # a pruned checkpoint's decode instance under --gates drop/substitute
                from slimwise.serving.pruned_gates import install_pruned_gates

                names = {int(m.group(1)): n for n, module in model.named_modules()
                         if (m := _GATE_NAME.search(n)) is not None and hasattr(module, "weight")}
                self.hooked["gates"] = install_pruned_gates(model, pruned_gates, names, _selection_router)
            self._install_counting(model, text_config)
            return
        for plan in self.plans.values():
            check_plan_config(plan, hf_config)
        self._load_delta(_setting(hf_config, text_config, DELTA_KEY))
        self.substitutes = {} if self.gates.gates != "substitute" else self.gates.vectors(
            sorted(self.plan.kept_experts), self.plan.num_experts, int(text_config.hidden_size))
        if self.has_delta and not self.gates.plain:
            raise SlimWiseError("a distilled delta decodes with the plain gates it was trained with: drop "
                                "--gates/--fallback/--budget/--extra, or serve them without --distilled")
        self._install_lora(model)
        routers, norms = self.pending_routers, self.pending_norms
        for name, module in model.named_modules():
            norm_match = _NORM_NAME.search(name)
            if norm_match is not None and int(norm_match.group(1)) in norms:
                self._install_norm(module, norms.pop(int(norm_match.group(1))))
                self.hooked["norms"].append(name)
            self._install_gate(model, name, module)
        if routers or norms:
            raise SlimWiseError(f"delta layers {sorted(set(routers) | set(norms))} have no router/norm in "
                                "this vLLM model: use the delta made for this model and plan")
        for name, plan in self.plans.items():
            missing = set(plan.kept_experts) - set(self.gates_by_layer) - {
                k for k, v in plan.kept_experts.items() if len(v) == plan.num_experts}
            if missing:
                raise SlimWiseError(f"plan {name!r}: layers {sorted(missing)} have no "
                                    "MoE gate in this vLLM model")
            logger.info("SlimWise: plan %r%s: decode routing on %d MoE layers, kept %s of %d "
                        "experts (%s, ratio %s)%s",
                        name, " (default)" if name == self.default_plan else "", len(self.gates_by_layer),
                        sorted({len(v) for v in plan.kept_experts.values()}),
                        plan.num_experts, plan.criterion, plan.ratio,
                        ", all tokens pruned (uniform)" if self.mode == "uniform" else "")
        if not self.gates.plain:
            fallback = self.gates.fallback
            logger.info("SlimWise: gates %s, fallback %s%s", self.gates.gates,
                        "off" if fallback is None else f"above a pruned share of {fallback}",
                        f", batch budget {self.gates.describe()}" if self.gates.budgeted else "")
        self._install_counting(model, text_config)

    def _install_gate(self, model: nn.Module, name: str, module: nn.Module) -> None:
        """If `name` is an MoE gate that a plan prunes or the delta has a router for: hook it (its layer's
        router taken from `pending_routers`); other modules are left alone."""
        match = _GATE_NAME.search(name)
        if match is None or not hasattr(module, "weight"):
            return
        layer = int(match.group(1))
        if all(layer not in p.kept_experts for p in self.plans.values()):
            return
        pruned = self._pruned_table(layer)
        budget = self._budget_table(layer, pruned)
        routers = self.pending_routers
        masks = bool(pruned.any()) or budget is not None
        if not masks and layer not in routers:
            return
        router = _selection_router(model, name)
        runner = getattr(model.get_submodule(name.rsplit(".", 1)[0]), "experts", None)
        full = self._full_routing(runner, router, name) if masks and not self.gates.plain else None
        if router is not None:  # sigmoid + correction bias / grouped top-k: -inf logits alone would not do
            self._install(module, pruned if masks else None, routers.pop(layer, None), layer, full, budget)
            if masks:
                self._install_selection(router)
                self.hooked["selection"].append(name.rsplit(".", 1)[0] + ".experts.router")
        elif getattr(runner, "_fse_fuse_gate", False):
            # the runner computes router + shared-expert-gate logits in one GEMM and never calls the gate; a
            # mask applied inside the runner is not known to survive torch.compile (see _install_selection)
            raise SlimWiseError(f"{name}: vLLM fuses this router with the shared-expert gate (ROCm AITER "
                                "fused shared experts), which bypasses the SlimWise gate hook; disable the "
                                "fusion (VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=0)")
        else:
            self._install(module, pruned, routers.pop(layer, None), layer, full, budget)
        if full is not None and self.gates.routes_as_drop:
            self._install_prerouted(runner.router, full)
        if full is not None and layer in self.substitutes:
            self._install_substitution(name.rsplit(".", 1)[0], model, module, full, self.substitutes[layer])
        self.gates_by_layer[layer] = module
        self.hooked["gates"].append(name)
        if self.counted_layer is None and masks:
            from slimwise.serving.row_counts import install_row_counter

            install_row_counter(module, self)
            self.counted_layer = layer
            prunes = pruned.any(dim=-1)
            if budget is not None:
                prunes = prunes | (budget[1] < pruned.shape[1])
            self.counted_prunes = prunes.tolist()

    def _full_routing(self, runner, selection, name: str):
        """The layer's stock routing as a function of (hidden, logits) -> (weights, ids): what the gate
        variants and the fallback start from, computed by vLLM's own router code so that rows left alone stay
        stock."""
        router = getattr(runner, "router", None)
        if selection is not None:
            return lambda hidden, logits: masked_grouped_topk(
                logits, torch.zeros_like(logits, dtype=torch.bool), selection)
        if router is None or not hasattr(router, "_compute_routing"):
            raise SlimWiseError(f"{name}: gates {self.gates.gates} / fallback need the layer's vLLM router "
                                "(FusedMoE.router), which this model does not have: serve with the default "
                                "gates and no fallback")
        stock = router._compute_routing
        return lambda hidden, logits: stock(hidden, logits, None)

    def _install_substitution(self, block_name: str, model: nn.Module, gate: nn.Module, full,
                              vectors: torch.Tensor) -> None:
        """`substitute`: the MoE block's output gains, per routed row, its pruned slots' weights times their
        experts' vectors. The block's input is the gate's, so the hook recomputes the routing the gate hook
        decided on (the gate's own forward, without its hooks; the same fallback) from data alone, which
        torch.compile traces like the gate hook."""
        block = model.get_submodule(block_name)
        block.register_buffer("slimwise_substitutes", vectors.to(gate.weight.device), persistent=False)
        routing, tau = self, self.gates.fallback

        def hook(module, args, output):
            hidden = args[0].reshape(-1, vectors.shape[-1])
            raw = gate.forward(hidden)
            logits = raw[0] if isinstance(raw, tuple) else raw
            weights, ids = full(hidden, logits)
            slot_pruned = gate.slimwise_pruned[routing.row_plan[: hidden.shape[0]]].gather(1, ids.long())
            slot_pruned = slot_pruned & ~falls_back(weights, slot_pruned, tau)[:, None]
            extra = substitution(weights, ids, slot_pruned, module.slimwise_substitutes)
            out = output[0] if isinstance(output, tuple) else output
            out = out + extra.to(out.dtype).view_as(out)
            return (out, *output[1:]) if isinstance(output, tuple) else out

        block.register_forward_hook(hook)
        self.hooked["substitution"].append(block_name)

    @staticmethod
    def _install_prerouted(router, full) -> None:
        """`drop`: the gate hook writes each routed row's final weights into its logits (`encode_prerouted`);
        the router reads them back, and routes every other row (finite logits) with its stock code."""
        top_k = router.top_k

        def compute_routing(hidden_states, router_logits, indices_type, *, input_ids=None):
            pre = torch.isneginf(router_logits).any(dim=-1, keepdim=True)
            weights, ids = full(hidden_states, router_logits.masked_fill(pre, 0))
            pre_weights, pre_ids = decode_prerouted(router_logits, top_k)
            return (torch.where(pre, pre_weights, weights.float()).contiguous(),
                    torch.where(pre, pre_ids, ids.to(torch.int32)).contiguous())

        router._compute_routing = compute_routing

    def _pruned_table(self, layer: int) -> torch.Tensor:
        """(plans + 1, experts) bool: row 0 (every expert) all False, row k plan
        k's pruned experts in `layer`."""
        rows = [torch.zeros(self.plan.num_experts, dtype=torch.bool)]
        for plan in self.plans.values():
            rows.append(plan.pruned_mask(layer) if layer in plan.kept_experts
                        else torch.zeros(plan.num_experts, dtype=torch.bool))
        return torch.stack(rows)

    def _budget_table(self, layer: int, pruned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A batch budget's (forced [plans + 1, experts], size [plans + 1]) for `budget_allowed` in `layer`:
        row 0 (every expert) forces all; plan k forces its kept set under `extra` (nothing under `budget`),
        and its size is `DecodeGates.step_experts`. None: no budget."""
        if not self.gates.budgeted:
            return None
        experts = pruned.shape[1]
        forced = ~pruned if self.gates.extra is not None else torch.zeros_like(pruned)
        forced[0] = True
        size = torch.tensor([experts] + [self.gates.step_experts(experts, self.top_k, int((~row).sum()))
                                         for row in pruned[1:]])
        return forced, size

    def _load_delta(self, value) -> None:
        """Load a distilled delta and let each trainable set hand its tensors over (`pending_routers`,
        `pending_norms`, `lora_blocks`: decode tokens only). Refuses a delta with several plans, made for
        another plan, or made for uniform pruning."""
        if not value:
            return
        if len(self.plans) > 1:
            raise SlimWiseError("a distilled delta is tied to one plan: serve it with that plan alone (one "
                                "engine per delta), not with several plans")
        from slimwise.delta import Delta, plan_hash
        from slimwise.trainable import TRAINABLE_SETS

        delta = Delta.load(value)
        if delta.manifest.get("plan_hash") != plan_hash(self.plan):
            raise SlimWiseError(f"delta {value} was distilled for another plan: serve it with its own plan")
        if delta.mode == "uniform" and self.mode != "uniform":
            raise SlimWiseError("this delta was distilled for uniform pruning (prefill "
                                "pruned too), not SlimWise")
        self.has_delta = True
        for trainable_set in TRAINABLE_SETS.values():
            trainable_set.install_in_vllm(self, delta)
        logger.info("SlimWise: decode-only delta %s (%s)", value, ", ".join(delta.params))

    def _install_lora(self, model: nn.Module) -> None:
        """Decode rows of each LoRA-targeted projection are recomputed with the merged weight
        W + scale * B @ A -- the reference engine's and the exporter's exact expression -- and selected by the
        decode mask; prompt rows keep the stock output. The merged weight is a fixed-address buffer filled by
        `merge_lora` once the checkpoint is loaded (it costs one more copy of the targeted projections: the
        attention weights, a few percent of an MoE model)."""
        if not self.lora_blocks:
            return
        from vllm.distributed import get_tensor_model_parallel_world_size

        if get_tensor_model_parallel_world_size() != 1:
            raise SlimWiseError("colocated LoRA deltas need tensor_parallel_size 1: export the folded "
                                "checkpoint with `slimwise prune --distilled` and serve it as the "
                                "--disaggregated decode model")
        modules = dict(model.named_modules())
        routing = self
        self.lora_blocks = {_vllm_name(modules, name): blocks for name, blocks in self.lora_blocks.items()}
        for name in self.lora_blocks:
            module = modules.get(name)
            if module is None or getattr(module, "weight", None) is None:
                raise SlimWiseError(f"the delta's LoRA targets {name}, which this vLLM model does not have: "
                                    "use the delta made for this model")
            module.register_buffer("slimwise_lora_weight",
                                   torch.zeros_like(module.weight, requires_grad=False), persistent=False)

            def hook(module, args, output):
                out = output[0] if isinstance(output, tuple) else output
                bias = module.bias if getattr(module, "bias", None) is not None \
                    and not module.skip_bias_add else None
                merged = F.linear(args[0], module.slimwise_lora_weight, bias).to(out.dtype)
                out = torch.where(routing.decode_mask[: out.shape[0], None], merged, out)
                return (out, *output[1:]) if isinstance(output, tuple) else out

            module.register_forward_hook(hook)
            self.lora_modules[name] = module
            self.hooked["lora"].append(name)

    @torch.no_grad()
    def merge_lora(self) -> None:
        """After the weights are loaded (before vLLM may repack them):
        W + scale * B @ A per targeted block."""
        from slimwise.trainable import merged_weight

        for name, module in self.lora_modules.items():
            merged = module.weight.detach().clone()
            sizes = list(getattr(module, "output_sizes", None) or [merged.shape[0]])
            starts = np.cumsum([0, *sizes]).tolist()
            for block, a, b in self.lora_blocks[name]:
                lo, hi = (0, merged.shape[0]) if block is None else (starts[block], starts[block + 1])
                if b.shape[0] != hi - lo or a.shape[1] != merged.shape[1]:
                    raise SlimWiseError(f"LoRA for {name} (block {block}) has shape B {tuple(b.shape)} A "
                                        f"{tuple(a.shape)}, not rows {hi - lo} x {merged.shape[1]}: use the "
                                        "delta made for this model")
                merged[lo:hi] = merged_weight(merged[lo:hi], a.to(merged.device), b.to(merged.device),
                                              self.lora_scale)
            module.slimwise_lora_weight.copy_(merged)
        if self.lora_modules:
            logger.info("SlimWise: decode-only LoRA merged into %d projections", len(self.lora_modules))

    def _install(self, gate: nn.Module, pruned: torch.Tensor | None, router: torch.Tensor | None = None,
                 layer: int = -1, full=None, budget: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Gate output hook: decode rows get the distilled router (if any) and, with `pruned` (the per-plan
        table), -inf logits for the experts their plan prunes (softmax routers). pruned=None: logits untouched
        (the selection is masked instead). `full` (the layer's stock routing; gates other than plain): rows
        over the fallback threshold keep their logits, and under `drop` each routed row that holds a pruned
        expert carries its final routing in its logits (`encode_prerouted`)."""
        if pruned is not None:
            gate.register_buffer("slimwise_pruned", pruned.to(gate.weight.device), persistent=False)
            first_kept = (~pruned).to(torch.int8).argmax(dim=-1)  # per plan row: a kept expert (drop's fill)
            gate.register_buffer("slimwise_first_kept", first_kept.to(gate.weight.device), persistent=False)
        if budget is not None:  # the batch budget's forced sets and sizes per plan row (`_budget_table`)
            gate.register_buffer("slimwise_forced", budget[0].to(gate.weight.device), persistent=False)
            gate.register_buffer("slimwise_size", budget[1].to(gate.weight.device), persistent=False)
        if router is not None:
            gate.register_buffer("slimwise_router",
                                 router.to(gate.weight.device, gate.weight.dtype), persistent=False)
        routing = self

        def hook(module, args, output):
            logits = output[0] if isinstance(output, tuple) else output
            n = logits.shape[0]
            if router is not None:  # decode tokens route with the distilled router
                logits = torch.where(routing.decode_mask[:n, None],
                                     F.linear(args[0], module.slimwise_router).to(logits.dtype), logits)
            if pruned is None:
                masked = logits
            elif full is None:
                masked = logits.masked_fill(module.slimwise_pruned[routing.row_plan[:n]], float("-inf"))
            else:
                masked = routing._gated(module, args[0], logits, full, layer)
            return (masked, *output[1:]) if isinstance(output, tuple) else masked

        gate.register_forward_hook(hook)

    def _gated(self, gate: nn.Module, hidden: torch.Tensor, logits: torch.Tensor, full, layer: int):
        """The gate variant and the fallback on one layer's logits (see `slimwise.decode_gates`)."""
        n = logits.shape[0]
        row_plan = self.row_plan[:n]
        rows_pruned = gate.slimwise_pruned[row_plan]
        weights, ids = full(hidden, logits)
        if hasattr(gate, "slimwise_forced"):  # batch budget: the step's S per plan group, its decode rows
            allowed = budget_allowed(weights, ids, row_plan, row_plan > 0, gate.slimwise_forced,
                                     gate.slimwise_size)
            rows_pruned = torch.where(self.budget_on, ~allowed[row_plan], rows_pruned)
            if self.gates.fallback is None and not self.count_experts:  # nothing reads the slots: mask now
                return logits.masked_fill(rows_pruned, float("-inf"))
        slot_pruned = rows_pruned.gather(1, ids.long())
        back = falls_back(weights, slot_pruned, self.gates.fallback)
        if self.count_experts and not torch.compiler.is_compiling():
            routed = row_plan > 0
            entry = self.counters.fallback.setdefault(layer, [0, 0, 0])
            entry[0] += int(routed.sum())
            entry[1] += int((slot_pruned.any(dim=-1) & routed).sum())
            entry[2] += int(back.sum())
        if not self.gates.routes_as_drop:
            return logits.masked_fill(rows_pruned & ~back[:, None], float("-inf"))
        slot_pruned = slot_pruned & ~back[:, None]
        encoded = encode_prerouted(weights, ids, slot_pruned, gate.slimwise_first_kept[row_plan],
                                   logits.shape[-1], logits.dtype)
        return torch.where(slot_pruned.any(dim=-1, keepdim=True), encoded, logits)

    @staticmethod
    def _install_selection(router) -> None:
        """Replace a grouped / biased vLLM router's routing with `masked_grouped_topk`, taking the experts a
        row may not select from its -inf logits: the gate hook writes those (decode rows, pruned experts), so
        the mask travels with the logits (a mask read from the decode buffer inside the router was not
        applied under torch.compile -- verified: compiled uniform mode gave other tokens) and a stock
        (finite) row routes as stock."""

        def compute_routing(hidden_states, router_logits, indices_type, *, input_ids=None):
            return masked_grouped_topk(router_logits, torch.isneginf(router_logits), router)

        router._compute_routing = compute_routing

    def _install_norm(self, norm: nn.Module, weight: torch.Tensor) -> None:
        """Decode tokens get the distilled MoE-input norm; recomputed from the (residual-added) input.
        Gemma-style norms (vLLM's GemmaRMSNorm: Qwen3.5/3.6-MoE) scale by 1 + weight, as transformers' do, and
        the delta holds the transformers parameter, so the offset is added here."""
        from vllm.model_executor.layers.layernorm import GemmaRMSNorm

        gemma = isinstance(norm, GemmaRMSNorm)
        norm.register_buffer("slimwise_norm", (weight.float() + 1.0 if gemma else weight).to(
            norm.weight.device, torch.float32 if gemma else norm.weight.dtype), persistent=False)
        routing = self

        def hook(module, args, output):
            normed = output[0] if isinstance(output, tuple) else output
            # fused add: output[1] = x + residual
            source = output[1] if isinstance(output, tuple) else args[0]
            x = source.float()
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
            y = (y * module.slimwise_norm).to(normed.dtype) if gemma \
                else module.slimwise_norm * y.to(normed.dtype)
            out = torch.where(routing.decode_mask[: normed.shape[0], None], y, normed)
            return (out, *output[1:]) if isinstance(output, tuple) else out

        norm.register_forward_hook(hook)

    def _install_counting(self, model: nn.Module, text_config) -> None:
        """With COUNT_EXPERTS_KEY: a hook on every gate, after the mask, recording the distinct experts that
        this step's decode tokens select (top-k of the masked logits). Costs a top-k and a host sync per
        layer, so it runs eager-only: skipped while torch.compile traces (counts then stay 0: benchmark with
        enforce_eager) and while a CUDA graph is captured (a sync is illegal there; `guards.counting_paused`).
        A CUDA engine that counts must be eager (refused otherwise: `guards.counting_problem`)."""
        if not self.count_experts:
            return
        from slimwise.serving.guards import counting_paused

        top_k = int(getattr(text_config, "num_experts_per_tok", 0)
                    or getattr(text_config, "experts_per_token", 0))
        self.register_buffer("count_rows", torch.zeros_like(self.decode_mask), persistent=False)
        routing = self
        for name, module in model.named_modules():
            match = _GATE_NAME.search(name)
            if match is None or not hasattr(module, "weight") or _selection_router(model, name) is not None:
                continue  # (a selection router does not pick the logits' top-k: not counted)
            layer = int(match.group(1))

            def hook(module, args, output, layer=layer):
                # counting_paused first: under torch.compile it is constant, so no guard on per-step state
                if counting_paused() or routing._count_batch == 0:
                    return None
                logits = output[0] if isinstance(output, tuple) else output
                rows = logits[routing.count_rows[: logits.shape[0]]]
                values, ids = rows.topk(min(top_k, rows.shape[-1]), dim=-1)
                # a `drop` row's left-over slots (-inf) read its heaviest slot's expert again
                ids = torch.where(torch.isneginf(values), ids[:, :1], ids)
                touched = int(torch.unique(ids).numel())
                c = routing.counters
                c.experts_touched_sum[layer] = c.experts_touched_sum.get(layer, 0) + touched
                c.experts_counted_steps[layer] = c.experts_counted_steps.get(layer, 0) + 1
                entry = c.touched_by_batch.setdefault(routing._count_batch, [0, 0])
                entry[0] += 1
                entry[1] += touched
                return None

            module.register_forward_hook(hook)

    def set_mode(self, mode: str, min_decode_batch: int | None = None) -> dict:
        """Switch the served mode between steps, so one engine (one weight copy) serves all three:
        "full" (no token pruned: every hook passes its input through), "slimwise" (generated tokens pruned) or
        "uniform" (every token pruned). Counters restart. The caller resets vLLM's prefix cache: its blocks
        were computed under the previous mode (prompt KV differs between uniform and the others)."""
        if mode not in MODES:
            raise SlimWiseError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        if mode != "full" and self.plan is None:
            raise SlimWiseError(f"mode {mode!r} needs a plan: serve the model with one")
        if mode == "uniform" and len(self.plans) > 1:
            raise SlimWiseError("mode 'uniform' prunes prompt tokens, whose KV the prefix cache shares "
                                "between requests: it runs with one plan per engine, not several")
        if mode == "uniform" and self.has_delta:
            raise SlimWiseError("this engine carries a SlimWise decode-only delta, which uniform pruning "
                                "must not use: start an engine without --distilled for uniform")
        self.mode = mode
        self.budget_on.fill_(mode != "uniform")
        if min_decode_batch is not None:
            self.min_decode_batch = int(min_decode_batch)
        self.counters = RoutingCounters()
        return {"mode": self.mode, "min_decode_batch": self.min_decode_batch}

    def describe(self) -> dict:
        """The vLLM modules this routing acts on, by kind (gates, norms, lora, selection), and the mode."""
        return {"mode": self.mode, "plans": list(self.plans), "default_plan": self.default_plan,
                **self.gates.describe(), **{kind: list(names) for kind, names in self.hooked.items()}}

    @property
    def multi_plan(self) -> bool:
        """Whether requests may choose their routing: whenever the engine has a plan, since "full" is always
        one of the choices (a server with one named plan exposes MODEL:full beside it)."""
        return bool(self.plans)

    def plan_of(self, req_id: str, params) -> int:
        """A request's plan index from its `SamplingParams.extra_args[REQUEST_PLAN_ARG]` (or the default). An
        unknown name (a client bypassing the server's check) is full-routed and counted, never an engine
        error."""
        name = ((getattr(params, "extra_args", None) or {}).get(REQUEST_PLAN_ARG) or self.default_plan)
        idx = self.plan_index.get(str(name))
        if idx is None:
            self.counters.unknown_plan_requests += 1
            logger.warning("SlimWise: request %s names plan %r, not one of %s: routed with every expert",
                           req_id, name, ", ".join(self.plan_names))
            idx = 0
        return idx

    def request_plans(self, req_ids: Sequence[str], params: Sequence) -> np.ndarray:
        """Plan index per request (`plan_of`), cached by request id for the request's life."""
        cache, out = {}, np.empty(len(req_ids), dtype=np.int64)
        for i, (rid, sp) in enumerate(zip(req_ids, params, strict=True)):
            idx = self._request_plans.get(rid)
            cache[rid] = out[i] = self.plan_of(rid, sp) if idx is None else idx
        self._request_plans = cache  # finished requests drop out
        return out

    def set_dummy_step(self) -> None:
        """A forward without requests (profiling, warm-up, CUDA-graph capture, DP padding): every row keeps
        every expert. Arms the next forward like `set_step`."""
        self.row_plan.zero_()
        self.decode_mask.zero_()
        self.counters.dummy_steps += 1
        self._step_ready = True

    def take_step(self) -> None:
        """Called by the model's forward (eager Python, outside any graph): the runner seam must have set
        this forward's step state. Fail closed: a forward with stale or unset state raises instead of routing
        rows with another step's mask (or none)."""
        if not self._step_ready and self.active:
            raise SlimWiseError(
                f"a forward ran without SlimWise's per-step state (model runner: {self.runner}): this vLLM "
                "model runner does not call the hook SlimWise installs, so the plan would not apply; use "
                "vLLM 0.32 with VLLM_USE_V2_MODEL_RUNNER=0, or report the runner")
        self._step_ready = False

    @property
    def active(self) -> bool:
        return (bool(self.gates_by_layer) or bool(self.lora_modules) or bool(self.hooked["norms"])
                or self.count_experts)

    def set_step(self, token_positions: np.ndarray, prompt_lens: np.ndarray,
                 model_positions: torch.Tensor | None = None, token_plans: np.ndarray | None = None) -> None:
        """Fill the decode mask for this step.

        token_positions: per scheduled token, its index in its request's sequence, computed on the host
        from the scheduler's bookkeeping (no GPU->CPU copy of the positions tensor, so no
        synchronisation per step);
        prompt_lens: per scheduled token, its request's prompt length. `model_positions`, the positions
        tensor vLLM passes to the model, is compared with them when it lives on the host (CPU
        backend, text positions).
        token_plans: per scheduled token, its request's plan index (see `request_plans`); None: the
        default plan.
        """
        if not self.active:
            return
        self._step_ready = True
        n = len(prompt_lens)
        pos = np.asarray(token_positions[:n])
        host = model_positions is not None and not model_positions.is_cuda and model_positions.dim() == 1
        if host and not np.array_equal(model_positions[:n].numpy(), pos):
            self.counters.position_mismatch_steps += 1
        generated = pos >= prompt_lens
        if self.count_experts:
            self._count_batch = int(generated.sum())
            self.count_rows[:n].copy_(torch.from_numpy(generated))
            self.count_rows[n:].zero_()
            self.counters.decode_steps += self._count_batch > 0
            if not self.gates_by_layer and not self.lora_modules and not self.hooked["norms"]:
                return
        plans = (np.full(n, self.plan_index.get(self.default_plan, 0), dtype=np.int64) if token_plans is None
                 else np.asarray(token_plans[:n], dtype=np.int64))
        if self.mode == "full":
            rows = np.zeros(n, dtype=np.int64)
        elif self.mode == "uniform":
            rows = plans
        else:
            rows = np.where(generated, plans, 0)
        decode = rows > 0
        n_decode = int(decode.sum())
        # load-aware policy: small decode batches keep every expert. With several plans the threshold counts
        # every token routed to a plan, whichever plan: the step's expert traffic is the union over the batch
        if self.min_decode_batch and self.mode == "slimwise" and n_decode < self.min_decode_batch:
            rows[:] = 0
            decode[:] = False
            n_decode = 0
        self.row_plan[:n].copy_(torch.from_numpy(rows), non_blocking=True)
        self.row_plan[n:].zero_()
        self.decode_mask[:n].copy_(torch.from_numpy(decode), non_blocking=True)
        self.decode_mask[n:].zero_()
        c = self.counters
        if n_decode and len(self.plans) > 1:
            for idx, count in zip(*np.unique(rows[decode], return_counts=True), strict=True):
                name = self.plan_names[int(idx)]
                c.plan_tokens[name] = c.plan_tokens.get(name, 0) + int(count)
        c.steps += 1
        c.pruned_tokens += n_decode
        c.full_tokens += n - n_decode
        c.recent.append((c.steps, n_decode, n - n_decode))
        if self.log_every and c.steps % self.log_every == 0:
            logger.info("SlimWise step %d: %d tokens pruned-routed, %d full-routed (totals %d / %d)",
                        c.steps, n_decode, n - n_decode, c.pruned_tokens, c.full_tokens)


def check_plan_config(plan: PrunePlan, hf_config) -> None:
    """Refuse a plan made for another model from its config alone (expert count, config fingerprint): cheap
    enough to run before any engine starts (`slimwise serve`) and again inside every worker."""
    text_config = getattr(hf_config, "text_config", None) or hf_config
    experts = getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", None) \
        or getattr(text_config, "n_routed_experts", None)
    if experts != plan.num_experts:
        raise SlimWiseError(f"plan is for {plan.num_experts} experts but the served model has {experts}: "
                            "serve the plan's source model")
    want = (plan.fingerprint or {}).get("config_sha256")
    have = {config_fingerprint(c.to_dict()) for c in (hf_config, text_config)}
    if want and want not in have:
        raise SlimWiseError("plan was made for a model with another configuration (config fingerprint "
                            f"{want} not in {sorted(have)}): serve the plan's source model")


def _vllm_name(modules: dict[str, nn.Module], name: str) -> str:
    """The vLLM module for a transformers module name. Names agree up to the language model's prefix: a
    delta made on the text-only transformers model (`model.layers.3...`) targets
    `language_model.model.layers.3...` in vLLM's multimodal Qwen3.5/3.6-MoE class. An exact name wins; else
    the one module ending in the same `layers.` path."""
    if name in modules or "layers." not in name:
        return name
    tail = name[name.index("layers."):]
    hits = [m for m in modules if m.endswith("." + tail)]
    return hits[0] if len(hits) == 1 else name


def _selection_router(model: nn.Module, gate_name: str):
    """The vLLM router of the MoE block that owns `gate_name` if it selects experts from anything but the
    logits' top-k (a correction bias, grouped top-k, sigmoid scores): masking logits is not enough there."""
    experts = getattr(model.get_submodule(gate_name.rsplit(".", 1)[0]), "experts", None)
    router = getattr(experts, "router", None)
    if router is None:
        return None
    biased = getattr(router, "e_score_correction_bias", None) is not None
    grouped = bool(getattr(router, "use_grouped_topk", getattr(router, "num_expert_group", None) is not None))
    if not (biased or grouped or getattr(router, "scoring_func", "softmax") != "softmax"):
        return None
    if getattr(router, "num_fused_shared_experts", 0):
        raise SlimWiseError(f"{gate_name}: shared experts fused into the routed top-k (ROCm AITER) are not "
                            "supported; disable the fusion (VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=0)")
    if not hasattr(router, "_compute_routing") \
            or getattr(router, "scoring_func", "softmax") not in ("softmax", "sigmoid"):
        raise SlimWiseError(f"{gate_name}: vLLM router {type(router).__name__} "
                            f"({getattr(router, 'scoring_func', '?')}) has no SlimWise selection mask")
    return router


def masked_grouped_topk(router_logits: torch.Tensor, rows_pruned: torch.Tensor, router) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """vLLM's CPU `_grouped_topk` (vllm/model_executor/layers/fused_moe/router/cpu_router.py) with the
    selection scores (scores + e_score_correction_bias) of `rows_pruned` set to -inf before the group scores
    and again after the group mask -- `DeepseekV3Adapter.route`, the reference engine's masking, row by row.
    Weights are the unbiased scores of the selected experts. Rows without a pruned entry give exactly the
    stock result. Tested for DeepSeek-V3 (sigmoid + bias + groups); softmax-scored grouped routers
    (DeepSeek-V2 style) follow the same code, untested.
    """
    scores = router_logits.float()
    # softmax scoring: pruned logits -> -inf first, as in a sliced router (sigmoid: the scores stay unbiased)
    scores = scores.sigmoid() if router.scoring_func == "sigmoid" else scores.masked_fill(rows_pruned, float(
        "-inf")).softmax(dim=-1)
    bias = getattr(router, "e_score_correction_bias", None)
    groups = int(getattr(router, "num_expert_group", None) or 1) \
        if getattr(router, "use_grouped_topk", True) else 1
    topk_group = int(getattr(router, "topk_group", None) or groups) if groups > 1 else 1
    choice = scores + bias.unsqueeze(0) if bias is not None else scores
    topk_ids = grouped_topk_ids(choice, rows_pruned, groups, topk_group, router.top_k,
                                "top2" if bias is not None else "max")
    topk_weights = scores.gather(1, topk_ids)  # biased: the unbiased scores; unbiased: the selection scores
    if router.renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    # a batch budget's S may leave a row fewer than k experts in its best groups: those slots read nothing
    topk_weights, topk_ids = within(topk_weights, topk_ids, rows_pruned)
    if router.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * router.routed_scaling_factor
    return topk_weights.to(torch.float32).contiguous(), topk_ids.to(torch.int32).contiguous()


def describe_plan(plan: PrunePlan) -> str:
    sizes = sorted({len(v) for v in plan.kept_experts.values()})
    return json.dumps({"criterion": plan.criterion, "ratio": plan.ratio, "phase": plan.phase,
                       "kept_per_layer": sizes, "num_experts": plan.num_experts})
