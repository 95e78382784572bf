"""OpenAI-compatible proxy for PD-disaggregated SlimWise: full-model prefill instance -> pruned decode instance.

Per request: (1) the prefill instance runs the prompt with max_tokens=1 and returns the prompt token ids and
the full model's first token t1 (vLLM's `return_token_ids`); its connector stores the KV of every prompt
token; (2) the decode instance gets prompt P + [t1] as token ids and max_tokens-1: its connector loads the
full model's KV for P, it computes t1 with the pruned weights and generates the rest. The client sees one
completion. A missing instance answers 503 with the URL at fault, never a hang.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

TIMEOUT = httpx.Timeout(600.0, connect=5.0)
DOWN_POLL_S = 0.25  # how often an in-flight request checks whether the supervisor saw an instance exit


def kv_folder(kv_dir: str | Path, token_ids: list[int]) -> Path:
    """Where ExampleConnector-style storage keeps a prompt's KV (same hash as the connector)."""
    from vllm.utils.hashing import safe_hash

    digest = safe_hash(torch.tensor(token_ids).numpy().tobytes(), usedforsecurity=False).hexdigest()
    return Path(kv_dir) / digest


def _error(status: int, message: str, kind: str = "service_unavailable") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class Unavailable(Exception):
    pass


def build_app(prefill_url: str, decode_url: str, kv_dir: str | None = None, nixl: bool = False,
              down: Callable[[], str | None] = lambda: None) -> FastAPI:
    """The proxy app. nixl=True asks the prefill instance for remote-decode transfer params (NixlConnector).

    `down()` names a supervised instance that exited (None while all run): `slimwise serve` stops the other
    instance then, so without it a request caught in that shutdown would blame the instance being stopped.
    """
    app = FastAPI(title="SlimWise PD proxy")
    client = httpx.AsyncClient(timeout=TIMEOUT)
    stats = {"requests": 0, "first_tokens_from_prefill": 0}

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

    async def post(base: str, path: str, body: dict, role: str) -> dict:
        try:
            r = await guarded(client.post(base + path, json=body))
        except httpx.HTTPError as exc:
            raise Unavailable(f"{role} instance at {base} is unreachable ({type(exc).__name__}: {exc})") from exc
        if r.status_code != 200:
            raise Unavailable(f"{role} instance at {base} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def cleanup(prompt_ids: list[int]) -> None:
        if kv_dir:
            shutil.rmtree(kv_folder(kv_dir, prompt_ids), ignore_errors=True)

    async def prefill(body: dict, path: str) -> tuple[list[int], int, str, str | None, dict]:
        pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "n")}
        pre.update(max_tokens=1, return_token_ids=True)
        if nixl:
            pre["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                         "remote_block_ids": None, "remote_host": None, "remote_port": None}
        pre.pop("max_completion_tokens", None)
        out = await post(prefill_url, path, pre, "prefill")
        choice = out["choices"][0]
        prompt_ids = list(out.get("prompt_token_ids") or choice.get("prompt_token_ids") or [])
        tokens = list(choice.get("token_ids") or [])
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return prompt_ids, tokens[0] if tokens else -1, text or "", choice.get("finish_reason"), out

    def decode_body(body: dict, prompt_ids: list[int], t1: int, remaining: int) -> dict:
        keep = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                "skip_special_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                "stream", "stream_options", "model", "min_tokens")
        dec = {k: v for k, v in body.items() if k in keep}
        dec.update(prompt=[*prompt_ids, t1], max_tokens=remaining, return_token_ids=True)
        return dec

    async def complete(body: dict, chat: bool):
        stats["requests"] += 1
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        prompt_ids, t1, t1_text, finish, pre = await prefill(body, "/v1/chat/completions" if chat else "/v1/completions")
        stats["first_tokens_from_prefill"] += 1
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        model = body.get("model") or pre.get("model")
        if max_tokens <= 1 or finish == "stop" or t1 < 0:
            cleanup(prompt_ids)
            return None, _finish(chat, rid, model, t1_text, finish or "length", len(prompt_ids), 1, [t1])
        dec = decode_body(body, prompt_ids, t1, max_tokens - 1)
        if pre.get("kv_transfer_params"):  # NIXL-style connectors hand the decode side the remote block ids
            dec["kv_transfer_params"] = pre["kv_transfer_params"]
        if body.get("stream"):
            return dec, (prompt_ids, t1, t1_text, rid, model)
        out = await post(decode_url, "/v1/completions", dec, "decode")
        cleanup(prompt_ids)
        choice = out["choices"][0]
        usage = out.get("usage") or {}
        return None, _finish(chat, rid, model, t1_text + choice["text"], choice.get("finish_reason"),
                             len(prompt_ids), 1 + int(usage.get("completion_tokens", 0)),
                             [t1, *(choice.get("token_ids") or [])])

    def _finish(chat, rid, model, text, reason, n_prompt, n_completion, token_ids):
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
        return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": model,
                             "choices": [choice], "usage": usage})

    async def stream(dec: dict, prompt_ids, t1_text: str, rid: str, model: str, chat: bool):
        def chunk(text: str | None, reason: str | None, first: bool = False) -> str:
            if chat:
                delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
                payload = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                           "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}
            else:
                payload = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                           "choices": [{"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}]}
            return f"data: {json.dumps(payload)}\n\n"

        yield chunk(t1_text, None, first=True)
        try:
            async with client.stream("POST", decode_url + "/v1/completions", json=dec) as r:
                if r.status_code != 200:
                    body = (await r.aread()).decode()[:300]
                    yield f"data: {json.dumps({'error': {'message': f'decode instance answered {r.status_code}: {body}'}})}\n\n"
                    return
                lines = r.aiter_lines()
                while True:
                    try:
                        line = await guarded(lines.__anext__())
                    except StopAsyncIteration:
                        break
                    if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                        continue
                    part = json.loads(line[6:])
                    for c in part.get("choices", []):
                        yield chunk(c.get("text"), c.get("finish_reason"))
        except httpx.HTTPError as exc:
            msg = f"decode instance at {decode_url} failed mid-stream ({type(exc).__name__})"
            yield f"data: {json.dumps({'error': {'message': msg}})}\n\n"
        except Unavailable as exc:  # the supervisor saw an instance exit while the stream waited
            yield f"data: {json.dumps({'error': {'message': f'{exc}; restart slimwise serve'}})}\n\n"
        finally:
            cleanup(prompt_ids)
        yield "data: [DONE]\n\n"

    async def handle(request: Request, chat: bool):
        body = await request.json()
        prompt = body.get("prompt")
        single = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and
                                             all(isinstance(t, int) for t in prompt))
        if not chat and not single:
            return _error(400, "the disaggregated proxy takes one prompt per request (a string or a token-id "
                               "list); send batches as separate requests", "invalid_request_error")
        if int(body.get("n") or 1) != 1:
            return _error(400, "n > 1 is not supported by the disaggregated proxy", "invalid_request_error")
        if reason := down():
            return _error(503, f"{reason}; restart slimwise serve")
        try:
            dec, result = await complete(body, chat)
        except Unavailable as exc:
            reason = down()
            if not reason:
                return _error(503, str(exc))
            return _error(503, f"{reason}; restart slimwise serve" + ("" if str(exc) == reason else f" ({exc})"))
        if dec is None:
            return result
        prompt_ids, _, t1_text, rid, model = result
        return StreamingResponse(stream(dec, prompt_ids, t1_text, rid, model, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models():
        try:
            r = await client.get(decode_url + "/v1/models")
            return JSONResponse(r.json(), status_code=r.status_code)
        except httpx.HTTPError as exc:
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

    return app
