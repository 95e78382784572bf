"""The streamed (SSE) answer of the disaggregated proxy: t1's chunk from the prefill instance, then the decode
instance's stream relayed chunk by chunk, rewritten to the client's request id, model and endpoint shape.

Invariants: a stream is well-formed SSE in the shape of the endpoint the client called (chat or completions)
and always ends with `data: [DONE]`, also when an instance fails mid-stream (an `error` chunk comes first);
`state["ended"]` is set only when the decode instance finished its stream; a `ClosingStream` runs its `close`
when the response ends, however it ends, also for a client that left before the first byte.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import NamedTuple

import httpx
from fastapi.responses import StreamingResponse

from slimwise.serving.proxy.upstream import Instances, Unavailable


class Reply(NamedTuple):
    """Who an answer is for: the endpoint's shape (chat or completions), the completion's id, its model."""

    chat: bool
    rid: str
    model: str


def chunk(reply: Reply, text: str | None, reason: str | None, first: bool = False) -> str:
    chat, rid, model = reply
    if chat:
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
        payload = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}
    else:
        payload = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                   "choices": [{"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}]}
    return f"data: {json.dumps(payload)}\n\n"


async def first_only(reply: Reply, text: str, reason: str):
    """A stream that ends at t1 (max_tokens 1, a stop at t1): still SSE, as vLLM answers a stream."""
    yield chunk(reply, text, None, first=True)
    yield chunk(reply, None, reason)
    yield "data: [DONE]\n\n"


def error_event(error: dict) -> str:
    return f"data: {json.dumps({'error': error})}\n\n"


class _NotVllmShape(Exception):
    """A decode-stream event that is not an object with a list of object choices."""


async def relay(upstream: Instances, r: httpx.Response, t1_text: str, reply: Reply, state: dict):
    """t1's chunk, then the decode instance's stream; `state["ended"]` once the instance finished it."""
    try:
        yield chunk(reply, t1_text, None, first=True)
        lines = r.aiter_lines()
        while True:
            try:
                line = await upstream.guarded(lines.__anext__())
            except StopAsyncIteration:
                break
            if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                continue
            try:
                part = json.loads(line[6:])
            except ValueError:
                continue
            choices = part.get("choices", []) if isinstance(part, dict) else None
            if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
                raise _NotVllmShape
            for c in choices:
                yield chunk(reply, c.get("text"), c.get("finish_reason"))
            if "error" in part:
                yield error_event(part["error"])
        state["ended"] = True
    except httpx.HTTPError as exc:
        msg = f"decode instance at {upstream.urls['decode']} failed mid-stream ({type(exc).__name__})"
        yield error_event({"message": msg})
    except _NotVllmShape:  # the instance's stream did not end: `ended` stays False
        yield error_event({"message": f"decode instance at {upstream.urls['decode']} sent an unexpected "
                                      "stream event"})
    except Unavailable as exc:  # the supervisor saw an instance exit while the stream waited
        yield error_event({"message": f"{exc}; restart slimwise serve"})
    yield "data: [DONE]\n\n"


class ClosingStream(StreamingResponse):
    """A streamed answer that runs `close()` once it ends, also when the client left before its first byte (a
    generator's own `finally` never runs if it never started)."""

    def __init__(self, content, close: Callable) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.close = close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.close()
