"""The disaggregated proxy's failure path, without engines: a real socket stands in for an instance mid-shutdown.

The end-to-end checks (real vLLM instances, one killed) live in test_vllm_serve.py; this one pins the race
that made them slow: a request already waiting on the surviving instance when the other one dies.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket

import httpx

from slimwise.serving.proxy import build_app


def test_proxy_fails_fast_when_an_instance_exits_mid_request():
    """A request caught while the supervisor stops the surviving instance answers 503 naming the dead one at once.

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
                call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4}))
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
    """The prefill instance's answer: prompt ids and the full model's first token (vLLM's return_token_ids)."""
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
    """A stream waiting on the decode instance ends with an error event naming the exited instance, at once."""

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
    assert [e["choices"][0]["text"] for e in events[:2]] == ["A", "B"]  # the full model's token, then the decoder's
    assert events[2] == {"error": {"message": "prefill instance exited with code -9; restart slimwise serve"}}
