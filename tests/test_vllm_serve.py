"""`slimwise serve` end to end: real vLLM OpenAI servers on localhost, spoken to with the `openai` client.

Disaggregated serving at tensor-parallel size 2 must return the reference engine's SlimWise tokens, take the
prompt KV and the first token from the full model, clean its KV directory on shutdown, and answer a clear
error (not hang) when an instance is gone; it takes a scaled-down load test (scripts/load_test.py, 2 rounds of
32: none failed or lost), and the proxy answers bad input as vLLM's own server does. Colocated serving, the
same load test, several plans in concurrent batches, 404 and 400: tests/test_vllm_clients.py (testbed-a's
server); kill -9 of `slimwise serve` leaving no process and no KV directory: at the end of
tests/test_vllm_clients.py::test_shipped_backbones_disaggregated_answer_text_as_the_reference, on the
testbed-c server already running for that test. The helpers here start servers for those tests too.
"""

from __future__ import annotations

import glob
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import APIStatusError, OpenAI
from tiny import save_tiny_model

from lab.testbed.tokenizer import build_tokenizer
from slimwise.calibrate import CalibrationConfig, calibrate
from slimwise.criteria import plan_from_stats
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.models import load_model, load_tokenizer
from slimwise.testbed import make_split

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
    stats = calibrate(
        model,
        [s.prompt for s in make_split("calib", 1)],
        tok,
        CalibrationConfig(max_new_tokens=8),
        progress=False,
    )
    plan = plan_from_stats(stats, "reap", 0.5)
    plan.save(root / "plan.json")
    prompts = [s.prompt for s in make_split("test", 1)][:4]
    engine = PhaseSplitEngine(model, tok, plan=plan)
    ref = {
        m: engine.generate(prompts, m, GenerationConfig(max_new_tokens=MAX_TOKENS))
        for m in ("full", "slimwise")
    }
    assert ref["full"] != ref["slimwise"]
    return root, prompts, ref


def launch(args: list[str], port: int, log, vllm_args: list[str] = VLLM_ARGS, name: str | None = "tiny"
           ) -> subprocess.Popen:
    """`slimwise serve ARGS` as a user starts it (a process of its own; `name`: --served-model-name, None: the
    default name). Returns at once: several servers can start side by side (`wait_healthy` each)."""
    named = ["--served-model-name", name] if name else []
    return subprocess.Popen(
        [sys.executable, "-m", "slimwise.cli", "serve", *args, "--port", str(port), *named, *vllm_args],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={
            **{
                k: v
                for k, v in os.environ.items()  # a real server: engine core in its
                if k != "VLLM_ENABLE_V1_MULTIPROCESSING"
            },  # own process
            "VLLM_LOGGING_LEVEL": "INFO",
        },
    )


def wait_healthy(proc: subprocess.Popen, port: int, log, timeout: float = 600) -> subprocess.Popen:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:  # the server's log says why (CI shows only this message)
            raise AssertionError(f"server exited with code {proc.returncode} during start-up; log tail:\n"
                                 + Path(log.name).read_text()[-6000:])
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise AssertionError(f"server did not become healthy within {timeout:.0f} s; log tail:\n"
                         + Path(log.name).read_text()[-6000:])


def start(args: list[str], port: int, log, vllm_args: list[str] = VLLM_ARGS, name: str | None = "tiny"
          ) -> subprocess.Popen:
    return wait_healthy(launch(args, port, log, vllm_args, name), port, log)


LOAD_TEST = Path(__file__).resolve().parents[1] / "scripts" / "load_test.py"


