"""CUDA-graph safety of every per-step hook SlimWise installs, checked on the CPU.

A served model is traced once (torch.compile, then CUDA-graph capture on a GPU) and replayed every step; what
changes per step is only the contents of fixed-address buffers that `DecodeRouting.set_step` fills in place
(`decode_mask`, `row_plan`; per gate `slimwise_pruned` is indexed by them). A hook that branched in Python on
per-step state would freeze that branch at trace time (once, a naive mask silently masked nothing). Each case
below installs one hook kind through the product's own entry points (`DecodeRouting`, a delta directory, a
statistics file, a gates file) on a model with vLLM's module layout and vLLM's own router (CPURouter) and
norms, then:

1. sets step state A and runs eager, torch.compile(fullgraph=True, backend="aot_eager") and a make_fx trace;
   the compiled and traced callables are built under A, the trace-time state;
2. changes the buffers in place to states B, C, ... (other decode rows, other plans, all prompt, all decode,
   uniform mode, a dummy step) and replays the same callables: each must equal eager bit for bit (float32,
   same aten ops in the same order), and torch.compile must not have recompiled (a recompile re-traces and
   would hide a frozen branch); make_fx has no guards at all, like vLLM's guard-free compiled graph;
3. asserts each state's eager output differs from the trace-time state's and from the previous state's, so a
   hook frozen at trace time (or reading a stale step) could not pass.

The row counter (`row_counts.install_row_counter`, a custom op that adds to `DecodeRouting.rows_seen`) rides
on the first pruning gate: each replay must add the rows of the state it ran, as eager does. Two cases use a
symbolic token count (vLLM's compiled graph serves every batch size), torch.compile only. The expert-counting
hook (COUNT_EXPERTS_KEY) is eager only by design and adds no guard on per-step state
(`test_counting_hook_adds_no_guard`: it did, before its pause check came first).

No engine is started (the engines' compiled runs are in tests/test_vllm_plugin.py and
tests/test_testbed_shipped.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.fx.experimental.proxy_tensor import make_fx
from transformers import PretrainedConfig

from slimwise.plan import PrunePlan
from slimwise.serving.routing import (
    BUDGET_KEY,
    COUNT_EXPERTS_KEY,
    DELTA_KEY,
    FALLBACK_KEY,
    GATES_KEY,
    PLAN_KEY,
    PLANS_KEY,
    PRUNED_GATES_KEY,
    SUBSTITUTES_KEY,
    DecodeRouting,
)

H = 16  # hidden size
N = 6  # tokens per step (fixed, as in a captured CUDA graph)


# ----- a model with vLLM's module layout ------------------------------------------------------------------


class Gate(nn.Module):
    """vLLM's ReplicatedLinear as an MoE gate: (logits, None)."""

    def __init__(self, experts: int, gen: torch.Generator):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, H, generator=gen))

    def forward(self, x):
        return F.linear(x, self.weight), None


class Experts(nn.Module):
    """FusedMoE's shape: `.router` (vLLM's CPURouter) routes the gate's logits, the experts are dense here."""

    def __init__(self, router, experts: int, gen: torch.Generator):
        super().__init__()
        self.router = router
        self.w = nn.Parameter(torch.randn(experts, H, H, generator=gen) / H ** 0.5)

    def forward(self, hidden_states, router_logits):
        weights, ids = self.router.select_experts(hidden_states=hidden_states, router_logits=router_logits)
        out = torch.einsum("nh,nkhd->nkd", hidden_states, self.w[ids.long()])
        return torch.einsum("nk,nkd->nd", weights.float(), out)


class MoEBlock(nn.Module):
    def __init__(self, router, experts: int, gen: torch.Generator):
        super().__init__()
        self.gate = Gate(experts, gen)
        self.experts = Experts(router, experts, gen)

    def forward(self, x):
        logits, _ = self.gate(x)
        return self.experts(hidden_states=x, router_logits=logits)


class ParallelLinear(nn.Module):
    """vLLM's QKVParallelLinear / RowParallelLinear shape at TP 1: (out, bias or None), `output_sizes`."""

    def __init__(self, output_sizes: list[int], bias: bool, gen: torch.Generator):
        super().__init__()
        self.output_sizes = output_sizes
        self.skip_bias_add = False
        self.weight = nn.Parameter(torch.randn(sum(output_sizes), H, generator=gen) / H ** 0.5)
        self.bias = nn.Parameter(torch.randn(sum(output_sizes), generator=gen)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias), None


