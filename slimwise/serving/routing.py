"""Decode-only routing inside a vLLM model (PD-colocated SlimWise): one weight copy, exact token classes.

A token is a *generated* (decode) token iff its position is at or past its request's prompt length; every
prompt token — chunked-prefill chunks of any length, one-token prompts, prompt tokens recomputed after a
prefix-cache hit — has a position below it. The model runner patch (`plugin.py`) computes that per-token
flag on the CPU before each forward and copies it into a persistent bool buffer; each MoE gate's output is
then always passed through `logits.masked_fill(decode[:n, None] & pruned[None, :], -inf)`. Because the
mask is data, not a Python branch, the same graph serves eager mode, torch.compile and CUDA graphs (the
buffer has a fixed address; only its contents change per step).
"""

from __future__ import annotations

import json
import logging
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from slimwise.errors import SlimWiseError
from slimwise.plan import PrunePlan, config_fingerprint

logger = logging.getLogger("vllm.slimwise")  # under "vllm": printed by vLLM's log config in every process

#: hf_overrides / config keys the SlimWise model classes read.
PLAN_KEY = "slimwise_plan"          # path to a plan JSON (or the plan as a dict)
MASK_ALL_KEY = "slimwise_mask_all"  # prune prompt tokens too (uniform pruning inside one engine)
MIN_BATCH_KEY = "slimwise_min_decode_batch"  # load-aware: prune only when >= this many decode tokens
LOG_EVERY_KEY = "slimwise_log_every"  # log counters every N steps (0 = never)

_GATE_NAME = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe|feed_forward)\.(?:gate|router)$")


@dataclass
class RoutingCounters:
    """Tokens routed with the pruned set and with the full set, in total and for recent steps."""

    steps: int = 0
    pruned_tokens: int = 0
    full_tokens: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))  # (step, pruned, full)

    def as_dict(self) -> dict:
        return {"steps": self.steps, "pruned_tokens": self.pruned_tokens, "full_tokens": self.full_tokens,
                "recent": list(self.recent)}


def load_plan_setting(value) -> PrunePlan | None:
    if value is None or value == "":
        return None
    if isinstance(value, PrunePlan):
        return value
    if isinstance(value, dict):
        return PrunePlan(**value)
    return PrunePlan.load(Path(value))


class DecodeRouting(nn.Module):
    """Owns the per-step decode mask and the pruned-expert masks; installed on a vLLM model's gates."""

    def __init__(self, model: nn.Module, hf_config, max_tokens: int):
        super().__init__()
        text_config = getattr(hf_config, "text_config", hf_config)
        self.plan = load_plan_setting(getattr(hf_config, PLAN_KEY, None) or getattr(text_config, PLAN_KEY, None))
        self.mask_all = bool(getattr(hf_config, MASK_ALL_KEY, False))
        self.min_decode_batch = int(getattr(hf_config, MIN_BATCH_KEY, 0) or 0)
        self.log_every = int(getattr(hf_config, LOG_EVERY_KEY, 0) or 0)
        self.counters = RoutingCounters()
        # fixed-address step buffer: True where the token is routed to the kept experts only
        self.register_buffer("decode_mask", torch.zeros(max_tokens, dtype=torch.bool), persistent=False)
        self.gates: dict[int, nn.Module] = {}
        if self.plan is None:
            return
        self._check_plan(hf_config, text_config)
        for name, module in model.named_modules():
            match = _GATE_NAME.search(name)
            if match is None or not hasattr(module, "weight"):
                continue
            layer = int(match.group(1))
            if layer not in self.plan.kept_experts:
                continue
            pruned = self.plan.pruned_mask(layer)
            if not pruned.any():
                continue
            self._install(module, pruned)
            self.gates[layer] = module
        missing = set(self.plan.kept_experts) - set(self.gates) - {
            k for k, v in self.plan.kept_experts.items() if len(v) == self.plan.num_experts}
        if missing:
            raise SlimWiseError(f"plan layers {sorted(missing)} have no MoE gate in this vLLM model")
        logger.info("SlimWise: decode routing on %d MoE layers, kept %s of %d experts (%s, ratio %s)%s",
                    len(self.gates), sorted({len(v) for v in self.plan.kept_experts.values()}),
                    self.plan.num_experts, self.plan.criterion, self.plan.ratio,
                    ", all tokens pruned (uniform)" if self.mask_all else "")

    def _check_plan(self, hf_config, text_config) -> None:
        experts = getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", None) \
            or getattr(text_config, "n_routed_experts", None)
        if experts != self.plan.num_experts:
            raise SlimWiseError(f"plan is for {self.plan.num_experts} experts but the served model has {experts}: "
                                "serve the plan's source model")
        want = (self.plan.fingerprint or {}).get("config_sha256")
        have = {config_fingerprint(c.to_dict()) for c in (hf_config, text_config)}
        if want and want not in have:
            raise SlimWiseError("plan was made for a model with another configuration (config fingerprint "
                                f"{want} not in {sorted(have)}): serve the plan's source model")

    def _install(self, gate: nn.Module, pruned: torch.Tensor) -> None:
        gate.register_buffer("slimwise_pruned", pruned.to(gate.weight.device), persistent=False)
        routing = self

        def hook(module, args, output):
            logits = output[0] if isinstance(output, tuple) else output
            mask = routing.decode_mask[: logits.shape[0], None] & module.slimwise_pruned[None, :]
            masked = logits.masked_fill(mask, float("-inf"))
            return (masked, *output[1:]) if isinstance(output, tuple) else masked

        gate.register_forward_hook(hook)

    @property
    def active(self) -> bool:
        return bool(self.gates)

    def set_step(self, positions: torch.Tensor, prompt_lens: np.ndarray) -> None:
        """Fill the decode mask for this step. prompt_lens: per scheduled token, its request's prompt length."""
        if not self.active:
            return
        n = len(prompt_lens)
        pos = positions[:n].to("cpu", non_blocking=False).numpy() if positions.is_cuda else positions[:n].numpy()
        decode = np.ones(n, dtype=bool) if self.mask_all else pos >= prompt_lens
        n_decode = int(decode.sum())
        if self.min_decode_batch and not self.mask_all and n_decode < self.min_decode_batch:
            decode[:] = False  # load-aware policy: small decode batches keep every expert
            n_decode = 0
        self.decode_mask[:n].copy_(torch.from_numpy(decode), non_blocking=True)
        self.decode_mask[n:].zero_()
        c = self.counters
        c.steps += 1
        c.pruned_tokens += n_decode
        c.full_tokens += n - n_decode
        c.recent.append((c.steps, n_decode, n - n_decode))
        if self.log_every and c.steps % self.log_every == 0:
            logger.info("SlimWise step %d: %d tokens pruned-routed, %d full-routed (totals %d / %d)",
                        c.steps, n_decode, n - n_decode, c.pruned_tokens, c.full_tokens)


def describe_plan(plan: PrunePlan) -> str:
    sizes = sorted({len(v) for v in plan.kept_experts.values()})
    return json.dumps({"criterion": plan.criterion, "ratio": plan.ratio, "phase": plan.phase,
                       "kept_per_layer": sizes, "num_experts": plan.num_experts})
