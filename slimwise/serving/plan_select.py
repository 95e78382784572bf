"""Per-request plan choice by model name in vLLM's OpenAI server (`slimwise serve --plan NAME=PLAN ...`).

`slimwise serve` starts vLLM with every model name it exposes as a served name (`MODEL`, `MODEL:full`,
`MODEL:<plan>`), so `/v1/models` lists them and vLLM answers 404 for any other. This ASGI middleware (vLLM's
`--middleware`) reads the request's `model` and writes the plan it stands for into the request's `vllm_xargs`,
which vLLM hands to the workers as `SamplingParams.extra_args` (what `DecodeRouting.request_plans` reads), and
puts the requested name back into the response's `model` field (vLLM echoes its first served name). A client
that sets `vllm_xargs.slimwise_plan` itself gets 400 for a name the engine does not serve.

Every colocated server runs it, plans or not: a body it cannot parse (malformed or deeply nested JSON, not an
object, not UTF-8) and a request for more than `--max-n` completions get an OpenAI-style 400 here, the answers
the disaggregated proxy gives (`validation.py`). The name -> plan map and the limit come from the environment
variables `PLAN_MODELS_ENV` (JSON) and `MAX_N_ENV`, set by `slimwise serve`.

Fail closed: a server that serves a plan (`SELF_CHECK_ENV`) runs the start-up self-check (`selfcheck.py`) on
its engine once, before the first completion; every completion waits for it and gets 503 with its reason if
it failed. `GET /slimwise/self-check` answers what it verified (`slimwise serve` asks before it says ready).
"""

from __future__ import annotations

import asyncio
import json
import os

from slimwise.serving.routing import REQUEST_PLAN_ARG
from slimwise.serving.selfcheck import SELF_CHECK_PATH
from slimwise.serving.validation import MAX_N_DEFAULT, BadRequest, check_n, parse_body

PLAN_MODELS_ENV = "SLIMWISE_PLAN_MODELS"  # {"served name": plan name or null (the default plan)}
SELF_CHECK_ENV = "SLIMWISE_SELF_CHECK"  # "1": the engine serves a plan; check it before the first completion
MAX_N_ENV = "SLIMWISE_MAX_N"  # completions per request the server accepts (slimwise serve --max-n)
_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def served_names(base: str, plans: list[str]) -> dict[str, str | None]:
    """Every model name a multi-plan server exposes and the plan it selects (None: the default plan)."""
    return {base: None, f"{base}:full": "full", **{f"{base}:{name}": name for name in plans}}


class PlanSelectMiddleware:
    """ASGI middleware in front of vLLM's OpenAI routes: refuses bodies it cannot parse and requests over the
    cost limit (400, as the disaggregated proxy does), maps `model` -> `vllm_xargs.slimwise_plan` on requests,
    and puts the requested name back on responses. Installed by every colocated `slimwise serve`, with or
    without plans."""

    def __init__(self, app) -> None:
        self.app = app
        self.models: dict[str, str | None] = json.loads(os.environ.get(PLAN_MODELS_ENV) or "{}")
        self.max_n = int(os.environ.get(MAX_N_ENV) or MAX_N_DEFAULT)
        self.base = next(iter(self.models), None)
        self.plans = {p for p in self.models.values() if p is not None}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("path") == SELF_CHECK_PATH:
            await _self_check(scope, send)
            return
        if scope["type"] == "http" and scope.get("path") == "/metrics" and scope.get("method") == "GET":
            await _metrics(self.app, scope, receive, send)
            return
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in _PATHS:
            await self.app(scope, receive, send)
            return
        problem = await _checked(scope)
        if problem is not None:
            await _reply(send, 503, {"error": {"message": problem, "type": "self_check_failed", "param": None,
                                               "code": 503}})
            return
        body = await _read_body(receive)
        try:
            request = parse_body(body)
            check_n(request, self.max_n)
            body, name = self.route(request, body)
        except BadRequest as exc:
            await _reply(send, exc.status, exc.payload())
            return
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()  # client disconnects etc. after the body
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        if not isinstance(name, str) or name == self.base or name not in self.models:
            await self.app(scope, replay, send)
            return
        await self.app(scope, replay, _renaming(send, self.base, name))

    def route(self, request: dict, body: bytes) -> tuple[bytes, object]:
        """The body to hand vLLM (the plan of the requested model name in `vllm_xargs`, unless the request
        named one itself) and the model name asked for; a plan this server does not serve is refused."""
        if not self.models:
            return body, None
        xargs = request.get("vllm_xargs") if isinstance(request.get("vllm_xargs"), dict) else {}
        asked = xargs.get(REQUEST_PLAN_ARG)
        if asked is not None and asked not in self.plans:
            raise BadRequest(f"vllm_xargs.{REQUEST_PLAN_ARG} {asked!r} is not served here; "
                             f"choose a plan by model name: {', '.join(self.models)}",
                             f"vllm_xargs.{REQUEST_PLAN_ARG}")
        name = request.get("model")
        plan = self.models.get(name) if isinstance(name, str) else None
        if plan is not None and asked is None:
            request["vllm_xargs"] = {**xargs, REQUEST_PLAN_ARG: plan}
            body = json.dumps(request).encode()
        return body, name


