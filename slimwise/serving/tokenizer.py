"""vLLM tokenizer mode "slimwise": vLLM encodes and decodes with the tokenizer the checkpoint ships.

vLLM's default mode ("hf") loads tokenizers through transformers' AutoTokenizer, which for some model types
(Qwen3.5/3.6-MoE's qwen3_5_moe*) replaces the saved tokenizer with the family's own class; a checkpoint whose
tokenizer.json is another tokenizer (the testbeds', or any retrained one) is then served with other token ids
than the model was trained on. This mode loads exactly what `slimwise.models.load_tokenizer` loads, so the
reference engine, `VllmEngine` and `slimwise serve` tokenize alike; `slimwise serve` checks that at start-up
(`check_tokenizer`, below). Registered by the plugin (`slimwise.serving.plugin.register`) with
vLLM's TokenizerRegistry, and with vLLM's Hugging Face renderer (chat templates) under the same name.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from slimwise.errors import SlimWiseError

TOKENIZER_MODE = "slimwise"


class ShippedTokenizer:
    """`from_pretrained` returns the checkpoint's tokenizer.json as saved, cached as vLLM's "hf" mode caches
    it; a directory without tokenizer.json (sentencepiece files only) gets vLLM's own "hf" loading. (vLLM's
    registry only calls `from_pretrained`; vLLM is imported there, so importing this module stays cheap.)"""

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | Path, *args, trust_remote_code: bool = False,
                        revision: str | None = None, download_dir: str | None = None, **kwargs):
        from transformers import PreTrainedTokenizerFast
        from vllm.tokenizers.hf import CachedHfTokenizer, get_cached_tokenizer

        from slimwise.models import TOKENIZER_FILE

        if not (Path(path_or_repo_id) / TOKENIZER_FILE).is_file():
            return CachedHfTokenizer.from_pretrained(
                path_or_repo_id,
                *args,
                trust_remote_code=trust_remote_code,
                revision=revision,
                download_dir=download_dir,
                **kwargs,
            )
        kwargs.pop("config", None)  # AutoTokenizer's: the class choice it informs is what this mode replaces
        kwargs.pop("mistral_format", None)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            path_or_repo_id, *args, revision=revision, cache_dir=download_dir, local_files_only=True, **kwargs
        )
        return get_cached_tokenizer(tokenizer)


def register_tokenizer_mode() -> None:
    """Make `--tokenizer-mode slimwise` known to vLLM (tokenizer and renderer); idempotent."""
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry

    if TOKENIZER_MODE not in TokenizerRegistry.tokenizers:
        TokenizerRegistry.register(TOKENIZER_MODE, __name__, ShippedTokenizer.__name__)
    if TOKENIZER_MODE not in RENDERER_REGISTRY.renderers:
        RENDERER_REGISTRY.register(TOKENIZER_MODE, "vllm.renderers.hf", "HfRenderer")


#: text every served model's tokenizer must encode as the reference engine's does: template words, digits,
#: punctuation, spaces and newlines, and characters outside ASCII
TOKENIZER_PROBE = "add 565+70\nQ: what pet does Bob have?\n  sort [3, 1, 2] -> \"x\"\tüñ€ 数字 #### 42\n"


def check_tokenizer(
    url: str, model: str, tokenizer_dir: str | None, what: str, api_key: str | None = None
) -> None:
    """Refuse to serve, in one line, when vLLM's tokenizer at `url` encodes TOKENIZER_PROBE differently from
    the tokenizer the reference engine loads from `tokenizer_dir`: a client's text would reach the model as
    other token ids than it was trained and calibrated on (vLLM's AutoTokenizer swaps classes for some model
    types)."""
    want = _reference_ids(tokenizer_dir)
    if want is None:
        return
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    try:
        r = httpx.post(
            url + "/tokenize",
            json={"model": model, "prompt": TOKENIZER_PROBE, "add_special_tokens": False},
            headers=headers,
            timeout=60,
        )
        got = r.json().get("tokens") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as exc:
        raise SlimWiseError(
            f"{what} at {url} did not answer the tokenizer check ({type(exc).__name__})"
        ) from exc
    if r.status_code != 200:
        raise SlimWiseError(f"{what} at {url} answered the tokenizer check with HTTP {r.status_code}: "
                            f"{r.text[:200]}")
    _refuse_if_different(got, want, f"{what}'s tokenizer")


def check_tokenizer_before_start(model_dir: str, vllm_args: list[str], tokenizer_dir: str | None) -> None:
    """`check_tokenizer` before any engine starts, for a user who chose a --tokenizer-mode other than
    SlimWise's (the only way vLLM can load another tokenizer than the reference's): the tokenizer is loaded
    as vLLM's server loads it (vLLM's `get_tokenizer` with the user's mode, --tokenizer,
    --tokenizer-revision and --trust-remote-code), so a refusal comes in seconds, not after the model's
    weights are loaded. The check of the running server stays: it is what vLLM loaded in the end. A tokenizer
    this cannot load is left to vLLM, whose start-up then says why."""
    from slimwise.argtypes import option_value

    mode = option_value(vllm_args, "--tokenizer-mode")
    if mode in (None, TOKENIZER_MODE) or (want := _reference_ids(tokenizer_dir)) is None:
        return
    from vllm.tokenizers.registry import get_tokenizer

    try:
        loaded = get_tokenizer(option_value(vllm_args, "--tokenizer") or model_dir, tokenizer_mode=mode,
                               trust_remote_code="--trust-remote-code" in vllm_args,
                               revision=option_value(vllm_args, "--tokenizer-revision"))
        got = loaded.encode(TOKENIZER_PROBE, add_special_tokens=False)
    except Exception:  # noqa: BLE001 - vLLM's own start-up reports what it cannot load
        return
    _refuse_if_different(got, want, f"the tokenizer vLLM loads with --tokenizer-mode {mode}")


def _reference_ids(tokenizer_dir: str | None) -> list[int] | None:
    """TOKENIZER_PROBE as the reference engine encodes it; None without tokenizer files (vLLM then has none
    either: --skip-tokenizer-init, token ids only)."""
    from slimwise.models import load_tokenizer

    reference = load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
    return None if reference is None else reference(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]


def _refuse_if_different(got: list[int] | None, want: list[int], subject: str) -> None:
    if got != want:
        raise SlimWiseError(
            f"{subject} encodes text differently from the checkpoint's tokenizer.json "
            f"({len(got or [])} vs {len(want)} tokens for a probe text, first difference at token "
            f"{_first_difference(got or [], want)}); clients' text would reach the model as other "
            "token ids. Drop --tokenizer-mode/--tokenizer, or give the tokenizer the model was "
            "trained with"
        )


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
