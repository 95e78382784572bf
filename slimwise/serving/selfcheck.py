"""Start-up self-check: an engine serves a plan only after a warm-up batch proved the mask is in effect.

For every served plan and for `full`, two requests with fresh token-id prompts generate `TOKENS` tokens each
(`ignore_eos`). The forward counts the rows it routed per plan inside one gate (`row_counts.py`), which also
runs under CUDA-graph replay. With exact bookkeeping (slimwise mode) each plan must have routed exactly its
requests' fed-back tokens, (TOKENS - 1) per request, every one of them masked where the plan prunes the
counted layer (plain gates; with drop / substitute / a fallback a row may keep its logits), and no full-routed
row may be masked. Any difference means the model runner did not set the
steps (an unsupported runner), the mask was not applied (a kernel that bypasses it) or rows were classified
wrongly: the engine refuses, in one line.
"""

from __future__ import annotations

import random

from slimwise.errors import SlimWiseError

TOKENS = 4  # generated per warm-up request: TOKENS - 1 decode rows each
PROMPT_LENGTHS = (5, 11)  # one warm-up request of each length per plan
SELF_CHECK_PATH = "/slimwise/self-check"  # the colocated server's endpoint (loopback only)


def warmup_batch(plan_names: list[str], vocab_size: int, seed: int) -> list[tuple[str, list[int]]]:
    """(plan name, prompt token ids) per warm-up request: every plan and "full", fresh prompts (a seed per
    check, so a repeated check meets no prefix-cache hit it did not expect)."""
    rng = random.Random(seed)
    hi = max(2, min(vocab_size, 32000))
    return [(name, [rng.randrange(1, hi) for _ in range(length)])
            for name in [*plan_names, "full"] for length in PROMPT_LENGTHS]


def expected_rows(batch: list[tuple[str, list[int]]], mode: str) -> dict[str, int]:
    """Rows each plan must route: fed-back tokens in slimwise mode, every row in uniform mode, none in
    full."""
    out: dict[str, int] = {}
    for name, prompt in batch:
        if name == "full" or mode == "full":
            continue
        out[name] = out.get(name, 0) + (TOKENS - 1) + (len(prompt) if mode == "uniform" else 0)
    return out


