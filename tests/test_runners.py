"""The per-step seams of vLLM's two model runners (slimwise/serving/runners.py), with vLLM's own objects.

vLLM 0.32's CPU build runs only the V1 runner, but its wheel holds Model Runner V2's Python: here V2's real
`DefaultModelState`, `InputBatch` and `NewRequestData` and V1's patched `_model_forward` are driven through
the same schedules (chunked prefill, a prefix-cache hit, a one-token prompt, preemption and recompute, mixed
plans, dummy steps), and the rows each marks as a plan's decode rows must equal the rule itself: a token is
generated iff its position is at or past its request's prompt length. The engines' own tests
(tests/test_vllm_*.py, tests/test_fail_closed.py) run the V1 path end to end.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import GateModel
from transformers import PretrainedConfig

from slimwise.errors import SlimWiseError
from slimwise.plan import PrunePlan
from slimwise.serving.routing import PLANS_KEY, REQUEST_PLAN_ARG, DecodeRouting
from slimwise.serving.runners import model_state_cls, patch_v1_runner, pin_v1_runner, step_rows

pytestmark = pytest.mark.slow

BUDGET = 16  # tokens per step: prompts longer than the rest of a step's budget are chunked


def _plan(kept):
    return PrunePlan(family="qwen3_moe", num_experts=8, top_k=2, kept_experts={0: kept, 1: kept}).to_dict()


def _routing() -> DecodeRouting:
    config = PretrainedConfig(num_experts=8, num_experts_per_tok=2,
                              **{PLANS_KEY: {"a": _plan([0, 1, 2, 3]), "b": _plan([4, 5, 6, 7])}})
    return DecodeRouting(GateModel(), config, max_tokens=64)


@dataclasses.dataclass
class Req:
    rid: str
    prompt: int  # prompt length
    plan: str | None  # the request's plan name (None: the engine's default)
    max_tokens: int
    computed: int = 0  # tokens whose KV exists (prefix-cache hits included)
    outputs: int = 0  # tokens generated so far


def schedule() -> list[tuple[list[tuple[Req, int, int]], list[Req], list[str]]]:
    """Steps of (rows: (request, num_computed, scheduled tokens) in batch order, requests added before the
    step, request ids removed before it), as vLLM's scheduler would produce them under a 16-token budget."""
    arrivals = {0: [Req("a", 7, "a", 4), Req("one", 1, None, 3), Req("long", 33, "b", 3)],
                2: [Req("hit", 12, "full", 3, computed=8), Req("pre", 5, "b", 6)]}
    live: list[Req] = []
    steps = []
    preempted = False
    for step in range(40):
        added = arrivals.get(step, [])
        live += added
        removed = []
        if step == 6 and not preempted:  # preempt "pre" mid-decode; it comes back and recomputes everything
            pre = next(r for r in live if r.rid == "pre")
            assert pre.outputs > 0
            live.remove(pre)
            removed.append(pre.rid)
            pre.computed, preempted = 0, True
            added = [*added, pre]
            live.append(pre)
        rows, budget = [], BUDGET
        for r in live:
            # a request with outputs recomputes prompt + outputs before decoding again (V1 and V2 alike)
            todo = r.prompt + r.outputs - r.computed
            n = min(max(todo, 1), budget)
            if n <= 0:
                continue
            rows.append((r, r.computed, n))
            budget -= n
        for r, _, n in rows:
            r.computed += n
            if r.computed >= r.prompt + r.outputs:
                r.outputs += 1
        done = [r for r in live if r.outputs >= r.max_tokens]
        steps.append((rows, added, removed))
        for r in done:
            live.remove(r)
        if not live and step > 2:
            break
    return steps


def truth(rows, plan_index) -> np.ndarray:
    """The rule: plan row of each scheduled token (0: every expert)."""
    out = []
    for r, computed, n in rows:
        for pos in range(computed, computed + n):
            out.append(plan_index[r.plan or "a"] if pos >= r.prompt else 0)
    return np.array(out, dtype=np.int64)


def _params(r: Req):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=r.max_tokens, extra_args={REQUEST_PLAN_ARG: r.plan} if r.plan else None)


