"""Timing decode in a vLLM engine: one batch measured from vLLM's engine-core timestamps (prefill excluded), the
prompts every variant shares, the cache bytes an engine needs, and shutting engines down cleanly."""

from __future__ import annotations

import contextlib
import gc
import json
import signal
import threading
import time
from pathlib import Path

from slimwise.errors import SlimWiseError


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    heads = text.get("num_attention_heads", 1)
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    kv_heads = text.get("num_key_value_heads", heads)
    layers = text["num_hidden_layers"]
    if isinstance(text.get("layer_types"), list):
        layers = sum(t != "linear_attention" for t in text["layer_types"]) or layers
    return 2 * layers * kv_heads * head_dim * (4 if dtype == "float32" else 2)


def state_bytes_per_layer(model_dir: str) -> int:
    """Conv + recurrent state of one linear-attention layer for one sequence (0 without such layers)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    if "linear_attention" not in (text.get("layer_types") or []):
        return 0
    nk, nv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
    ssm = 4 if str(text.get("mamba_ssm_dtype", "")).removeprefix("torch.") == "float32" else 2
    return nv * dk * dv * ssm + (2 * nk * dk + nv * dv) * (text.get("linear_conv_kernel_dim", 4) - 1) * 2


def close_engine(llm) -> None:
    with contextlib.suppress(Exception):  # best effort: vLLM's process manager kills what remains
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@contextlib.contextmanager
def engines_closed_on_sigterm():
    """SIGTERM raises KeyboardInterrupt, so the `finally` blocks shut the engine processes down (else orphans)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token-id prompts (ids >= 4 skip the synthetic tokenizer's specials), the same for every variant."""
    import torch

    g = torch.Generator().manual_seed(seed * 100_003 + batch)
    return torch.randint(4, vocab, (batch, prompt_len), generator=g).tolist()


def measure(llm, prompts: list[list[int]], output_len: int) -> dict:
    """One timed generate: decode throughput and time per output token from vLLM's engine-core timestamps."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    requests = [{"prompt_token_ids": p} for p in prompts]
    t0 = time.perf_counter()
    # scheduler paused while the requests are added, so the engine core cannot start a step with only the first
    # few: every prompt is prefilled in the same step and every decode step holds all B sequences
    llm.sleep(level=0)
    try:
        llm.enqueue(requests, params, use_tqdm=False)
    finally:
        llm.wake_up()
    outs = llm.wait_for_completion(use_tqdm=False)
    wall = time.perf_counter() - t0
    if len(outs) != len(prompts):
        raise SlimWiseError(f"vLLM returned {len(outs)} outputs for {len(prompts)} requests")
    if any(o.metrics is None or not o.metrics.last_token_ts for o in outs):
        raise SlimWiseError("vLLM returned no request metrics: the engine needs disable_log_stats=False")
    first = [o.metrics.first_token_ts for o in outs]
    last = [o.metrics.last_token_ts for o in outs]
    generated = [len(o.outputs[0].token_ids) for o in outs]
    decode_tokens = sum(generated) - len(generated)
    decode_s = max(last) - min(first)
    return {"tokens_per_s": decode_tokens / decode_s if decode_s > 0 else float("nan"),
            "tpot_ms": 1e3 * decode_s / max(1, max(generated) - 1), "decode_s": decode_s, "wall_s": wall,
            "decode_tokens": decode_tokens, "generated": sum(generated),
            "prefill_spread_s": max(first) - min(first)}
