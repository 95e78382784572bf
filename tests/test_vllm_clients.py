"""What a client sees: `slimwise serve` driven as users drive it, with the official `openai` client and text
prompts.

For every served family, one colocated server under the name the user typed: the shipped backbones (testbed-a
qwen3_moe, -b qwen2_moe, -c qwen3_5_moe) and the tiny model of each other family (mixtral, olmoe, deepseek_v3,
gpt_oss, qwen3_next), with the testbed tokenizer, so that a model type whose AutoTokenizer swaps in its
family's class (qwen3_5_moe, qwen3_next) meets a tokenizer that class does not reproduce. For every model name
a server serves (`MODEL`, `MODEL:full`, `MODEL:<plan>`):
- the text of completions, chat completions and streamed completions is the reference engine's (`slimwise
  generate`'s `PhaseSplitEngine`) for that routing, and the prompt reached the model as the reference
  tokenizer's ids. vLLM runs float32 where its CPU kernels allow; the hybrids run bf16 (vLLM's CPU Gated
  DeltaNet kernel), where greedy tokens are checked against the float32 reference by the mean log-prob gap of
  tests/test_vllm_hybrid.py;
- the tiny families serve one named plan (the case whose `MODEL:full` used to be served pruned), the shipped
  backbones two (`math` and `general`, as the README suggests).
Disaggregated through the same client with text: testbed-c here (the hybrid, with its KV size chosen by
SlimWise and ended by kill -9 of the supervisor), the tiny qwen3_moe at TP 2 (tests/test_vllm_serve.py); the
instances of every family at the engine level:
tests/test_vllm_disaggregated.py (a server per family would add minutes of vLLM start-ups to CI). Servers of
one group start side by side (their start-up is mostly vLLM imports, one core each), and the reference runs
while they start. CI runs testbed-a colocated and testbed-c
disaggregated; testbed-b's and -c's colocated servers (two plans), testbed-a and -b disaggregated and the tiny
families' servers are `make test-matrix`, their engines' token equality CI's (tests/test_vllm_plugin.py,
tests/test_vllm_disaggregated.py): CI has to stay under 30 minutes.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from conftest import TINY_INIT
from openai import APIStatusError, OpenAI
from test_vllm_hybrid import MEAN_GAP, WRONG_GAP, mean_gap
from test_vllm_plugin import VLLM_TINY, set_selection_bias
from test_vllm_serve import free_port, launch, stop, wait_healthy
from tiny import build_tiny_model

from lab.testbed.tokenizer import build_tokenizer
from slimwise.baseline_plans import random_plan
from slimwise.calibrate import CalibrationConfig, calibrate
from slimwise.criteria import plan_from_stats
from slimwise.embedded import EMBEDDED, embedded_model_dir
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.models import is_hybrid, load_model, load_tokenizer
from slimwise.plan import PrunePlan
from slimwise.testbed import make_split

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"  # the committed plans a user would serve
MAX_TOKENS = {"tiny": 12, "shipped": 40}
def tiny_with_testbed_tokenizer(family: str, root) -> str:
    """The family's tiny random model with the testbed tokenizer, saved as `root/family` (served as
    `family`)."""
    out = root / family
    tok = build_tokenizer(out)
    model = build_tiny_model(
        family,
        seed=0,
        initializer_range=TINY_INIT,
        vocab_size=len(tok),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **VLLM_TINY.get(family, {}),
    )
    if family == "deepseek_v3":
        set_selection_bias(model)
    model.save_pretrained(out)
    return str(out)


class Served:
    """One model as served: its reference engine, plans and (after `reference()`) the reference text per
    routing. The plan files exist once it is built, so its server can start before the reference runs."""

    def __init__(
        self,
        name: str,
        model_dir: str,
        plans: dict[str, object],
        candidates: list[str],
        max_tokens: int,
        tmp,
        n_prompts: int = 4,
    ) -> None:
        self.name, self.model_dir, self.max_tokens = name, model_dir, max_tokens
        self.model, self.tok = load_model(model_dir, dtype="float32"), load_tokenizer(model_dir)
        self.hybrid = is_hybrid(model_dir)
        self.family = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
        self.trained = name in EMBEDDED  # a shipped backbone, not random weights
        self.plans, self.plan_files = plans, {}
        for plan_name, plan in plans.items():
            self.plan_files[plan_name] = tmp / f"{name}-{plan_name}.json"
            plan.save(self.plan_files[plan_name])
        self.engines = {"full": PhaseSplitEngine(self.model, self.tok)}
        self.engines.update({n: PhaseSplitEngine(self.model, self.tok, plan=p) for n, p in plans.items()})
        self.candidates, self.n_prompts = candidates, n_prompts

    def reference(self) -> None:
        """The reference text of every routing; keeps the prompts on which the routings differ."""
        candidates, plans = self.candidates, self.plans
        config = GenerationConfig(max_new_tokens=self.max_tokens)
        want = {"full": self.engines["full"].generate(candidates, "full", config)}
        want.update({n: self.engines[n].generate(candidates, "slimwise", config) for n in plans})
        # prompts on which some plan's reference text differs from full's, so the checks tell routings apart
        keep = [
            i for i in range(len(candidates)) if any(want[n][i].text != want["full"][i].text for n in plans)
        ]
        keep = keep[: self.n_prompts]
        self.prompts = [candidates[i] for i in keep]
        self.want = {routing: [outs[i] for i in keep] for routing, outs in want.items()}
        for n in plans:
            assert any(a.text != b.text for a, b in zip(self.want[n], self.want["full"], strict=True)), n
        self.ids = [self.tok(p, add_special_tokens=False)["input_ids"] for p in self.prompts]

    def args(self, model_arg: str) -> list[str]:
        return [model_arg, *(a for n, f in self.plan_files.items() for a in ("--plan", f"{n}={f}"))]

    def routing_of(self, served: str) -> str:
        """`name` -> the default plan (the first), `name:full` -> full, `name:p` -> p."""
        suffix = served.removeprefix(self.name).removeprefix(":")
        return suffix or next(iter(self.plans))


def check_client(port: int, served: Served, disaggregated: bool = False) -> None:
    """Every model name the server lists, through the openai client: completions (text and prompt ids), chat
    and streaming equal the reference's text for that name's routing (disaggregated: one name, the one
    plan); a request over --max-n gets 400."""
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    names = [m.id for m in client.models.list().data]
    expected = [served.name] if disaggregated else [served.name, f"{served.name}:full",
                                                    *(f"{served.name}:{n}" for n in served.plans)]
    assert names == expected, names
    with pytest.raises(APIStatusError) as err:  # the request-cost limit, in both modes
        client.completions.create(model=names[0], prompt=served.prompts[0], max_tokens=2, n=10_000)
    assert err.value.status_code == 400 and "--max-n" in str(err.value)
    for name in names:
        routing = served.routing_of(name)
        want = served.want[routing]
        texts, tokens = [], []
        for prompt, ids in zip(served.prompts, served.ids, strict=True):
            r = client.completions.create(
                model=name,
                prompt=prompt,
                max_tokens=served.max_tokens,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
            choice = r.choices[0]
            assert r.model == name
            assert choice.model_extra["prompt_token_ids"] == ids, (name, prompt)  # the text became these ids
            texts.append(choice.text)
            tokens.append(choice.model_extra["token_ids"])
            assert served.tok.decode(choice.model_extra["token_ids"], skip_special_tokens=True) == choice.text
        stream = client.completions.create(model=name, prompt=served.prompts[0], max_tokens=served.max_tokens,
                                           temperature=0, stream=True)
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks) == texts[0] and {c.model for c in chunks} == {name}
        # the testbed chat template ends the user's message with a newline: the same prompt as the
        # completion's.
        # GPT-OSS chat is rendered by vLLM in OpenAI's Harmony format, whose o200k special-token ids only a
        # GPT-OSS tokenizer has (the testbed tokenizer gets 400 "Token id 200008 is out of vocabulary"):
        # completions only
        messages = [{"role": "user", "content": served.prompts[1].rstrip("\n")}]
        chat = None if served.family == "gpt_oss" else client.chat.completions.create(
            model=name, messages=messages, max_tokens=served.max_tokens, temperature=0)
        assert chat is None or (chat.choices[0].message.content == texts[1] and chat.model == name)
        if not served.hybrid:  # float32: the reference's tokens, and their text as an OpenAI server writes it
            assert tokens == [w.token_ids for w in want], (name, tokens, [w.token_ids for w in want])
            assert texts == [served.tok.decode(w.token_ids, skip_special_tokens=True) for w in want]
            continue
        # bf16 engine vs float32 reference: vLLM's tokens follow the promised routing (mean log-prob gap)
        engine = served.engines["full" if routing == "full" else routing]
        mode = "full" if routing == "full" else "slimwise"
        gap = mean_gap(engine, mode, tokens, served.ids)
        assert gap <= MEAN_GAP, (name, gap)
        if served.trained:  # near-ties are rare in a trained model: bf16 flips at most one answer here
            same = sum(t == w.text for t, w in zip(texts, want, strict=True))
            assert same >= len(want) - 1, (name, same, texts, [w.text for w in want])
        else:
            # random weights: the gap under the other routing tells the routings apart (test_vllm_hybrid.py)
            other = served.engines[next(iter(served.plans))] if routing == "full" else served.engines["full"]
            wrong = mean_gap(other, "full" if mode == "slimwise" else "slimwise", tokens, served.ids)
            assert wrong >= WRONG_GAP, (name, wrong)


def run_group(entries: list[tuple[Served, list[str], list[str]]], root, disaggregated: bool = False,
              finish=None) -> None:
    """Start every (served, serve args, vLLM args) of a group side by side, then check each through the
    client. `finish(served, port, proc)`, if given, runs after each server's checks, while it is still up."""
    running = []
    # a disaggregated server listens on its port and starts its instances on the next two: the servers of a
    # group get disjoint, currently free spans (three side by side once collided: a proxy found its port taken
    # by another server's decode instance)
    ports = free_spans(len(entries), 3 if disaggregated else 1)
    try:
        for (served, args, vllm_args), port in zip(entries, ports, strict=True):
            log = open(root / f"{served.name}.log", "w")  # noqa: SIM115
            running.append((served, port, log, launch(args, port, log, vllm_args, name=None)))
        for served, *_ in running:  # while the servers start (their start-up is imports on one core)
            served.reference()
        for served, port, log, proc in running:
            wait_healthy(proc, port, log)
            check_client(port, served, disaggregated)
            if finish is not None:
                finish(served, port, proc)
    finally:
        for *_, proc in running:
            stop(proc)
    for served, port, log, _ in running:
        text = Path(log.name).read_text()
        ready = "SlimWise PD proxy ready" if disaggregated else f"SlimWise ready on http://127.0.0.1:{port}"
        assert ready in text and f"as model {served.name!r}" in text, text[-2000:]


