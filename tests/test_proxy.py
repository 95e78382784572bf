"""The disaggregated proxy and the serve supervisor without engines: real localhost listeners stand in for the
vLLM instances, small Python processes for their process groups.

The end-to-end checks (real vLLM instances, one killed, the load test) live in test_vllm_serve.py; these
pin the proxy's own behaviour: the race that made them slow (a request already waiting on the surviving
instance when the other one dies), malformed input refused with a 400 JSON error before anything is
forwarded, instances' 4xx answers passed through unchanged, the KV folder deleted on every path,
connection retries and back-pressure; and the supervisor's: killed with kill -9, it leaves no instance
process and no KV directory behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from slimwise.serving.proxy import KVFolders, build_app, kv_folder
from slimwise.serving.proxy import upstream as proxy_upstream


def test_proxy_fails_fast_when_an_instance_exits_mid_request():
    """A request caught while the supervisor stops the surviving instance answers
    503 naming the dead one at once.

    Regression: CI once waited 30.4 s for this 503, the stopped prefill instance's grace period.
    """
    with socket.socket() as upstream:  # accepts connections, never answers: an instance being stopped
        upstream.bind(("127.0.0.1", 0))
        upstream.listen()
        url = f"http://127.0.0.1:{upstream.getsockname()[1]}"
        state: dict[str, str | None] = {"down": None}
        app = build_app(url, url, down=lambda: state["down"])

        async def request_while_an_instance_dies() -> httpx.Response:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
                call = asyncio.create_task(client.post("/v1/completions",
                                                       json={"prompt": "x", "max_tokens": 4}))
                await asyncio.sleep(1.0)
                assert not call.done()  # still waiting on the silent instance
                state["down"] = "decode instance exited with code -9"  # what Supervisor.wait_any records
                return await asyncio.wait_for(call, 5)  # without the race against down(): the 600 s timeout

        r = asyncio.run(request_while_an_instance_dies())
    assert r.status_code == 503
    assert r.json()["error"]["message"] == "decode instance exited with code -9; restart slimwise serve"


async def _http_server(respond) -> tuple[asyncio.AbstractServer, str]:
    """A real HTTP/1.1 listener on localhost; `respond(writer)` writes the answer to each POST."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(re.search(rb"(?i)content-length: (\d+)", head).group(1)))
        await respond(writer)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _prefill_answer(writer: asyncio.StreamWriter) -> None:
    """The prefill instance's answer: prompt ids and the full model's first
    token (vLLM's return_token_ids)."""
    payload = json.dumps({"model": "m", "prompt_token_ids": [5, 6],
                          "choices": [{"text": "A", "token_ids": [7], "finish_reason": "length"}]}).encode()
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (len(payload), payload))
    await writer.drain()


async def _decode_then_silence(writer: asyncio.StreamWriter) -> None:
    """The decode instance streams one token, then goes silent, as an instance being stopped does."""
    event = b'data: {"choices": [{"text": "B", "finish_reason": null}]}\n\n'
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                 b"%x\r\n%s\r\n" % (len(event), event))
    await writer.drain()
    await asyncio.sleep(3600)


