"""The proxy's HTTP client to its two vLLM instances (prefill and decode): bounded, retrying, raced against
the supervisor's record of an instance that exited.

Invariants: at most `concurrency` requests are in flight to each instance, more wait in the proxy; a request
is sent again only when it cannot be delivered twice (no connection was made, or one connection closed before
any answer); every wait on an instance is raced against `down()`, so no request waits out a stopped instance's
grace period; a non-200 answer is read in full and raised, `Upstream` for a 4xx (passed to the client
unchanged), `Unavailable` otherwise (a 503 naming the instance). The client's own headers (`forwarded`, a
context variable: this request's task and the calls it awaits) go with every request sent on its behalf.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Callable

import httpx
from fastapi.responses import Response

from slimwise.serving.proxy.kv_folders import KVFolders

# connect: an instance under load (hundreds of connections at once on 2 cores) can take seconds to accept,
# and a healthy instance must not lose a request to a short connect timeout. pool: waiting for a connection
# is bounded by the per-instance semaphore instead. keepalive_expiry stays below the instances' keep-alive
# (vLLM's default 5 s; SERVER_KEEPALIVE_S for instances `slimwise serve` starts), so the proxy rarely sends a
# request on a connection the instance is closing; when it does (the clocks of a loaded proxy and instance
# drift apart), the instance closed before answering and the request is sent once more.
TIMEOUT = httpx.Timeout(600.0, connect=30.0, pool=None)
KEEPALIVE_S = 3.0
# idle keep-alive of every server slimwise serve starts (nginx's default): above clients' 5 s
SERVER_KEEPALIVE_S = 75
CONNECT_RETRIES = 4  # connection never made: the request was not sent, so retrying is safe
# closed before any answer (a stale keep-alive connection): sent once more, on a new connection
RESET_RETRIES = 1
RETRY_BACKOFF_S = 0.25  # doubles per retry: 0.25 + 0.5 + 1 + 2 s at most
UPSTREAM_CONCURRENCY = 128  # requests in flight to each instance; more wait in the proxy (back-pressure)
DOWN_POLL_S = 0.25  # how often an in-flight request checks whether the supervisor saw an instance exit


class Unavailable(Exception):
    """An instance that cannot answer: 503. `sent` False: the request never reached it (no connection)."""

    def __init__(self, message: str, sent: bool = True) -> None:
        super().__init__(message)
        self.sent = sent


class Upstream(Exception):
    """An instance's own 4xx answer (prompt too long, unknown model, ...): passed to the client unchanged."""

    def __init__(self, response: httpx.Response, content: bytes) -> None:
        super().__init__(f"{response.status_code}")
        self.status, self.content = response.status_code, content
        self.media_type = response.headers.get("content-type", "application/json")

    def response(self) -> Response:
        return Response(self.content, status_code=self.status, media_type=self.media_type)


class Instances:
    """The prefill and decode instances as the proxy reaches them: one connection pool, a semaphore of
    `concurrency` slots per instance, and the retry counters in `stats` (shown by /health).

    With `kv`, each prefill request runs inside `kv.prefill_window()` once it holds its slot: a prefill
    instance writes KV folders only while such a request runs, and the directory's cap is checked there.
    """

    def __init__(self, prefill_url: str, decode_url: str, down: Callable[[], str | None], concurrency: int,
                 kv: KVFolders | None, stats: dict) -> None:
        limits = httpx.Limits(max_connections=2 * concurrency + 16,
                              max_keepalive_connections=2 * concurrency, keepalive_expiry=KEEPALIVE_S)
        self.client = httpx.AsyncClient(timeout=TIMEOUT, limits=limits)
        self.urls = {"prefill": prefill_url, "decode": decode_url}
        self.slots = {"prefill": asyncio.Semaphore(concurrency), "decode": asyncio.Semaphore(concurrency)}
        self.down, self.kv, self.stats = down, kv, stats
        self.forwarded: contextvars.ContextVar[tuple] = contextvars.ContextVar("forwarded", default=())

    async def guarded(self, awaitable):
        """`awaitable`'s result, raced against down(): when one instance dies, the supervisor stops the other,
        and a request caught in that shutdown would otherwise wait out the stopped instance's 30 s grace
        period."""
        call = asyncio.ensure_future(awaitable)
        try:
            while not (await asyncio.wait({call}, timeout=DOWN_POLL_S))[0]:
                if reason := self.down():
                    raise Unavailable(reason)
            return call.result()
        finally:
            call.cancel()

    async def _connect(self, role: str, path: str, body: dict) -> httpx.Response:
        """The instance's answer up to its headers. Retried: a connection never made (nothing was sent), and
        once a connection closed before the answer's headers (a keep-alive connection the instance closed as
        the request went out; were it a crash, the retry finds no listener). A completion changes no state in
        vLLM, and an instance that loses its client aborts the request, so the second send cannot deliver a
        duplicate."""
        base = self.urls[role]
        attempt = resets = 0
        while True:
            try:
                request = self.client.build_request("POST", base + path, json=body,
                                                    headers=self.forwarded.get())
                return await self.guarded(self.client.send(request, stream=True))  # returns at the headers
            except httpx.HTTPError as exc:
                never_sent = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
                closed = isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError))
                retry = (never_sent and attempt < CONNECT_RETRIES) or (closed and resets < RESET_RETRIES)
                if self.down() or not retry:
                    raise Unavailable(f"{role} instance at {base} is unreachable "
                                      f"({type(exc).__name__}: {exc})", sent=not never_sent) from exc
                if never_sent:
                    self.stats["connect_retries"] += 1
                    await asyncio.sleep(RETRY_BACKOFF_S * 2**attempt)
                    attempt += 1
                else:
                    self.stats["reset_retries"] += 1
                    resets += 1

    async def send(self, role: str, path: str, body: dict, stream: bool = False) -> httpx.Response:
        """POST to an instance (the caller holds one of its slots); a non-200 answer is read and raised:
        Upstream for 4xx, Unavailable otherwise. `stream`: a 200 answer is returned unread, for the caller to
        read and close."""
        base = self.urls[role]
        r = await self._connect(role, path, body)
        if r.status_code == 200:
            if not stream:
                try:
                    await self.guarded(r.aread())
                except httpx.HTTPError as exc:
                    raise Unavailable(f"{role} instance at {base} answered 200, then failed "
                                      f"({type(exc).__name__}: {exc})") from exc
                finally:
                    await r.aclose()
            return r
        try:
            content = await self.guarded(r.aread())
        except httpx.HTTPError as exc:
            raise Unavailable(f"{role} instance at {base} answered {r.status_code}, then failed") from exc
        finally:
            await r.aclose()
        if 400 <= r.status_code < 500:
            raise Upstream(r, content)
        raise Unavailable(f"{role} instance at {base} answered {r.status_code}: "
                          f"{content[:300].decode(errors='replace')}")

    async def post(self, role: str, path: str, body: dict) -> dict:
        """The instance's JSON answer, sent once a slot of that instance is free."""
        async with self.slots[role]:
            prefill = role == "prefill" and self.kv
            with self.kv.prefill_window() if prefill else contextlib.nullcontext():
                r = await self.send(role, path, body)
        try:
            return r.json()
        except ValueError as exc:
            raise Unavailable(f"{role} instance at {self.urls[role]} answered 200 without JSON") from exc