def free_spans(count: int, width: int) -> list[int]:
    """`count` ports P, each with P..P+width-1 free now and no two spans overlapping."""
    import socket

    def free(port: int) -> bool:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        span = range(port, port + width)
        if port + width <= 65536 and all(abs(port - p) >= width for p in ports) and all(map(free, span)):
            ports.append(port)
    return ports


def vllm_dtype(model_dir: str) -> list[str]:
    return ["--dtype", "bfloat16" if is_hybrid(model_dir) else "float32", "--enforce-eager"]


def tiny_served(family: str, n_plans: int, tmp_path) -> Served:
    """The family's tiny model with `n_plans` named plans: `p` (REAP 50% from a short calibration), then `q`
    (a random 50% plan)."""
    prompts = [s.prompt for s in make_split("test", 1)][:8]
    calib = [s.prompt for s in make_split("calib", 1)]
    model_dir = tiny_with_testbed_tokenizer(family, tmp_path)
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    stats = calibrate(model, calib, tok, CalibrationConfig(max_new_tokens=8), progress=False)
    plans = {"p": plan_from_stats(stats, "reap", 0.5)}
    if n_plans > 1:
        plans["q"] = random_plan(model, 0.5, seed=1)
    return Served(family, model_dir, plans, prompts, MAX_TOKENS["tiny"], tmp_path)