class Attention(nn.Module):
    def __init__(self, gen):
        super().__init__()
        self.qkv_proj = ParallelLinear([H, H, H], True, gen)
        self.o_proj = ParallelLinear([H], False, gen)

    def forward(self, x):
        q, k, v = self.qkv_proj(x)[0].split(H, dim=-1)
        return self.o_proj(torch.tanh(q) * k + v)[0]


class Layer(nn.Module):
    def __init__(self, router, experts: int, norm: nn.Module, fused_norm: bool, gen):
        super().__init__()
        self.self_attn = Attention(gen)
        self.post_attention_layernorm = norm
        self.fused_norm = fused_norm
        self.mlp = MoEBlock(router, experts, gen)

    def forward(self, h, residual):
        attn = self.self_attn(h)
        if self.fused_norm:  # vLLM's decoder layers: norm(x, residual) -> (normed, x + residual)
            normed, residual = self.post_attention_layernorm(attn, residual)
        else:
            residual = attn + residual
            normed = self.post_attention_layernorm(residual)
        return self.mlp(normed), residual


class Model(nn.Module):
    """`model.layers.{i}.{self_attn.qkv_proj, post_attention_layernorm, mlp.gate, mlp.experts.router}`."""

    def __init__(self, make_router, experts: int, layers: int = 2, norm: str = "rms", seed: int = 0):
        super().__init__()
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Parameter(torch.randn(H, H, generator=gen) / H ** 0.5)
        self.model = nn.Module()
        with set_current_vllm_config(VllmConfig()):  # vLLM's CustomOp norms read it when built
            norms = [GemmaRMSNorm(H) if norm == "gemma" else RMSNorm(H) for _ in range(layers)]
        for n in norms:
            with torch.no_grad():
                n.weight.copy_(1.0 + 0.1 * torch.randn(H, generator=gen))
        self.model.layers = nn.ModuleList(Layer(make_router(), experts, n, norm == "rms", gen) for n in norms)

    def forward(self, x):
        h = residual = x @ self.embed  # fresh tensors: vLLM's fused norm may write its inputs in place
        for layer in self.model.layers:
            h, residual = layer(h, residual)
        return h + residual


def softmax_router(experts: int = 8, top_k: int = 2, renormalize: bool = True):
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    return lambda: CPURouter(top_k=top_k, global_num_experts=experts, renormalize=renormalize)


