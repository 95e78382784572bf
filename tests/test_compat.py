"""vLLM compatibility pieces checked without an engine: the torchvision-free import of vLLM's Qwen3.5/3.6 model file
(slimwise/serving/compat.py; each case in a fresh interpreter, so that no module imported by another test decides the
outcome) and the connector classes vLLM resolves by name."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.vllm


def run(code: str, path: str | None = None) -> subprocess.CompletedProcess:
    prefix = f"import sys; sys.path.insert(0, {path!r})\n" if path else ""
    return subprocess.run([sys.executable, "-c", prefix + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300)


def test_qwen3_5_imports_only_with_the_fallback():
    """On this CPU stack (no torchvision) the stock module fails to import; after the fallback it imports, and the
    function vLLM takes from the torchvision module is transformers' PIL backend's copy."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        pytest.fail("torchvision is installed in this environment; scripts/setup.sh removes it on the CPU stack")
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
        from vllm.model_executor.models.qwen3_5 import Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration
        import vllm.model_executor.models.qwen3_vl as vl
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil
        assert vl.image_smart_resize is pil.smart_resize
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_a_real_torchvision_is_never_touched(tmp_path):
    """Where torchvision is installed (GPU stacks) the fallback does nothing: the transformers module name stays free
    for the real import."""
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
    `kv_connector` + `kv_connector_module_path` and is vLLM's pull NixlConnector with hybrid-memory support. Its
    constructor (which keeps hybrid prefill prompts whole) and its transfers need NIXL and CUDA: not run here
    (docs/serving.md lists what a GPU run must check)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

    from slimwise.serving import connector

    config = KVTransferConfig(kv_connector="SlimWiseNixlConnector", kv_role="kv_both",
                              kv_connector_module_path="slimwise.serving.connector")
    cls = KVConnectorFactory.get_connector_class(config)
    assert cls is connector.SlimWiseNixlConnector and issubclass(cls, NixlPullConnector) and issubclass(cls, SupportsHMA)
    for name in ("SlimWiseConnector", "SlimWiseNixlConnector"):
        assert issubclass(getattr(connector, name), SupportsHMA)