def shipped_served(name: str, n_plans: int, tmp_path) -> Served:
    """A shipped backbone with `n_plans` named plans: `math` (the committed REAP 50% decode plan), then
    `general` (a random 50% plan)."""
    prompts = [s.prompt for s in make_split("test", 8) if s.family in ("add", "sub", "mul")][:24]
    model_dir = str(embedded_model_dir(name))
    plans = {"math": PrunePlan.load(RESULTS / name / "plans" / "reap-decode-0.5.json")}
    if n_plans > 1:
        plans["general"] = random_plan(load_model(model_dir, dtype="float32"), 0.5, seed=1)
    return Served(name, model_dir, plans, prompts, MAX_TOKENS["shipped"], tmp_path)


SHIPPED = [("testbed-a",)]  # testbed-b and -c with two plans: `make test-matrix`


@pytest.mark.parametrize("names", SHIPPED, ids=["-".join(g) for g in SHIPPED])
def test_shipped_backbones_answer_text_as_the_reference(names, tmp_path):
    """`slimwise serve testbed-X --plan math=... --plan general=...` with the committed 50% plans (REAP,
    decode calibration; `general` a random plan): served as `testbed-X`, `testbed-X:full`, `testbed-X:math`,
    `testbed-X:general`, each equal to the reference engine (float32; testbed-c bf16, within the gap
    bound). On testbed-a also: the plans at once in concurrent batches, 404 and 400, the load test."""
    entries = []
    for name in names:
        served = shipped_served(name, 2, tmp_path)
        default = ["--default-plan", "math"] if name == "testbed-a" else []  # explicit, the same routing
        entries.append((served, [*served.args(name), *default], vllm_dtype(served.model_dir)))
    run_group(entries, tmp_path, finish=lambda served, port, proc: (
        several_plans_at_once(served, port) if served.name == "testbed-a" else None))
    text = (tmp_path / "testbed-a.log").read_text()
    assert "GiB per instance on CPU" in text  # no KV size given: SlimWise chose one and said so
    assert "mode:     PD-colocated" in text and "plan math:" in text and "plan general:" in text
    # fail closed: before the server said ready, the self-check saw each plan route its warm-up decode rows
    assert ("checked:  V1 (vllm.v1.worker.cpu_model_runner.CPUModelRunner): the warm-up's decode rows "
            "routed with each plan (math 6, general 6;") in text