_CHECK: dict = {"task": None}  # this server process's one self-check (an asyncio task once started)


async def _checked(scope) -> str | None:
    """Run the start-up self-check once per server process, on the first request that needs it (every
    completion waits for it: its row counts must see the warm-up alone); the failure's one line, or None.
    Servers without a plan (SELF_CHECK_ENV unset) skip it."""
    if not os.environ.get(SELF_CHECK_ENV):
        return None
    from slimwise.errors import SlimWiseError
    from slimwise.serving.selfcheck import check_engine_client

    if _CHECK["task"] is None:
        _CHECK["task"] = asyncio.ensure_future(check_engine_client(scope["app"].state.engine_client, seed=1))
    try:
        await asyncio.shield(_CHECK["task"])
    except SlimWiseError as exc:
        return str(exc)
    return None


async def _self_check(scope, send) -> None:
    """`GET SELF_CHECK_PATH`: 200 with what the self-check verified, or 409 with its one-line reason
    (`slimwise serve` asks before it announces the server)."""
    problem = await _checked(scope)
    if problem is not None:
        await _reply(send, 409, {"error": {"message": problem, "type": "self_check_failed", "param": None,
                                           "code": 409}})
    elif _CHECK["task"] is None:
        await _reply(send, 404, {"error": {"message": "this server serves no SlimWise plan", "type":
                                           "not_found", "param": None, "code": 404}})
    else:
        await _reply(send, 200, _CHECK["task"].result())


async def _metrics(app, scope, receive, send) -> None:
    """vLLM's `/metrics` with SlimWise's families appended (`metrics.py`); asked uncompressed, so the text
    can be extended."""
    from slimwise.serving.metrics import render

    scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers", [])
                                  if k.lower() != b"accept-encoding"]}
    start, chunks = None, []

    async def capture(message) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, capture)
    body = b"".join(chunks)
    if start is not None and start.get("status") == 200:
        counters = await scope["app"].state.engine_client.collective_rpc("slimwise_counters")
        task = _CHECK["task"]
        passed = None if task is None or not task.done() else task.exception() is None
        body += render(counters, passed)
    headers = [(k, v) for k, v in (start or {}).get("headers", []) if k.lower() != b"content-length"]
    await send({"type": "http.response.start", "status": (start or {}).get("status", 500),
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if message["type"] == "http.disconnect" or not message.get("more_body"):
            return b"".join(chunks)


def _renaming(send, base: str, name: str):
    """An ASGI `send` that puts the requested model name back: responses echo vLLM's first served name (JSON
    and SSE chunks alike); the content length is recomputed for a whole body."""
    old, new = f'"model":"{base}"'.encode(), f'"model":"{name}"'.encode()
    start = None

    async def send_renamed(message) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
            return
        if message["type"] == "http.response.body":
            data = message.get("body", b"").replace(old, new)
            if start is not None:
                headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                if not message.get("more_body"):
                    headers.append((b"content-length", str(len(data)).encode()))
                await send({**start, "headers": headers})
                start = None
            await send({**message, "body": data})
            return
        await send(message)

    return send_renamed


async def _reply(send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
