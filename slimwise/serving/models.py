"""SlimWise model classes for vLLM: each is the stock vLLM class plus `DecodeRouting` on its MoE gates.

Selected with `hf_overrides={"architectures": ["SlimWise<Arch>"], "slimwise_plan": "plan.json"}` (what
`slimwise serve` and `VllmEngine` pass). Everything else — weights, kernels, parallelism — is stock vLLM.
"""

from __future__ import annotations

import importlib

from torch import nn

from slimwise.serving.routing import DecodeRouting

#: stock vLLM architecture -> module that defines it. The SlimWise class is named "SlimWise" + arch.
STOCK_ARCHS: dict[str, str] = {
    "Qwen3MoeForCausalLM": "vllm.model_executor.models.qwen3_moe",
    "Qwen2MoeForCausalLM": "vllm.model_executor.models.qwen2_moe",
    "MixtralForCausalLM": "vllm.model_executor.models.mixtral",
    "OlmoeForCausalLM": "vllm.model_executor.models.olmoe",
    "GptOssForCausalLM": "vllm.model_executor.models.gpt_oss",
}


def slimwise_arch(stock_arch: str) -> str:
    return "SlimWise" + stock_arch


class SlimWiseMixin:
    """Builds the stock model, then installs decode-only routing from the plan in the config."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        scheduler = vllm_config.scheduler_config
        max_tokens = max(scheduler.max_num_batched_tokens, scheduler.max_num_seqs) + 64
        routing = DecodeRouting(self, vllm_config.model_config.hf_config, max_tokens)
        nn.Module.__setattr__(self, "slimwise", routing)


def _make(stock_arch: str) -> type:
    base = getattr(importlib.import_module(STOCK_ARCHS[stock_arch]), stock_arch)
    return type(slimwise_arch(stock_arch), (SlimWiseMixin, base), {"__module__": __name__,
                                                                    "__doc__": f"SlimWise {stock_arch}."})


def __getattr__(name: str):
    """Lazy module attributes: vLLM's registry imports `slimwise.serving.models:SlimWise<Arch>` on demand."""
    for stock in STOCK_ARCHS:
        if name == slimwise_arch(stock):
            cls = _make(stock)
            globals()[name] = cls
            return cls
    raise AttributeError(name)
