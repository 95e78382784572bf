"""The disaggregated proxy's HTTP face: the FastAPI app, its routes, and how each outcome becomes a response.

Invariants: a client request is checked in full before anything is forwarded (a refusal is an OpenAI-style
JSON error); while the supervisor reports an exited instance every completion and /health answer 503 naming
it; an instance's own 4xx reaches the client unchanged, any other failure is a 503 with an OpenAI-style body,
and a full KV directory a 503 with Retry-After.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from slimwise.serving.proxy.checks import check_request, read_body, request_models, strip_client_steering
from slimwise.serving.proxy.kv_folders import KV_DIR_MAX_BYTES, Full, KVFolders
from slimwise.serving.proxy.pipeline import Pipeline
from slimwise.serving.proxy.upstream import UPSTREAM_CONCURRENCY, Instances, Unavailable, Upstream
from slimwise.serving.validation import MAX_N_DEFAULT, BadRequest, check_n, parse_body


def refusal(exc: BadRequest) -> JSONResponse:
    return JSONResponse(exc.payload(), status_code=exc.status)


def _error(status: int, message: str, kind: str = "service_unavailable", param: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


def failure(exc: Upstream | Full | Unavailable, down: Callable[[], str | None]) -> Response:
    """The answer when the pipeline could not complete; an exited instance (down()) is named first."""
    if isinstance(exc, Upstream):
        return exc.response()
    if isinstance(exc, Full):
        return _error(503, str(exc), headers={"Retry-After": "1"})
    reason = down()
    if not reason:
        return _error(503, str(exc))
    return _error(503, f"{reason}; restart slimwise serve" + ("" if str(exc) == reason else f" ({exc})"))


async def handle(pipeline: Pipeline, request: Request, chat: bool, max_n: int) -> Response:
    upstream = pipeline.upstream
    try:
        body = parse_body(await read_body(request))
        check_n(body, max_n)
        max_tokens, param, streaming = check_request(body, chat)
    except BadRequest as exc:
        return refusal(exc)
    body = strip_client_steering(body)
    # vLLM's --api-key (passed to both instances) is checked by the instances: the client's key goes with its
    # requests (a context variable: this request's task and the calls it awaits)
    auth = request.headers.get("authorization")
    upstream.forwarded.set((("authorization", auth),) if auth else ())
    if reason := upstream.down():
        return _error(503, f"{reason}; restart slimwise serve")
    try:
        if max_tokens is not None and (limit := await pipeline.max_model_len()) is not None \
                and max_tokens > limit:
            return refusal(BadRequest(f"{param}={max_tokens} cannot be greater than max_model_len={limit}. "
                                      "Please request fewer output tokens.", param))  # vLLM's words
        return await pipeline.complete(body, chat, max_tokens, streaming)
    except (Upstream, Full, Unavailable) as exc:
        return failure(exc, upstream.down)


async def model_cards(upstream: Instances, request: Request) -> JSONResponse:
    """The decode instance's /v1/models, with the client's key."""
    auth = request.headers.get("authorization")
    decode_url = upstream.urls["decode"]
    try:
        headers = {"authorization": auth} if auth else None
        r = await upstream.client.get(decode_url + "/v1/models", headers=headers)
        return JSONResponse(r.json(), status_code=r.status_code)
    except (httpx.HTTPError, ValueError) as exc:
        return _error(503, f"decode instance at {decode_url} is unreachable ({type(exc).__name__})")


async def check_health(upstream: Instances, stats: dict) -> JSONResponse:
    """200 with the proxy's counters when both instances answer their /health with 200, else 503."""
    if reason := upstream.down():
        return _error(503, reason)
    bad = []
    for role, url in upstream.urls.items():
        try:
            if (await upstream.client.get(url + "/health")).status_code != 200:
                bad.append(role)
        except httpx.HTTPError:
            bad.append(role)
    if bad:
        return _error(503, f"{' and '.join(bad)} instance(s) not healthy")
    return JSONResponse({"status": "ok", **stats})


def build_app(prefill_url: str, decode_url: str, kv_dir: str | None = None, nixl: bool = False,
              down: Callable[[], str | None] = lambda: None, kv_dir_max_bytes: int = KV_DIR_MAX_BYTES,
              upstream_concurrency: int = UPSTREAM_CONCURRENCY, max_n: int = MAX_N_DEFAULT) -> FastAPI:
    """The proxy app. nixl=True asks the prefill instance for remote-decode transfer params (NixlConnector).

    `down()` names a supervised instance that exited (None while all run): `slimwise serve` stops the other
    instance then, so without it a request caught in that shutdown would blame the instance being stopped.
    At most `upstream_concurrency` requests are in flight to each instance; more wait in the proxy. A request
    for more than `max_n` completions gets the same 400 as from the colocated server (the proxy serves n = 1
    only).
    """
    request_models()
    app = FastAPI(title="SlimWise PD proxy")
    kv = KVFolders(kv_dir, kv_dir_max_bytes) if kv_dir else None
    # one dict, shown by /health in this order; the instances' context length joins it once read
    stats = {"requests": 0, "first_tokens_from_prefill": 0, "connect_retries": 0, "reset_retries": 0}
    upstream = Instances(prefill_url, decode_url, down, upstream_concurrency, kv, stats)
    pipeline = Pipeline(upstream, kv, nixl, stats)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(pipeline, request, chat=False, max_n=max_n)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(pipeline, request, chat=True, max_n=max_n)

    @app.get("/v1/models")
    async def models(request: Request):
        return await model_cards(upstream, request)

    @app.get("/health")
    async def health():
        return await check_health(upstream, stats)

    @app.get("/metrics")
    async def metrics():
        from slimwise.serving.metrics import render_proxy

        try:
            answer = await upstream.client.get(upstream.urls["decode"] + "/metrics")
            text = answer.text if answer.status_code == 200 else None
        except httpx.HTTPError:
            text = None
        return Response(render_proxy(stats, text), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.state.kv = kv  # for tests and /health readers
    return app
