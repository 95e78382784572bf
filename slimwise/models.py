"""Loading models and tokenizers from local directories (never from a hub: SlimWise runs offline)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from slimwise.adapters import get_adapter
from slimwise.errors import SlimWiseError

DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PLAN_FILE = "slimwise_plan.json"
MANIFEST_FILE = "slimwise_manifest.json"


def is_hybrid(config_or_dir) -> bool:
    """True for models with linear-attention (Gated-DeltaNet) layers (Qwen3-Next, Qwen3.5/3.6-MoE): their decode state
    includes each such layer's conv and recurrent state beside the attention KV, and the CPU training kernels ignore
    packed-sample boundaries. Takes a config (object or dict) or a checkpoint directory."""
    config = config_or_dir
    if isinstance(config_or_dir, (str, Path)):
        path = Path(config_or_dir) / "config.json"
        if not path.is_file():
            return False
        config = json.loads(path.read_text())
    if not isinstance(config, dict):
        config = config.to_dict()
    text = config.get("text_config") or config
    return "linear_attention" in (text.get("layer_types") or [])


def resolve_model_dir(path: str | Path) -> Path:
    """A local model directory with a config.json, or one of the embedded testbed names."""
    p = Path(path)
    if not p.is_dir():
        from slimwise.embedded import embedded_model_dir

        embedded = embedded_model_dir(str(path))
        if embedded is not None:
            return embedded
        raise SlimWiseError(f"model directory {path} does not exist; pass a local checkpoint directory "
                            "(SlimWise never downloads weights)")
    if not (p / "config.json").is_file():
        raise SlimWiseError(f"{p} has no config.json; pass a transformers checkpoint directory")
    return p


def load_config(path: str | Path):
    return AutoConfig.from_pretrained(resolve_model_dir(path), local_files_only=True)


def load_model(path: str | Path, dtype: str | torch.dtype = "auto", device: str = "cpu") -> nn.Module:
    """Load a supported MoE checkpoint for inference; refuse dense or unknown models up front."""
    model_dir = resolve_model_dir(path)
    get_adapter(load_config(model_dir))  # clear error for dense/unknown families before loading weights
    torch_dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, local_files_only=True)
    model.slimwise_source_dir = str(model_dir)
    return model.to(device).eval()


def load_tokenizer(path: str | Path):
    """The tokenizer saved next to a model, or None when there is none (token-id prompts still work)."""
    model_dir = resolve_model_dir(path)
    try:
        if _saved_tokenizer_class(model_dir) == "PreTrainedTokenizerFast":
            # as saved: next to some configs (qwen3_5_moe_text) AutoTokenizer swaps in the family's own class,
            # whose pre-tokenizer differs from the saved one (the testbed tokenizer of testbed-c)
            return PreTrainedTokenizerFast.from_pretrained(model_dir, local_files_only=True)
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, TypeError):
        return None


def _saved_tokenizer_class(model_dir: str | Path) -> str | None:
    f = Path(model_dir) / "tokenizer_config.json"
    try:
        return json.loads(f.read_text()).get("tokenizer_class") if f.is_file() else None
    except (OSError, ValueError):
        return None


def read_manifest(path: str | Path) -> dict | None:
    f = Path(path) / MANIFEST_FILE
    return json.loads(f.read_text()) if f.is_file() else None
