#!/usr/bin/env python
"""Load test of a running `slimwise serve` endpoint (colocated or disaggregated) on this machine.

Sends ROUNDS rounds of CONCURRENCY requests at once to http://127.0.0.1:PORT/v1/completions (one round after
the other), a share of them streamed, and prints one row per round and a total:

    sent     requests sent
    ok       HTTP 200 with a well-formed answer: max_tokens tokens (ignore_eos) or, streamed, a finish reason
             and [DONE]
    failed   an answer that is not that (HTTP 4xx/5xx, a malformed body, an error event, fewer tokens)
    lost     no answer: the connection failed, the request timed out, or a stream broke off before [DONE]
    p50/p99  latency of the ok requests, seconds

Exit code 0 when every request was ok, 1 otherwise, 2 for bad arguments or an endpoint that is not healthy.
Bounded: at most 1,024 concurrent requests and 20 rounds, localhost only, and a wall-clock deadline
(--deadline) after which whatever is still in flight counts as lost.

    slimwise serve testbed-a --plan plan.json --disaggregated --port 8000 &
    python scripts/load_test.py --port 8000 --rounds 3 --concurrency 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

HOST = "127.0.0.1"  # never anything else: this script loads a server on this machine only
MAX_CONCURRENCY = 1024
MAX_ROUNDS = 20
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliett", "kilo"]


@dataclass
class Round:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    lost: int = 0
    latencies: list[float] = field(default_factory=list)
    reasons: Counter = field(default_factory=Counter)
    wall: float = 0.0


def prompt(round_index: int, i: int) -> str:
    """A different prompt per request (lengths vary), so no two requests share a KV folder or a cache hit by
    design."""
    words = [WORDS[(round_index * 7 + i * 3 + k) % len(WORDS)] for k in range(3 + i % 13)]
    return f"request {round_index}-{i}: " + " ".join(words) + "\n"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)  # nearest rank
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


async def one(
    client: httpx.AsyncClient, model: str, text: str, max_tokens: int, stream: bool
) -> tuple[str, str]:
    """(outcome, reason): outcome is ok, failed or lost."""
    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    try:
        if not stream:
            r = await client.post("/v1/completions", json=body)
            if r.status_code != 200:
                return "failed", f"HTTP {r.status_code}: {r.text[:120]}"
            try:
                out = r.json()
                got = int(out["usage"]["completion_tokens"])
                _ = out["choices"][0]["text"]
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                return "failed", f"malformed answer ({type(exc).__name__})"
            return ("ok", "") if got == max_tokens else ("failed", f"{got} of {max_tokens} tokens")
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return "failed", f"HTTP {r.status_code}: {(await r.aread())[:120].decode(errors='replace')}"
            finish, done = None, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line.strip() == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    return "failed", f"error event: {str(event['error'])[:120]}"
                for choice in event.get("choices", []):
                    finish = choice.get("finish_reason") or finish
            if not done:
                return "lost", "stream ended before [DONE]"
            return ("ok", "") if finish == "length" else ("failed", f"finish_reason {finish!r}")
    except httpx.TimeoutException as exc:
        return "lost", f"timeout ({type(exc).__name__})"
    except httpx.HTTPError as exc:
        return "lost", f"{type(exc).__name__}: {str(exc)[:100]}"


async def run(port: int, rounds: int, concurrency: int, max_tokens: int, stream_every: int, timeout: float,
              deadline_s: float, model: str | None) -> list[Round]:
    # idle connections go after 2 s, before the server's 5 s keep-alive closes them under a request being sent
    limits = httpx.Limits(
        max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=2.0
    )
    async with httpx.AsyncClient(base_url=f"http://{HOST}:{port}", limits=limits,
                                 timeout=httpx.Timeout(timeout, connect=60.0, pool=None)) as client:
        if model is None:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
        deadline = time.monotonic() + deadline_s
        results = []
        for r in range(rounds):
            stats = Round()
            left = deadline - time.monotonic()
            if left <= 0:
                stats.reasons[f"round {r + 1} not sent: --deadline reached"] += 1
                results.append(stats)
                continue

            async def timed(i: int, r: int = r) -> tuple[str, str, float]:
                t0 = time.monotonic()
                outcome, reason = await one(client, model, prompt(r, i), max_tokens,
                                            stream_every > 0 and i % stream_every == 0)
                return outcome, reason, time.monotonic() - t0

            t0 = time.monotonic()
            tasks = [asyncio.ensure_future(timed(i)) for i in range(concurrency)]
            stats.sent = len(tasks)
            done, pending = await asyncio.wait(tasks, timeout=left)
            for task in pending:
                task.cancel()
                stats.lost += 1
                stats.reasons["deadline reached"] += 1
            for task in done:
                outcome, reason, latency = task.result()
                if outcome == "ok":
                    stats.ok += 1
                    stats.latencies.append(latency)
                else:
                    setattr(stats, outcome, getattr(stats, outcome) + 1)
                    stats.reasons[reason] += 1
            stats.wall = time.monotonic() - t0
            results.append(stats)
        return results


def table(results: list[Round]) -> str:
    rows = [
        "| round | sent | ok | failed | lost | p50 s | p99 s | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    total = Round()
    for i, s in enumerate(results, 1):
        rows.append(
            f"| {i} | {s.sent} | {s.ok} | {s.failed} | {s.lost} | {percentile(s.latencies, 50):.2f} | "
            f"{percentile(s.latencies, 99):.2f} | {s.wall:.1f} |"
        )
        total.sent += s.sent
        total.ok += s.ok
        total.failed += s.failed
        total.lost += s.lost
        total.latencies += s.latencies
        total.reasons += s.reasons
        total.wall += s.wall
    rows.append(
        f"| all | {total.sent} | {total.ok} | {total.failed} | {total.lost} | "
        f"{percentile(total.latencies, 50):.2f} | {percentile(total.latencies, 99):.2f} | {total.wall:.1f} |"
    )
    for reason, count in total.reasons.most_common(5):
        rows.append(f"  {count} x {reason}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000, help=f"the server's port on {HOST}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=256, help="requests sent at once in each round")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per request (ignore_eos)")
    parser.add_argument("--stream-every", type=int, default=4, help="every Nth request streams (0: none)")
    parser.add_argument("--model", help="model name (default: the server's first)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--deadline", type=float, default=1800.0, help="seconds the whole test may take")
    args = parser.parse_args(argv)
    if not (
        1 <= args.concurrency <= MAX_CONCURRENCY
        and 1 <= args.rounds <= MAX_ROUNDS
        and 1 <= args.port <= 65535
        and args.max_tokens >= 1
        and args.stream_every >= 0
        and args.timeout > 0
        and args.deadline > 0
    ):
        print(
            f"load_test: error: need 1 <= --concurrency <= {MAX_CONCURRENCY}, 1 <= --rounds <= {MAX_ROUNDS}, "
            "a port, --max-tokens >= 1, --stream-every >= 0 and positive --timeout/--deadline",
            file=sys.stderr,
        )
        return 2
    try:
        health = httpx.get(f"http://{HOST}:{args.port}/health", timeout=30)
    except httpx.HTTPError as exc:
        print(f"load_test: error: no server on {HOST}:{args.port} ({type(exc).__name__})", file=sys.stderr)
        return 2
    if health.status_code != 200:
        print(f"load_test: error: {HOST}:{args.port}/health answered {health.status_code}", file=sys.stderr)
        return 2
    print(
        f"load test: {args.rounds} rounds of {args.concurrency} concurrent requests, {args.max_tokens} "
        f"tokens each, every {args.stream_every or 'no'}th streamed, on {HOST}:{args.port}",
        flush=True,
    )
    results = asyncio.run(run(args.port, args.rounds, args.concurrency, args.max_tokens, args.stream_every,
                              args.timeout, args.deadline, args.model))
    print(table(results), flush=True)
    return 0 if all(s.ok == s.sent for s in results) and all(s.sent for s in results) else 1


if __name__ == "__main__":
    sys.exit(main())
