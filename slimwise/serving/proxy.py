"""OpenAI-compatible proxy for PD-disaggregated SlimWise: full-model prefill instance -> pruned decode instance.

Per request: (1) the prefill instance runs the prompt with max_tokens=1 and returns the prompt token ids and
the full model's first token t1 (vLLM's `return_token_ids`); its connector stores the KV of every prompt
token; (2) the decode instance gets prompt P + [t1] as token ids and max_tokens-1: its connector loads the
full model's KV for P, it computes t1 with the pruned weights and generates the rest. The client sees one
completion. A missing instance answers 503 with the URL at fault, never a hang.

Client input is checked before anything is forwarded, with vLLM's own request models (the same types and
limits as vLLM's server) plus strict JSON: a malformed request gets a 400 with an OpenAI-style JSON error, and
an instance's own 4xx answer reaches the client unchanged. Fields that steer the KV connector
(`kv_transfer_params`, ...) are the proxy's business and are dropped from client requests. Each prompt's KV
folder in the shared directory is reference-counted and deleted on every path (see `KVFolders`), and the
directory has a size cap.

Longer than 600 lines because the three parts -- request checks, KV folder bookkeeping, the request pipeline --
are one contract with the client and the connector (what is refused, what is forwarded, when a folder may go),
and each part's reasons are written next to its code; they would split into modules of their own if they grew.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import math
import os
import shutil
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from slimwise.serving.validation import MAX_N_DEFAULT, BadRequest, check_n, parse_body

# connect: an instance under load (hundreds of connections at once on 2 cores) can take seconds to accept;
# 5 s lost a request at concurrency 256 while the instance was healthy. pool: waiting for a connection is
# bounded by the per-instance semaphore instead. keepalive_expiry stays below the instances' keep-alive (vLLM's
# default 5 s; SERVER_KEEPALIVE_S for instances `slimwise serve` starts), so the proxy rarely sends a request on a
# connection the instance is closing; when it does (the clocks of a loaded proxy and instance drift apart: CI saw
# one such ReadError in 64 requests), the instance closed before answering and the request is sent once more.
TIMEOUT = httpx.Timeout(600.0, connect=30.0, pool=None)
KEEPALIVE_S = 3.0
SERVER_KEEPALIVE_S = 75  # idle keep-alive of every server slimwise serve starts (nginx's default): above clients' 5 s
CONNECT_RETRIES = 4  # connection never made: the request was not sent, so retrying is safe
RESET_RETRIES = 1  # closed before any answer (a stale keep-alive connection): sent once more, on a new connection
RETRY_BACKOFF_S = 0.25  # doubles per retry: 0.25 + 0.5 + 1 + 2 s at most
UPSTREAM_CONCURRENCY = 128  # requests in flight to each instance; more wait in the proxy (back-pressure)
DOWN_POLL_S = 0.25  # how often an in-flight request checks whether the supervisor saw an instance exit
MAX_BODY_BYTES = 32 << 20  # a larger request body gets 413 before it is read into memory
KV_DIR_MAX_BYTES = 4 << 30  # default cap of the shared KV directory (slimwise serve --kv-dir-max-gb)
KV_STALE_S = 1800.0  # an unreferenced folder this old belongs to no request the proxy still waits on
KV_GRACE_S = 30.0  # after an abnormal end: time for the decode instance to drop the aborted request
KV_SCAN_S = 1.0  # the directory's size is measured at most this often
# connector-steering fields: set by the proxy only (NIXL transfer params), never taken from a client
STRIPPED = ("kv_transfer_params", "ec_transfer_params", "request_id")


def kv_folder(kv_dir: str | Path, token_ids: list[int]) -> Path:
    """Where ExampleConnector-style storage keeps a prompt's KV (same hash as the connector)."""
    from vllm.utils.hashing import safe_hash

    digest = safe_hash(torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes(), usedforsecurity=False).hexdigest()
    return Path(kv_dir) / digest


