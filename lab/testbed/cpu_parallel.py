"""How the testbed trainer spends the CPU cores: data-parallel single-thread ranks,
or one process's thread count.

The testbed models' matmuls are tiny (64 experts of 64 x 128), so a second OpenMP thread in one process adds
little. `spawn` (`ranks` in TrainConfig) runs the loop in single-thread processes instead: each rank takes its
share of a step's micro-batches, the gradients are summed with gloo (a file store in a temporary directory;
nothing listens on the network), and every rank applies the same optimizer step to the same summed gradients,
so the weights stay identical without a broadcast (`check_in_sync` verifies it at the end). Rank 0 alone
writes files. On a 2-core machine two ranks were not measurably faster than two threads, so the default stays
one process; on more cores it is not measured. `ThreadTuner` picks 1 or 2 OpenMP threads for one process on a
machine shared with other jobs.

Two cores of a shared VM do not give twice one core's throughput, and two runs of one command can differ by a
quarter in tokens/s: compare throughput side by side, in one run. The measurements are in
docs/history/testbeds.md.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from slimwise.parent_death import parent_death_hook


def spawn(fn: Callable[..., object], world: int, *args) -> None:
    """Run fn(rank, world, *args) in `world` fresh processes (one torch thread each) joined by a gloo group.

    The ranks die with this process, however it ends: torch's spawn gives them a parent-death signal,
    SIGINT, which a command started in the background (`cmd &`, nohup) ignores, and a `kill` of such a
    training command left its ranks training on, orphaned, writing the run directory;
    `parent_death_hook` makes it SIGTERM."""
    with tempfile.TemporaryDirectory(prefix="slimwise-ddp-") as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(_entry, args=(fn, world, store, args, os.getpid()), nprocs=world, join=True,
                           start_method="spawn")


def _entry(rank: int, fn: Callable[..., object], world: int, store: str, args: tuple, parent: int) -> None:
    hook = parent_death_hook(parent)
    if hook is not None:
        hook()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank_batches(batches: Sequence[dict[str, torch.Tensor]], rank: int,
                 world: int) -> list[dict[str, torch.Tensor]]:
    """This rank's share of a step: micro-batches balanced by padded positions, or every
    world-th row of a single packed batch.

    Micro-batches go longest first to the least-loaded rank (ties to the lower rank), so every rank computes
    the same assignment. Why not every world-th one: the micro-batches are length-sorted, so that gave one
    rank the longest; on testbed-c's steps (4 micro-batches, 2 ranks) the busier rank had 1.46x the positions
    of half the real tokens, 1.31x balanced. A rank may get nothing (fewer micro-batches than ranks); it still
    joins the gradient sum with zeros.
    """
    if world == 1:
        return list(batches)
    if len(batches) == 1:
        share = {k: v[rank::world] for k, v in batches[0].items()}
        return [share] if share["input_ids"].shape[0] else []
    loads, mine = [0] * world, []
    for i in sorted(range(len(batches)), key=lambda i: -batches[i]["input_ids"].numel()):
        r = min(range(world), key=lambda r: loads[r])
        loads[r] += batches[i]["input_ids"].numel()
        if r == rank:
            mine.append(batches[i])
    return mine


def sum_gradients(model: nn.Module) -> None:
    """All-reduce (sum) every trainable parameter's gradient in one flat buffer; a
    missing gradient counts as 0."""
    if world_size() == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        p.grad = g
        offset += n


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of t over the ranks (t itself on one process)."""
    if world_size() > 1:
        dist.all_reduce(t)
    return t


def from_rank0(value: float) -> float:
    """Rank 0's value on every rank (the time budget: all ranks must stop at the same step)."""
    if world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.broadcast(t, 0)
    return float(t.item())


def check_in_sync(model: nn.Module) -> None:
    """Raise unless every rank holds bit-identical weights (the same summed gradients and optimizer steps must
    give them; a difference means a rank took another path)."""
    if world_size() == 1:
        return
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    if not torch.equal(high, low):
        raise RuntimeError(f"data-parallel ranks diverged: {int((high != low).sum())} weights differ")


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


class ThreadTuner:
    """Picks the faster torch thread count on a shared machine.

    Every `period` steps it runs up to `probe` steps with each choice and keeps the one with the lowest median
    seconds per token. A probe step more than `abort` times slower than the reference (the chosen count's
    median at the last decision) ends that choice's probe at once, and `patience` consecutive steps of the
    chosen count that slow start a new probe right away. On 2 cores shared with other jobs, 2 OpenMP threads
    can be ten times slower than 1 (each thread waits for the other while another job holds a core); on an
    idle machine 2 threads are faster.
    """

    def __init__(self, choices: Sequence[int] = (1, 2), period: int = 100, probe: int = 5, abort: float = 2.0,
                 patience: int = 3):
        self.choices, self.period, self.probe, self.abort, self.patience = (
            tuple(choices), period, probe, abort, patience)
        self.best = self.choices[0]
        self.reference: float | None = None
        self.samples: dict[int, list[float]] = {c: [] for c in self.choices}
        self.aborted: set[int] = set()
        self.origin = 0  # step at which the current probe cycle started
        self.slow = 0
        self._step = 0

    def threads_for(self, step: int) -> int:
        self._step = step
        phase = (step - self.origin) % self.period
        if phase == 0:
            self.samples = {c: [] for c in self.choices}
            self.aborted = set()
        if phase < self.probe * len(self.choices):
            choice = self.choices[phase // self.probe]
            return self.best if choice in self.aborted else choice
        if phase == self.probe * len(self.choices):
            medians = {c: sorted(v)[len(v) // 2]
                       for c, v in self.samples.items() if v and c not in self.aborted}
            if medians:
                self.best = min(medians, key=medians.get)
                self.reference = medians[self.best]
            self.slow = 0
        return self.best

    def record(self, threads: int, seconds_per_token: float) -> None:
        if threads not in self.samples:
            return
        self.samples[threads].append(seconds_per_token)
        too_slow = self.reference is not None and seconds_per_token > self.abort * self.reference
        if threads != self.best and too_slow:
            self.aborted.add(threads)
        probing = (self._step - self.origin) % self.period < self.probe * len(self.choices)
        if threads == self.best and not probing:
            self.slow = self.slow + 1 if too_slow else 0
            if self.slow >= self.patience:  # the machine got busier: measure again from the next step
                self.origin, self.slow = self._step + 1, 0
