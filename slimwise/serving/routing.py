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

This module owns the per-step state and the modes (`DecodeRouting`: `set_step`, `take_step`, `set_mode`, the
plan of each request) and the plan settings (the `hf_overrides` keys, `load_plans`, `check_plan_config`). The
hooks it installs live by job: `gate_hooks` (the gates, the selection mask, pre-routing, substitution, budget
tables), `delta_hooks` (a distilled router, norm and LoRA), `counters` (`RoutingCounters`, expert counting),
`row_counts` (rows seen inside the forward), `pruned_gates` (a pruned checkpoint's gates file).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from slimwise.decode_gates import PLAIN, DecodeGates
from slimwise.errors import SlimWiseError
from slimwise.fingerprint import config_fingerprint
from slimwise.plan import PrunePlan
from slimwise.serving.counters import RoutingCounters, install_counting
from slimwise.serving.delta_hooks import NORM_NAME, install_lora, install_norm, load_delta
from slimwise.serving.delta_hooks import merge_lora as merge_delta_lora
from slimwise.serving.gate_hooks import GATE_NAME, install_gate

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
        # a delta's tensors, handed over by each trainable set's installer (`delta_hooks.VLLM_INSTALLERS`):
        # routers and norms by layer, taken as the module walk hooks them (any left over is refused); LoRA
        # factors by vLLM module name and fused output block, merged by `merge_lora`
        self.pending_routers: dict[int, torch.Tensor] = {}
        self.pending_norms: dict[int, torch.Tensor] = {}
        self.lora_blocks: dict[str, list[tuple[int | None, torch.Tensor, torch.Tensor]]] = {}
        self.lora_scale = 1.0
        if self.plan is None:
            pruned_gates = _setting(hf_config, text_config, PRUNED_GATES_KEY)
            if pruned_gates:  # a pruned checkpoint's decode instance under --gates drop/substitute
                from slimwise.serving.pruned_gates import install_pruned_gates

                names = {int(m.group(1)): n for n, module in model.named_modules()
                         if (m := GATE_NAME.search(n)) is not None and hasattr(module, "weight")}
                self.hooked["gates"] = install_pruned_gates(model, pruned_gates, names)
            install_counting(self, model, text_config)
            return
        for plan in self.plans.values():
            check_plan_config(plan, hf_config)
        load_delta(self, _setting(hf_config, text_config, DELTA_KEY))
        self.substitutes = {} if self.gates.gates != "substitute" else self.gates.vectors(
            sorted(self.plan.kept_experts), self.plan.num_experts, int(text_config.hidden_size))
        if self.has_delta and not self.gates.plain:
            raise SlimWiseError("a distilled delta decodes with the plain gates it was trained with: drop "
                                "--gates/--fallback/--budget/--extra, or serve them without --distilled")
        install_lora(self, model)
        routers, norms = self.pending_routers, self.pending_norms
        for name, module in model.named_modules():
            norm_match = NORM_NAME.search(name)
            if norm_match is not None and int(norm_match.group(1)) in norms:
                install_norm(self, module, norms.pop(int(norm_match.group(1))))
                self.hooked["norms"].append(name)
            install_gate(self, model, name, module)
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
        install_counting(self, model, text_config)

    def merge_lora(self) -> None:
        """After the weights are loaded (`SlimWiseMixin.load_weights`): a distilled LoRA's merged weights
        (`delta_hooks.merge_lora`)."""
        merge_delta_lora(self)

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


def describe_plan(plan: PrunePlan) -> str:
    sizes = sorted({len(v) for v in plan.kept_experts.values()})
    return json.dumps({"criterion": plan.criterion, "ratio": plan.ratio, "phase": plan.phase,
                       "kept_per_layer": sizes, "num_experts": plan.num_experts})