def test_proxy_stream_ends_when_an_instance_exits_mid_stream():
    """A stream waiting on the decode instance ends with an error event naming
    the exited instance, at once."""

    async def stream_while_an_instance_dies() -> str:
        prefill, prefill_url = await _http_server(_prefill_answer)
        decode, decode_url = await _http_server(_decode_then_silence)
        state: dict[str, str | None] = {"down": None}
        app = build_app(prefill_url, decode_url, down=lambda: state["down"])
        transport = httpx.ASGITransport(app=app)  # returns once the proxy's stream has ended
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
                body = {"prompt": "x", "max_tokens": 4, "stream": True}
                call = asyncio.create_task(client.post("/v1/completions", json=body))
                await asyncio.sleep(1.0)
                assert not call.done()  # streaming, waiting on the silent decode instance
                state["down"] = "prefill instance exited with code -9"
                return (await asyncio.wait_for(call, 5)).text  # without the race: never (the instance hangs)
        finally:
            prefill.close()
            decode.close()

    events = [json.loads(line[6:]) for line in asyncio.run(stream_while_an_instance_dies()).splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    # the full model's token, then the decoder's
    assert [e["choices"][0]["text"] for e in events[:2]] == ["A", "B"]
    assert events[2] == {"error": {"message": "prefill instance exited with code -9; restart slimwise serve"}}


# ----- fake instances that record what the proxy forwards ---------------------------------------------------
PROMPT_IDS = [5, 6]
MAX_MODEL_LEN = 128
PREFILL_OK = {"model": "m", "prompt_token_ids": PROMPT_IDS,
              "choices": [{"text": "A", "token_ids": [7], "finish_reason": "length"}]}
DECODE_OK = {"model": "m", "choices": [{"text": "BC", "token_ids": [8, 9], "finish_reason": "length"}],
             "usage": {"completion_tokens": 2}}
DECODE_EVENTS = [{"choices": [{"text": "B", "finish_reason": None}]},
                 {"choices": [{"text": "C", "finish_reason": "length"}]}]


class Instance:
    """A real HTTP/1.1 listener on localhost for one vLLM instance: records (path, JSON body) of every request
    and answers `await respond(path, body)` -> (status, payload): a dict is sent as JSON, a list as SSE
    events, bytes as they are. One request per connection (`connection: close`)."""

    def __init__(self, respond=None) -> None:
        self.respond = respond or (lambda path, body: None)
        self.requests: list[tuple[str, dict]] = []
        self.auth: list[str | None] = []  # each POST's Authorization header
        self.models_auth: list[str | None] = []  # each GET /v1/models's
        self.active = self.peak = 0

    async def start(self, port: int = 0) -> Instance:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     head: bytes = b"") -> None:
        try:
            head = head or await reader.readuntil(b"\r\n\r\n")
            auth = m[1].decode() if (m := re.search(rb"(?i)\r\nauthorization: ([^\r]*)", head)) else None
            if head.startswith(b"GET /health "):  # vLLM's health check: 200, no body
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                await writer.drain()
                return
            if head.startswith(b"GET /v1/models "):  # the model card, with vLLM's max_model_len
                self.models_auth.append(auth)
                data = json.dumps({"data": [{"id": "m", "max_model_len": MAX_MODEL_LEN}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (len(data), data))
                await writer.drain()
                return
            body = json.loads(
                await reader.readexactly(int(re.search(rb"(?i)content-length: (\d+)", head).group(1))))
            path = head.split(b" ")[1].decode()
            self.requests.append((path, body))
            self.auth.append(auth)
            self.active += 1
            self.peak = max(self.peak, self.active)
            try:
                status, payload = await self.respond(path, body)
            finally:
                self.active -= 1
            if isinstance(payload, list):
                kind, data = b"text/event-stream", \
                    b"".join(b"data: %s\n\n" % json.dumps(e).encode() for e in payload)
                data += b"data: [DONE]\n\n"
            else:
                kind, data = b"application/json", \
                    payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            writer.write(b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n"
                         b"connection: close\r\n\r\n%s" % (status, kind, len(data), data))
            await writer.drain()
        finally:
            writer.close()


def prefill_storing(kv_dir: Path | None, payload: dict = PREFILL_OK, status: int = 200, store_from: int = 1):
    """A prefill instance that answers `payload`; from its `store_from`-th request on, its 'connector' writes
    the prompt's KV folder as SlimWiseConnector does."""
    calls = []

    async def respond(path, body):
        calls.append(body)
        if kv_dir is not None and status == 200 and len(calls) >= store_from:
            folder = kv_folder(kv_dir, PROMPT_IDS)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "model.layers.0.self_attn.attn.safetensors").write_bytes(b"k" * 1000)
        return status, payload

    return respond


def decode_answering(status: int = 200, payload=DECODE_OK, delay: float = 0.0):
    async def respond(path, body):
        await asyncio.sleep(delay)
        if body.get("stream") and status == 200:
            return status, DECODE_EVENTS
        return status, payload

    return respond


def run_proxy(prefill_respond, decode_respond, calls, kv_dir=None, **kwargs):
    """Start both instances and the proxy app; `await calls(client, prefill, decode)`'s result."""

    async def main():
        prefill = await Instance(prefill_respond).start()
        decode = await Instance(decode_respond).start()
        app = build_app(prefill.url, decode.url, str(kv_dir) if kv_dir else None, **kwargs)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy",
                                         timeout=60) as client:
                return await calls(client, prefill, decode)
        finally:
            prefill.server.close()
            decode.server.close()

    return asyncio.run(main())


def sse(text: str) -> list:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ----- malformed input: 400 with a JSON error, nothing forwarded --------------------------------------------
MALFORMED = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", b'"a string"'),
    ("/v1/completions", b"null"),
    ("/v1/completions", b""),
    ("/v1/completions", b"   "),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 1e400}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "abc"}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": -5}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 2.5}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0, "stream": true}'),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
    ("/v1/completions", b'{"prompt": "x", "temperature": Infinity}'),
    ("/v1/completions", b'{"prompt": "x", "top_p": -1e999}'),
    ("/v1/completions", b'{"prompt": "x", "n": "x"}'),
    ("/v1/completions", b'{"prompt": "x", "n": 2}'),
    ("/v1/completions", b'{"prompt": "x", "n": 10000}'),  # above --max-n: the colocated server's 400 too
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "n": 17}'),
    ("/v1/completions", b'{"prompt": "\xff\xfe x"}'),
    ("/v1/completions", b'{"prompt": "\\ud800"}'),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\udfff"]}'),
    ("/v1/completions", b'{"prompt": ["a", "b"]}'),
    ("/v1/completions", b'{"prompt": [1, -2]}'),
    # vLLM's own validator raises VLLMValidationError, not a ValueError
    ("/v1/completions", b'{"prompt": ""}'),
    ("/v1/completions", b'{"prompt": []}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 9' + b"9" * 5000 + b"}"),
    ("/v1/completions", b"[" * 100_000),
    ("/v1/chat/completions", b'{"messages": "hi"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
                             b'"max_completion_tokens": 0}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "abc"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}'),
    # a plan by name: the decode instance is one pruned checkpoint, so no name (not even full) is served
    ("/v1/completions", b'{"prompt": "x", "vllm_xargs": {"slimwise_plan": "other"}}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
                             b'"vllm_xargs": {"slimwise_plan": "full"}}'),
]


@pytest.mark.parametrize(("path", "raw"), MALFORMED,
                         ids=[f"{i}-{raw[:40]!r}" for i, (_, raw) in enumerate(MALFORMED)])
def test_malformed_input_gets_400_json_and_is_not_forwarded(path, raw):
    async def calls(client, prefill, decode):
        r = await client.post(path, content=raw, headers={"content-type": "application/json"})
        return r, prefill.requests + decode.requests

    r, forwarded = run_proxy(prefill_storing(None), decode_answering(), calls)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error" and error["message"], error
    assert forwarded == []
    if b"slimwise_plan" in raw:
        assert error["param"] == "vllm_xargs.slimwise_plan" and "serves the one plan" in error["message"]
    if b'"n": 1' in raw:  # 10000, 17: the request-cost limit, named as the colocated server names it
        assert "limit of 16 completions" in error["message"] and "--max-n" in error["message"], error


