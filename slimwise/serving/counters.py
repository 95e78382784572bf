"""What the vLLM decode routing counts: tokens routed with the pruned set and with every expert per step (by
`DecodeRouting.set_step`, on the host), and with COUNT_EXPERTS_KEY the distinct experts each layer's decode
rows selected and the fallbacks (eager only: a top-k and a host sync per layer).

Read through `collective_rpc("slimwise_counters")` (`slimwise.serving.plugin`) by the bench, the traffic
counters and the tests; restarted by every mode switch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

from slimwise.hooks import first_output
from slimwise.serving.gate_hooks import GATE_NAME, selection_router


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


def install_counting(routing, model: nn.Module, text_config) -> None:
    """With COUNT_EXPERTS_KEY: a hook on every gate, after the mask, recording the distinct experts that
    this step's decode tokens select (top-k of the masked logits). Costs a top-k and a host sync per
    layer, so it runs eager-only: skipped while torch.compile traces (counts then stay 0: benchmark with
    enforce_eager) and while a CUDA graph is captured (a sync is illegal there; `guards.counting_paused`).
    A CUDA engine that counts must be eager (refused otherwise: `guards.counting_problem`). `routing`: the
    `DecodeRouting` whose `counters` and per-step `_count_batch` / `count_rows` the hooks use."""
    if not routing.count_experts:
        return
    from slimwise.serving.guards import counting_paused

    top_k = int(getattr(text_config, "num_experts_per_tok", 0)
                or getattr(text_config, "experts_per_token", 0))
    routing.register_buffer("count_rows", torch.zeros_like(routing.decode_mask), persistent=False)
    for name, module in model.named_modules():
        match = GATE_NAME.search(name)
        if match is None or not hasattr(module, "weight") or selection_router(model, name) is not None:
            continue  # (a selection router does not pick the logits' top-k: not counted)
        layer = int(match.group(1))

        def hook(module, args, output, layer=layer):
            # counting_paused first: under torch.compile it is constant, so no guard on per-step state
            if counting_paused() or routing._count_batch == 0:
                return None
            logits = first_output(output)
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
