"""vLLM compatibility pieces checked without an engine: the torchvision-free import of vLLM's Qwen3.5/3.6
model file (slimwise/serving/compat.py; each case in a fresh interpreter, so that no module imported by
another test decides the outcome) and the connector classes vLLM resolves by name."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm


def run(code: str, path: str | None = None) -> subprocess.CompletedProcess:
    prefix = f"import sys; sys.path.insert(0, {path!r})\n" if path else ""
    return subprocess.run(
        [sys.executable, "-c", prefix + textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )


def test_qwen3_5_imports_only_with_the_fallback():
    """On this CPU stack (no torchvision) the stock module fails to import; after the fallback it imports, and
    the function vLLM takes from the torchvision module is transformers' PIL backend's copy."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        pytest.fail(
            "torchvision is installed in this environment; scripts/setup.sh removes it on the CPU stack"
        )
    out = run("""
        try:
            import vllm.model_executor.models.qwen3_5
        except ModuleNotFoundError as e:
            assert e.name == "torchvision", e
        else:
            raise AssertionError("the stock module imported without torchvision: the fallback is not needed")
        from slimwise.serving.compat import install_torchvision_free_qwen_vl
        assert install_torchvision_free_qwen_vl() is True
        assert install_torchvision_free_qwen_vl() is True  # idempotent
        from vllm.model_executor.models.qwen3_5 import \
Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration
        import vllm.model_executor.models.qwen3_vl as vl
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil
        assert vl.image_smart_resize is pil.smart_resize
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_a_real_torchvision_is_never_touched(tmp_path):
    """Where torchvision is installed (GPU stacks) the fallback does nothing: the transformers module name
    stays free for the real import."""
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text("")
    out = run("""
        from slimwise.serving.compat import TORCHVISION_MODULE, install_torchvision_free_qwen_vl
        assert install_torchvision_free_qwen_vl() is False
        assert TORCHVISION_MODULE not in sys.modules
        print("ok")
    """, path=str(tmp_path))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_nixl_connector_for_hybrids_resolves_as_vllm_loads_it():
    """`SlimWiseNixlConnector` (GPU disaggregation of hybrid models) is found by vLLM's connector factory from
    `kv_connector` + `kv_connector_module_path` and is vLLM's pull NixlConnector with hybrid-memory support.
    Its constructor (which keeps hybrid prefill prompts whole) and its transfers need NIXL and CUDA: not run
    here (docs/serving.md lists what a GPU run must check)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

    from slimwise.serving import connector

    config = KVTransferConfig(kv_connector="SlimWiseNixlConnector", kv_role="kv_both",
                              kv_connector_module_path="slimwise.serving.connector")
    cls = KVConnectorFactory.get_connector_class(config)
    assert (
        cls is connector.SlimWiseNixlConnector
        and issubclass(cls, NixlPullConnector)
        and issubclass(cls, SupportsHMA)
    )
    for name in ("SlimWiseConnector", "SlimWiseNixlConnector"):
        assert issubclass(getattr(connector, name), SupportsHMA)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_shared_directory_connector_waits_for_every_rank_and_refuses_another_tp_size(tmp_path, tp_size):
    """The decode side of `SlimWiseConnector` (scheduler role, built from the vLLM config of a real tiny
    model) loads a prompt only once every layer's file of every rank of its tensor-parallel size is stored,
    and refuses, in one line naming the fix, a prompt stored at another size (whose shards do not fit its
    ranks). The files' writing and loading by real ranks is test_vllm_serve::test_disaggregated_serve."""
    import torch
    from tiny import save_tiny_model
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from slimwise.errors import SlimWiseError
    from slimwise.serving.connector import SlimWiseConnector, state_file_name

    model = save_tiny_model("qwen3_moe", tmp_path / "model")
    kv_dir = tmp_path / "kv"
    config = EngineArgs(
        model=str(model),
        tensor_parallel_size=tp_size,
        kv_transfer_config=KVTransferConfig(
            kv_connector="SlimWiseConnector",
            kv_connector_module_path="slimwise.serving.connector",
            kv_role="kv_consumer",
            kv_connector_extra_config={"shared_storage_path": str(kv_dir)},
        ),
    ).create_engine_config()
    layers = [
        f"model.layers.{i}.self_attn.attn" for i in range(config.model_config.hf_config.num_hidden_layers)
    ]
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32)
    kv_config = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
    )
    connector = SlimWiseConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config=kv_config)

    prompt = [5, 6, 7, 8]
    folder = Path(connector._generate_foldername_debug(torch.tensor(prompt), [], create_folder=True))
    assert not connector._stored(prompt, [])
    files = [state_file_name(layer, tp_size, rank) for layer in layers for rank in range(tp_size)]
    for name in files[:-1]:
        (folder / name).write_bytes(b"")
    assert not connector._stored(prompt, [])  # one rank's last layer is not on disk yet: not loaded
    (folder / files[-1]).write_bytes(b"")
    assert connector._stored(prompt, [])

    other = [9, 10, 11]
    folder = Path(connector._generate_foldername_debug(torch.tensor(other), [], create_folder=True))
    for layer in layers:
        for rank in range(3 - tp_size):  # stored by a prefill instance at the other size
            (folder / state_file_name(layer, 3 - tp_size, rank)).write_bytes(b"")
    with pytest.raises(
        SlimWiseError,
        match=rf"at --tensor-parallel-size {3 - tp_size} and this decode instance "
        rf"runs {tp_size}.*same --tensor-parallel-size",
    ) as err:
        connector._stored(other, [])
    assert "\n" not in str(err.value)