def test_max_tokens_semantics_follow_vllm():
    """vLLM's server: max_tokens must be an integer >= 1 (messages name the
    field); "5" is an integer to it."""

    async def calls(client, prefill, decode):
        out = {}
        for value in (-5, 0, 2.5, "5", 3, MAX_MODEL_LEN + 1):
            out[repr(value)] = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": value})
        return out, decode.requests

    out, decoded = run_proxy(prefill_storing(None), decode_answering(), calls)
    assert out["-5"].json()["error"]["message"] == "max_tokens must be at least 1, got -5."
    assert out["0"].json()["error"]["message"] == "max_tokens must be at least 1, got 0."
    assert out["2.5"].status_code == 400 and "max_tokens" in out["2.5"].json()["error"]["message"]
    assert out["'5'"].status_code == 200 and out["3"].status_code == 200
    # the decode instance, asked for 128, would not
    assert out[repr(MAX_MODEL_LEN + 1)].json()["error"]["message"] == (
        "max_tokens=129 cannot be greater than max_model_len=128. Please request fewer output tokens.")
    assert [body["max_tokens"] for _, body in decoded] == [4, 2]  # t1 came from the prefill instance


def test_without_max_tokens_the_defaults_are_vllms():
    """No max_tokens: vLLM's completions default to 16 tokens, its chat completions to the rest of the context
    (max_model_len - prompt); the decode instance is asked for that less the prefill's first token."""

    async def calls(client, prefill, decode):
        for path, body in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            assert (await client.post(path, json=body)).status_code == 200
        return decode.requests

    decoded = run_proxy(prefill_storing(None), decode_answering(), calls)
    assert [body["max_tokens"] for _, body in decoded] == [15, MAX_MODEL_LEN - len(PROMPT_IDS) - 1]


@pytest.mark.parametrize("chat", [False, True])
def test_stream_ending_at_the_first_token_is_still_sse(chat):
    """stream: true with max_tokens 1 is answered as a stream (vLLM does), not as one JSON object."""
    path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
                  if chat else ("/v1/completions", {"prompt": "x", "max_tokens": 1}))
    payload = PREFILL_OK
    if chat:
        payload = {**PREFILL_OK, "choices": [{"message": {"role": "assistant", "content": "A"},
                                              "token_ids": [7], "finish_reason": "length"}]}

    async def calls(client, prefill, decode):
        return await client.post(path, json={**body, "stream": True}), decode.requests

    r, decoded = run_proxy(prefill_storing(None, payload), decode_answering(), calls)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    if chat:
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "A"}
    else:
        assert events[0]["choices"][0]["text"] == "A"
    assert events[-1]["choices"][0]["finish_reason"] == "length" and decoded == []


ODD_CHOICES = [["A"], [None], [7], "A", None]


@pytest.mark.parametrize("choices", ODD_CHOICES, ids=["str", "null", "int", "not-a-list", "none"])
@pytest.mark.parametrize("who", ["prefill", "decode"])
def test_an_instance_answer_not_in_vllms_shape_is_a_503_naming_it(who, choices):
    """Choices that are not objects (a broken or foreign instance behind the port): 503 naming the
    instance, not a 500 with a traceback."""
    odd = {"model": "m", "prompt_token_ids": PROMPT_IDS, "choices": choices,
           "usage": {"completion_tokens": 2}}

    async def calls(client, prefill, decode):
        return await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})

    pre, dec = (prefill_storing(None, odd), decode_answering()) if who == "prefill" else \
        (prefill_storing(None), decode_answering(payload=odd))
    r = run_proxy(pre, dec, calls)
    assert r.status_code == 503, r.text
    assert f"{who} instance at" in r.json()["error"]["message"] and "unexpected answer" in r.text


@pytest.mark.parametrize("event", [["B"], {"choices": ["B"]}, {"choices": "B"}])
def test_a_stream_event_not_in_vllms_shape_ends_the_stream_with_an_error(event):
    """The decode instance's stream sends an event that is not vLLM's: the client's stream still ends as SSE,
    with t1's text, an error chunk naming the instance and [DONE]."""

    async def respond(path, body):
        return 200, [DECODE_EVENTS[0], event, DECODE_EVENTS[1]]

    async def calls(client, prefill, decode):
        return await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True})

    r = run_proxy(prefill_storing(None), respond, calls)
    assert r.status_code == 200
    events = sse(r.text)  # ends with [DONE]
    assert [e["choices"][0]["text"] for e in events[:2]] == ["A", "B"]
    assert "decode instance at" in events[2]["error"]["message"] and len(events) == 3


# ----- upstream answers and the KV folder -------------------------------------------------------------------
VLLM_400 = {"error": {"message": "This model's maximum context length is 128 tokens.",
                      "type": "BadRequestError", "param": "max_tokens", "code": 400}}
VLLM_404 = {"error": {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                      "param": "model", "code": 404}}


@pytest.mark.parametrize("status,answer", [(400, VLLM_400), (404, VLLM_404)])
def test_prefill_4xx_passes_through_unchanged(status, answer):
    async def calls(client, prefill, decode):
        return await client.post("/v1/completions", json={"prompt": "x" * 1000, "max_tokens": 4}), \
            decode.requests

    r, decoded = run_proxy(prefill_storing(None, answer, status), decode_answering(), calls)
    assert (r.status_code, r.json()) == (status, answer) and decoded == []


