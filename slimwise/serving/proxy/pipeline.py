"""One completion through the two instances: the prefill instance (full model) runs the prompt and gives the
first token t1, the prompt's KV folder is held, the decode instance (pruned model) generates the rest from the
full model's KV, and the client gets one OpenAI-shaped answer.

Invariants: the first token is always the full model's; a held KV folder is released on every path: at once
when nothing will load it any more (a normal end, a decode request the instance refused with a 4xx or never
received), after KV_GRACE_S otherwise (the instance may still load it); a streamed decode holds its instance
slot and its folder until the stream ends; an instance answer of the wrong shape is a 503 naming the instance.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import NamedTuple

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from slimwise.serving.proxy.kv_folders import KVFolders
from slimwise.serving.proxy.relay import ClosingStream, Reply, first_only, relay
from slimwise.serving.proxy.upstream import Instances, Unavailable, Upstream

PREFILL_DROPPED = ("stream", "stream_options", "n", "max_completion_tokens", "min_tokens")
# the sampling fields the decode instance takes from the client's request; it gets the prompt as token ids
DECODE_KEPT = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
               "skip_special_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
               "logit_bias", "stream", "stream_options", "model")
NIXL_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}


class First(NamedTuple):
    """The prefill instance's answer: the prompt's token ids, t1 (-1 when it gave none), t1's text, why it
    stopped (None: it did not), and its whole JSON answer."""

    prompt_ids: list[int]
    t1: int
    text: str
    finish: str | None
    answer: dict


def prefill_body(body: dict, nixl: bool) -> dict:
    pre = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
    pre.update(max_tokens=1, return_token_ids=True)
    if nixl:
        pre["kv_transfer_params"] = dict(NIXL_PREFILL)
    return pre


def decode_body(body: dict, prompt_ids: list[int], t1: int, remaining: int) -> dict:
    dec = {k: v for k, v in body.items() if k in DECODE_KEPT}
    dec.update(prompt=[*prompt_ids, t1], max_tokens=remaining, return_token_ids=True)
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 1:  # t1 was the first of them
        dec["min_tokens"] = body["min_tokens"] - 1
    return dec


def completion(reply: Reply, text: str, reason: str | None, prompt_ids: list[int], n_completion: int,
               token_ids: list[int] | None) -> JSONResponse:
    """The whole (non-streamed) answer, as vLLM's server writes it."""
    chat, rid, model = reply
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