def deepseek_router():
    """DeepSeek-V3's: sigmoid scores, a correction bias that steers the selection, 4 groups of 4, 2 chosen."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    gen = torch.Generator().manual_seed(1)

    def make():
        return CPURouter(top_k=4, global_num_experts=16, use_grouped_topk=True, num_expert_group=4,
                         topk_group=2, renormalize=True, scoring_func="sigmoid", routed_scaling_factor=2.5,
                         e_score_correction_bias=0.5 * torch.randn(16, generator=gen))

    return make


# ----- plans and step states --------------------------------------------------------------------------------

KEPT = {0: [0, 2, 4, 6], 1: [1, 3, 5, 7]}
OTHER = {0: [1, 3, 5, 7], 1: [0, 2, 4, 6]}
DEEPSEEK_KEPT = {0: [0, 1, 6, 7, 9, 10, 12, 15], 1: [2, 3, 4, 5, 8, 11, 13, 14]}


def plan(kept=KEPT, experts=8, top_k=2, family="qwen3_moe") -> dict:
    return PrunePlan(family=family, num_experts=experts, top_k=top_k, kept_experts=kept).to_dict()


def config(experts=8, top_k=2, **settings) -> PretrainedConfig:
    return PretrainedConfig(num_experts=experts, num_experts_per_tok=top_k, hidden_size=H, **settings)


@dataclass
class Step:
    """One step's scheduler view: per token its position and its request's prompt length (and plan)."""

    name: str
    positions: list[int]
    prompt_lens: list[int]
    plans: list[int] | None = None
    mode: str = "slimwise"  # DecodeRouting's mode ("full", "slimwise", "uniform"), switched to first
    dummy: bool = False  # a forward without requests (warm-up, CUDA-graph capture): `set_dummy_step`

    def apply(self, routing: DecodeRouting) -> None:
        if routing.mode != self.mode:
            routing.set_mode(self.mode)
        if self.dummy:
            routing.set_dummy_step()
            return
        routing.set_step(np.array(self.positions), np.array(self.prompt_lens), torch.tensor(self.positions),
                         None if self.plans is None else np.array(self.plans))


LENS = [5, 4, 7, 3, 2, 6]
MIXED_A = Step("mixed-A", [5, 1, 7, 9, 0, 3], LENS)  # tokens 0, 2, 3 generated; 1, 4, 5 prompt
MIXED_B = Step("mixed-B", [2, 6, 0, 1, 4, 8], LENS)  # tokens 1, 4, 5 generated
ALL_PROMPT = Step("all-prompt", [0, 1, 2, 0, 1, 2], [8] * N)
ALL_DECODE = Step("all-decode", [9] * N, [1] * N)
UNIFORM = Step("uniform", [0, 1, 2, 0, 1, 2], [8] * N, mode="uniform")  # prompt tokens pruned too
DUMMY = Step("dummy", [], [], dummy=True)
STATES = [MIXED_A, MIXED_B, ALL_PROMPT, ALL_DECODE]


# ----- the check --------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _x(seed: int = 0, n: int = N) -> torch.Tensor:
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed))


def _run(fn, x, routing):
    """fn(x) and what it added to the row counter."""
    before = routing.rows_seen.clone()
    out = fn(x)
    return out, routing.rows_seen - before


def check_replays(model: nn.Module, routing: DecodeRouting, states: list, inputs=None,
                  counted: bool = True, dynamic: bool = False) -> list[torch.Tensor]:
    """Trace under states[0], replay under every state (buffers changed in place); equal to eager each time,
    no recompile, and the states' outputs differ. `inputs`: one input per state (default: the same input);
    `counted`: the row counter is installed (a pruning gate); `dynamic`: a symbolic token count (vLLM's
    compiled graph), traced once for steps of several sizes. Returns the eager outputs."""
    inputs = inputs or [_x()] * len(states)
    with torch.no_grad():
        states[0].apply(routing)
        backend = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        if dynamic:  # the token count symbolic, as vLLM marks it
            torch._dynamo.mark_dynamic(inputs[0], 0)
        compiled(inputs[0])  # compiled under the first state
        assert backend.frame_count == 1
        callables = [("torch.compile", compiled)]
        if not dynamic:  # no guards at all: every branch frozen as it went under state 0
            callables.append(("make_fx", make_fx(model)(inputs[0])))
        outs, rows, plan_rows = [], [], []
        for step, x in zip(states, inputs, strict=True):
            step.apply(routing)
            plan_rows.append(routing.row_plan[: x.shape[0]].clone())
            want, want_rows = _run(model, x, routing)
            for name, fn in callables:
                got, got_rows = _run(fn, x, routing)
                assert torch.equal(got, want), f"{name} under {step.name}: not the eager output"
                assert torch.equal(got_rows, want_rows), f"{name} under {step.name}: rows counted {got_rows}"
            outs.append(want)
            rows.append(want_rows)
        assert backend.frame_count == 1, "recompiled: a guard on per-step state (a frozen branch in a graph)"
    if counted:  # the row counter added the rows of the state that ran, per plan row
        assert routing.counted_layer is not None
        for step, r, plans in zip(states, rows, plan_rows, strict=True):
            assert torch.equal(r[0], torch.bincount(plans, minlength=r.shape[1])), step.name
            # masked rows (a -inf logit): only rows routed with a plan, and those all masked where the plan
            # prunes experts without a fallback (the fallback may hand a row every expert back)
            assert r[1, 0] == 0 and (r[1] <= r[0]).all(), step.name
    else:  # (no counter, or not in the traced computation: every replay added nothing, as eager did)
        assert not any(r.any() for r in rows)
    # a hook frozen at trace time would give state 0's output, or (stale buffers) the previous state's
    for i in range(1, len(states)):
        for j in {0, i - 1}:
            assert not torch.equal(outs[i], outs[j]), f"{states[i].name} and {states[j].name} gave one output"
    return outs


def routed(make_router, settings: dict, experts=8, top_k=2, norm="rms", **cfg) -> tuple[Model, DecodeRouting]:
    model = Model(make_router, experts, norm=norm).eval()
    return model, DecodeRouting(model, config(experts, top_k, **settings, **cfg), max_tokens=32)


# ----- the gate mask and its plans --------------------------------------------------------------------------


def test_plain_gate_mask():
    model, routing = routed(softmax_router(), {PLAN_KEY: plan()})
    assert routing.hooked["gates"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    check_replays(model, routing, [MIXED_A, MIXED_B, ALL_DECODE, ALL_PROMPT, UNIFORM, DUMMY])


def test_multi_plan_rows():
    """Per-token plan rows: the same tokens routed with plan a, b or full between replays."""
    model, routing = routed(softmax_router(), {PLANS_KEY: {"a": plan(KEPT), "b": plan(OTHER)}})
    positions = [9] * N
    check_replays(model, routing, [
        Step("plans-a-b-full", positions, [1] * N, [1, 2, 0, 1, 2, 0]),
        Step("plans-b-a-a", positions, [1] * N, [2, 1, 1, 2, 0, 1]),
        Step("plan-b-mixed", MIXED_A.positions, LENS, [2] * N),
        Step("plans-none-decode", ALL_PROMPT.positions, [8] * N, [1, 2, 1, 2, 1, 2]),
    ])


def test_load_aware_threshold():
    """`min_decode_batch` zeroes the step's rows on the host: the same graph then routes every row full."""
    model, routing = routed(softmax_router(), {PLAN_KEY: plan()})
    routing.set_mode("slimwise", min_decode_batch=4)
    # 3 generated tokens: under the threshold, all full; 6: pruned
    check_replays(model, routing, [MIXED_A, ALL_DECODE, Step("5-decode", [9, 9, 9, 9, 9, 0], [1] * 5 + [8])])


