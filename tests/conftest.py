"""Shared fixtures: tiny random checkpoints per family, saved once per session."""

from __future__ import annotations

import pytest
import torch

from slimwise.tiny import TINY_CONFIGS, save_tiny_model

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


def random_prompts(n: int = 6, vocab: int = 512, seed: int = 0, lengths=(5, 9, 1, 14, 3, 7)) -> list[list[int]]:
    """Token-id prompts of different lengths (a 1-token prompt included)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


ALL_FAMILIES = sorted(TINY_CONFIGS)
