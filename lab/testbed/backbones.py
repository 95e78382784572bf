"""The testbed backbones: stock transformers MoE architectures at a size that
trains on 2 CPU cores in an hour.

  a  Qwen3MoeForCausalLM, fine-grained like Qwen3-30B-A3B: 64 routed experts, top-8,
     normalised top-k weights.
  b  Qwen2MoeForCausalLM, like Qwen1.5-MoE: 32 routed experts, top-4,
     plus a shared expert behind a sigmoid gate.
  c  Qwen3_5MoeForCausalLM (model_type qwen3_5_moe_text), a hybrid like Qwen3.6-35B-A3B:
     Gated-DeltaNet (linear attention) and gated full-attention layers at 3:1, 64 routed experts,
     top-8, plus a shared expert.

What every stage that touches a trained backbone needs (presets, the MoE blocks, parameter
counts, the shippable files); the trainer (`train.py`) and the model card (`evaluate.py`)
both import it, never each other.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from torch import nn
from transformers import AutoConfig, PretrainedConfig

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "README.md", "eval.json",
               "train_config.json", "train_summary.json")


#: Architecture presets; vocab_size and the special token ids come from the tokenizer.
BACKBONES: dict[str, dict] = {
    "a": dict(
        model_type="qwen3_moe",
        hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=256, moe_intermediate_size=64, num_experts=64, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    ),
    "b": dict(
        model_type="qwen2_moe",
        hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=256, moe_intermediate_size=96, shared_expert_intermediate_size=256,
        num_experts=32, num_experts_per_tok=4, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[],
    ),
    # Qwen3.6-35B-A3B's text config scaled down: 3 Gated-DeltaNet layers per gated full-attention layer, 64
    # routed experts top-8 (the router always renormalises its top-k) plus a sigmoid-gated shared expert;
    # partial rotary (0.25), the attention output gate and the zero-centred norms are transformers' defaults
    # for the family. Linear heads keep the reference's 2 value heads per key head at head dim 64 (vLLM's CPU
    # GDN kernel rejects 32). 4 layers, not 8: 8 layers train too few tokens in an hour on a 2-core CPU. The
    # training runs behind this preset, shipped and not, are in docs/history/testbeds.md.
    "c": dict(
        model_type="qwen3_5_moe_text",
        hidden_size=128, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=1,
        linear_num_value_heads=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=128, num_experts=64, num_experts_per_tok=8,
    ),
}
_COMMON = dict(max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.02,
               rms_norm_eps=1e-6, hidden_act="silu", use_cache=True, output_router_logits=False)
CARD_NAMES = {"a": "testbed-a", "b": "testbed-b", "c": "testbed-c"}
#: Difficulty sampling: more draws of the families that need the most steps (one-shot multi-digit division in
#: gcd and base, the fact lookups of qa), fewer of those learnt first (the letter-by-letter text families,
#: list copying). Every family is in every batch (weights >= 1/3 of 3 samples).
DEFAULT_FAMILY_WEIGHTS = {"add": 1.0, "sub": 1.0, "mul": 1.0, "gcd": 4.0, "base": 4.0, "sort": 1.5,
                          "reverse": 0.67, "dedup": 0.67, "count": 0.67, "strrev": 0.34, "upper": 0.34,
                          "novowel": 0.34, "qa": 2.0}


def backbone_config(backbone: str, tokenizer, **overrides) -> PretrainedConfig:
    """The transformers config of a backbone preset, sized to the tokenizer, with overrides applied."""
    if backbone not in BACKBONES:
        raise ValueError(f"unknown backbone {backbone!r}; choose one of {sorted(BACKBONES)}")
    args = {**_COMMON, **BACKBONES[backbone], **overrides}
    model_type = args.pop("model_type")
    args.update(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    return AutoConfig.for_model(model_type, **args)


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The sparse MoE blocks (modules with a router `gate` and fused `experts`), in layer order."""
    return [layer.mlp for layer in model.model.layers
            if hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate")]


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Total, routed-expert and per-token active parameter counts (embeddings and head included)."""
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for b in moe_blocks(model) for p in b.experts.parameters())
    cfg = model.config
    active_fraction = cfg.num_experts_per_tok / cfg.num_experts
    return {"total": total, "routed_experts": routed,
            "active": int(total - routed + routed * active_fraction)}


def copy_model_files(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copy only the shippable files of a trained model directory (no optimizer state, no logs)."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    return dst