def several_plans_at_once(served: Served, port: int) -> None:
    """testbed-a's server, float32: the default plan, a second plan and full in one batch of twelve concurrent
    requests, each answered with its own routing's reference text; a name it does not serve gets vLLM's 404, a
    plan named past the model names 400 (not full-routed); then the CI-sized load test (2 rounds of 32
    concurrent requests, none failed or lost)."""
    from concurrent.futures import ThreadPoolExecutor

    from test_vllm_serve import load_test

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    names = [served.name, f"{served.name}:general", f"{served.name}:full"]
    before = slimwise_metrics(port)
    assert before["slimwise_self_check_passed"] == 1.0
    fed_back = {"math": 0, "general": 0}
    with ThreadPoolExecutor(12) as pool:
        jobs = [(m, i, pool.submit(client.completions.create, model=m, prompt=served.prompts[i],
                                   max_tokens=served.max_tokens, temperature=0))
                for m in names for i in range(len(served.prompts))]
        for m, i, job in jobs:
            answer = job.result()
            assert answer.choices[0].text == served.want[served.routing_of(m)][i].text, (m, i)
            plan = {served.name: "math", f"{served.name}:general": "general"}.get(m)
            if plan:  # every generated token but the last is fed back through the pruned decoder
                fed_back[plan] += answer.usage.completion_tokens - 1
    after = slimwise_metrics(port)
    for plan, tokens in fed_back.items():  # the operator's counters are the tokens the clients received
        key = f'slimwise_decode_tokens_pruned_total{{plan="{plan}"}}'
        assert after[key] - before[key] == tokens > 0, (plan, before, after)
    with pytest.raises(APIStatusError) as err:
        client.completions.create(model=f"{served.name}:nope", prompt=served.prompts[0], max_tokens=2)
    assert err.value.status_code == 404
    with pytest.raises(APIStatusError) as err:
        client.completions.create(model=served.name, prompt=served.prompts[0], max_tokens=2,
                                  extra_body={"vllm_xargs": {"slimwise_plan": "nope"}})
    assert err.value.status_code == 400 and "'nope' is not served here" in str(err.value)
    load_test(port)