class Pipeline:
    """Completions through `upstream`'s two instances, with `kv` (None: no shared directory in the proxy's
    care, as for a proxy over instances it did not start) holding each prompt's KV folder between its prefill
    and its decode. `stats` counts requests (shown by /health) and caches the instances' context length."""

    def __init__(self, upstream: Instances, kv: KVFolders | None, nixl: bool, stats: dict) -> None:
        self.upstream, self.kv, self.nixl, self.stats = upstream, kv, nixl, stats

    async def max_model_len(self) -> int | None:
        """The instances' context length (their /v1/models cards, read once): vLLM refuses max_tokens above
        it, and the decode instance, asked for max_tokens - 1, would not."""
        if "max_model_len" not in self.stats:
            found = []
            for url in self.upstream.urls.values():
                try:
                    r = await self.upstream.guarded(self.upstream.client.get(
                        url + "/v1/models", timeout=30, headers=self.upstream.forwarded.get()))
                    found += [int(c["max_model_len"]) for c in r.json()["data"] if c.get("max_model_len")]
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    return None  # asked again next time; the instances check what they can
            self.stats["max_model_len"] = min(found) if found else None
        return self.stats["max_model_len"]

    async def prefill(self, body: dict, path: str) -> First:
        out = await self.upstream.post("prefill", path, prefill_body(body, self.nixl))
        try:
            choice = out["choices"][0]
            prompt_ids = [int(t) for t in out.get("prompt_token_ids") or choice.get("prompt_token_ids") or []]
            tokens = list(choice.get("token_ids") or [])
            text = choice["message"]["content"] if "message" in choice else choice["text"]
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise Unavailable(f"prefill instance at {self.upstream.urls['prefill']} gave an unexpected "
                              f"answer ({type(exc).__name__}: {exc})") from exc
        return First(prompt_ids, tokens[0] if tokens else -1, text or "", choice.get("finish_reason"), out)

    async def _first_token(self, body: dict, chat: bool,
                           max_tokens: int | None) -> tuple[First, int, bool, bool]:
        """(the prefill's answer, max_tokens, done at t1, the folder is held). The folder is held only when
        the decode instance will need it; a folder found missing was deleted under a prefill that found it
        stored, and the prompt is prefilled again (3 tries)."""
        path = "/v1/chat/completions" if chat else "/v1/completions"
        for _ in range(3):
            first = await self.prefill(body, path)
            if max_tokens is None:  # vLLM's defaults: completions 16; chat, up to the context length
                limit = await self.max_model_len() if chat else None
                max_tokens = limit - len(first.prompt_ids) if limit and limit > len(first.prompt_ids) else 16
            done = max_tokens <= 1 or first.finish == "stop" or first.t1 < 0
            if self.kv is None or done:
                return first, max_tokens, done, False
            if self.kv.acquire(first.prompt_ids):
                return first, max_tokens, done, True
            self.kv.release(first.prompt_ids)  # missing: deleted under a prefill that found it stored
        raise Unavailable(f"the prefill instance at {self.upstream.urls['prefill']} stored no KV for the "
                          f"prompt in {self.kv.dir} (3 tries); is it started with the same "
                          "--kv-transfer-config directory?")

    async def complete(self, body: dict, chat: bool, max_tokens: int | None, streaming: bool) -> Response:
        """The client's completion: Upstream, Unavailable or Full when an instance or the KV directory
        refuses."""
        self.stats["requests"] += 1
        first, max_tokens, done, held = await self._first_token(body, chat, max_tokens)
        self.stats["first_tokens_from_prefill"] += 1
        reply = Reply(chat, ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
                      body.get("model") or first.answer.get("model"))
        if done:
            if self.kv:
                self.kv.discard(first.prompt_ids)
            if streaming:
                return StreamingResponse(first_only(reply, first.text, first.finish or "length"),
                                         media_type="text/event-stream")
            return completion(reply, first.text, first.finish or "length", first.prompt_ids, 1, [first.t1])
        dec = decode_body(body, first.prompt_ids, first.t1, max_tokens - 1)
        if first.answer.get("kv_transfer_params"):  # NIXL-style connectors: the remote block ids for decode
            dec["kv_transfer_params"] = first.answer["kv_transfer_params"]
        return await self._decode(dec, first, reply, streaming, held)

    async def _decode(self, dec: dict, first: First, reply: Reply, streaming: bool, held: bool) -> Response:
        """The decode instance's part; releases a `held` folder however it ends (a stream: when it ends)."""
        clean = False  # False: an abnormal end, the decode instance may still hold the request for a moment
        try:
            if streaming:
                r = await self._send_stream(dec)
                held = False  # released when the response ends, however it ends
                return self._stream(r, first, reply)
            out = await self.upstream.post("decode", "/v1/completions", dec)
            clean = True
        except Upstream:
            clean = True  # refused before it was scheduled: nothing will load the folder
            raise
        except Unavailable as exc:
            clean = not exc.sent  # never reached the instance: nothing will load the folder
            raise
        finally:
            if held and self.kv:
                self.kv.release(first.prompt_ids, now=clean)
        try:
            choice = out["choices"][0]
            usage = out.get("usage") or {}
            return completion(reply, first.text + choice["text"], choice.get("finish_reason"),
                              first.prompt_ids, 1 + int(usage.get("completion_tokens", 0)),
                              [first.t1, *(choice.get("token_ids") or [])])
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise Unavailable(f"decode instance at {self.upstream.urls['decode']} gave an unexpected answer "
                              f"({type(exc).__name__}: {exc})") from exc

    async def _send_stream(self, dec: dict) -> httpx.Response:
        """The decode instance's streamed answer at its headers, holding a decode slot the caller frees."""
        slot = self.upstream.slots["decode"]
        await self.upstream.guarded(slot.acquire())
        try:
            return await self.upstream.send("decode", "/v1/completions", dec, stream=True)
        except BaseException:
            slot.release()
            raise

    def _stream(self, r: httpx.Response, first: First, reply: Reply) -> ClosingStream:
        """The relayed stream; when it ends it closes `r`, frees the decode slot and releases the folder (at
        once when the instance finished the stream, else after KV_GRACE_S)."""
        state = {"ended": False}

        async def close() -> None:
            with contextlib.suppress(Exception):
                await r.aclose()
            self.upstream.slots["decode"].release()
            if self.kv:
                self.kv.release(first.prompt_ids, now=state["ended"])

        return ClosingStream(relay(self.upstream, r, first.text, reply, state), close)