@pytest.mark.parametrize("stream", [False, True])
def test_decode_4xx_passes_through_and_the_kv_folder_goes(tmp_path, stream):
    """Prefill stored the prompt's KV, then the decode instance refused the request: the client gets the
    decode instance's answer unchanged and the folder is deleted (it leaked 908 KB a request)."""

    async def calls(client, prefill, decode):
        return await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 100, "stream": stream})

    r = run_proxy(prefill_storing(tmp_path), decode_answering(400, VLLM_400), calls, kv_dir=tmp_path)
    assert (r.status_code, r.json()) == (400, VLLM_400)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("stream", [False, True])
def test_kv_folder_goes_after_success_and_when_decode_is_unreachable(tmp_path, monkeypatch, stream):
    monkeypatch.setattr(proxy_upstream, "RETRY_BACKOFF_S", 0.01)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"

    async def calls(client, prefill, decode):
        body = {"prompt": "x", "max_tokens": 3, "stream": stream}
        ok = await client.post("/v1/completions", json=body)
        left_after_ok = os.listdir(tmp_path)
        app = build_app(prefill.url, dead, str(tmp_path))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://proxy") as other:
            failed = await other.post("/v1/completions", json=body)
        return ok, left_after_ok, failed

    ok, left_after_ok, failed = run_proxy(prefill_storing(tmp_path), decode_answering(),
                                          calls, kv_dir=tmp_path)
    assert ok.status_code == 200 and left_after_ok == []
    text = "".join(e["choices"][0]["text"] for e in sse(ok.text)) if stream \
        else ok.json()["choices"][0]["text"]
    assert text == "ABC"
    assert failed.status_code == 503 and "decode instance" in failed.json()["error"]["message"]
    assert os.listdir(tmp_path) == []  # the request never reached the decode instance: deleted at once


def test_prefill_again_when_the_folder_was_deleted_under_it(tmp_path):
    """Same prompt in flight twice: a prefill that found the folder stored wrote nothing, and
    the other request deleted it before this one held it. The proxy sees it missing and
    prefills again (which stores it)."""

    async def calls(client, prefill, decode):
        return await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}), \
            len(prefill.requests)

    r, prefills = run_proxy(prefill_storing(tmp_path, store_from=2), decode_answering(),
                            calls, kv_dir=tmp_path)
    assert r.status_code == 200 and prefills == 2 and os.listdir(tmp_path) == []


def test_a_prefill_instance_that_stores_nothing_is_an_error(tmp_path):
    """Decoding without the stored KV would silently prefill with the pruned model:
    503 instead, after 3 tries."""

    async def calls(client, prefill, decode):
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        return r, len(prefill.requests), decode.requests

    r, prefills, decoded = run_proxy(prefill_storing(tmp_path, store_from=99), decode_answering(), calls,
                                     kv_dir=tmp_path)
    assert r.status_code == 503 and "stored no KV" in r.json()["error"]["message"]
    assert prefills == 3 and decoded == []


def test_client_cannot_steer_the_connector():
    steering = {"kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1]},
                "ec_transfer_params": {"x": 1}, "request_id": "mine",
                "vllm_xargs": {"kv_transfer_params": "do_remote_decode", "mine": 1}}

    async def calls(client, prefill, decode):
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, **steering})
        return r, prefill.requests + decode.requests

    r, forwarded = run_proxy(prefill_storing(None), decode_answering(), calls)
    assert r.status_code == 200 and len(forwarded) == 2
    for _, body in forwarded:
        assert not {"kv_transfer_params", "ec_transfer_params", "request_id"} & set(body)
    assert forwarded[0][1]["vllm_xargs"] == {"mine": 1}


# ----- load: retries and back-pressure ----------------------------------------------------------------------
def test_connection_refused_at_first_is_retried(monkeypatch):
    """An instance that cannot take the connection yet (here: not listening for 0.5 s) gets the request on a
    retry; a connection never made carries no request, so the retry cannot run it twice."""
    # retries until 7.5 s: 15x the 0.5 s the listener needs
    monkeypatch.setattr(proxy_upstream, "RETRY_BACKOFF_S", 0.5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        prefill = await Instance(prefill_storing(None)).start()
        app = build_app(prefill.url, f"http://127.0.0.1:{port}")
        late = Instance(decode_answering())

        async def listen_late():
            await asyncio.sleep(0.5)
            await late.start(port)

        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://proxy") as client:
                _, r = await asyncio.gather(listen_late(), client.post("/v1/completions",
                                                                       json={"prompt": "x", "max_tokens": 3}))
                return r, len(late.requests)
        finally:
            prefill.server.close()
            if hasattr(late, "server"):
                late.server.close()

    r, decoded = asyncio.run(main())
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ABC" and decoded == 1


class Dropping(Instance):
    """An instance that reads each of its first `drop` requests and closes the connection without an
    answer, as a server does when its keep-alive timer fires while the request is on the way (the race
    CI hit once in 64 requests: ReadError). `abort`: a reset (ReadError in the proxy), else an orderly
    close (RemoteProtocolError)."""

    def __init__(self, respond, drop: int, abort: bool) -> None:
        super().__init__(respond)
        self.drop, self.abort, self.dropped = drop, abort, 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if self.dropped == self.drop or head.startswith(b"GET "):  # GETs (model card, health) are answered
            return await super()._serve(reader, writer, head)
        await reader.readexactly(int(re.search(rb"(?i)content-length: (\d+)", head).group(1)))
        self.dropped += 1
        if self.abort:
            writer.transport.abort()
        else:
            writer.close()


@pytest.mark.parametrize("abort", [False, True], ids=["closed", "reset"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_connection_closed_before_the_answer_is_sent_once_more(stream, abort):
    """A request on a connection the instance closes before answering goes once more, on a new connection, to
    both instances; a second close in a row is a 503 naming the instance, after exactly one retry."""

    async def main():
        prefill = await Dropping(prefill_storing(None), 1, abort).start()
        decode = await Dropping(decode_answering(), 1, abort).start()
        flaky = await Dropping(decode_answering(), 3, abort).start()
        try:
            body = {"prompt": "x", "max_tokens": 3, "stream": stream}
            async with httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=build_app(prefill.url, decode.url)),
                    base_url="http://proxy", timeout=60) as client:
                ok = await client.post("/v1/completions", json=body)
                health = (await client.get("/health")).json()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(prefill.url, flaky.url)),
                                         base_url="http://proxy", timeout=60) as client:
                failed = await client.post("/v1/completions", json={**body, "stream": False})
            return ok, health, failed, prefill, decode, flaky
        finally:
            for instance in (prefill, decode, flaky):
                instance.server.close()

    ok, health, failed, prefill, decode, flaky = asyncio.run(main())
    assert ok.status_code == 200, ok.text
    text = "".join(e["choices"][0]["text"] for e in sse(ok.text)) if stream \
        else ok.json()["choices"][0]["text"]
    assert text == "ABC"
    assert prefill.dropped == decode.dropped == 1 and len(prefill.requests) == 2 and len(decode.requests) == 1
    assert health["reset_retries"] == 2 and health["connect_retries"] == 0
    assert failed.status_code == 503 \
        and f"decode instance at {flaky.url} is unreachable" in failed.json()["error"]["message"]
    assert flaky.dropped == 2 and flaky.requests == []  # one retry, not more