def slimwise_metrics(port: int) -> dict[str, float]:
    """SlimWise's samples on the server's Prometheus /metrics (vLLM's own families are there too)."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=60).text
    assert "vllm:" in text  # vLLM's own metrics are still served
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("slimwise_")}


def disaggregated_args(served: Served, model_arg: str) -> list[str]:
    return [model_arg, "--plan", str(next(iter(served.plan_files.values()))), "--disaggregated"]


def kill_9_leaves_nothing(proc) -> None:
    """kill -9 of the `slimwise serve` supervisor: its instances (API servers, engine and worker processes,
    the watchdog) and its KV directory go with it (parent-death signal, watchdog)."""
    import glob
    import os
    import signal
    import subprocess
    import tempfile
    import time

    from test_vllm_serve import group_alive

    children = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                               text=True).stdout.split()]
    groups = {os.getpgid(p) for p in children}  # prefill and decode instances, the watchdog
    kv_dirs = glob.glob(os.path.join(tempfile.gettempdir(), f"slimwise-kv-*-{proc.pid}-*"))
    assert len(groups) >= 3 and len(kv_dirs) == 1, (children, kv_dirs)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 60  # measured by hand: 9 processes gone 2.8 s after the kill
    try:
        while left := [g for g in groups if group_alive(g)] + [d for d in kv_dirs if os.path.exists(d)]:
            assert time.monotonic() < deadline, f"left after kill -9 of slimwise serve: {left}"
            time.sleep(0.5)
    finally:
        for g in groups:
            if group_alive(g):
                os.killpg(g, signal.SIGKILL)


def test_shipped_backbones_disaggregated_answer_text_as_the_reference(tmp_path):
    """`slimwise serve testbed-c --plan plan.json --disaggregated` (full-model prefill instance, exported
    pruned decode instance, proxy): served as `testbed-c`, completions, streams and chats with text equal the
    reference engine's SlimWise text (bf16: the gap bound and the same answers). The proxy refuses a request
    over --max-n as the colocated server does. (Float32 token-exact disaggregated serving through the
    client: the tiny qwen3_moe at TP 2 in tests/test_vllm_serve.py; testbed-a and -b disaggregated: `make
    test-matrix`.)

    testbed-c, the hybrid: no KV size is given, and SlimWise sizes the cache itself, linear-attention state
    included; the prefill instance runs without prefix caching (the connector refuses the 'align' Mamba cache
    mode); the decode instance loads the full model's handed-over state. Its server ends with kill -9 of the
    supervisor, and nothing of it is left."""
    entries = []
    for name in ("testbed-c",):  # testbed-a and -b: `make test-matrix`
        served = shipped_served(name, 1, tmp_path)
        entries.append((served, disaggregated_args(served, name), vllm_dtype(served.model_dir)))
    run_group(entries, tmp_path, disaggregated=True,
              finish=lambda served, port, proc: kill_9_leaves_nothing(proc) if served.hybrid else None)
    text = (tmp_path / "testbed-c.log").read_text()
    assert "GiB per instance on CPU" in text and "linear-attention state" in text
    assert "SlimWise: loading the full model's state" in text
    prefill_cmd = next(line for line in text.splitlines() if line.startswith("starting prefill:"))
    assert "--no-enable-prefix-caching" in prefill_cmd


def test_the_server_refuses_a_tokenizer_that_disagrees_with_the_checkpoint(tmp_path):
    """`--tokenizer-mode hf` next to a qwen3_5_moe config: vLLM's AutoTokenizer swaps in Qwen3_5Tokenizer for
    the shipped testbed tokenizer. The check before start-up loads the tokenizer as vLLM would and catches
    it: one line, exit 2, no engine started, no server left running. (The same check against running
    instances: tests/test_proxy.py.)"""
    model_dir = tiny_with_testbed_tokenizer("qwen3_5_moe", tmp_path)
    port, log = free_port(), open(tmp_path / "refused.log", "w")  # noqa: SIM115
    vllm_args = ["--dtype", "bfloat16", "--enforce-eager", "--tokenizer-mode", "hf"]
    proc = launch([model_dir], port, log, vllm_args, name=None)
    try:
        assert proc.wait(timeout=600) == 2
    finally:
        stop(proc)
    text = Path(log.name).read_text()
    errors = [line for line in text.splitlines() if line.startswith("slimwise: error:")]
    assert len(errors) == 1 and "the tokenizer vLLM loads with --tokenizer-mode hf encodes text differently" \
        in errors[0], text[-3000:]
    assert "Traceback" not in text and "starting vllm" not in text, text[-3000:]
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)


def test_the_reference_loads_the_tokenizer_another_tool_saved(tmp_path):
    """A copy of testbed-c saved the way transformers 5.17 / llm-compressor save it (`tokenizer_class:
    TokenizersBackend`): the reference engine still encodes with the shipped tokenizer.json, and so does
    vLLM's SlimWise tokenizer mode."""
    import shutil

    from slimwise.serving.tokenizer import ShippedTokenizer

    src = embedded_model_dir("testbed-c")
    dst = tmp_path / "exported"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "TokenizersBackend"}))
    text = "add 565+70\n"
    want = load_tokenizer(src)(text, add_special_tokens=False)["input_ids"]
    assert want[0] == load_tokenizer(src).convert_tokens_to_ids("add")  # a template word is one token
    for tok in (load_tokenizer(dst), ShippedTokenizer.from_pretrained(dst)):
        assert tok(text, add_special_tokens=False)["input_ids"] == want
        assert tok.decode(want) == text