SIZED = [Step("6-mixed-A", MIXED_A.positions, LENS), Step("4-mixed", [2, 6, 7, 1], [5, 4, 7, 3]),
         Step("6-mixed-B", MIXED_B.positions, LENS), Step("5-all-decode", [9] * 5, [1] * 5)]


@pytest.mark.parametrize("case", ["drop-fallback", "deepseek"])
def test_symbolic_token_count(case):
    """vLLM compiles for a symbolic number of tokens (and captures CUDA graphs per size): one trace serves
    steps of 6, 4 and 5 tokens, slicing the step buffers with the symbolic size."""
    if case == "deepseek":
        model, routing = routed(deepseek_router(), {PLAN_KEY: plan(DEEPSEEK_KEPT, 16, 4, "deepseek_v3")},
                                experts=16, top_k=4)
    else:
        model, routing = routed(softmax_router(), {PLAN_KEY: plan(), GATES_KEY: "drop", FALLBACK_KEY: 0.4})
    check_replays(model, routing, SIZED, inputs=[_x(0, len(s.positions)) for s in SIZED], dynamic=True)


# ----- gate variants and the fallback (`_gated`, the pre-routed router, substitution) -----------------------


@pytest.mark.parametrize(("gates", "fallback"), [("renorm", 0.3), ("drop", 0.4)])
def test_gate_variants_and_fallback(gates, fallback):
    settings = {PLAN_KEY: plan(), GATES_KEY: gates, FALLBACK_KEY: fallback}
    # renorm on a router that does not renormalize its top-k (Qwen2-MoE, OLMoE), drop on one that does
    model, routing = routed(softmax_router(renormalize=gates == "drop"), settings)
    assert not routing.gates.plain
    check_replays(model, routing, STATES)


def _substitutes(tmp_path, experts=8) -> str:
    from slimwise.stats import ExpertStats

    stats = ExpertStats.zeros([0, 1], experts)
    stats.count.fill_(2.0)
    stats.output_sum = torch.randn(2, experts, H, generator=torch.Generator().manual_seed(3),
                                   dtype=torch.float64)
    return str(stats.save(tmp_path / "sums.safetensors"))


