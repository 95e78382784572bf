"""vLLM tokenizer mode "slimwise": vLLM encodes and decodes with the tokenizer the checkpoint ships.

vLLM's default mode ("hf") loads tokenizers through transformers' AutoTokenizer, which for some model types
(Qwen3.5/3.6-MoE's qwen3_5_moe*) replaces the saved tokenizer with the family's own class; a checkpoint whose
tokenizer.json is another tokenizer (the testbeds', or any retrained one) is then served with other token ids
than the model was trained on. This mode loads exactly what `slimwise.models.load_tokenizer` loads, so the
reference engine, `VllmEngine` and `slimwise serve` tokenize alike; `slimwise serve` checks that at start-up
(`slimwise.serving.server.check_tokenizer`). Registered by the plugin (`slimwise.serving.plugin.register`) with
vLLM's TokenizerRegistry, and with vLLM's Hugging Face renderer (chat templates) under the same name.
"""

from __future__ import annotations

from pathlib import Path

TOKENIZER_MODE = "slimwise"


class ShippedTokenizer:
    """`from_pretrained` returns the checkpoint's tokenizer.json as saved, cached as vLLM's "hf" mode caches it;
    a directory without tokenizer.json (sentencepiece files only) gets vLLM's own "hf" loading. (vLLM's registry
    only calls `from_pretrained`; vLLM is imported there, so importing this module stays cheap.)"""

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | Path, *args, trust_remote_code: bool = False,
                        revision: str | None = None, download_dir: str | None = None, **kwargs):
        from transformers import PreTrainedTokenizerFast
        from vllm.tokenizers.hf import CachedHfTokenizer, get_cached_tokenizer

        from slimwise.models import TOKENIZER_FILE

        if not (Path(path_or_repo_id) / TOKENIZER_FILE).is_file():
            return CachedHfTokenizer.from_pretrained(path_or_repo_id, *args, trust_remote_code=trust_remote_code,
                                                     revision=revision, download_dir=download_dir, **kwargs)
        kwargs.pop("config", None)  # AutoTokenizer's: the class choice it informs is what this mode replaces
        kwargs.pop("mistral_format", None)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path_or_repo_id, *args, revision=revision,
                                                            cache_dir=download_dir, local_files_only=True, **kwargs)
        return get_cached_tokenizer(tokenizer)


def register_tokenizer_mode() -> None:
    """Make `--tokenizer-mode slimwise` known to vLLM (tokenizer and renderer); idempotent."""
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry

    if TOKENIZER_MODE not in TokenizerRegistry.tokenizers:
        TokenizerRegistry.register(TOKENIZER_MODE, __name__, ShippedTokenizer.__name__)
    if TOKENIZER_MODE not in RENDERER_REGISTRY.renderers:
        RENDERER_REGISTRY.register(TOKENIZER_MODE, "vllm.renderers.hf", "HfRenderer")