def _v1_rows(routing, rows):
    """V1's patched `_model_forward` on the runner fields it reads."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    starts = np.concatenate([[0], np.cumsum([n for _, _, n in rows])]).astype(np.int32)
    runner = SimpleNamespace(
        _slimwise_routing=routing, model=lambda **kwargs: None, query_start_loc=SimpleNamespace(np=starts),
        requests={r.rid: SimpleNamespace(sampling_params=_params(r)) for r, _, _ in rows},
        input_batch=SimpleNamespace(num_reqs=len(rows), req_ids=[r.rid for r, _, _ in rows],
                                    num_computed_tokens_cpu=np.array([c for _, c, _ in rows]),
                                    num_prompt_tokens=np.array([r.prompt for r, _, _ in rows])))
    positions = torch.from_numpy(step_rows(starts, [c for _, c, _ in rows], [0] * len(rows))[0])
    GPUModelRunner._model_forward(runner, input_ids=None, positions=positions)
    routing.take_step()
    return routing.row_plan[: int(starts[-1])].numpy().copy()


@pytest.fixture(scope="module")
def v2_state_cls():
    """V2's real DefaultModelState (what `resolve_model_state_cls` picks for these models) with SlimWise's
    seam, over a VllmConfig built by vLLM for a tiny Qwen3-MoE checkpoint."""
    from tiny import save_tiny_model
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    model_dir = save_tiny_model("qwen3_moe", _tmp() / "tiny", seed=0)
    config = EngineArgs(model=str(model_dir), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                        skip_tokenizer_init=True).create_engine_config()

    def make(model):
        with set_current_vllm_config(config):
            return model_state_cls(config)(config, model, None, torch.device("cpu"))

    return make


def _tmp():
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp(prefix="slimwise-runners-"))


def _v2_batch(rows, slots: dict[str, int], buffers):
    from vllm.v1.worker.gpu.input_batch import InputBatch

    counts = [n for _, _, n in rows]
    batch = InputBatch.make_dummy(len(rows), sum(counts), buffers)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    positions = torch.from_numpy(step_rows(starts, [c for _, c, _ in rows], [0] * len(rows))[0])
    return dataclasses.replace(
        batch, req_ids=[r.rid for r, _, _ in rows],
        idx_mapping_np=np.array([slots[r.rid] for r, _, _ in rows]),
        query_start_loc_np=starts, num_computed_tokens_np=np.array([c for _, c, _ in rows], dtype=np.int32),
        positions=positions)


def test_v1_and_v2_seams_mark_exactly_the_generated_rows(v2_state_cls):
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.worker.gpu.input_batch import InputBuffers

    assert patch_v1_runner()
    v1, v2 = _routing(), _routing()
    state = v2_state_cls(SimpleNamespace(slimwise=v2))
    assert type(state).__name__ == "SlimWiseDefaultModelState" and v2.runner.startswith("V2")
    buffers = InputBuffers(8, 64, torch.device("cpu"))
    slots: dict[str, int] = {}
    steps = schedule()
    kinds = {"chunked": False, "mixed": False, "recompute": False}
    for rows, added, removed in steps:
        for rid in removed:
            state.remove_request(rid)
            slots.pop(rid)
        for r in added:  # V2 learns a request's prompt and plan once, when the scheduler adds it
            slots[r.rid] = min(set(range(8)) - set(slots.values()))
            state.add_request(slots[r.rid], NewRequestData(
                req_id=r.rid, prompt_token_ids=list(range(1, r.prompt + 1)), mm_features=[],
                sampling_params=_params(r), pooling_params=None, block_ids=([],),
                num_computed_tokens=r.computed,
                # a preempted request comes back with its outputs in the tokens to prefill again
                lora_request=None, prefill_token_ids=list(range(1, r.prompt + r.outputs + 1))))
        want = truth(rows, v1.plan_index)
        assert np.array_equal(_v1_rows(v1, rows), want)
        batch = _v2_batch(rows, slots, buffers)
        state.preprocess_state(batch, (), None, None)
        state.prepare_inputs(batch, None)
        v2.take_step()
        assert np.array_equal(v2.row_plan[: len(want)].numpy(), want)
        assert not v2.row_plan[len(want):].any()
        kinds["chunked"] |= any(c and c < r.prompt for r, c, _ in rows)
        kinds["mixed"] |= bool((want > 0).any() and (want == 0).any())
        kinds["recompute"] |= any(r.rid == "pre" and c < r.prompt + r.outputs - 1 and r.outputs
                                  for r, c, _ in rows)
    assert all(kinds.values()), kinds
    assert len(steps) > 8
    # every plan's decode rows were seen, and the same number by both seams
    assert v1.counters.pruned_tokens == v2.counters.pruned_tokens > 0
    assert v1.counters.plan_tokens == v2.counters.plan_tokens and set(v2.counters.plan_tokens) == {"a", "b"}


def test_a_dummy_forward_routes_every_row_with_every_expert(v2_state_cls):
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    routing = _routing()
    state = v2_state_cls(SimpleNamespace(slimwise=routing))
    routing.set_step(np.array([5, 6]), np.array([1, 1]), None, np.array([1, 2]))
    routing.take_step()
    assert routing.row_plan[:2].tolist() == [1, 2]
    # a dummy batch (no preprocess_state: profiling, DP padding) and a capture (prepare_dummy_inputs)
    state.prepare_inputs(InputBatch.make_dummy(2, 2, InputBuffers(8, 64, torch.device("cpu"))), None)
    routing.take_step()
    assert not routing.row_plan.any() and not routing.decode_mask.any()
    state.prepare_dummy_inputs(2, 2)
    routing.take_step()
    assert routing.counters.dummy_steps == 2


def test_a_forward_without_step_state_raises():
    routing = _routing()
    with pytest.raises(SlimWiseError, match="without SlimWise's per-step state"):
        routing.take_step()  # no seam ran
    routing.set_step(np.array([0, 1]), np.array([1, 1]))
    routing.take_step()
    with pytest.raises(SlimWiseError, match="model runner: unknown"):
        routing.take_step()  # the state of a step serves one forward, never the next


def test_v1_is_pinned_unless_the_user_chose():
    env = {}
    assert pin_v1_runner(env) == "0" and env == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert pin_v1_runner({"VLLM_USE_V2_MODEL_RUNNER": "1"}) == "1"


def test_hybrids_get_the_mamba_state():
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

    config = SimpleNamespace(model_config=SimpleNamespace(is_hybrid=True, is_attention_free=False))
    cls = model_state_cls(config)
    assert issubclass(cls, MambaHybridModelState) and cls.__name__ == "SlimWiseMambaHybridModelState"
    assert model_state_cls(config) is cls