# The rest of the cross-product (every served model x one named plan, two, disaggregated), beyond the slice
# the tests above run in CI: `make test-matrix` (pytest -m matrix; deselected by default in pyproject.toml, as
# its 30 vLLM instances add about 19 minutes here). Each row: a serving configuration, and the models started
# side by side for it.
MATRIX = [
    ("one-plan", ("testbed-a", "testbed-b", "testbed-c")),
    ("one-plan", ("mixtral", "olmoe", "qwen3_next")),
    ("one-plan", ("qwen3_moe", "qwen2_moe", "qwen3_5_moe")),
    ("one-plan", ("deepseek_v3", "gpt_oss")),
    ("two-plans", ("testbed-b", "testbed-c")),
    ("two-plans", ("qwen3_moe", "qwen2_moe", "qwen3_5_moe")),
    ("two-plans", ("mixtral", "olmoe", "qwen3_next")),
    ("two-plans", ("deepseek_v3", "gpt_oss")),
    ("disaggregated", ("testbed-a", "testbed-b")),
    ("disaggregated", ("qwen3_moe", "qwen2_moe")),
    ("disaggregated", ("qwen3_5_moe", "mixtral")),
    ("disaggregated", ("olmoe", "qwen3_next")),
    ("disaggregated", ("deepseek_v3", "gpt_oss")),
]


@pytest.mark.matrix
@pytest.mark.parametrize(("config", "names"), MATRIX, ids=[f"{c}-{'-'.join(n)}" for c, n in MATRIX])
def test_the_rest_of_the_client_matrix(config, names, tmp_path):
    """Colocated with one named plan (MODEL, MODEL:full, MODEL:PLAN) or two (+ MODEL:PLAN2), or disaggregated
    with one plan: every name's completions, chats and streams with text equal the reference's text for its
    routing, as in the tests above."""
    n_plans = 2 if config == "two-plans" else 1
    entries = []
    for name in names:
        served = shipped_served(name, n_plans, tmp_path) if name in EMBEDDED else tiny_served(name, n_plans,
                                                                                                tmp_path)
        model_arg = name if name in EMBEDDED else served.model_dir
        args = disaggregated_args(served, model_arg) if config == "disaggregated" else served.args(model_arg)
        entries.append((served, args, vllm_dtype(served.model_dir)))
    run_group(entries, tmp_path, disaggregated=config == "disaggregated")
