"""`SlimWiseConnector` on vLLM's own config objects, without an engine: the worker side stores from the
layers' bound caches without a forward context (V2 calls `wait_for_save` after the forward), maps the KV-cache
manager's blocks to the attention kernel's smaller blocks, and refuses a layout it cannot map. The engines'
handoff itself: tests/test_vllm_disaggregated.py, tests/test_vllm_serve.py."""

from __future__ import annotations

import os

import pytest
import safetensors.torch
import torch

from slimwise.errors import SlimWiseError

pytestmark = pytest.mark.slow

BLOCK = 16  # the manager's tokens per block
NUM_BLOCKS = 6


def connector(tmp_path, monkeypatch):
    from tiny import save_tiny_model
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from slimwise.serving.connector import SlimWiseConnector

    model_dir = save_tiny_model("qwen3_moe", tmp_path / "tiny", seed=0)
    transfer = KVTransferConfig(kv_connector="SlimWiseConnector", kv_role="kv_producer",
                                kv_connector_module_path="slimwise.serving.connector",
                                kv_connector_extra_config={"shared_storage_path": str(tmp_path / "kv")})
    config = EngineArgs(model=str(model_dir), max_model_len=256, skip_tokenizer_init=True, block_size=BLOCK,
                        kv_transfer_config=transfer).create_engine_config()
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(["layers.0.attn"], spec)])
    conn = SlimWiseConnector(config, KVConnectorRole.WORKER, kv_config)
    # a single-process worker: tensor-parallel rank 0 (vLLM's distributed state is not set up here)
    monkeypatch.setattr(SlimWiseConnector, "_rank", staticmethod(lambda: 0))
    return conn


def bind(conn, cache: torch.Tensor) -> None:
    """What vLLM's `bind_kv_cache` does for the layer: its cache on the module the forward context holds."""
    from types import SimpleNamespace

    conn._vllm_config.compilation_config.static_forward_context["layers.0.attn"] = SimpleNamespace(
        kv_cache=cache)


def store(conn, blocks: list[int], tokens: int):
    from slimwise.serving.connector import PromptState, SlimWiseConnectorMetadata

    request = PromptState(token_ids=list(range(1, tokens + 1)), block_ids=(blocks,), is_store=True,
                          mm_hashes=[])
    conn.bind_connector_metadata(SlimWiseConnectorMetadata(requests=[request]))
    conn.wait_for_save()  # no forward context is set: what V2 does (post_forward)
    folder = conn._folder(request.token_ids, [])
    return safetensors.torch.load_file(os.path.join(folder, os.listdir(folder)[0]))["kv_cache"]


@pytest.mark.parametrize("ratio", [1, 2])
def test_stores_the_registered_blocks_outside_a_forward(tmp_path, monkeypatch, ratio):
    from vllm.forward_context import is_forward_context_available

    conn = connector(tmp_path, monkeypatch)
    # ratio 2: the attention kernel works in 8-token blocks, so vLLM views the cache as 12 kernel blocks
    cache = torch.arange(NUM_BLOCKS * ratio * 4, dtype=torch.float32).view(NUM_BLOCKS * ratio, 4)
    bind(conn, cache)
    assert not is_forward_context_available()
    saved = store(conn, blocks=[4, 1, 3], tokens=2 * BLOCK + 3)  # 35 tokens: the first three blocks
    rows = [b * ratio + j for b in (4, 1, 3) for j in range(ratio)]
    assert torch.equal(saved, cache[rows])


def test_refuses_a_cache_it_cannot_map(tmp_path, monkeypatch):
    conn = connector(tmp_path, monkeypatch)
    bind(conn, torch.zeros(NUM_BLOCKS * 2 + 1, 4))
    with pytest.raises(SlimWiseError, match="13 blocks for the manager's 6, a layout it cannot map"):
        store(conn, blocks=[0], tokens=3)


def test_a_layer_without_a_bound_cache_is_refused(tmp_path, monkeypatch):
    conn = connector(tmp_path, monkeypatch)
    with pytest.raises(SlimWiseError, match=r"\['layers.0.attn'\] of the KV-cache config have no bound"):
        store(conn, blocks=[0], tokens=3)
