"""Masked view of a full model: pruned experts made unselectable in the routers, one weight copy.

`ExpertMask` wraps each pruned layer's router. While `active` is False the router runs its stock forward
(bit-identical to the unpruned model); while True it routes only to the plan's kept experts. The reference
engine switches it on for decode steps (SlimWise) or for everything (uniform pruning). An optional per-token
mask restricts pruning to some rows of a batch (mixed prompt/decode batches). `gates` chooses what a pruned
row's gates do and when it falls back to every expert (`slimwise.decode_gates`); the counters say how often.
A batch budget in `gates` chooses each decode step's experts from the step's own routing over `budget_rows`
(the live rows: finished rows stay in the reference engine's batch but must not weigh in); it applies while
`budgeted` is True (decode), never to uniform pruning.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from slimwise.adapters import MoEAdapter, get_adapter
from slimwise.decode_gate_ops import budget_allowed, drop_pruned, falls_back, substitution, within
from slimwise.decode_gates import PLAIN, DecodeGates
from slimwise.devices import execution_device, onloaded
from slimwise.hooks import ForwardWrappers, first_output, with_first_output
from slimwise.plan import PrunePlan


class ExpertMask:
    """Installs masked routers on `model` for `plan`; use as a context manager or call `remove()`."""

    def __init__(self, model: nn.Module, plan: PrunePlan, adapter: MoEAdapter | None = None,
                 gates: DecodeGates = PLAIN):
        self.model = model
        self.adapter = adapter or get_adapter(model.config)
        self.gates = gates
        self.active = False
        self.token_mask: torch.Tensor | None = None  # bool [num_tokens]: rows to prune (None = all rows)
        self.budgeted = False  # route with the batch budget of `gates` (decode steps), not the static plan
        # bool [rows]: the rows whose gate weight chooses a budget's S (None: every row)
        self.budget_rows: torch.Tensor | None = None
        # per MoE layer, summed over pruned forwards (device tensors: no host sync while generating): rows
        # routed with the plan, rows whose full top-k held a pruned expert, rows that fell back
        self.counts: dict[int, torch.Tensor] = {}
        self._wrappers = ForwardWrappers("expert mask")
        # `substitute`: per layer, the pruned slots' weighted vectors of the current forward, which the MoE
        # block's output hook adds (the router computes them, the block consumes them once)
        self._extra: dict[int, torch.Tensor] = {}
        num_experts = self.adapter.num_experts(model.config)
        top_k = self.adapter.top_k(model.config)
        plan.validate(self.adapter.min_kept_per_group(model.config))
        plan.check_model(model, self.adapter)
        layers = self.adapter.moe_layers(model)
        hidden = self.adapter.text_config(model.config).hidden_size
        vectors = {} if gates.gates != "substitute" else gates.vectors(
            [layer.index for layer in layers], num_experts, int(hidden))
        for layer in layers:
            pruned = torch.ones(num_experts, dtype=torch.bool, device=execution_device(layer.router))
            pruned[plan.kept(layer.index)] = False
            # a budget of E experts chooses from every expert, so it acts on layers the plan leaves whole
            size = gates.step_experts(num_experts, top_k, int((~pruned).sum())) if gates.budgeted else None
            dynamic = size is not None and gates.extra is None and size < num_experts
            if not pruned.any() and not dynamic:
                continue  # nothing pruned: this layer always runs its stock router
            substitutes = vectors.get(layer.index)
            if substitutes is not None:
                substitutes = substitutes.to(pruned.device)
                self._wrappers.hook(layer.block, self._add_extra(layer.index))
            first_kept = plan.kept(layer.index)[0]
            if size is None:
                self._install(layer.router, pruned, layer.index, first_kept, substitutes)
                continue
            forced = torch.zeros_like(pruned) if gates.extra is None else ~pruned
            self._install(layer.router, pruned, layer.index, first_kept, substitutes,
                          (forced[None], torch.tensor([size], device=pruned.device)))

    def _add_extra(self, index: int):
        def hook(module, args, output):
            extra = self._extra.pop(index, None)
            if extra is None:
                return None
            out = first_output(output)
            out = out + extra.to(out.dtype).view_as(out)
            return with_first_output(output, out)

        return hook

    def _install(self, router: nn.Module, static_pruned: torch.Tensor, index: int, first_kept: int,
                 substitutes: torch.Tensor | None = None, budget: tuple | None = None) -> None:
        """`budget`: (forced [1, E], size [1]) of `budget_allowed` for this layer, or None (static plan)."""
        adapter, static_gates = self.adapter, self.gates.static
        prunes = bool(static_pruned.any())  # False: a layer hooked for the budget alone

        def make(original):
            def forward(hidden_states, *args, **kwargs):
                budgeted = self.budgeted and budget is not None
                if not self.active or not (budgeted or prunes):
                    return original(hidden_states, *args, **kwargs)
                gates = self.gates if budgeted else static_gates
                pruned = static_pruned
                if self.token_mask is None and gates.plain:
                    with onloaded(router):  # an offloaded router's weight is only there while it runs
                        return adapter.route(router, hidden_states, pruned)
                full = original(hidden_states, *args, **kwargs)  # (logits, weights, ids)
                rows = torch.ones(full[2].shape[0], dtype=torch.bool, device=full[2].device) \
                    if self.token_mask is None else self.token_mask.reshape(-1).to(full[2].device)
                if budgeted:
                    counted = rows if self.budget_rows is None else rows & self.budget_rows.reshape(-1).to(
                        rows.device)
                    groups = torch.zeros_like(rows, dtype=torch.long)
                    pruned = ~budget_allowed(full[1], full[2], groups, counted, *budget)[0]
                slot_pruned = pruned[full[2]] & rows[:, None]
                back = falls_back(full[1], slot_pruned, gates.fallback) & rows
                self._count(index, rows, slot_pruned.any(dim=-1), back)
                rows = rows & ~back
                if gates.routes_as_drop:
                    placeholder = torch.full_like(full[2][:, 0], first_kept)
                    slot_pruned = slot_pruned & rows[:, None]
                    weights, ids = drop_pruned(full[1], full[2], slot_pruned, placeholder)
                    if substitutes is not None:
                        self._extra[index] = substitution(full[1], full[2], slot_pruned, substitutes)
                    return full[0], weights, ids
                with onloaded(router):
                    masked = adapter.route(router, hidden_states, pruned)
                if budgeted:  # grouped routers (DeepSeek) may find fewer than k of S in their groups
                    masked = (masked[0], *within(masked[1], masked[2], pruned))
                rows = rows.reshape(-1, 1)
                return tuple(torch.where(rows, m, f) for f, m in zip(full, masked, strict=True))

            return forward

        self._wrappers.wrap(router, make)

    def _count(self, index: int, rows: torch.Tensor, hit: torch.Tensor, back: torch.Tensor) -> None:
        step = torch.stack([rows.sum(), (hit & rows).sum(), back.sum()])
        total = self.counts.get(index)
        self.counts[index] = step if total is None else total + step

    def fallback_summary(self) -> dict:
        """Token-layer pairs routed with the plan since the mask was made (or `reset_counts`): how many, how
        many had a pruned expert among the full router's top-k, how many fell back to every expert, and the
        shares. Filled only where the variant needs the full routing (`gates` not plain or a token mask)."""
        rows, hit, back = (sum(int(c[i]) for c in self.counts.values()) for i in range(3))
        return {**self.gates.describe(), "routed": rows, "touching_pruned": hit, "fell_back": back,
                "fallback_share": back / rows if rows else 0.0,
                "touching_pruned_share": hit / rows if rows else 0.0}

    def reset_counts(self) -> None:
        self.counts = {}

    @contextmanager
    def pruned(self, active: bool = True, token_mask: torch.Tensor | None = None, budgeted: bool = False):
        """Route to the kept experts inside the block (optionally only for rows where token_mask is True);
        `budgeted`: with the batch budget of `gates` instead (decode steps)."""
        previous = (self.active, self.token_mask, self.budgeted)
        self.active, self.token_mask, self.budgeted = active, token_mask, budgeted
        try:
            yield self
        finally:
            self.active, self.token_mask, self.budgeted = previous

    def remove(self) -> None:
        """Restore each router's forward. Wrappers stack (another engine's mask, a delta), so they must come
        off in reverse order: removing one from under another would silently drop the one on top."""
        self._wrappers.remove()

    def __enter__(self) -> ExpertMask:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
