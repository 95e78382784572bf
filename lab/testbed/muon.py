"""Muon for the testbed trainer: orthogonalised momentum for matrices and expert stacks, AdamW for the rest.

Why not `torch.optim.Muon`: it runs Newton-Schulz in bfloat16 (0.4 GFLOP/s on an AVX2-only CPU, so seconds per
step) and takes 2-D parameters only, while the experts of transformers' MoE blocks are fused (E, out, in)
stacks. Here the iteration runs in float32 and batched over the experts, each expert's gate, up and down
matrices orthogonalised on their own (the gate and up halves of `gate_up_proj` too). The update is scaled
to AdamW's RMS (Moonlight, "Muon is Scalable for LLM Training": 0.2 * sqrt(max(rows, cols))), so one
learning rate, schedule and weight decay serve both optimizers. Embeddings, the LM head, routers, norms,
gates of a few rows (the Gated-DeltaNet's beta and decay projections) and its convolution stay on AdamW, as
Moonlight keeps embeddings and head.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, as in torch.optim.Muon


def orthogonalize(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximately U V^T of each matrix in g (..., m, n), by the quintic
    Newton-Schulz iteration in float32."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    """Muon over groups of matrices; a group's `blocks` splits each (.., rows, cols) tensor into that many row
    blocks orthogonalised separately (2 for a fused gate/up projection)."""

    def __init__(self, params, lr: float, weight_decay: float = 0.0, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      ns_steps=ns_steps, blocks=1))

    @torch.no_grad()
    def step(self, closure=None):
        """One step. Under torch.distributed (the trainer's data-parallel ranks, which hold identical summed
        gradients) each rank orthogonalises a share of the tensors, balanced by size, and broadcasts
        its updates: Newton-Schulz is a large share of a step on one core, so computing it on every rank
        would cost a large share of each step (figures: docs/history/testbeds.md, "Trainer kernels")."""
        items = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        owners, load = [0] * len(items), [0] * world
        for i in sorted(range(len(items)), key=lambda i: -items[i][1].numel()):  # same order on every rank
            owners[i] = min(range(world), key=load.__getitem__)
            load[owners[i]] += items[i][1].numel()
        updates = []
        for (group, p), owner in zip(items, owners, strict=True):
            mu, blocks = group["momentum"], group["blocks"]
            buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
            # every rank keeps every buffer: the same state on all, resumable from any
            buf.lerp_(p.grad, 1 - mu)
            if owner != rank:
                updates.append(torch.empty_like(p))
                continue
            update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
            rows, cols = p.shape[-2] // blocks, p.shape[-1]
            ortho = orthogonalize(update.reshape(-1, blocks, rows, cols), group["ns_steps"]).reshape(p.shape)
            updates.append(ortho.mul_(0.2 * max(rows, cols) ** 0.5).to(p.dtype))
        if world > 1:
            for work in [dist.broadcast(u, src=o, async_op=True)
                         for u, o in zip(updates, owners, strict=True)]:
                work.wait()
        for (group, p), update in zip(items, updates, strict=True):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update, alpha=-group["lr"])


class MuonAdamW:
    """Muon and AdamW stepped together, with one list of param groups (the trainer sets every group's lr)."""

    def __init__(self, muon: Muon, adamw: torch.optim.Optimizer):
        self.muon, self.adamw = muon, adamw
        self.param_groups = muon.param_groups + adamw.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def muon_parameters(model: nn.Module) -> dict[str, int]:
    """Name -> row blocks of the parameters Muon trains: hidden Linear weights and fused expert stacks."""
    chosen = {}
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(module, nn.Linear) and min(module.weight.shape) >= 16:
            if module is model.get_output_embeddings() or mod_name.endswith("mlp.gate"):
                # the LM head and the routers stay on AdamW; so do gates of a few rows (min side < 16)
                continue
            chosen[prefix + "weight"] = 1
        for name, blocks in (("gate_up_proj", 2), ("down_proj", 1)):
            p = getattr(module, name, None)
            if isinstance(p, nn.Parameter) and p.ndim == 3:
                chosen[prefix + name] = blocks
    return chosen
