"""Loading models and tokenizers from local directories (never from a hub: SlimWise runs offline)."""

from __future__ import annotations

import contextlib
import json
import sys
import warnings
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from slimwise.adapters import get_adapter
from slimwise.errors import SlimWiseError

DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PLAN_FILE = "slimwise_plan.json"
MANIFEST_FILE = "slimwise_manifest.json"


def is_hybrid(config_or_dir) -> bool:
    """True for models with linear-attention (Gated-DeltaNet) layers (Qwen3-Next, Qwen3.5/3.6-MoE): their
    decode state includes each such layer's conv and recurrent state beside the attention KV, and the CPU
    training kernels ignore packed-sample boundaries. Takes a config (object or dict) or a checkpoint
    directory."""
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


def text_config_dict(config) -> dict:
    """The (text) config as a dict, from a config object or dict (multimodal wrappers nest it)."""
    d = config if isinstance(config, dict) else config.to_dict()
    return d.get("text_config") or d


def kv_bytes_per_token_of(config, dtype: str) -> int:
    """Attention KV bytes one token adds, from a config object or dict (full-attention layers only; 4-byte
    elements in float32, else 2)."""
    text = text_config_dict(config)
    heads = text.get("num_attention_heads", 1)
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    kv_heads = text.get("num_key_value_heads", heads)
    layers = text["num_hidden_layers"]
    if isinstance(text.get("layer_types"), list):
        layers = sum(t != "linear_attention" for t in text["layer_types"]) or layers
    return 2 * layers * kv_heads * head_dim * (4 if dtype == "float32" else 2)


def state_bytes_per_layer_of(config) -> int:
    """Conv + recurrent state of one linear-attention layer for one sequence, from a config object or dict
    (0 without such layers)."""
    text = text_config_dict(config)
    if "linear_attention" not in (text.get("layer_types") or []):
        return 0
    nk, nv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
    ssm = 4 if str(text.get("mamba_ssm_dtype", "")).removeprefix("torch.") == "float32" else 2
    return nv * dk * dv * ssm + (2 * nk * dk + nv * dv) * (text.get("linear_conv_kernel_dim", 4) - 1) * 2


def linear_attention_layers(config) -> int:
    return sum(t == "linear_attention" for t in (text_config_dict(config).get("layer_types") or []))


def kv_bytes_per_token(model_dir: str | Path, dtype: str) -> int:
    """`kv_bytes_per_token_of` a checkpoint directory's config.json."""
    return kv_bytes_per_token_of(json.loads((Path(model_dir) / "config.json").read_text()), dtype)


def state_bytes_per_layer(model_dir: str | Path) -> int:
    """`state_bytes_per_layer_of` a checkpoint directory's config.json."""
    return state_bytes_per_layer_of(json.loads((Path(model_dir) / "config.json").read_text()))


def resolve_model_dir(path: str | Path) -> Path:
    """A local model directory with a config.json, or one of the embedded testbed names."""
    p = Path(path)
    if not p.is_dir():
        from slimwise.embedded import embedded_model_dir, missing_embedded

        embedded = embedded_model_dir(str(path))
        if embedded is not None:
            return embedded
        if (missing := missing_embedded(str(path))) is not None:
            raise SlimWiseError(missing)
        raise SlimWiseError(f"model directory {path} does not exist; pass a local checkpoint directory "
                            "(SlimWise never downloads weights)")
    if not (p / "config.json").is_file():
        raise SlimWiseError(f"{p} has no config.json; pass a transformers checkpoint directory")
    return p


# names different writers give the routed-expert count; a config.json that states two of them differently is
# contradictory (llm-compressor 0.14 writes num_experts beside the original num_local_experts) and
# transformers would silently pick one
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def load_config(path: str | Path):
    """The model's config, refused in one line when config.json is unreadable, malformed or
    self-contradictory."""
    model_dir = resolve_model_dir(path)
    try:
        raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SlimWiseError(
            f"{model_dir}/config.json is not readable JSON ({type(exc).__name__}); restore the "
            "checkpoint's config.json"
        ) from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise SlimWiseError(
            f"{model_dir}/config.json has no model_type; restore the checkpoint's config.json"
        )
    for section in (raw, raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}):
        counts = {k: section[k] for k in _EXPERT_COUNT_KEYS if k in section and section[k] is not None}
        if len(set(map(str, counts.values()))) > 1:
            raise SlimWiseError(
                f"{model_dir}/config.json contradicts itself on the expert count ({counts}); keep the "
                "one that matches the weights"
            )
    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as exc:
        raise SlimWiseError(
            f"{model_dir}/config.json is invalid: {_first_line(exc)}; restore the checkpoint's config.json"
        ) from exc


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:200]


