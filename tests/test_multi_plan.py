"""Several plans in one engine, without an engine: DecodeRouting's per-token plan rows on a stand-in model
(the same hooks vLLM's gates get), the plan settings' refusals, the CLI's --plan parsing and the OpenAI
server's model-name -> plan middleware on a real ASGI app. Real vLLM engines: tests/test_vllm_plugin.py (token
equality) and tests/test_vllm_serve.py (the OpenAI server)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import GateModel
from transformers import PretrainedConfig

from slimwise.errors import SlimWiseError
from slimwise.plan import PrunePlan
from slimwise.serving.routing import DEFAULT_PLAN_KEY, DELTA_KEY, PLAN_KEY, PLANS_KEY, DecodeRouting

A_KEPT, B_KEPT = [0, 2, 4, 6], [1, 3, 5, 7]


def _plan(kept) -> dict:
    return PrunePlan(family="qwen3_moe", num_experts=8, top_k=2, kept_experts={0: kept, 1: kept}).to_dict()


def _routing(default=None, **extra) -> tuple[DecodeRouting, GateModel]:
    settings = {PLANS_KEY: {"a": _plan(A_KEPT), "b": _plan(B_KEPT)}, **extra}
    if default is not None:
        settings[DEFAULT_PLAN_KEY] = default
    model = GateModel()
    return DecodeRouting(model, PretrainedConfig(num_experts=8, num_experts_per_tok=2, **settings), 16), model


def _masked(model, routing, positions, prompt_lens, plans=None):
    routing.set_step(np.array(positions), np.array(prompt_lens), torch.tensor(positions),
                     None if plans is None else np.array(plans))
    x = torch.randn(len(positions), 16)
    return [torch.isneginf(block.mlp.gate(x)) for block in model.layers]


def test_each_generated_token_is_routed_with_its_own_plan():
    routing, model = _routing()
    assert routing.multi_plan and routing.plan_names == ["full", "a", "b"] and routing.default_plan == "a"
    # tokens: a-decode, b-decode, full-decode, a-prompt, b-prompt
    masks = _masked(model, routing, [5, 7, 9, 0, 1], [5, 4, 3, 2, 8], plans=[1, 2, 0, 1, 2])
    want = torch.zeros(5, 8, dtype=torch.bool)
    want[0, B_KEPT] = True  # plan a prunes b's experts, and the other way round
    want[1, A_KEPT] = True
    for m in masks:
        assert torch.equal(m, want)  # prompt tokens and the "full" request keep every expert
    c = routing.counters
    assert (c.pruned_tokens, c.full_tokens, c.plan_tokens) == (2, 3, {"a": 1, "b": 1})
    # no per-token plans: every token gets the default plan
    masks = _masked(model, routing, [5, 7], [5, 4])
    assert masks[0][:, B_KEPT].all() and not masks[0][:, A_KEPT].any()


def test_load_aware_threshold_counts_every_plan_routed_token():
    routing, model = _routing()
    routing.set_mode("slimwise", min_decode_batch=3)
    # 2 plan-routed decode tokens (+1 full-routed request): under the threshold, every expert for all
    assert not any(m.any() for m in _masked(model, routing, [5, 7, 9], [5, 4, 3], plans=[1, 2, 0]))
    # 3 decode tokens of two plans together reach it
    masks = _masked(model, routing, [5, 7, 9], [5, 4, 3], plans=[1, 2, 1])
    assert masks[0][0, B_KEPT].all() and masks[0][1, A_KEPT].all() and masks[0][2, B_KEPT].all()


def test_requests_choose_plans_by_extra_args_and_unknown_names_are_full_routed():
    routing, _ = _routing(default="full")
    params = [SimpleNamespace(extra_args={"slimwise_plan": "b"}), SimpleNamespace(extra_args=None),
              SimpleNamespace(extra_args={"slimwise_plan": "nope"})]
    assert routing.request_plans(["r1", "r2", "r3"], params).tolist() == [2, 0, 0]
    assert routing.counters.unknown_plan_requests == 1
    # cached per request while it lives; finished requests drop out of the cache
    assert routing.request_plans(["r1"], [SimpleNamespace(extra_args={"slimwise_plan": "a"})]).tolist() == [2]
    assert set(routing._request_plans) == {"r1"}


def test_one_plan_is_the_single_plan_case():
    model = GateModel()
    routing = DecodeRouting(model, PretrainedConfig(num_experts=8, num_experts_per_tok=2,
                                                    **{PLAN_KEY: _plan(A_KEPT)}), 16)
    assert routing.plans.keys() == {"default"}
    # one plan still leaves requests a choice: "full" (MODEL:full beside one named
    # plan was once served pruned)
    assert routing.multi_plan
    params = [SimpleNamespace(extra_args={"slimwise_plan": "full"}), SimpleNamespace(extra_args=None)]
    assert routing.request_plans(["r1", "r2"], params).tolist() == [0, 1]
    masks = _masked(model, routing, [5, 0], [5, 2])
    assert masks[0][0, B_KEPT].all() and not masks[0][1].any()
    assert routing.counters.plan_tokens == {}  # per-plan counts only with several plans


@pytest.mark.parametrize(("settings", "message"), [
    ({PLAN_KEY: _plan(A_KEPT), PLANS_KEY: {"a": _plan(A_KEPT)}}, "not both"),
    ({PLANS_KEY: {"full": _plan(A_KEPT)}}, "not 'full'"),
    ({PLANS_KEY: {"a b": _plan(A_KEPT)}}, "use letters"),
    ({PLANS_KEY: {"a": _plan(A_KEPT)}, DEFAULT_PLAN_KEY: "c"}, "default plan 'c' is not among"),
    ({PLANS_KEY: {"a": _plan(A_KEPT), "b": _plan(B_KEPT)}, DELTA_KEY: "/nonexistent"}, "tied to one plan"),
])
def test_plan_settings_are_refused_with_the_fix(settings, message):
    with pytest.raises(SlimWiseError, match=message):
        DecodeRouting(GateModel(), PretrainedConfig(num_experts=8, num_experts_per_tok=2, **settings), 16)


def test_uniform_mode_is_refused_with_several_plans():
    routing, _ = _routing()
    with pytest.raises(SlimWiseError, match="one plan per engine"):
        routing.set_mode("uniform")
    assert routing.set_mode("full")["mode"] == "full"


def test_serve_plan_arguments():
    from slimwise.cli import serve_plans

    assert serve_plans([]) == (None, {})
    assert serve_plans(["p.json"]) == ("p.json", {})
    assert serve_plans(["math=a.json", "general=b.json"]) == (None, {"math": "a.json", "general": "b.json"})
    for bad, message in ((["a.json", "b.json"], "need names"), (["a.json", "m=b.json"], "either all named"),
                         (["m=a.json", "m=b.json"], "given twice"), (["=a.json"], "expected NAME=PLAN")):
        with pytest.raises(SlimWiseError, match=message):
            serve_plans(bad)


def _call(app, body: dict, path="/v1/completions") -> tuple[int, dict]:
    """One POST of `body` as JSON through an ASGI app; the status and the JSON body it answers."""
    return _post_raw(app, json.dumps(body).encode(), path)


def _post_raw(app, raw: bytes, path="/v1/completions") -> tuple[int, dict]:
    messages, sent = [], False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        messages.append(message)

    scope = {"type": "http", "method": "POST", "path": path,
             "headers": [(b"content-type", b"application/json")]}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in messages if m["type"] == "http.response.start")
    data = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    length = dict(start["headers"]).get(b"content-length")
    assert length is None or int(length) == len(data)
    return start["status"], json.loads(data)


def test_the_middleware_maps_model_names_to_plans(monkeypatch):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from slimwise.serving.plan_select import PLAN_MODELS_ENV, PlanSelectMiddleware, served_names

    async def echo(request: Request):  # answers as vLLM does: its first served name in "model"
        body = await request.json()
        return JSONResponse({"model": "m", "xargs": body.get("vllm_xargs")}, media_type="application/json")

    names = served_names("m", ["math", "general"])
    assert names == {"m": None, "m:full": "full", "m:math": "math", "m:general": "general"}
    monkeypatch.setenv(PLAN_MODELS_ENV, json.dumps(names))
    app = PlanSelectMiddleware(Starlette(routes=[Route("/v1/completions", echo, methods=["POST"])]))
    assert _call(app, {"model": "m:math"}) == (200, {"model": "m:math", "xargs": {"slimwise_plan": "math"}})
    assert _call(app, {"model": "m:full", "vllm_xargs": {"x": 1}}) == (
        200, {"model": "m:full", "xargs": {"x": 1, "slimwise_plan": "full"}})
    assert _call(app, {"model": "m"}) == (200, {"model": "m", "xargs": None})  # the default plan: untouched
    assert _call(app, {"model": "other"}) == (200, {"model": "m", "xargs": None})  # vLLM answers 404 itself
    status, body = _call(app, {"model": "m", "vllm_xargs": {"slimwise_plan": "nope"}})
    assert status == 400 and "'nope' is not served here" in body["error"]["message"]



@pytest.mark.parametrize("plans", [False, True], ids=["no-plan", "plans"])
def test_the_middleware_answers_400_for_every_body_it_cannot_parse_and_over_max_n(plans, monkeypatch):
    """Every colocated server runs the middleware: a deeply nested body (RecursionError in Python's json, once
    a 500), malformed JSON, a non-object, bytes that are not UTF-8 and n above --max-n get an OpenAI-style 400
    before vLLM sees them; a request within the limit passes through."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from slimwise.serving.plan_select import MAX_N_ENV, PLAN_MODELS_ENV, PlanSelectMiddleware, served_names

    async def echo(request: Request):
        return JSONResponse({"model": "m", "n": (await request.json()).get("n")})

    monkeypatch.delenv(PLAN_MODELS_ENV, raising=False)
    if plans:
        monkeypatch.setenv(PLAN_MODELS_ENV, json.dumps(served_names("m", ["math"])))
    monkeypatch.setenv(MAX_N_ENV, "4")
    app = PlanSelectMiddleware(Starlette(routes=[Route("/v1/chat/completions", echo, methods=["POST"])]))
    for raw, words in ((b"[" * 100_000, "not valid JSON"),
                       (b'{"model": "m", "messages": [' * 50_000, "not valid JSON"),
                       (b'{"model": ', "not valid JSON"), (b"[1]", "must be a JSON object"),
                       (b"\xff", "not UTF-8"),
                       (b'{"model": "m", "n": 5}', "limit of 4 completions"),
                       (b'{"model": "m", "best_of": 100}', "limit of 4 completions")):
        status, body = _post_raw(app, raw, "/v1/chat/completions")
        assert status == 400 and words in body["error"]["message"], (raw[:40], body)
        assert body["error"]["code"] == 400 and body["error"]["type"] == "invalid_request_error"
    assert _post_raw(app, b'{"model": "m", "n": 4}', "/v1/chat/completions") == (200, {"model": "m", "n": 4})