def test_substitute_gates(tmp_path):
    settings = {PLAN_KEY: plan(), GATES_KEY: "substitute", FALLBACK_KEY: 0.5,
                SUBSTITUTES_KEY: _substitutes(tmp_path)}
    model, routing = routed(softmax_router(), settings)
    assert routing.hooked["substitution"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    check_replays(model, routing, STATES)


# ----- batch budgets: each step's S from the step's own rows (`decode_gate_ops.budget_allowed`) -------------


@pytest.mark.parametrize("budget", [{"budget": 3}, {"extra": 1}, {"budget_share": 0.375, "fallback": 0.8}])
def test_batch_budget(budget):
    """S depends on the step's decode rows (which rows, which plan), all in tensors: every state replays."""
    settings = {PLANS_KEY: {"a": plan(KEPT), "b": plan(OTHER)},
                BUDGET_KEY: {k: v for k, v in budget.items() if k != "fallback"},
                **({FALLBACK_KEY: budget["fallback"]} if "fallback" in budget else {})}
    model, routing = routed(softmax_router(), settings)
    assert routing.gates.budgeted
    positions = [9] * N
    check_replays(model, routing, [*STATES, Step("plans-a-b-full", positions, [1] * N, [1, 2, 0, 1, 2, 0]),
                                   Step("plans-b-a-a", positions, [1] * N, [2, 1, 1, 2, 0, 1])])


def test_batch_budget_symbolic_token_count():
    model, routing = routed(deepseek_router(), {PLAN_KEY: plan(DEEPSEEK_KEPT, 16, 4, "deepseek_v3"),
                                                BUDGET_KEY: {"budget": 6}}, experts=16, top_k=4)
    check_replays(model, routing, SIZED, inputs=[_x(0, len(s.positions)) for s in SIZED], dynamic=True)


# ----- DeepSeek-V3: the selection mask (`masked_grouped_topk`) ----------------------------------------------


@pytest.mark.parametrize(("gates", "fallback"), [("renorm", None), ("drop", 0.4)])
def test_deepseek_selection_mask(gates, fallback):
    settings = {PLAN_KEY: plan(DEEPSEEK_KEPT, 16, 4, "deepseek_v3"), GATES_KEY: gates, FALLBACK_KEY: fallback}
    model, routing = routed(deepseek_router(), settings, experts=16, top_k=4)
    assert routing.hooked["selection"] == ["model.layers.0.mlp.experts.router",
                                           "model.layers.1.mlp.experts.router"]
    check_replays(model, routing, STATES)


# ----- a distilled delta: router rows, norms, LoRA on decode rows -------------------------------------------


def _delta(tmp_path, kept, tensors: dict, lora_scale: float = 2.0) -> str:
    from slimwise.delta import DELTA_FORMAT, Delta, plan_hash

    manifest = {"format": DELTA_FORMAT, "mode": "slimwise", "plan_hash": plan_hash(PrunePlan.from_dict(
        plan(kept))), "params": ["router", "norm", "lora"], "lora": {"scale": lora_scale}}
    return str(Delta(tensors, manifest).save(tmp_path / "delta"))


def _delta_tensors(kinds: set[str]) -> dict:
    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for i in range(2):
        if "router" in kinds:
            tensors[f"layers.{i}.router.weight"] = torch.randn(8, H, generator=gen)
        if "norm" in kinds:
            tensors[f"layers.{i}.moe_norm.weight"] = 1.0 + 0.5 * torch.randn(H, generator=gen)
        if "lora" in kinds:
            for leaf in ("q_proj", "v_proj", "o_proj"):
                prefix = f"lora.model.layers.{i}.self_attn.{leaf}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(2, H, generator=gen) / 4
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(H, 2, generator=gen) / 4
    return tensors


EVERY_EXPERT = {0: list(range(8)), 1: list(range(8))}  # a plan that prunes nothing: the delta's hooks alone
LAYER_1 = {1: KEPT[1]}  # prunes layer 1 only: layer 0 runs the delta's hooks alone


class FirstLayer(nn.Module):
    """Layer 0 of `model` alone (its MoE block's output): what its norm hook feeds."""

    def __init__(self, model: Model):
        super().__init__()
        self.model = model

    def forward(self, x):
        h = x @ self.model.embed
        return self.model.model.layers[0](h, h.clone())[0]


@pytest.mark.parametrize(("kinds", "kept", "norm"), [
    ({"router"}, EVERY_EXPERT, "rms"),
    # norms alone arm no step state (`DecodeRouting.active` counts gates and LoRA; `slimwise distill` refuses
    # a plan that prunes nothing): a plan that prunes layer 1, and layer 0 checked alone
    ({"norm"}, LAYER_1, "rms"),  # vLLM's fused-add RMSNorm: (normed, x + residual)
    ({"norm"}, LAYER_1, "gemma"),  # GemmaRMSNorm (Qwen3.5/3.6-MoE), called without the residual
    ({"lora"}, EVERY_EXPERT, "rms"),
    ({"router", "norm", "lora"}, KEPT, "rms"),  # a served delta: all of it, with the plan's mask
], ids=["router", "norm", "gemma-norm", "lora", "router-norm-lora-masked"])
def test_distilled_delta(kinds, kept, norm, tmp_path, monkeypatch):
    import vllm.distributed

    # `delta_hooks.install_lora` refuses tensor parallelism; no TP group exists without an engine
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: 1)
    settings = {PLAN_KEY: plan(kept), DELTA_KEY: _delta(tmp_path, kept, _delta_tensors(kinds))}
    model, routing = routed(softmax_router(), settings, norm=norm)
    routing.merge_lora()  # what the served model's load_weights does
    hooked = {kind for kind, names in routing.hooked.items() if names}
    want = {"router": "gates", "norm": "norms", "lora": "lora"}
    assert hooked == {want[k] for k in kinds} | ({"gates"} if kept != EVERY_EXPERT else set())
    if "lora" in kinds:
        assert sorted(routing.lora_modules) == [f"model.layers.{i}.self_attn.{p}" for i in range(2)
                                                for p in ("o_proj", "qkv_proj")]
    if kept == LAYER_1:
        assert routing.hooked["gates"] == ["model.layers.1.mlp.gate"]
        check_replays(FirstLayer(model), routing, STATES, counted=False)
    else:
        check_replays(model, routing, STATES, counted=kept == KEPT)


