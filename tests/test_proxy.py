"""The disaggregated proxy's failure path, without engines: a real socket stands in for an instance mid-shutdown.

The end-to-end checks (real vLLM instances, one killed) live in test_vllm_serve.py; this one pins the race
that made them slow: a request already waiting on the surviving instance when the other one dies.
"""

from __future__ import annotations

import asyncio
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
