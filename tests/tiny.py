"""Tiny random-weight models built from each family's real transformers config.

Used by the tests only (one per family); the package never imports it. Sizes follow
the vLLM CPU kernel rules (hidden and expert sizes multiples of 32, head size >= 32).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

TINY_CONFIGS: dict[str, Callable[..., PretrainedConfig]] = {}

_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def tiny_config_factory(family: str):
    def deco(fn: Callable[..., PretrainedConfig]):
        TINY_CONFIGS[family] = fn
        return fn

    return deco


@tiny_config_factory("qwen3_moe")
def _qwen3_moe(**kw) -> PretrainedConfig:
    args = dict(_COMMON, intermediate_size=128, moe_intermediate_size=32, num_experts=16,
                num_experts_per_tok=4, norm_topk_prob=True)
    return AutoConfig.for_model("qwen3_moe", **(args | kw))


@tiny_config_factory("qwen2_moe")
def _qwen2_moe(**kw) -> PretrainedConfig:
    args = dict(_COMMON, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                num_experts=16, num_experts_per_tok=4, norm_topk_prob=False)
    args.pop("head_dim")
    return AutoConfig.for_model("qwen2_moe", **(args | kw))


# Larger than the stock 0.02 so that random routers spread tokens over many experts (checked in the tests).
_ROUTED_INIT = 0.1


@tiny_config_factory("mixtral")
def _mixtral(**kw) -> PretrainedConfig:
    args = dict(_COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                initializer_range=_ROUTED_INIT)
    return AutoConfig.for_model("mixtral", **(args | kw))


@tiny_config_factory("olmoe")
def _olmoe(**kw) -> PretrainedConfig:
    args = dict(_COMMON, intermediate_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False,
                initializer_range=_ROUTED_INIT, pad_token_id=1, eos_token_id=2)
    args.pop("head_dim")  # OLMoE derives head_dim = hidden_size / num_attention_heads (= 32)
    return AutoConfig.for_model("olmoe", **(args | kw))


@tiny_config_factory("deepseek_v3")
def _deepseek_v3(**kw) -> PretrainedConfig:
    """16 routed experts in 4 groups of 4, 2 groups per token, top-4; layer 0 dense, layers 1-2 MoE.

    MLA dims are small for the tests. vLLM's CPU MLA decode kernel only handles the real latent size
    (kv_lora_rank + qk_rope_head_dim = 576): pass kv_lora_rank=512, qk_rope_head_dim=64 for a vLLM CPU model.
    """
    args = dict(
        _COMMON,
        num_hidden_layers=3,
        num_key_value_heads=2,
        intermediate_size=128,
        moe_intermediate_size=32,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_rope_head_dim=32,
        qk_nope_head_dim=32,
        v_head_dim=32,
        initializer_range=_ROUTED_INIT,
        num_nextn_predict_layers=0,
        # not fields of transformers' DeepseekV3Config (it always routes this way), but vLLM reads
        # them: without them it builds a softmax router with no e_score_correction_bias
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    )
    args.pop("head_dim")  # derived (= qk_rope_head_dim)
    return AutoConfig.for_model("deepseek_v3", **(args | kw))


@tiny_config_factory("gpt_oss")
def _gpt_oss(**kw) -> PretrainedConfig:
    # keeps the stock yarn rope_parameters: vLLM's GPT-OSS reads factor/beta_fast/beta_slow from them
    args = dict(_COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
                initializer_range=_ROUTED_INIT, max_position_embeddings=131072)  # = 4096 * yarn factor 32
    return AutoConfig.for_model("gpt_oss", **(args | kw))


_HYBRID = dict(
    _COMMON,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    intermediate_size=128,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    num_experts=16,
    num_experts_per_tok=4,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=64,  # vLLM's CPU Gated DeltaNet kernel rejects 32 ("Unexpected head dim size")
    linear_value_head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    initializer_range=_ROUTED_INIT,
)


@tiny_config_factory("qwen3_next")
def _qwen3_next(**kw) -> PretrainedConfig:
    args = dict(_HYBRID, norm_topk_prob=True)
    return AutoConfig.for_model("qwen3_next", **(args | kw))


@tiny_config_factory("qwen3_5_moe")
def _qwen3_5_moe(**kw) -> PretrainedConfig:
    """The nested (vision + text) config of a Qwen3.5/3.6-MoE checkpoint; overrides go to the text config.

    AutoModelForCausalLM builds the text-only Qwen3_5MoeForCausalLM from it.
    """
    # no intermediate_size: not a Qwen3.5-MoE field (every layer is sparse)
    text = {key: value for key, value in _HYBRID.items() if key != "intermediate_size"} | kw
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=1, out_hidden_size=64,
                  num_position_embeddings=64)
    return AutoConfig.for_model("qwen3_5_moe", text_config=text, vision_config=vision,
                                tie_word_embeddings=False)


def tiny_config(family: str, **overrides) -> PretrainedConfig:
    if family not in TINY_CONFIGS:
        raise KeyError(f"no tiny config for {family!r}; have {sorted(TINY_CONFIGS)}")
    return TINY_CONFIGS[family](**overrides)


def build_tiny_model(
    family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides
) -> PreTrainedModel:
    """A randomly initialised model of `family`, deterministic in `seed`, in eval mode."""
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def save_tiny_model(family: str, out_dir: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32,
                    **overrides) -> Path:
    out_dir = Path(out_dir)
    build_tiny_model(family, seed=seed, dtype=dtype, **overrides).save_pretrained(out_dir)
    return out_dir