def refusal(exc: BadRequest) -> JSONResponse:
    return JSONResponse(exc.payload(), status_code=exc.status)


def _error(status: int, message: str, kind: str = "service_unavailable", param: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


class Unavailable(Exception):
    """An instance that cannot answer: 503. `sent` False: the request never reached it (no connection)."""

    def __init__(self, message: str, sent: bool = True) -> None:
        super().__init__(message)
        self.sent = sent


class Full(Exception):
    """The shared KV directory is over its cap: 503 with Retry-After."""


class Upstream(Exception):
    """An instance's own 4xx answer (prompt too long, unknown model, ...): passed to the client unchanged."""

    def __init__(self, response: httpx.Response, content: bytes) -> None:
        super().__init__(f"{response.status_code}")
        self.status, self.content = response.status_code, content
        self.media_type = response.headers.get("content-type", "application/json")

    def response(self) -> Response:
        return Response(self.content, status_code=self.status, media_type=self.media_type)


def _validation_message(exc: Exception) -> tuple[str, str | None]:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        found = errors(include_url=False)
        if found:
            first = found[0]
            loc = ".".join(str(p) for p in first.get("loc", ()) if not str(p).startswith(("function-", "list[", "str")))
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            return f"{loc or 'body'}: {first.get('msg', 'invalid')}{more}", loc or None
    return str(exc)[:500], getattr(exc, "parameter", None)


def request_models() -> tuple[type, type]:
    """vLLM's (CompletionRequest, ChatCompletionRequest): imported once, by build_app (seconds), not by a request."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return CompletionRequest, ChatCompletionRequest


def check_request(body: dict, chat: bool) -> tuple[int | None, str, bool]:
    """(max_tokens or None when the client set none, its field's name, stream) after vLLM's own validation, or
    BadRequest.

    Mirrors vLLM's OpenAI server: the request model types every field (max_tokens 2.5 or "abc", n "x" are
    refused), SamplingParams refuses max_tokens < 1 (0 included: vLLM answers 400 "max_tokens must be at least
    1, got 0."), and the proxy's own limits come on top (one prompt, n = 1, no prompt embeddings)."""
    from vllm.exceptions import VLLMValidationError

    Model = request_models()[chat]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # chat's max_tokens, deprecated yet accepted
            req = Model.model_validate(body)
    except VLLMValidationError as exc:  # raised by vLLM's own validators (empty prompt, ...): vLLM answers 400
        raise BadRequest(str(exc)[:1000], exc.parameter) from None
    except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
        message, param = _validation_message(exc)
        raise BadRequest(message, param) from None
    if chat:
        max_tokens, param = ((req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens is not None
                             else (req.max_tokens, "max_tokens"))
    else:
        max_tokens, param = req.max_tokens, "max_tokens"
        prompt = req.prompt
        if req.prompt_embeds is not None:
            raise BadRequest("the disaggregated proxy takes token or text prompts, not prompt_embeds", "prompt_embeds")
        single = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt))
        if not single:
            raise BadRequest("the disaggregated proxy takes one prompt per request (a string or a token-id list); "
                             "send batches as separate requests", "prompt")
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest(f"{param} must be at least 1, got {max_tokens}.", param)
    if req.n != 1:
        raise BadRequest("n > 1 is not supported by the disaggregated proxy", "n")
    return max_tokens, param, bool(req.stream)


def strip_client_steering(body: dict) -> dict:
    """The request without fields that steer the KV connector: only the proxy sets them."""
    body = {k: v for k, v in body.items() if k not in STRIPPED}
    if isinstance(body.get("vllm_xargs"), dict):  # vLLM copies kv_transfer_params from there into the request too
        body["vllm_xargs"] = {k: v for k, v in body["vllm_xargs"].items() if k not in STRIPPED}
    return body


# ----- the shared KV directory ---------------------------------------------------------------------------------
class KVFolders:
    """Lifetime of the per-prompt folders in the shared-directory connector's storage.

    A folder is keyed by the prompt's token ids, so concurrent requests with the same prompt share it: it is
    reference-counted from the moment its prefill answered until its decode request ended, and deleted when the
    last holder lets go: soon after a normal end or a decode rejection (the decode instance no longer needs it),
    KV_GRACE_S later when the decode request was abandoned (timeout, client gone: the instance may still be about
    to load it). "Soon" is once every prefill request sent before the deletion was asked for has answered: a
    prefill instance writes a folder only while such a request runs, so a folder never goes from under a writer.
    Deleting renames the folder first (atomic); a prefill that found the folder just before it went stored
    nothing, which `acquire` detects (the folder is missing) and the proxy answers by prefilling again. Folders
    nobody holds that are older than KV_STALE_S (a prefill answer that never arrived, a crashed proxy) are swept,
    and new requests get 503 while the directory is over `max_bytes`.
    """

    def __init__(self, kv_dir: str | Path, max_bytes: int = KV_DIR_MAX_BYTES, stale_s: float = KV_STALE_S) -> None:
        self.dir, self.max_bytes, self.stale_s = Path(kv_dir), max_bytes, stale_s
        self.refs: Counter[Path] = Counter()
        self.sent = 0  # prefill requests sent so far (their sequence numbers)
        self.prefilling: set[int] = set()  # sequence numbers of prefill requests not yet answered
        self.pending: dict[Path, tuple[int, float]] = {}  # folder -> (prefills sent when asked, not before)
        self.usage, self.measured = 0, -math.inf

    def prefill_sent(self) -> int:
        self.sent += 1
        self.prefilling.add(self.sent)
        return self.sent

    def prefill_answered(self, seq: int) -> None:
        self.prefilling.discard(seq)
        self.run_pending()

    def acquire(self, token_ids: list[int]) -> bool:
        """Hold the prompt's folder; True when it holds the stored KV."""
        folder = kv_folder(self.dir, token_ids)
        self.refs[folder] += 1
        self.pending.pop(folder, None)
        with contextlib.suppress(OSError):
            return any(name.endswith(".safetensors") for name in os.listdir(folder))
        return False

    def release(self, token_ids: list[int], now: bool = True) -> None:
        """Let go of the folder; the last holder deletes it (`now` False: after KV_GRACE_S)."""
        folder = kv_folder(self.dir, token_ids)
        self.refs[folder] -= 1
        if self.refs[folder] <= 0:
            del self.refs[folder]
            self._pend(folder, 0.0 if now else KV_GRACE_S)

    def discard(self, token_ids: list[int]) -> None:
        """A prompt that never reaches the decode instance (finished at t1): delete its folder unless held."""
        folder = kv_folder(self.dir, token_ids)
        if not self.refs[folder]:  # a Counter lookup adds no key
            self._pend(folder, 0.0)

    def _pend(self, folder: Path, delay: float) -> None:
        """Delete when the prefills sent so far have answered. Only a folder that exists: a prefill sent later may
        be writing one that does not (after a missing folder, the proxy prefills again)."""
        if folder.is_dir():
            self.pending[folder] = (self.sent, time.monotonic() + delay)
            self.run_pending()

    def run_pending(self) -> None:
        oldest = min(self.prefilling, default=math.inf)
        now = time.monotonic()
        for folder, (sent, when) in list(self.pending.items()):
            if sent < oldest and when <= now:
                del self.pending[folder]
                if not self.refs[folder]:
                    self._delete(folder)

    def _delete(self, folder: Path) -> None:
        doomed = folder.with_name(f".deleting-{folder.name}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(folder, doomed)
        except OSError:
            return  # already gone
        shutil.rmtree(doomed, ignore_errors=True)

    def over_cap(self) -> str | None:
        """A message when the directory is over its cap (measured at most every KV_SCAN_S, sweeping as it goes)."""
        now = time.monotonic()
        if now - self.measured >= KV_SCAN_S:
            self.measured, self.usage = now, self.sweep()
        if self.usage > self.max_bytes:
            return (f"the shared KV directory {self.dir} holds {self.usage / 2**20:.0f} MiB, over its cap of "
                    f"{self.max_bytes / 2**20:.0f} MiB (slimwise serve --kv-dir-max-gb); retry shortly")
        return None

    def sweep(self) -> int:
        """Delete pending folders that may go and stale unheld folders; the bytes that remain."""
        self.run_pending()
        wall = time.time()
        total = 0
        with contextlib.suppress(OSError), os.scandir(self.dir) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    if not entry.is_dir(follow_symlinks=False):
                        continue
                    folder = Path(entry.path)
                    if entry.name.startswith(".deleting-"):  # renamed by a delete that did not finish
                        shutil.rmtree(folder, ignore_errors=True)
                        continue
                    if not self.refs[folder] and folder not in self.pending and \
                            wall - entry.stat().st_mtime > self.stale_s:
                        self._delete(folder)
                        continue
                    with os.scandir(folder) as files:
                        total += sum(f.stat().st_size for f in files if f.is_file(follow_symlinks=False))
        return total


class _Stream(StreamingResponse):
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


# ----- the app -------------------------------------------------------------------------------------------------
def build_app(prefill_url: str, decode_url: str, kv_dir: str | None = None, nixl: bool = False,
              down: Callable[[], str | None] = lambda: None, kv_dir_max_bytes: int = KV_DIR_MAX_BYTES,
              upstream_concurrency: int = UPSTREAM_CONCURRENCY, max_n: int = MAX_N_DEFAULT) -> FastAPI:
    """The proxy app. nixl=True asks the prefill instance for remote-decode transfer params (NixlConnector).

    `down()` names a supervised instance that exited (None while all run): `slimwise serve` stops the other
    instance then, so without it a request caught in that shutdown would blame the instance being stopped.
    At most `upstream_concurrency` requests are in flight to each instance; more wait in the proxy. A request for
    more than `max_n` completions gets the same 400 as from the colocated server (the proxy serves n = 1 only).
    """
    request_models()
    app = FastAPI(title="SlimWise PD proxy")
    limits = httpx.Limits(max_connections=2 * upstream_concurrency + 16,
                          max_keepalive_connections=2 * upstream_concurrency, keepalive_expiry=KEEPALIVE_S)
    client = httpx.AsyncClient(timeout=TIMEOUT, limits=limits)
    slots = {"prefill": asyncio.Semaphore(upstream_concurrency), "decode": asyncio.Semaphore(upstream_concurrency)}
    kv = KVFolders(kv_dir, kv_dir_max_bytes) if kv_dir else None
    stats = {"requests": 0, "first_tokens_from_prefill": 0, "connect_retries": 0, "reset_retries": 0}
    base_of = {"prefill": prefill_url, "decode": decode_url}
    forwarded: contextvars.ContextVar[tuple] = contextvars.ContextVar("forwarded", default=())  # header pairs

    async def guarded(awaitable):
        """`awaitable`'s result, raced against down(): when one instance dies, the supervisor stops the other,
        and a request caught in that shutdown would otherwise wait out the stopped instance's 30 s grace period."""
        call = asyncio.ensure_future(awaitable)
        try:
            while not (await asyncio.wait({call}, timeout=DOWN_POLL_S))[0]:
                if reason := down():
                    raise Unavailable(reason)
            return call.result()
        finally:
            call.cancel()

    async def send(role: str, path: str, body: dict, stream: bool = False) -> httpx.Response:
        """POST to an instance (the caller holds one of its slots); a non-200 answer is read and raised: Upstream
        for 4xx, Unavailable otherwise. Retried: a connection never made (nothing was sent), and once a connection
        closed before the answer's headers (a keep-alive connection the instance closed as the request went out;
        were it a crash, the retry finds no listener). A completion changes no state in vLLM, and an instance that
        loses its client aborts the request, so the second send cannot deliver a duplicate."""
        base = base_of[role]
        attempt = resets = 0
        while True:
            try:
                request = client.build_request("POST", base + path, json=body, headers=forwarded.get())
                r = await guarded(client.send(request, stream=True))  # returns at the headers
                break
            except httpx.HTTPError as exc:
                never_sent = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
                closed = isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError))
                if down() or not ((never_sent and attempt < CONNECT_RETRIES) or (closed and resets < RESET_RETRIES)):
                    raise Unavailable(f"{role} instance at {base} is unreachable ({type(exc).__name__}: {exc})",
                                      sent=not never_sent) from exc
                if never_sent:
                    stats["connect_retries"] += 1
                    await asyncio.sleep(RETRY_BACKOFF_S * 2**attempt)
                    attempt += 1
                else:
                    stats["reset_retries"] += 1
                    resets += 1
        if r.status_code == 200:
            if not stream:
                try:
                    await guarded(r.aread())
                except httpx.HTTPError as exc:
                    raise Unavailable(f"{role} instance at {base} answered 200, then failed "
                                      f"({type(exc).__name__}: {exc})") from exc
                finally:
                    await r.aclose()
            return r
        try:
            content = await guarded(r.aread())
        except httpx.HTTPError as exc:
            raise Unavailable(f"{role} instance at {base} answered {r.status_code}, then failed") from exc
        finally:
            await r.aclose()
        if 400 <= r.status_code < 500:
            raise Upstream(r, content)
        raise Unavailable(f"{role} instance at {base} answered {r.status_code}: {content[:300].decode(errors='replace')}")

    async def post(role: str, path: str, body: dict) -> dict:
        async with slots[role]:
            if role == "prefill" and kv:
                if full := kv.over_cap():  # checked again after the wait: the folders waiting for decode count
                    raise Full(full)
                seq = kv.prefill_sent()  # a prefill writes KV only now: deletions wait for it from here on
                try:
                    r = await send(role, path, body)
                finally:
                    kv.prefill_answered(seq)
            else:
                r = await send(role, path, body)
        try:
            return r.json()
        except ValueError as exc:
            raise Unavailable(f"{role} instance at {base_of[role]} answered 200 without JSON") from exc

    async def prefill(body: dict, path: str) -> tuple[list[int], int, str, str | None, dict]:
        pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "n", "max_completion_tokens",
                                                          "min_tokens")}
        pre.update(max_tokens=1, return_token_ids=True)
        if nixl:
            pre["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                         "remote_block_ids": None, "remote_host": None, "remote_port": None}
        out = await post("prefill", path, pre)
        try:
            choice = out["choices"][0]
            prompt_ids = [int(t) for t in out.get("prompt_token_ids") or choice.get("prompt_token_ids") or []]
            tokens = list(choice.get("token_ids") or [])
            text = choice["message"]["content"] if "message" in choice else choice["text"]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise Unavailable(f"prefill instance at {prefill_url} gave an unexpected answer "
                              f"({type(exc).__name__}: {exc})") from exc
        return prompt_ids, tokens[0] if tokens else -1, text or "", choice.get("finish_reason"), out

    def decode_body(body: dict, prompt_ids: list[int], t1: int, remaining: int) -> dict:
        keep = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                "skip_special_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                "stream", "stream_options", "model")
        dec = {k: v for k, v in body.items() if k in keep}
        dec.update(prompt=[*prompt_ids, t1], max_tokens=remaining, return_token_ids=True)
        if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 1:  # t1 was the first of them
            dec["min_tokens"] = body["min_tokens"] - 1
        return dec

    def _finish(chat, rid, model, text, reason, prompt_ids, n_completion, token_ids):
        n_prompt = len(prompt_ids)
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                 "total_tokens": n_prompt + n_completion}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
            obj = "text_completion"
        if token_ids is not None:
            choice["token_ids"] = token_ids  # t1 from the full model, the rest from the pruned decoder
            choice["prompt_token_ids"] = prompt_ids  # as vLLM answers return_token_ids: what the text became
        return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": model,
                             "choices": [choice], "usage": usage})

    def chunk(chat: bool, rid: str, model: str, text: str | None, reason: str | None, first: bool = False) -> str:
        if chat:
            delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
            payload = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                       "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}
        else:
            payload = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                       "choices": [{"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}]}
        return f"data: {json.dumps(payload)}\n\n"

    async def first_only(chat: bool, rid: str, model: str, text: str, reason: str):
        """A stream that ends at t1 (max_tokens 1, a stop at t1): still SSE, as vLLM answers a stream."""
        yield chunk(chat, rid, model, text, None, first=True)
        yield chunk(chat, rid, model, None, reason)
        yield "data: [DONE]\n\n"

    async def relay(r: httpx.Response, t1_text: str, rid: str, model: str, chat: bool, state: dict):
        """t1's chunk, then the decode instance's stream; `state["ended"]` once the instance finished it."""
        try:
            yield chunk(chat, rid, model, t1_text, None, first=True)
            lines = r.aiter_lines()
            while True:
                try:
                    line = await guarded(lines.__anext__())
                except StopAsyncIteration:
                    break
                if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                    continue
                try:
                    part = json.loads(line[6:])
                except ValueError:
                    continue
                for c in part.get("choices", []):
                    yield chunk(chat, rid, model, c.get("text"), c.get("finish_reason"))
                if "error" in part:
                    yield f"data: {json.dumps({'error': part['error']})}\n\n"
            state["ended"] = True
        except httpx.HTTPError as exc:
            msg = f"decode instance at {decode_url} failed mid-stream ({type(exc).__name__})"
            yield f"data: {json.dumps({'error': {'message': msg}})}\n\n"
        except Unavailable as exc:  # the supervisor saw an instance exit while the stream waited
            yield f"data: {json.dumps({'error': {'message': f'{exc}; restart slimwise serve'}})}\n\n"
        yield "data: [DONE]\n\n"

    async def complete(body: dict, chat: bool, max_tokens: int | None, streaming: bool):
        stats["requests"] += 1
        path = "/v1/chat/completions" if chat else "/v1/completions"
        for _ in range(3):
            prompt_ids, t1, t1_text, finish, pre = await prefill(body, path)
            if max_tokens is None:  # vLLM's defaults: completions 16; chat, up to the context length
                limit = await max_model_len() if chat else None
                max_tokens = limit - len(prompt_ids) if limit and limit > len(prompt_ids) else 16
            done = max_tokens <= 1 or finish == "stop" or t1 < 0
            if kv is None or done:
                held = False
                break
            if kv.acquire(prompt_ids):
                held = True
                break
            kv.release(prompt_ids)  # missing: deleted under a prefill that found it stored; prefill again
        else:
            raise Unavailable(f"the prefill instance at {prefill_url} stored no KV for the prompt in {kv.dir} "
                              "(3 tries); is it started with the same --kv-transfer-config directory?")
        stats["first_tokens_from_prefill"] += 1
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        model = body.get("model") or pre.get("model")
        if done:
            if kv:
                kv.discard(prompt_ids)
            if streaming:
                return StreamingResponse(first_only(chat, rid, model, t1_text, finish or "length"),
                                         media_type="text/event-stream")
            return _finish(chat, rid, model, t1_text, finish or "length", prompt_ids, 1, [t1])
        dec = decode_body(body, prompt_ids, t1, max_tokens - 1)
        if pre.get("kv_transfer_params"):  # NIXL-style connectors hand the decode side the remote block ids
            dec["kv_transfer_params"] = pre["kv_transfer_params"]
        clean = False  # False: an abnormal end, the decode instance may still hold the request for a moment
        try:
            if streaming:
                await guarded(slots["decode"].acquire())
                try:
                    r = await send("decode", "/v1/completions", dec, stream=True)
                except BaseException:
                    slots["decode"].release()
                    raise
                held = False  # released when the response ends, however it ends
                state = {"ended": False}

                async def close(r=r, prompt_ids=prompt_ids, state=state) -> None:
                    with contextlib.suppress(Exception):
                        await r.aclose()
                    slots["decode"].release()
                    if kv:
                        kv.release(prompt_ids, now=state["ended"])

                return _Stream(relay(r, t1_text, rid, model, chat, state), close)
            out = await post("decode", "/v1/completions", dec)
            clean = True
        except Upstream:
            clean = True  # refused before it was scheduled: nothing will load the folder
            raise
        except Unavailable as exc:
            clean = not exc.sent  # never reached the instance: nothing will load the folder
            raise
        finally:
            if held and kv:
                kv.release(prompt_ids, now=clean)
        try:
            choice = out["choices"][0]
            usage = out.get("usage") or {}
            return _finish(chat, rid, model, t1_text + choice["text"], choice.get("finish_reason"),
                           prompt_ids, 1 + int(usage.get("completion_tokens", 0)),
                           [t1, *(choice.get("token_ids") or [])])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise Unavailable(f"decode instance at {decode_url} gave an unexpected answer "
                              f"({type(exc).__name__}: {exc})") from exc

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise BadRequest(f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB", status=413)
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > MAX_BODY_BYTES:
                raise BadRequest(f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB", status=413)
            parts.append(part)
        return b"".join(parts)

    async def max_model_len() -> int | None:
        """The instances' context length (their /v1/models cards, read once): vLLM refuses max_tokens above it, and
        the decode instance, asked for max_tokens - 1, would not."""
        if "max_model_len" not in stats:
            found = []
            for url in (prefill_url, decode_url):
                try:
                    r = await guarded(client.get(url + "/v1/models", timeout=30, headers=forwarded.get()))
                    found += [int(c["max_model_len"]) for c in r.json()["data"] if c.get("max_model_len")]
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    return None  # asked again next time; the instances check what they can
            stats["max_model_len"] = min(found) if found else None
        return stats["max_model_len"]

    async def handle(request: Request, chat: bool):
        try:
            body = parse_body(await read_body(request))
            check_n(body, max_n)
            max_tokens, param, streaming = check_request(body, chat)
        except BadRequest as exc:
            return refusal(exc)
        body = strip_client_steering(body)
        # vLLM's --api-key (passed to both instances) is checked by the instances: the client's key goes with its
        # requests (a context variable: this request's task and the calls it awaits)
        forwarded.set((("authorization", auth),) if (auth := request.headers.get("authorization")) else ())
        if reason := down():
            return _error(503, f"{reason}; restart slimwise serve")
        try:
            if max_tokens is not None and (limit := await max_model_len()) is not None and max_tokens > limit:
                return refusal(BadRequest(f"{param}={max_tokens} cannot be greater than max_model_len={limit}. Please "
                                          "request fewer output tokens.", param))  # vLLM's words
            return await complete(body, chat, max_tokens, streaming)
        except Upstream as exc:
            return exc.response()
        except Full as exc:
            return _error(503, str(exc), headers={"Retry-After": "1"})
        except Unavailable as exc:
            reason = down()
            if not reason:
                return _error(503, str(exc))
            return _error(503, f"{reason}; restart slimwise serve" + ("" if str(exc) == reason else f" ({exc})"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        auth = request.headers.get("authorization")
        try:
            r = await client.get(decode_url + "/v1/models", headers={"authorization": auth} if auth else None)
            return JSONResponse(r.json(), status_code=r.status_code)
        except (httpx.HTTPError, ValueError) as exc:
            return _error(503, f"decode instance at {decode_url} is unreachable ({type(exc).__name__})")

    @app.get("/health")
    async def health():
        if reason := down():
            return _error(503, reason)
        bad = []
        for role, url in (("prefill", prefill_url), ("decode", decode_url)):
            try:
                if (await client.get(url + "/health")).status_code != 200:
                    bad.append(role)
            except httpx.HTTPError:
                bad.append(role)
        if bad:
            return _error(503, f"{' and '.join(bad)} instance(s) not healthy")
        return JSONResponse({"status": "ok", **stats})

    app.state.kv = kv  # for tests and /health readers
    return app