def test_servers_keep_idle_connections_far_longer_than_their_clients():
    """The vLLM servers `slimwise serve` starts keep an idle connection 75 s; the proxy reuses one for at most
    3 s, httpx and the openai SDK 5 s: a loaded client whose clock lags the server's by seconds still never
    reuses a connection the server is closing."""
    from slimwise.serving.server import server_env

    assert (max(proxy_upstream.KEEPALIVE_S, httpx.Limits().keepalive_expiry) * 10
            < proxy_upstream.SERVER_KEEPALIVE_S == 75)
    # V1 pinned unless the user chose (docs/serving.md, "Model runners")
    assert server_env({}, {}) == {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "75", "VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert server_env({"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "9",
                                                             "VLLM_USE_V2_MODEL_RUNNER": "1"}) == {
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "9", "VLLM_USE_V2_MODEL_RUNNER": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # the user's settings win


def test_requests_beyond_the_upstream_limit_wait_in_the_proxy(tmp_path):
    """64 concurrent requests with one prompt, at most 4 in flight to each instance: none fails, none is lost,
    and the prompt's shared KV folder is gone at the end."""

    async def calls(client, prefill, decode):
        rs = await asyncio.gather(*(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3,
                                                                         "stream": i % 2 == 0})
                                    for i in range(64)))
        return rs, prefill.peak, decode.peak

    store = prefill_storing(tmp_path)

    async def slow_prefill(path, body):
        await asyncio.sleep(0.02)
        return await store(path, body)

    rs, prefill_peak, decode_peak = run_proxy(slow_prefill, decode_answering(delay=0.05), calls,
                                              kv_dir=tmp_path, upstream_concurrency=4)
    assert [r.status_code for r in rs] == [200] * 64
    assert 1 < prefill_peak <= 4 and 1 < decode_peak <= 4
    assert os.listdir(tmp_path) == []


# ----- the KV directory's bookkeeping -----------------------------------------------------------------------
def _store(kv_dir: Path, ids: list[int], size: int = 1000) -> Path:
    folder = kv_folder(kv_dir, ids)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "layer.safetensors").write_bytes(b"k" * size)
    return folder


def test_kv_folders_are_reference_counted_swept_and_capped(tmp_path):
    kv = KVFolders(tmp_path, max_bytes=1500, stale_s=600)
    assert not kv.acquire([1, 2])  # nothing stored: the caller prefills again
    kv.release([1, 2])
    a = _store(tmp_path, [1, 2])
    assert kv.acquire([1, 2]) and kv.acquire([1, 2])  # two requests with the same prompt
    kv.release([1, 2])
    assert a.is_dir()  # the other one still decodes from it
    kv.release([1, 2], now=False)  # an abandoned request: the folder waits out the grace period
    assert a.is_dir() and kv.pending
    kv.pending[a] = (kv.pending[a][0], 0.0)
    kv.sweep()
    assert not a.exists()
    # a prefill instance writes a folder only while a prefill request runs: no folder goes before those sent
    # earlier have answered (here one still runs when the folder is let go)
    a = _store(tmp_path, [1, 2])
    assert kv.acquire([1, 2])
    seq = kv.prefill_sent()
    kv.release([1, 2])
    later = kv.prefill_sent()  # sent after the release: it does not hold the deletion back
    assert a.is_dir()
    kv.prefill_answered(seq)
    assert not a.exists()
    kv.prefill_answered(later)
    b, c = _store(tmp_path, [3]), _store(tmp_path, [4])
    assert kv.acquire([4])
    assert "over its cap" in kv.over_cap()  # 2000 bytes > 1500
    past = time.time() - 3600
    os.utime(b, (past, past))
    os.utime(c, (past, past))
    kv.measured = float("-inf")
    assert kv.over_cap() is None  # b was stale and unheld: swept; c is held
    assert not b.exists() and c.is_dir()
    kv.discard([4])
    assert c.is_dir()  # held: discard leaves it to the holder
    kv.release([4])
    assert os.listdir(tmp_path) == []