def rows_delta(before: list[dict], after: list[dict], replicas: int) -> tuple[list[int], list[int], dict]:
    """(routed, masked) per plan row over the warm-up, summed over the workers that count in the first counted
    layer (each pipeline stage counts in its own first pruned layer: the first stage's are taken) and divided
    by the `replicas` that see the same rows (tensor-parallel ranks); and one such worker's counters."""
    layers = [a.get("counted_layer") for a in after if a.get("counted_layer") is not None]
    if not layers:
        raise SlimWiseError("self-check: no worker counts routed rows (no gate of the served plan was "
                            "hooked); SlimWise cannot tell whether the plan is in effect")
    counted = [(b, a) for b, a in zip(before, after, strict=True) if a.get("counted_layer") == min(layers)]
    width = len(counted[0][1]["rows_seen"][0])
    total = [[0] * width, [0] * width]
    for b, a in counted:
        for kind in (0, 1):
            for k in range(width):
                total[kind][k] += a["rows_seen"][kind][k] - b["rows_seen"][kind][k]
    if any(v % replicas for row in total for v in row):
        raise SlimWiseError(f"self-check: row counts {total} are not a multiple of the {replicas} tensor-"
                            "parallel ranks that should each see every row")
    return [v // replicas for v in total[0]], [v // replicas for v in total[1]], counted[0][1]


def verify(before: list[dict], after: list[dict], expected: dict[str, int], replicas: int = 1) -> dict:
    """Compare the forward's counts with `expected` (plan name -> rows); raise SlimWiseError (one line) on any
    difference, else return what was checked (for the start-up log)."""
    routed, masked, info = rows_delta(before, after, replicas)
    names, prunes = info["plan_names"], info["counted_prunes"]
    problems = []
    for k, name in enumerate(names):
        if k == 0:
            if masked[0]:
                problems.append(f"{masked[0]} rows routed with every expert were masked")
            continue
        want = expected.get(name, 0)
        if routed[k] != want:
            problems.append(f"plan {name!r} routed {routed[k]} rows, expected {want}")
        elif not info.get("gates_plain", True):
            # drop / substitute / fallback: a row whose full top-k holds no pruned expert, or that falls
            # back, keeps its logits; none may be masked beyond the plan's rows
            if masked[k] > routed[k]:
                problems.append(f"plan {name!r}: {masked[k]} rows masked for {routed[k]} routed")
        elif masked[k] != (want if prunes[k] else 0):
            problems.append(f"plan {name!r}: {masked[k]} of its {routed[k]} rows masked in layer "
                            f"{info['counted_layer']}, expected {want if prunes[k] else 0}")
    if problems:
        raise SlimWiseError(f"SlimWise self-check failed on model runner {info.get('runner', '?')}: "
                            f"{'; '.join(problems)}: the plan is not in effect, refusing to serve")
    return {"runner": info.get("runner"), "rows": {n: routed[k] for k, n in enumerate(names) if k},
            "layer": info["counted_layer"]}


def _start(before: list[dict], vocab_size: int, seed: int) -> tuple[str, int, list, list]:
    """(mode, load-aware threshold, warm-up batch, SamplingParams per request) from the workers' counters."""
    from vllm import SamplingParams

    from slimwise.serving.routing import REQUEST_PLAN_ARG

    if not before or not before[0]:
        raise SlimWiseError("self-check: the engine's workers carry no SlimWise routing (a stock model class "
                            "or the plugin inactive): the plan is not in effect, refusing to serve")
    batch = warmup_batch(before[0]["plan_names"][1:], vocab_size, seed)
    params = [SamplingParams(max_tokens=TOKENS, min_tokens=TOKENS, ignore_eos=True, temperature=0.0,
                             detokenize=False, extra_args={REQUEST_PLAN_ARG: name}) for name, _ in batch]
    return before[0]["mode"], before[0]["min_decode_batch"], batch, params


def check_llm(llm, replicas: int = 1, seed: int = 0) -> dict:
    """Run the self-check on an offline `vllm.LLM` whose workers carry a SlimWise routing, in the mode it is
    in, with the load-aware threshold off for the warm-up (restored after; worker counters restart)."""
    before = llm.collective_rpc("slimwise_counters")
    mode, threshold, batch, params = _start(before, llm.llm_engine.model_config.get_vocab_size(), seed)
    llm.collective_rpc("slimwise_set_mode", args=(mode, 0))
    llm.generate([{"prompt_token_ids": p} for _, p in batch], params, use_tqdm=False)
    after = llm.collective_rpc("slimwise_counters")
    llm.collective_rpc("slimwise_set_mode", args=(mode, threshold))
    return verify(before, after, expected_rows(batch, mode), replicas)


async def check_engine_client(client, seed: int = 0) -> dict:
    """The same on the engine client of vLLM's OpenAI server (`AsyncLLM`), from inside its process
    (`plan_select.PlanSelectMiddleware` answers `GET SELF_CHECK_PATH` from the loopback address with it)."""
    import asyncio

    before = await client.collective_rpc("slimwise_counters")
    mode, threshold, batch, params = _start(before, client.model_config.get_vocab_size(), seed)

    async def run(i: int) -> None:
        async for _ in client.generate({"prompt_token_ids": batch[i][1]}, params[i],
                                       f"slimwise-self-check-{seed}-{i}"):
            pass

    await client.collective_rpc("slimwise_set_mode", args=(mode, 0))
    try:
        await asyncio.gather(*(run(i) for i in range(len(batch))))
        after = await client.collective_rpc("slimwise_counters")
    finally:
        await client.collective_rpc("slimwise_set_mode", args=(mode, threshold))
    replicas = int(client.vllm_config.parallel_config.tensor_parallel_size or 1)
    return verify(before, after, expected_rows(batch, mode), replicas)
