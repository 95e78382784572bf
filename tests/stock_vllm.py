"""Test helper: greedy/sampled generation with stock vLLM on token-id prompts.

`vllm_generate` runs this file as a subprocess and reads back JSON: a fresh interpreter with vLLM's own
process layout, which must be driven from a `__main__`-guarded entry point. `vllm_generate_here` runs the same
engine in the calling process, for tests marked `vllm_in_process` (engine core in-process, no worker spawned):
a fraction of a subprocess call's time, which importing vLLM again dominates
(docs/history/measurement-notes.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from slimwise.errors import SlimWiseError


def vllm_generate(model_dir: str | Path, prompts: list[list[int]], max_tokens: int, *, dtype: str = "float32",
                  temperature: float = 0.0, seed: int = 0, enforce_eager: bool = True, timeout: float = 600,
                  extra: dict | None = None) -> list[list[int]]:
    """Generated token ids per prompt from a fresh vLLM engine on `model_dir` (stock vLLM, no plugin)."""
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "req.json"
        out = Path(tmp) / "out.json"
        req.write_text(json.dumps({"model": str(model_dir), "prompts": prompts, "max_tokens": max_tokens,
                                   "dtype": dtype, "temperature": temperature, "seed": seed,
                                   "enforce_eager": enforce_eager, "extra": extra or {}}))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        proc = subprocess.run([sys.executable, __file__, str(req), str(out)], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
            raise SlimWiseError(f"vLLM run on {model_dir} failed (exit {proc.returncode}):\n{tail}")
        return json.loads(out.read_text())["tokens"]


def vllm_generate_here(
    model_dir: str | Path,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    dtype: str = "float32",
    temperature: float = 0.0,
    seed: int = 0,
    enforce_eager: bool = True,
) -> list[list[int]]:
    """`vllm_generate` in this process; the engine is shut down before returning."""
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0", "mark the test vllm_in_process"
    return _run({"model": str(model_dir), "prompts": prompts, "max_tokens": max_tokens, "dtype": dtype,
                 "temperature": temperature, "seed": seed, "enforce_eager": enforce_eager}, shutdown=True)


def _run(req: dict, shutdown: bool = False) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=req["model"],
        dtype=req["dtype"],
        enforce_eager=req["enforce_eager"],
        skip_tokenizer_init=True,
        max_model_len=512,
        seed=req["seed"],
        kv_cache_memory_bytes=512 << 20,
        **req.get("extra", {}),
    )
    params = SamplingParams(temperature=req["temperature"], max_tokens=req["max_tokens"], seed=req["seed"],
                            detokenize=False)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], params, use_tqdm=False)
    finally:
        if shutdown:
            llm.llm_engine.engine_core.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("request", help="JSON request file")
    parser.add_argument("out", help="JSON output file")
    args = parser.parse_args(argv)
    tokens = _run(json.loads(Path(args.request).read_text()))
    Path(args.out).write_text(json.dumps({"tokens": tokens}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
