"""Shared fixtures: tiny random checkpoints per family, saved once per session."""

from __future__ import annotations

import os

import pytest
import torch
from tiny import TINY_CONFIGS, save_tiny_model

# Larger init than the default 0.02 so random routers spread tokens over experts and pruning changes outputs.
TINY_INIT = 0.15


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """family -> directory of a saved tiny float32 checkpoint (built lazily)."""
    root = tmp_path_factory.mktemp("tiny")
    cache: dict[str, object] = {}

    def get(family: str):
        if family not in cache:
            cache[family] = save_tiny_model(family, root / family, seed=0, initializer_range=TINY_INIT)
        return cache[family]

    return get


def random_prompts(
    n: int = 6, vocab: int = 512, seed: int = 0, lengths=(5, 9, 1, 14, 3, 7)
) -> list[list[int]]:
    """Token-id prompts of different lengths (a 1-token prompt included)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


ALL_FAMILIES = sorted(TINY_CONFIGS)


@pytest.fixture(autouse=True, scope="session")
def _no_vllm_shared_memory_left():
    """vLLM's killed tensor-parallel workers leave shared-memory segments in /dev/shm
    (slimwise/serving/shm.py): about 8 MB per TP=2 engine, for good. Before the session, remove what earlier
    runs left (segments no live process maps), so a small /dev/shm filled by past runs cannot make this run's
    TP engines die at start-up; after it, what this run left."""
    from slimwise.serving import shm

    shm.remove_leftovers()
    yield
    shm.remove_after_exit()


@pytest.fixture(autouse=True)
def _vllm_engine_in_process(request, monkeypatch):
    """Tests marked `vllm_in_process` run vLLM's engine core inside the test process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0): the same engine, scheduler, worker and SlimWise plugin, without
    spawning and re-importing a process per engine. Measured on 2 cores: a tiny engine's start and first
    generate take 7 s (2 s from the second on) instead of 23-26 s, and closing it 2 s instead of 5.5 s; memory
    is returned (RSS 859 -> 864 MiB over four engines). vLLM's CPU worker binds its OpenMP threads, then
    replaces `torch.set_num_threads` process-wide with a no-op and sets VLLM_DIST_IDENT. The function and
    the environment are restored after the test; the thread count is not: changing it after a binding made
    the next in-process engine's float32 tokens differ from the reference's (a test whose CLI ran
    `--threads 1`, then a restore to 2), so the count an engine bound stays until the next engine binds its
    own. An engine core also freezes vLLM's environment variables process-wide when it starts (`vllm.envs`'s
    cache): without `disable_envs_cache()` after the test, every later engine in the process, marked or not,
    reads this test's values (VLLM_ENABLE_V1_MULTIPROCESSING=0 among them, so it runs in-process). Servers
    the tests start (`slimwise serve`) never inherit the switch (tests/test_vllm_serve.py `start`)."""
    if request.node.get_closest_marker("vllm_in_process") is None:
        yield
        return
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    set_num_threads, env = torch.set_num_threads, dict(os.environ)
    yield
    from vllm import envs

    envs.disable_envs_cache()
    torch.set_num_threads = set_num_threads
    for key in set(os.environ) - set(env):
        del os.environ[key]
    os.environ.update(env)


class _GateBlock(torch.nn.Module):
    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.gate = torch.nn.Linear(hidden, experts, bias=False)


class GateModel(torch.nn.Module):
    """A stand-in with the module names of vLLM's MoE gates (`layers.N.mlp.gate`): all DecodeRouting hooks, so
    its routing logic is tested without an engine (the engines' tests are tests/test_vllm_*.py)."""

    def __init__(self, hidden=16, experts=8, layers=2):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(_GateBlock(hidden, experts) for _ in range(layers))


@pytest.fixture(scope="module")
def planned():
    """family -> (a tiny model, its REAP plan at 50% from 8 random prompts), built once per test module."""
    from tiny import build_tiny_model

    from slimwise.calibrate import CalibrationConfig, calibrate
    from slimwise.criteria import plan_from_stats

    cache = {}

    def get(family):
        if family not in cache:
            model = build_tiny_model(family, seed=0, initializer_range=TINY_INIT)
            stats = calibrate(model, random_prompts(8, seed=1), config=CalibrationConfig(max_new_tokens=8),
                              progress=False)
            cache[family] = (model, plan_from_stats(stats, "reap", 0.5))
        return cache[family]

    return get
