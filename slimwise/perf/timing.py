"""Timing decode in a vLLM engine: one batch measured from vLLM's engine-core timestamps (prefill excluded),
the prompts every variant shares, the cache bytes an engine needs, and shutting engines down cleanly."""

from __future__ import annotations

import contextlib
import gc
import signal
import threading
import time

from slimwise.errors import SlimWiseError
from slimwise.models import kv_bytes_per_token, state_bytes_per_layer  # noqa: F401  (re-exported for bench)


def shutdown_llm(llm) -> None:
    with contextlib.suppress(Exception):  # best effort: vLLM's process manager kills what remains
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@contextlib.contextmanager
def engines_closed_on_sigterm():
    """SIGTERM raises KeyboardInterrupt, so the `finally` blocks shut the engine processes down (else
    orphans)."""
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


def vocab_size(model_dir: str) -> int:
    """The vocabulary random prompts are drawn from (a multimodal config's text part)."""
    import json
    from pathlib import Path

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg.get("text_config", cfg)["vocab_size"])


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token-id prompts (ids >= 4 skip the synthetic tokenizer's specials), the same for every
    variant."""
    import torch

    g = torch.Generator().manual_seed(seed * 100_003 + batch)
    return torch.randint(4, vocab, (batch, prompt_len), generator=g).tolist()


def measure(llm, prompts: list[list[int]], output_len: int, plans: list[str] | None = None) -> dict:
    """One timed generate: decode throughput and time per output token from vLLM's engine-core timestamps.
    `plans`: each request's plan name on a several-plan engine (SamplingParams.extra_args)."""
    from vllm import SamplingParams

    from slimwise.serving.routing import REQUEST_PLAN_ARG

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    if plans is not None:
        params = [SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False,
                                 extra_args={REQUEST_PLAN_ARG: name}) for name in plans]
    requests = [{"prompt_token_ids": p} for p in prompts]
    t0 = time.perf_counter()
    # scheduler paused while the requests are added, so the engine core cannot start a step with only the
    # first few: every prompt is prefilled in the same step and every decode step holds all B sequences
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