def test_kv_directory_over_its_cap_refuses_new_requests(tmp_path):
    _store(tmp_path, [9, 9], size=5000)

    async def calls(client, prefill, decode):
        return await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}), prefill.requests

    r, forwarded = run_proxy(prefill_storing(tmp_path), decode_answering(), calls, kv_dir=tmp_path,
                             kv_dir_max_bytes=4096)
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and forwarded == []
    assert "over its cap" in r.json()["error"]["message"]


# ----- the supervisor killed: no orphan, no KV directory ----------------------------------------------------
SUPERVISOR = """
import sys, time
from slimwise.serving.server import Supervisor
sup = Supervisor()
kv_dir = sup.make_kv_dir("0" * 12)
# an instance: an API server whose engine process (its child, same process group) gets no parent-death signal
child = sup.start("fake", [sys.executable, "-c", "import subprocess, sys, time; "
                   "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); \
time.sleep(600)"])
print(kv_dir, child.pid, sup.watchdog.pid, flush=True)
time.sleep(600)
"""


def _live(pgid: int | None = None, pid: int | None = None) -> bool:
    """A process of group `pgid` (or process `pid`) that is running: zombies, dead but not yet reaped by
    whoever inherited them, do not count."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(") ", 1)[1].split()[:3]
        except (OSError, IndexError):
            continue
        if state != "Z" and (int(group) == pgid or int(stat.parent.name) == pid):
            return True
    return False


def _group_alive(pgid: int) -> bool:
    return _live(pgid=pgid)


@pytest.fixture(scope="module")
def supervisors(tmp_path_factory):
    """Two supervisors, each with a fake instance and a KV directory, started at once (their imports take
    seconds): name -> (process, KV directory, the instance's pid = process group, the watchdog's pid)."""
    import subprocess
    import sys

    started = {}
    for name in ("plain", "no-watchdog"):
        tmp = tmp_path_factory.mktemp(name)  # the KV directory goes here: TMPDIR for this child only
        started[name] = tmp, subprocess.Popen([sys.executable, "-c", SUPERVISOR], stdout=subprocess.PIPE,
                                              text=True, env={**os.environ, "TMPDIR": str(tmp)})
    out = {}
    try:
        for name, (tmp, proc) in started.items():
            while not (line := proc.stdout.readline()).startswith(str(tmp)):  # past "starting fake: ..."
                assert line, "the supervisor exited"
            kv_dir, child, watchdog = line.split()
            out[name] = proc, Path(kv_dir), int(child), int(watchdog)
        time.sleep(0.5)  # the grandchildren are started
        yield out
    finally:
        for _, proc in started.values():
            if proc.poll() is None:
                proc.terminate()  # its SIGTERM handler stops what it started
                proc.wait()
        for _, _, child, _ in out.values():
            if _group_alive(child):
                os.killpg(child, signal.SIGKILL)


def test_kill_9_of_the_supervisor_leaves_no_process_and_no_kv_directory(supervisors):
    proc, kv_dir, child, _ = supervisors["plain"]
    assert kv_dir.is_dir() and _group_alive(child)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 60  # measured: under 2 s (SIGTERM; the watchdog waits up to 15 s each)
    while _group_alive(child) or kv_dir.exists():
        assert time.monotonic() < deadline, \
            "the instance's process group or the KV directory outlived kill -9"
        time.sleep(0.2)


def test_parent_death_signal_and_the_next_start_clean_up_without_the_watchdog(supervisors):
    """Watchdog killed too (e.g. with the supervisor's whole session): the instance's API server still dies of
    its parent-death signal, and the next start removes the dead supervisor's KV directory."""
    from slimwise.serving.server import remove_stale_kv_dirs

    proc, kv_dir, child, watchdog = supervisors["no-watchdog"]
    os.kill(watchdog, signal.SIGKILL)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 60
    # the group leader (the API server) goes; its engine process is the watchdog's job
    while _live(pid=child):
        assert time.monotonic() < deadline, "the instance outlived its supervisor"
        time.sleep(0.2)
    assert kv_dir.is_dir()
    # a name from a running supervisor (pid 1) is kept
    other = kv_dir.parent / "slimwise-kv-0123456789ab-1-abc"
    other.mkdir()
    assert remove_stale_kv_dirs(str(kv_dir.parent)) == [str(kv_dir)] and other.is_dir()
    # the engine process of the instance (no parent-death signal, no watchdog) is left to the fixture to stop


def test_the_clients_api_key_goes_to_the_instances():
    """vLLM's --api-key is checked by the instances: the proxy forwards each
    client's own Authorization header."""

    async def calls(client, prefill, decode):
        keyed = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True},
                                  headers={"authorization": "Bearer k1"})
        bare = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        models = await client.get("/v1/models", headers={"authorization": "Bearer k2"})
        return keyed, bare, models, prefill, decode

    keyed, bare, models, prefill, decode = run_proxy(prefill_storing(None), decode_answering(), calls)
    assert keyed.status_code == bare.status_code == models.status_code == 200
    assert prefill.auth == decode.auth == ["Bearer k1", None]
    # max_model_len's look-up, the client's /v1/models
    assert decode.models_auth == ["Bearer k1", "Bearer k2"]