def load_test(port: int) -> str:
    """The CI-sized run of scripts/load_test.py (the issue-15 figures use 3 rounds of 256): every request
    ok."""
    r = subprocess.run(
        [
            sys.executable,
            str(LOAD_TEST),
            "--port",
            str(port),
            "--rounds",
            "2",
            "--concurrency",
            "32",
            "--max-tokens",
            "8",
            "--deadline",
            "600",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def group_alive(pgid: int) -> bool:
    """A running process in group `pgid`; zombies (dead, not yet reaped by whoever inherited them) do not
    count."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(") ", 1)[1].split()[:3]
        except (OSError, IndexError):
            continue
        if state != "Z" and int(group) == pgid:
            return True
    return False


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def check_completions(client: OpenAI, prompts, ref, model: str = "tiny") -> None:
    for prompt, want in zip(prompts, ref, strict=True):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True})
        assert r.choices[0].text == want.text
        assert r.choices[0].model_extra["token_ids"] == want.token_ids
        assert r.model == model
    stream = client.completions.create(model=model, prompt=prompts[0], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == ref[0].text and {c.model for c in chunks} == {model}
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompts[1].rstrip("\n")}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert chat.choices[0].message.content == ref[1].text and chat.model == model


def health_on(sock: socket.socket) -> int:
    """GET /health on an open keep-alive connection: the status code (0 when the server has closed it)."""
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        answer = http.client.HTTPResponse(sock)
        answer.begin()
        answer.read()  # the whole answer: the next one starts clean
        return answer.status
    except (OSError, http.client.HTTPException):
        return 0


def test_disaggregated_serve(served):
    """PD-disaggregated with --tensor-parallel-size 2 on both instances (4 CPU workers on 2 cores; SlimWise
    binds each instance's ranks, as vLLM's NUMA auto-binding refuses on one node): each rank stores and loads
    its own shard, the tokens are the reference engine's SlimWise tokens, the load test and bad input pass, a
    killed decode instance is named, and nothing is left behind: no process, no KV directory, no shared-memory
    segment. (TP 1 disaggregated serving: testbed-c, the hybrid, in tests/test_vllm_clients.py, a real server
    too. One server here for both, as the TP 1 and TP 2 servers took 132 and 141 s each on an AVX2-only
    VM.)"""
    from slimwise.serving import shm

    root, prompts, ref = served
    port = free_port()
    before = set(glob.glob("/tmp/slimwise-kv-*"))
    shm_before = shm.segments()
    log = open(root / "pd.log", "w")  # noqa: SIM115
    proc = start(
        [
            str(root / "model"),
            "--plan",
            str(root / "plan.json"),
            "--disaggregated",
            "--tensor-parallel-size",
            "2",
        ],
        port,
        log,
        vllm_args=["--dtype", "float32", "--enforce-eager"],
    )
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        check_completions(client, prompts, ref["slimwise"])
        # the servers keep idle connections 75 s, not vLLM's 5 s (CI once lost a request to a proxy reusing a
        # decode-instance connection as it closed): connections to the proxy and the decode instance stay
        # usable
        idle = [socket.create_connection(("127.0.0.1", p), timeout=60) for p in (port, port + 2)]
        assert [health_on(sock) for sock in idle] == [200, 200]
        t_idle = time.monotonic()
        load_test(port)  # 2 rounds of 32 concurrent requests: none failed or lost
        time.sleep(max(0.0, 8 - (time.monotonic() - t_idle)))
        assert [health_on(sock) for sock in idle] == [200, 200], "an idle keep-alive connection was closed"
        for sock in idle:
            sock.close()
        kv_dirs = set(glob.glob("/tmp/slimwise-kv-*")) - before
        # per pair, emptied after each request
        assert len(kv_dirs) == 1 and not os.listdir(kv_dir := kv_dirs.pop())
        check_bad_input_as_vllm(port, prompts[0])
        assert not os.listdir(kv_dir)  # nothing leaked by refused or streamed requests
        # /metrics: the decode instance's vLLM families and the proxy's counters, which equal its /health's
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=60).text
        served = httpx.get(f"http://127.0.0.1:{port}/health", timeout=60).json()["requests"]
        assert "vllm:generation_tokens_total" in metrics and "slimwise_proxy_decode_metrics_up 1.0" in metrics
        assert f"slimwise_proxy_requests_total {float(served)}" in metrics and served > 0
        deadline = time.monotonic() + 60  # the decode engine process's log line may reach the file late
        while "SlimWise: loading the full model's state" not in (text := (root / "pd.log").read_text()):
            assert time.monotonic() < deadline, (
                "no KV load logged by the decode instance; log tail:\n" + text[-3000:]
            )
            time.sleep(0.5)
        # one instance gone: the client gets a clear 503 naming it, quickly
        decode = subprocess.run(
            ["pgrep", "-f", "--", f"--port {port + 2} "], capture_output=True, text=True
        ).stdout.split()
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
        while (
            "decode instance exited"
            not in (health := httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)).text
        ):
            assert time.monotonic() - t0 < 30, (
                f"the supervisor did not report the dead instance: {health.text}"
            )
            # not yet noticed: the unreachable decode instance already fails it
            assert health.status_code == 503
            time.sleep(0.5)
        assert health.status_code == 503
        with pytest.raises(APIStatusError) as info:
            client.completions.create(model="tiny", prompt=prompts[0], max_tokens=MAX_TOKENS, temperature=0)
        assert info.value.status_code == 503 and "decode instance exited" in str(info.value)
    finally:
        stop(proc)
    # the killed instance's engine processes (orphans of its API server) went with the rest of its group
    deadline = time.monotonic() + 20  # SIGKILLed members take a moment to be reaped
    while any(group_alive(int(pid)) for pid in decode):
        assert time.monotonic() < deadline, "the killed decode instance left processes running"
        time.sleep(0.5)
    assert set(glob.glob("/tmp/slimwise-kv-*")) == before  # cleaned on shutdown
    text = (root / "pd.log").read_text()
    assert "threads:" in text and "tensor_parallel_size=2" in text
    # the decode instance starts once the prefill instance is healthy (vLLM's memory profiler on shared GPUs)
    started = text.index("prefill instance healthy; starting the decode instance")
    assert f"--port {port + 2}" not in text[:started] and f"--port {port + 2}" in text[started:]
    # TP workers killed (the decode instance's by the test, the rest at shutdown): the shared memory they held
    # was unlinked, by the server or, where a worker's resource tracker got there first, by that tracker (both
    # seen)
    assert not shm.segments() - shm_before, text[-3000:]
    assert ("shared-memory segments the instances' workers left" in text
            or "leaked shared_memory objects to clean up at shutdown" in text), text[-3000:]


# Requests whose answer must be vLLM's own: the proxy's status equals the prefill instance's (vLLM's server),
# and where the instance refuses, its body reaches the client unchanged (passed through, not turned into a
# 503).
SAME_AS_VLLM = [
    {"max_tokens": -5},
    {"max_tokens": 0},
    {"max_tokens": 2.5},
    {"max_tokens": "abc"},
    {"n": "x"},
    {"prompt": ""},
    {"max_tokens": 100_000},  # above max_model_len
    {"model": "nope"},  # unknown model: 404
    {"prompt": "x " * 5000},  # too long
    {"prompt": "y" * (1 << 20)},  # 1 MB
    {"temperature": -1},
    {"prompt": [10**7, 5]},  # out-of-vocabulary ids
]
PASSED_THROUGH = SAME_AS_VLLM[7:]


def check_bad_input_as_vllm(port: int, prompt: str) -> None:
    proxy, vllm = f"http://127.0.0.1:{port}/v1/completions", f"http://127.0.0.1:{port + 1}/v1/completions"
    for case in SAME_AS_VLLM:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, **case}
        mine, theirs = httpx.post(proxy, json=body, timeout=120), httpx.post(vllm, json=body, timeout=120)
        assert mine.status_code == theirs.status_code, (str(case)[:80], mine.text[:300], theirs.text[:300])
        assert 400 <= mine.status_code < 500 and mine.json()["error"]["message"], mine.text[:300]
        if case in PASSED_THROUGH:
            assert mine.json() == theirs.json(), (str(case)[:80], mine.text[:300], theirs.text[:300])
    for raw in (
        b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
        b'{"model": "tiny", "prompt": "\\ud800"}',
        b"[1]",
        b"",
        b"\xff",
    ):
        r = httpx.post(proxy, content=raw, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, (raw, r.text[:300])
    # a stream that ends at the first token is still a stream
    with httpx.stream(
        "POST", proxy, json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 2


@pytest.mark.matrix  # one more server start (about 48 s here): `make test-matrix`; the command line is in CI
def test_colocated_serve_with_a_fallback(served):
    """`slimwise serve --fallback 0.3`, as a user starts it: text completions, streams and chat equal the
    reference engine with the same fallback (float32), which differs from plain SlimWise here, and the log
    states the setting."""
    from slimwise.decode_gates import DecodeGates

    text = serve_gated(served, DecodeGates("renorm", 0.3), ["--fallback", "0.3"], "fallback.log")
    assert "gates renorm, fallback above a pruned share of 0.3" in text


def test_colocated_serve_with_a_batch_budget(served):
    """`slimwise serve --budget-share 0.5`, as a user starts it: requests sent one at a time are decode
    batches of one, whose k experts never exceed the budget, so completions, streams and chat equal the
    reference engine's under the same budget at batch 1 (which differ from static SlimWise's here), the
    start-up self-check passes with the budget in effect, and the log states the budget."""
    from slimwise.decode_gates import DecodeGates

    text = serve_gated(served, DecodeGates(budget_share=0.5), ["--budget-share", "0.5"], "budget.log",
                       batch_size=1)
    assert "batch budget {'gates': 'renorm', 'fallback': None, 'budget_share': 0.5}" in text
    assert "checked:" in text


def serve_gated(served, gates, args: list[str], log_name: str, vllm_args: list[str] = VLLM_ARGS,
                batch_size: int = 16) -> str:
    """`slimwise serve MODEL --plan P ARGS` against the reference engine with `gates` (which must change the
    tokens here): completions, streams and chat equal; returns the server's log."""
    from slimwise.plan import PrunePlan

    root, prompts, ref = served
    model, tok = load_model(root / "model"), load_tokenizer(root / "model")
    with PhaseSplitEngine(model, tok, plan=PrunePlan.load(root / "plan.json"), gates=gates) as engine:
        want = engine.generate(prompts, "slimwise", GenerationConfig(max_new_tokens=MAX_TOKENS,
                                                                     batch_size=batch_size))
    assert [g.token_ids for g in want] != [g.token_ids for g in ref["slimwise"]]
    port = free_port()
    log = open(root / log_name, "w")  # noqa: SIM115
    proc = start([str(root / "model"), "--plan", str(root / "plan.json"), *args], port, log,
                 vllm_args=vllm_args)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        check_completions(client, prompts, want)
        # the server prints its start-up lines (the self-check's included) while clients may already be
        # served: wait for the last of them, so the log read below is whole
        deadline = time.monotonic() + 300
        while "SlimWise ready" not in (root / log_name).read_text() and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        stop(proc)
        log.close()
    return (root / log_name).read_text()


@pytest.mark.matrix  # a disaggregated server start (about 100 s here): `make test-matrix`
def test_disaggregated_serve_with_substitute_gates(served):
    """`slimwise serve --disaggregated --gates substitute --substitutes S`, as a user starts it: the pruned
    decode instance reads the gates file the server writes, and text completions, streams and chat equal the
    reference engine with the same gates (float32), which differ from plain SlimWise here."""
    from slimwise.decode_gates import DecodeGates

    root = served[0]
    model, tok = load_model(root / "model"), load_tokenizer(root / "model")
    stats = calibrate(model, [s.prompt for s in make_split("calib", 1)], tok,
                      CalibrationConfig(max_new_tokens=8, output_sums=True), progress=False)
    sums = str(stats.save(root / "sums.safetensors"))
    text = serve_gated(served, DecodeGates("substitute", None, sums),
                       ["--disaggregated", "--gates", "substitute", "--substitutes", sums],
                       "pd-substitute.log", vllm_args=["--dtype", "float32", "--enforce-eager"])
    assert "writing the decode instance's gates file (substitute)" in text
    assert "pruned checkpoint decoding with gates substitute" in text


# a user's site breaks the gate hook in every process of the server (what a MoE kernel that routes from the
# raw logits amounts to): the server must refuse to serve, not serve the full model
UNMASKED_SITE = """
from slimwise.serving import gate_hooks
gate_hooks.mask_hook = lambda routing, gate, *args, **kwargs: None
"""


def test_colocated_serve_refuses_a_plan_whose_mask_is_not_in_effect(served, tmp_path):
    """`slimwise serve MODEL --plan P` whose engine does not apply the mask: the start-up self-check finds 0
    of the warm-up's decode rows masked, and the command exits non-zero with one line, no traceback, and
    nothing left running; a completion sent meanwhile is answered 503 with the same reason, never served."""
    root, prompts, _ = served
    (tmp_path / "sitecustomize.py").write_text(UNMASKED_SITE)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "slimwise.cli", "serve", str(root / "model"), "--plan",
                                 str(root / "plan.json"), "--port", str(port), "--served-model-name", "tiny",
                                 *VLLM_ARGS], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env)
        answers = []
        try:
            deadline = time.monotonic() + 600
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                                   json={"model": "tiny", "prompt": prompts[0], "max_tokens": 4})
                    answers.append((r.status_code, r.text))
                except httpx.HTTPError:
                    time.sleep(1)
            code = proc.wait(timeout=120)
        finally:
            stop(proc)
    text = (tmp_path / "server.log").read_text()
    assert code != 0, text[-3000:]
    assert "refusing to serve" in text and "plan 'default': 0 of its 6 rows masked" in text, text[-3000:]
    assert "Traceback" not in text.split("self-check failed")[-1]
    assert "SlimWise ready" not in text
    assert all(status == 503 and "self-check failed" in body for status, body in answers), answers
    assert not group_alive(proc.pid)
