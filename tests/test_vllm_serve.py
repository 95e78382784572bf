"""`slimwise serve` end to end: real vLLM OpenAI servers on localhost, spoken to with the `openai` client.

Colocated and disaggregated serving must return the reference engine's SlimWise tokens; the disaggregated
path must take the prompt KV and the first token from the full model, clean its KV directory on shutdown,
and answer a clear error (not hang) when an instance is gone.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from openai import APIStatusError, OpenAI

from slimwise.calibrate import CalibrationConfig, calibrate
from slimwise.criteria import plan_from_stats
from slimwise.generate import GenerationConfig, PhaseSplitEngine
from slimwise.models import load_model, load_tokenizer
from slimwise.testbed import build_tokenizer, make_split
from slimwise.tiny import save_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
VLLM_ARGS = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20)]
MAX_TOKENS = 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny model with the testbed tokenizer, a 50% plan, and the reference engine's outputs."""
    root = tmp_path_factory.mktemp("serve")
    tok = build_tokenizer(root / "model")
    save_tiny_model("qwen3_moe", root / "model", initializer_range=0.15, vocab_size=len(tok),
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model, tok = load_model(root / "model"), load_tokenizer(root / "model")
    stats = calibrate(model, [s.prompt for s in make_split("calib", 1)], tok, CalibrationConfig(max_new_tokens=8),
                      progress=False)
    plan = plan_from_stats(stats, "reap", 0.5)
    plan.save(root / "plan.json")
    prompts = [s.prompt for s in make_split("test", 1)][:4]
    engine = PhaseSplitEngine(model, tok, plan=plan)
    ref = {m: engine.generate(prompts, m, GenerationConfig(max_new_tokens=MAX_TOKENS)) for m in ("full", "slimwise")}
    assert [o.token_ids for o in ref["full"]] != [o.token_ids for o in ref["slimwise"]]
    return root, prompts, ref


def start(args: list[str], port: int, log, vllm_args: list[str] = VLLM_ARGS) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "slimwise.cli", "serve", *args, "--port", str(port),
                             "--served-model-name", "tiny", *vllm_args], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "VLLM_LOGGING_LEVEL": "INFO"})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert proc.poll() is None, "server exited during start-up"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise AssertionError("server did not become healthy")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def check_completions(client: OpenAI, prompts, ref) -> None:
    for prompt, want in zip(prompts, ref, strict=True):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True})
        assert r.choices[0].text == want.text
        assert r.choices[0].model_extra["token_ids"] == want.token_ids
    stream = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == ref[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompts[1].rstrip("\n")}],
                                          max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].message.content == ref[1].text


def test_colocated_serve(served):
    root, prompts, ref = served
    port = free_port()
    log = open(root / "colocated.log", "w")  # noqa: SIM115
    proc = start([str(root / "model"), "--plan", str(root / "plan.json")], port, log)
    try:
        check_completions(OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x"), prompts, ref["slimwise"])
    finally:
        stop(proc)
    text = (root / "colocated.log").read_text()
    assert "mode:     PD-colocated" in text and "keeps 8/16 experts" in text


def test_disaggregated_serve(served):
    root, prompts, ref = served
    port = free_port()
    before = set(glob.glob("/tmp/slimwise-kv-*"))
    log = open(root / "pd.log", "w")  # noqa: SIM115
    proc = start([str(root / "model"), "--plan", str(root / "plan.json"), "--disaggregated"], port, log)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        check_completions(client, prompts, ref["slimwise"])
        kv_dirs = set(glob.glob("/tmp/slimwise-kv-*")) - before
        assert len(kv_dirs) == 1 and not os.listdir(kv_dirs.pop())  # per pair, emptied after each request
        deadline = time.monotonic() + 30  # the decode engine process's log line may reach the file late
        while "SlimWise: loading the full model's state" not in (text := (root / "pd.log").read_text()):
            assert time.monotonic() < deadline, "no KV load logged by the decode instance; log tail:\n" + text[-3000:]
            time.sleep(0.5)
        # one instance gone: the client gets a clear 503 naming it, quickly
        decode = subprocess.run(["pgrep", "-f", "--", f"--port {port + 2} "], capture_output=True, text=True).stdout.split()
        assert decode, "decode instance process not found"
        for pid in decode:
            os.kill(int(pid), signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(APIStatusError) as info:
            client.completions.create(model="tiny", prompt=prompts[0], max_tokens=MAX_TOKENS, temperature=0)
        assert info.value.status_code == 503 and "decode instance" in str(info.value)
        assert time.monotonic() - t0 < 30
        # once the supervisor has noticed (and stopped the prefill instance), health and requests still name
        # the decode instance as the cause, not the prefill instance it stopped
        while "decode instance exited" not in (health := httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)).text:
            assert time.monotonic() - t0 < 30, f"the supervisor did not report the dead instance: {health.text}"
            assert health.status_code == 503  # not yet noticed: the unreachable decode instance already fails it
            time.sleep(0.5)
        assert health.status_code == 503
        with pytest.raises(APIStatusError) as info:
            client.completions.create(model="tiny", prompt=prompts[0], max_tokens=MAX_TOKENS, temperature=0)
        assert info.value.status_code == 503 and "decode instance exited" in str(info.value)
    finally:
        stop(proc)
    # the killed instance's engine processes (orphans of its API server) went with the rest of its group
    deadline = time.monotonic() + 20  # SIGKILLed members take a moment to be reaped

    def group_alive(pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True

    while any(group_alive(int(pid)) for pid in decode):
        assert time.monotonic() < deadline, "the killed decode instance left processes running"
        time.sleep(0.5)
    assert set(glob.glob("/tmp/slimwise-kv-*")) == before  # cleaned on shutdown