# ----- the expert-counting hook (COUNT_EXPERTS_KEY: eager only) ---------------------------------------------


def test_counting_hook_leaves_the_graph_alone():
    """Counting is documented as eager only (skipped while torch.compile traces): the compiled graph routes
    as eager does and the row counter counts the state replayed; the host-side counts come from eager runs
    only. Recompiles are checked in `test_counting_hook_adds_no_guard`."""
    model, routing = routed(softmax_router(), {PLAN_KEY: plan(), COUNT_EXPERTS_KEY: True})
    states = [MIXED_A, ALL_PROMPT, MIXED_B]
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        outs = []
        for step in states:
            step.apply(routing)
            want, want_rows = _run(model, _x(), routing)
            counted = dict(routing.counters.experts_counted_steps)
            got, got_rows = _run(compiled, _x(), routing)
            assert torch.equal(got, want) and torch.equal(got_rows, want_rows), step.name
            assert routing.counters.experts_counted_steps == counted  # the compiled run counted nothing
            outs.append(want)
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    assert routing.counters.experts_counted_steps == {0: 2, 1: 2}  # the two eager steps with decode rows


def test_counting_hook_adds_no_guard():
    """A guard on per-step state is a branch that vLLM's guard-free compiled graph freezes."""
    model, routing = routed(softmax_router(), {PLAN_KEY: plan(), COUNT_EXPERTS_KEY: True})
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with torch.no_grad():
        for step in (MIXED_A, ALL_PROMPT):
            step.apply(routing)
            compiled(_x())
    assert backend.frame_count == 1


# ----- a pruned checkpoint's gates file (`--gates drop/substitute` on the decode instance) ------------------


def _gates_file(tmp_path, gates: str) -> str:
    """A gates file as `slimwise.gate_sidecar.write_gate_sidecar` writes it, for KEPT of 8 experts."""
    import json

    from safetensors.torch import save_file

    from slimwise.gate_sidecar import FORMAT

    gen = torch.Generator().manual_seed(7)
    tensors = {}
    for layer, kept in KEPT.items():
        pruned = sorted(set(range(8)) - set(kept))
        tensors[f"{layer}.kept"] = torch.tensor(kept, dtype=torch.int64)
        tensors[f"{layer}.pruned"] = torch.tensor(pruned, dtype=torch.int64)
        tensors[f"{layer}.rows"] = torch.randn(len(pruned), H, generator=gen)
        if gates == "substitute":
            tensors[f"{layer}.vectors"] = torch.randn(len(pruned), H, generator=gen)
    head = {"format": FORMAT, "gates": gates, "num_experts": 8, "top_k": 2, "family": "qwen3_moe",
            "layers": sorted(KEPT)}
    save_file(tensors, str(tmp_path / "gates.safetensors"), metadata={"slimwise": json.dumps(head)})
    return str(tmp_path / "gates.safetensors")


@pytest.mark.parametrize("gates", ["drop", "substitute"])
def test_pruned_checkpoint_gates_file(gates, tmp_path):
    """The decode instance of a pruned checkpoint (4 of 8 experts kept) routes every row with the full
    router: its hooks read no per-step buffer (`set_step` is a no-op there), so the replays vary the input
    and check that nothing of the trace-time routing was kept."""
    model, routing = routed(softmax_router(experts=4), {PRUNED_GATES_KEY: _gates_file(tmp_path, gates)},
                            experts=4)
    assert routing.hooked["gates"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert not routing.active
    check_replays(model, routing, STATES, inputs=[_x(seed) for seed in range(len(STATES))], counted=False)