def test_cpu_kv_budget_is_sized_from_the_model_and_the_users_choice_wins(monkeypatch):
    """On CPU, `slimwise serve` sizes vLLM's KV cache from max_model_len x max_num_seqs (vLLM's CPU backend
    would reserve 92% of the memory and refuse to start on a busy machine); an explicit vLLM memory option, or
    VLLM_CPU_KVCACHE_SPACE, wins; nothing is chosen on a GPU."""
    from slimwise.models import resolve_model_dir
    from slimwise.serving.server import cpu_kv_budget

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    # 4 attention layers x 2 KV heads x 32 dims x 2 (K, V) x 2 bytes
    model = str(resolve_model_dir("testbed-a"))
    chosen, why = cpu_kv_budget(model, [], available=16 << 30, on_cpu=True)
    assert chosen == int(1.25 * 128 * 512 * 1024) + (64 << 20)  # max_position_embeddings 512, 128 sequences
    assert "max_model_len 512 x max_num_seqs 128 x 1024 B/token" in why and "--kv-cache-memory-bytes" in why
    args = ["--max-model-len", "256", "--max-num-seqs=8", "--dtype", "float32"]
    assert cpu_kv_budget(model, args, on_cpu=True, available=16 << 30)[0] \
        == int(1.25 * 8 * 256 * 2048) + (64 << 20)
    capped, why = cpu_kv_budget(model, ["--max-model-len", "4096", "--max-num-seqs", "256"], instances=2,
                                available=1 << 30, on_cpu=True)
    assert capped == int(0.4 * (1 << 30) / 2) and "capped" in why  # two instances share 40% of what is free
    for user in (["--kv-cache-memory-bytes", "1000000"], ["--gpu-memory-utilization=0.5"]):
        assert cpu_kv_budget(model, user, on_cpu=True) is None
    assert cpu_kv_budget(model, [], on_cpu=False) is None
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert cpu_kv_budget(model, [], on_cpu=True) is None


def test_cpu_dtype_keeps_the_checkpoints_unless_the_cpu_lacks_bf16(monkeypatch, tmp_path):
    """`slimwise serve` on CPU without --dtype (or with auto): the checkpoint's dtype where the CPU has bf16
    matrix instructions, float32 for a bf16 checkpoint where it has none (faster there: docs/serving.md), bf16
    always for the hybrids (vLLM's CPU Gated DeltaNet kernel is bf16 only); the user's dtype wins."""
    import json

    from slimwise import hardware
    from slimwise.models import resolve_model_dir
    from slimwise.serving.server import ServeConfig, _with_cpu_dtype, cpu_dtype

    model = str(resolve_model_dir("testbed-a"))  # a bf16 checkpoint
    assert hardware.cpu_info()["flags"]  # the real /proc/cpuinfo was read
    here = cpu_dtype(model, [], on_cpu=True)
    assert here[0] == ("bfloat16" if hardware.bf16_support() else "float32")
    assert cpu_dtype(model, ["--dtype", "float16"], on_cpu=True) is None \
        and cpu_dtype(model, [], on_cpu=False) is None
    avx2_only = {**hardware.cpu_info(), "flags": {"avx2", "fma"}}  # an AVX2-only AMD EPYC
    monkeypatch.setattr(hardware, "cpu_info", lambda: avx2_only)
    dtype, why = cpu_dtype(model, ["--dtype=auto"], on_cpu=True)
    assert dtype == "float32" and "no bf16 matrix instructions" in why
    hybrid = tmp_path / "hybrid"
    hybrid.mkdir()
    (hybrid / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": {
        "model_type": "qwen3_5_moe_text", "dtype": "bfloat16"}}))
    assert cpu_dtype(str(hybrid), [], on_cpu=True)[0] == "bfloat16"
    # the transformers reference (slimwise eval --engine hf) has no bf16-only
    # kernel: the hybrid runs float32 too
    assert hardware.resolve_dtype("auto", str(hybrid), engine="hf")[0] == "float32"
    assert hardware.resolve_dtype("auto", model, engine="hf")[0] == "float32"
    assert hardware.resolve_dtype("bfloat16", model, engine="hf") == ("bfloat16", "as requested")
    # hardware never asks vLLM where it runs: a vLLM caller resolving "auto" must say (serving.platform)
    with pytest.raises(TypeError, match="needs on_cpu"):
        hardware.resolve_dtype("auto", model)
    assert hardware.resolve_dtype("auto", model, on_cpu=False) == ("auto",
                                                                   "vLLM's auto (the checkpoint's dtype)")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "torch_dtype": "float32"}))
    assert cpu_dtype(str(tmp_path), [], on_cpu=True)[0] == "float32"
    cfg = ServeConfig(model=model, vllm_args=["--dtype", "auto", "--max-num-seqs", "8"])
    line = _with_cpu_dtype(cfg, model)  # vLLM's CPU platform here
    assert cfg.vllm_args == ["--max-num-seqs", "8", "--dtype", "float32"] and "float32" in line["dtype"]