@contextlib.contextmanager
def _progress_on_terminal_only():
    """transformers' weight-loading bar only when stderr is a terminal: in logs and pipes an error stays one
    line."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if was and not sys.stderr.isatty():
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def load_model(path: str | Path, dtype: str | torch.dtype = "auto", device: str = "cpu",
               max_memory: str | dict | None = None) -> nn.Module:
    """Load a supported MoE checkpoint for inference; refuse dense or unknown models up front, and refuse
    truncated, corrupt or mis-shaped weights in one line.

    `device` ("auto", "cpu", "cuda", "cuda:N") loads the weights straight onto that device; `max_memory`
    spreads the model over several (`slimwise.devices`). `dtype="auto"` is the checkpoint's dtype on the CPU
    and bf16 on a GPU (a half-precision checkpoint keeps its own)."""
    from safetensors import SafetensorError

    from slimwise.devices import auto_dtype_on, placement

    model_dir = resolve_model_dir(path)
    config = load_config(model_dir)
    adapter = get_adapter(config)  # clear error for dense/unknown families before loading weights
    n, k = adapter.num_experts(config), adapter.top_k(config)
    if not (isinstance(n, int) and isinstance(k, int) and 1 <= k <= n):
        raise SlimWiseError(
            f"{model_dir}/config.json routes top-{k} of {n} experts; top-k must be in [1, experts]: "
            "restore the checkpoint's config.json"
        )
    where = placement(device, max_memory)
    if dtype == "auto":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        dtype = auto_dtype_on(where.device, getattr(text, "dtype", None) or getattr(config, "dtype", None)) \
            or "auto"
    torch_dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    dequantize = _dequantized_on_load(config)
    try:
        with _progress_on_terminal_only(), warnings.catch_warnings():
            # the checkpoint's own quantization_config, loaded dequantized: not the mix-up this warns about
            warnings.filterwarnings("ignore", message="You passed `quantization_config`")
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, local_files_only=True,
                                                         **where.from_pretrained_kwargs(), **dequantize)
    except SafetensorError as exc:
        raise SlimWiseError(
            f"the weights in {model_dir} are truncated or corrupt ({_first_line(exc)}); copy the "
            "checkpoint again"
        ) from exc
    except RuntimeError as exc:
        if dequantize and "conversion of the weights" in str(exc):
            from slimwise.quantized import quantization_config

            method = quantization_config(config)["quant_method"]
            raise SlimWiseError(
                f"transformers cannot load the {method} checkpoint in {model_dir} (its loader found no "
                "conversion for some quantized tensors, see the report above); SlimWise can still prune it "
                "from its files (`slimwise prune`) and vLLM may serve it"
            ) from exc
        if "mismatched" not in str(exc) and "size mismatch" not in str(exc):
            raise
        raise SlimWiseError(
            f"the weights in {model_dir} do not have the shapes its config.json describes; restore "
            "the config.json written with these weights"
        ) from exc
    model.slimwise_source_dir = str(model_dir)
    return model.eval()


def _dequantized_on_load(config) -> dict:
    """`from_pretrained` arguments that dequantize a quantized checkpoint as it loads, on every device: the
    observers, masks and trained deltas read expert weights as tensors in the model's dtype, and transformers'
    compressed-tensors modules left compressed replace `weight_packed` by `weight` at their first forward (the
    weights' checksum would change under a plan). Quantized kernels are the server's (vLLM)."""
    from slimwise.quantized import quantization_config

    found = quantization_config(config)
    method = (found or {}).get("quant_method")
    if method == "fp8":
        from transformers import FineGrainedFP8Config

        return {"quantization_config": FineGrainedFP8Config.from_dict({**found, "dequantize": True})}
    if method == "compressed-tensors":
        from transformers import CompressedTensorsConfig

        return {"quantization_config": CompressedTensorsConfig.from_dict({**found, "dequantize": True})}
    return {}


def structure_model(path: str | Path) -> nn.Module:
    """The model's modules on the meta device (no weights read, no memory): what a plan's layers, expert count
    and top-k are checked against before an engine starts (the weights' fingerprint needs `load_model`)."""
    config = load_config(path)
    get_adapter(config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer(path: str | Path):
    """The tokenizer a checkpoint ships, or None when there is none (token-id prompts still work).

    A checkpoint's `tokenizer.json` is its whole tokenizer (normalizer, pre-tokenizer, model, post-processor,
    decoder), so it is loaded as saved, whatever `tokenizer_class` tokenizer_config.json names: transformers'
    AutoTokenizer swaps in a family's own class for some model types (qwen3_5_moe*: Qwen3_5Tokenizer, which
    rebuilds the pipeline from the vocabulary and encodes another tokenizer's text differently), and other
    tools write other class names (llm-compressor: "TokenizersBackend"). Only a checkpoint without
    tokenizer.json (slow sentencepiece files) goes through AutoTokenizer. vLLM loads the same object through
    the plugin's tokenizer mode (`slimwise.serving.tokenizer`)."""
    model_dir = resolve_model_dir(path)
    try:
        if (model_dir / TOKENIZER_FILE).is_file():
            return PreTrainedTokenizerFast.from_pretrained(model_dir, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, TypeError):
        return None
    # Without vocabulary files AutoTokenizer still builds one for some model types (qwen3_moe: a
    # Qwen2Tokenizer holding only its special token), which encodes every text to nothing: no tokenizer.
    return tok if len(tok.get_vocab()) > len(tok.all_special_tokens) else None


def read_manifest(path: str | Path) -> dict | None:
    f = Path(path) / MANIFEST_FILE
    return json.loads(f.read_text()) if f.is_file() else None