def test_server_commands_name_the_model_as_typed_and_carry_the_tokenizer_and_cpu_fixes(tiny_dirs, tmp_path):
    """What `slimwise serve` hands vLLM, engine-free: the name the user typed (an embedded name as is, a
    directory by its name, never an absolute path), the checkpoint's own tokenizer (tokenizer mode
    slimwise) unless the user chose a mode, the middleware on every colocated server, and SlimWise's class
    without a plan where it fixes vLLM on CPU (DeepSeek-V3's MLA rotary; disaggregated instances and
    plan-less colocated servers once ran stock vLLM there and gave other tokens than transformers) unless
    the user passes --hf-overrides."""
    from slimwise.argtypes import option_value
    from slimwise.serving.server import (
        ServeConfig,
        colocated_command,
        cpu_fix_args,
        default_served_name,
        local_address,
    )

    assert default_served_name("testbed-c") == "testbed-c"
    deepseek, qwen = str(tiny_dirs("deepseek_v3")), str(tiny_dirs("qwen3_moe"))
    assert default_served_name(deepseek) == "deepseek_v3" \
        and default_served_name(deepseek + "/") == "deepseek_v3"
    cmd = colocated_command(ServeConfig(model=deepseek))
    assert option_value(cmd, "--served-model-name") == "deepseek_v3"
    assert option_value(cmd, "--tokenizer-mode") == "slimwise"
    assert option_value(cmd, "--middleware") == "slimwise.serving.plan_select.PlanSelectMiddleware"
    assert json.loads(option_value(cmd, "--hf-overrides")) \
        == {"architectures": ["SlimWiseDeepseekV3ForCausalLM"]}
    assert cpu_fix_args(qwen, []) == [] and cpu_fix_args(deepseek, ["--hf-overrides", "{}"]) == []
    # the gate variant, fallback and substitution vectors reach the engine's hf_overrides (the served run:
    # tests/test_vllm_serve.py::test_colocated_serve_with_a_fallback, make test-matrix)
    gated = colocated_command(ServeConfig(model=qwen, plan=str(tmp_path / "p.json"), gates="substitute",
                                          fallback=0.0, substitutes="stats.safetensors"))
    overrides = json.loads(option_value(gated, "--hf-overrides"))
    assert (overrides["slimwise_gates"], overrides["slimwise_fallback"]) == ("substitute", 0.0)
    assert overrides["slimwise_substitutes"] == str((Path.cwd() / "stats.safetensors").resolve())
    # --disaggregated --gates drop/substitute: the decode instance's overrides name the gates file (the served
    # run: tests/test_vllm_serve.py::test_disaggregated_serve_with_substitute_gates, make test-matrix)
    from slimwise.serving.overrides import pruned_gates_overrides

    assert pruned_gates_overrides(qwen, "g.safetensors") == {
        "architectures": ["SlimWiseQwen3MoeForCausalLM"],
        "slimwise_pruned_gates": str((Path.cwd() / "g.safetensors").resolve())}
    mine = colocated_command(ServeConfig(model=qwen, vllm_args=["--tokenizer-mode", "hf"]))
    assert mine.count("--tokenizer-mode") == 1 and option_value(mine, "--tokenizer-mode") == "hf"
    # the start-up health and tokenizer checks reach the server where it listens
    assert [local_address(h) for h in ("0.0.0.0", "::", "127.0.0.1", "10.1.2.3", "fd00::1")] == [
        "127.0.0.1", "127.0.0.1", "127.0.0.1", "10.1.2.3", "[fd00::1]"]


# ----- a proxy over instances started elsewhere -------------------------------------------------------------

def _instance_encoding(ids: list[int]):
    """A running vLLM instance as the proxy meets it: health, and `/tokenize` answering `ids`."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self._answer({})

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["content-length"]))
            self._answer({"tokens": ids, "count": len(ids)})

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_a_chosen_tokenizer_mode_is_checked_before_any_engine_starts():
    """`--tokenizer-mode hf|auto`: the tokenizer is loaded by vLLM's own `get_tokenizer` before any engine
    starts. testbed-a's (qwen3_moe) is its tokenizer.json and passes; testbed-c's (qwen3_5_moe) becomes
    Qwen3_5Tokenizer and is refused in one line (through `slimwise serve`: tests/test_vllm_clients.py).
    SlimWise's own mode, the default, needs no check."""
    from slimwise.embedded import embedded_model_dir
    from slimwise.errors import SlimWiseError
    from slimwise.serving.tokenizer import check_tokenizer_before_start

    a, c = str(embedded_model_dir("testbed-a")), str(embedded_model_dir("testbed-c"))
    for mode in ("hf", "auto"):
        check_tokenizer_before_start(a, ["--tokenizer-mode", mode], a)
    with pytest.raises(SlimWiseError, match="the tokenizer vLLM loads with --tokenizer-mode hf encodes text "
                                            "differently .* first difference at token 0"):
        check_tokenizer_before_start(c, ["--tokenizer-mode", "hf"], c)
    for args in ([], ["--tokenizer-mode", "slimwise"]):
        check_tokenizer_before_start(c, args, c)


def test_running_instances_are_probed_for_the_checkpoints_tokenizer(tmp_path):
    """`slimwise serve MODEL --disaggregated --prefill-url P --decode-url D`: instances started elsewhere
    (perhaps with another --tokenizer) are probed as the ones serve starts itself; one that encodes the probe
    text otherwise is refused in one line before the proxy listens, and matching ones get the proxy."""
    import subprocess
    import sys

    from slimwise.models import load_tokenizer
    from slimwise.serving.tokenizer import TOKENIZER_PROBE

    want = load_tokenizer("testbed-a")(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    right, right_url = _instance_encoding(want)
    wrong, wrong_url = _instance_encoding([*want[:3], want[3] + 1, *want[4:]])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = [sys.executable, "-m", "slimwise.cli", "serve", "testbed-a", "--disaggregated",
             "--port", str(port)]
    try:
        refused = subprocess.run([*serve, "--prefill-url", right_url, "--decode-url", wrong_url],
                                 capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2, refused.stderr[-2000:]
        errors = refused.stderr.strip().splitlines()
        assert errors[-1].startswith("slimwise: error: the decode instance's tokenizer encodes text "
                                     "differently") and "first difference at token 3" in errors[-1], errors
        assert "Traceback" not in refused.stderr
        proc = subprocess.Popen([*serve, "--prefill-url", right_url, "--decode-url", right_url],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            lines = []
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not any("PD proxy ready" in line for line in lines):
                line = proc.stdout.readline()
                if not line:
                    break
                lines.append(line)
            assert any("SlimWise PD proxy ready" in line and "'testbed-a'" in line for line in lines), lines
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    finally:
        right.shutdown()
        wrong.shutdown()
