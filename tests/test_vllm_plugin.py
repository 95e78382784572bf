"""The SlimWise vLLM plugin on real vLLM engines (CPU): PD-colocated decode-only routing.

Greedy tokens must equal the reference engine's for the same token-id prompts; routing counters prove that
every prompt token (chunked-prefill chunks, a 1-token last chunk, 1-token prompts, prefix-cache recomputes)
used all experts and every generated token fed back used the kept ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_INIT, random_prompts
from tiny import build_tiny_model

from slimwise.adapters import get_adapter
from slimwise.calibrate import CalibrationConfig, calibrate
from slimwise.criteria import plan_from_stats
from slimwise.decode_gates import DecodeGates
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.engines.vllm_engine import VllmEngine
from slimwise.masking import ExpertMask
from slimwise.models import load_model
from slimwise.trainable import ATTENTION_TARGETS, DENSE_MLP_TARGETS

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.vllm_in_process]

CONFIG = GenerationConfig(max_new_tokens=12, eos_token_id=-1, batch_size=16)
# lengths: a 1-token prompt, short ones, and 33 (= one 32-token chunk + a 1-token last chunk when chunked)
PROMPTS = random_prompts(8, seed=5, lengths=(5, 9, 1, 14, 3, 7, 33, 2))


#: tiny-config overrides a family needs to load in vLLM on CPU: the CPU MLA decode kernel only takes the real
#: latent size (kv_lora_rank + qk_rope_head_dim = 576)
VLLM_TINY = {"deepseek_v3": dict(kv_lora_rank=512, qk_rope_head_dim=64)}
#: engine dtype where float32 does not run: vLLM's CPU Gated DeltaNet kernel asserts bfloat16
VLLM_DTYPE = {"qwen3_next": "bfloat16"}
#: bf16 engine vs float32 reference: mean log-prob gap (nats) allowed between vLLM's greedy tokens and the
#: reference's best tokens under the promised routing, and the least mean gap the other routing must show. A
#: mean, not a per-token bound: one token can differ by a few tenths of a nat from bf16 rounding alone, which
#: says nothing about routing. Both bounds sit well clear of the measured means
#: (docs/history/test-tolerances.md).
BF16_MEAN_GAP = 0.15
BF16_WRONG_GAP = 0.5


def totals(counters: list[dict]) -> tuple[int, int]:
    c = counters[0]
    # the host-side positions that classify tokens equal the positions vLLM gave the model, on every step
    assert c.get("position_mismatch_steps") == 0, c.get("position_mismatch_steps")
    return c.get("pruned_tokens", 0), c.get("full_tokens", 0)


def set_selection_bias(model, scale: float = 0.3) -> None:
    """Real DeepSeek-V3 checkpoints carry a non-zero e_score_correction_bias (init leaves zeros,
    with which masking the logits would happen to be enough); 0.3 makes logit masking pick
    pruned experts on these prompts."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in get_adapter(model).moe_layers(model):
            bias = layer.router.e_score_correction_bias
            bias.copy_(scale * torch.randn(bias.shape, generator=gen))


@pytest.fixture(scope="module")
def model_dirs(tiny_dirs, tmp_path_factory):
    """family -> a tiny checkpoint that vLLM loads on CPU (the shared tiny one
    unless VLLM_TINY says otherwise)."""
    cache = {}

    def get(family):
        if family not in VLLM_TINY:
            return tiny_dirs(family)
        if family not in cache:
            model = build_tiny_model(family, seed=0, initializer_range=TINY_INIT, **VLLM_TINY[family])
            if family == "deepseek_v3":
                set_selection_bias(model)
            cache[family] = tmp_path_factory.mktemp("vllm-tiny") / family
            model.save_pretrained(cache[family])
        return cache[family]

    return get


@pytest.fixture(scope="module")
def setup(model_dirs):
    """family -> (model dir, plan at 50% REAP, reference tokens per mode)."""
    cache = {}

    def get(family):
        if family not in cache:
            model = load_model(model_dirs(family))
            stats = calibrate(model, random_prompts(8, seed=1), config=CalibrationConfig(max_new_tokens=8),
                              progress=False)
            plan = plan_from_stats(stats, "reap", 0.5)
            engine = PhaseSplitEngine(model, plan=plan)
            ref = {m: [o.token_ids for o in engine.generate(PROMPTS, m, CONFIG)]
                   for m in ("full", "slimwise", "uniform")}
            cache[family] = (model_dirs(family), plan, ref, stats)
        return cache[family]

    return get


def test_colocated_equals_reference_with_exact_counters(setup):
    model_dir, plan, ref, _ = setup("qwen3_moe")
    assert ref["slimwise"] != ref["full"]
    # one engine, the mode switched in place (slimwise_set_mode): what `slimwise eval --engine vllm` runs
    engine = VllmEngine(model_dir, plan, share_engine=True)
    n_prompt = sum(len(p) for p in PROMPTS)
    n_fed_back = sum(len(t) - 1 for t in ref["slimwise"])
    try:
        assert [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG)] == ref["slimwise"]
        assert totals(engine.counters()) == (n_fed_back, n_prompt)  # prompt tokens never pruned
        assert [o.token_ids for o in engine.generate(PROMPTS, "uniform", CONFIG)] == ref["uniform"]
        assert totals(engine.counters()) == (n_prompt + n_fed_back, 0)  # counters restart with the mode
        # full: the SlimWise class with nothing masked gives the reference's full-model tokens
        assert [o.token_ids for o in engine.generate(PROMPTS, "full", CONFIG)] == ref["full"]
        assert totals(engine.counters()) == (0, n_prompt + sum(len(t) - 1 for t in ref["full"]))
        # and back: the prefix cache was reset, so no block computed under another mode is reused
        assert [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG)] == ref["slimwise"]
        assert engine.llm.collective_rpc("slimwise_set_mode", args=("slimwise", 3)) == [
            {"mode": "slimwise", "min_decode_batch": 3}]
        with pytest.raises(Exception, match="unknown mode 'half'"):
            engine.llm.collective_rpc("slimwise_set_mode", args=("half",))
    finally:
        engine.close()


def test_several_plans_in_one_engine_route_each_request_with_its_own(setup):
    """Two plans and full in one engine, chosen per request: every request's tokens equal the
    reference engine's slimwise mode with its plan, whether its batch is homogeneous or mixes plans
    (float32: exact); counters per plan."""
    from slimwise.baseline_plans import random_plan

    model_dir, plan_a, ref, _ = setup("qwen3_moe")
    model = load_model(model_dir)
    plan_b = random_plan(model, 0.5, seed=3)
    assert plan_b.kept_experts != plan_a.kept_experts
    ref_b = [o.token_ids for o in PhaseSplitEngine(model, plan=plan_b).generate(PROMPTS, "slimwise", CONFIG)]
    want = {"a": ref["slimwise"], "b": ref_b, "full": ref["full"]}
    # the three routings differ on these prompts
    assert len({tuple(map(tuple, t)) for t in want.values()}) == 3
    engine = VllmEngine(model_dir, {"a": plan_a, "b": plan_b}, default_plan="full", share_engine=True)
    names = ["a", "b", "full", None, "b", "a", None, "b"]  # None: the default plan (full here)
    try:
        for name in ("a", "b"):  # homogeneous batches: every request with one plan
            assert [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG, plans=[name] * 8)] \
                == want[name]
        c = engine.counters()[0]
        assert c["plan_tokens"] == {"a": sum(len(t) - 1 for t in want["a"]),
                                    "b": sum(len(t) - 1 for t in want["b"])}
        engine.llm.reset_prefix_cache()
        got = [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG, plans=names)]
        assert got == [want[n or "full"][i] for i, n in enumerate(names)]  # mixed batch: each its own plan
        c2 = engine.counters()[0]
        fed_back = {k: sum(len(want[k][i]) - 1 for i, n in enumerate(names) if n == k) for k in ("a", "b")}
        assert {k: c2["plan_tokens"][k] - c["plan_tokens"][k] for k in ("a", "b")} == fed_back
        assert c2["position_mismatch_steps"] == 0 and c2["unknown_plan_requests"] == 0
        with pytest.raises(Exception, match="one plan per engine"):
            engine.generate(PROMPTS[:1], "uniform", CONFIG)
        with pytest.raises(Exception, match="unknown plan names"):
            engine.generate(PROMPTS[:1], "slimwise", CONFIG, plans=["c"])
    finally:
        engine.close()


def test_tensor_parallel_2_colocated(setup):
    """--tensor-parallel-size 2 on the CPU backend (two worker processes, one core each, shared-memory
    all-reduce): the plan, the mask and the counters act on both ranks; full / slimwise / uniform in one
    engine equal the reference (and so TP=1); the load-aware policy holds on both ranks. The core binding is
    SlimWise's (one NUMA node here)."""
    from slimwise.serving import shm

    model_dir, plan, ref, _ = setup("qwen3_moe")
    shm_before = shm.segments()
    engine = VllmEngine(model_dir, plan, share_engine=True,
                        engine_kwargs={"tensor_parallel_size": 2, "distributed_executor_backend": "mp"})
    n_prompt = sum(len(p) for p in PROMPTS)
    n_fed_back = sum(len(t) - 1 for t in ref["slimwise"])
    try:
        assert [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG)] == ref["slimwise"]
        ranks = engine.counters()
        assert len(ranks) == 2 and all(totals([c]) == (n_fed_back, n_prompt) for c in ranks)
        assert [o.token_ids for o in engine.generate(PROMPTS, "uniform", CONFIG)] == ref["uniform"]
        assert [o.token_ids for o in engine.generate(PROMPTS, "full", CONFIG)] == ref["full"]
        engine.set_min_decode_batch(len(PROMPTS) + 1)  # every step has fewer decode tokens: every expert
        assert [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG)] == ref["full"]
        assert all(totals([c])[0] == 0 for c in engine.counters())
    finally:
        engine.close()
    # the killed workers' shared memory (CPU all-reduce, message queues) went with them
    assert not shm.segments() - shm_before


# qwen3_moe / qwen2_moe: the empty plan is checked on the trained backbones (test_testbed_shipped.py). An
# empty plan installs nothing whatever the family (`engine.counters() == [{}]`), so one float32 family that is
# token-equal to the reference suffices here (qwen3_next's bf16 engine could only be compared with itself).
@pytest.mark.parametrize("family", ["deepseek_v3"])
def test_empty_plan_gives_stock_tokens(family, setup):
    """deepseek_v3: equal to the reference (stock vLLM CPU is not: see fix_cpu_multihead_rope)."""
    model_dir, _, ref, stats = setup(family)
    engine = VllmEngine(model_dir, plan_from_stats(stats, "reap", 0.0),
                        dtype=VLLM_DTYPE.get(family, "float32"))
    try:
        got = [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG)]
        assert engine.counters() == [{}]  # nothing installed: the stock model runs
        assert got == ref["full"]
    finally:
        engine.close()


def test_chunked_prefill_and_prefix_cache_hits_are_never_pruned(setup):
    model_dir, plan, ref, _ = setup("qwen3_moe")
    engine = VllmEngine(model_dir, plan, engine_kwargs={"max_num_batched_tokens": 32, "max_num_seqs": 8,
                                                       "enable_prefix_caching": True, "max_model_len": 512})
    n_fed_back = sum(len(t) - 1 for t in ref["slimwise"])
    try:
        assert [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG)] == ref["slimwise"]
        pruned, full = totals(engine.counters())
        assert (pruned, full) == (n_fed_back, sum(len(p) for p in PROMPTS))
        steps = engine.counters()[0]["recent"]
        # mixed batches ran
        assert max(p + f for _, p, f in steps) <= 32 and any(p and f for _, p, f in steps)
        # the same prompts again: prefix-cache hits, the uncached tail recomputed as prompt tokens
        assert [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG)] == ref["slimwise"]
        pruned2, full2 = totals(engine.counters())
        assert pruned2 - pruned == n_fed_back
        assert 0 < full2 - full <= sum(len(p) for p in PROMPTS)
    finally:
        engine.close()




@pytest.mark.parametrize(("family", "eager", "targets"),
                         [("qwen3_moe", False, ATTENTION_TARGETS),
                          ("qwen2_moe", True, ATTENTION_TARGETS + DENSE_MLP_TARGETS),
                          ("deepseek_v3", True, ("auto",))])
def test_distilled_delta_in_vllm_equals_reference(family, eager, targets, setup, tmp_path):
    """Router + norm + LoRA act on decode tokens only, in vLLM exactly as in the reference engine, compiled
    (qwen3_moe) and eager; the first token stays the full model's. LoRA targets: q/k/v/o (qwen2_moe's q/k/v
    carry a bias), the shared expert's gate/up/down too (qwen2_moe), and the default "auto" on DeepSeek-V3
    (its shared experts' and its dense first layer's gate/up/down)."""
    from slimwise.delta import Delta
    from slimwise.distill import DistillConfig, distill
    from slimwise.trainable import resolve_lora_targets

    model_dir, plan, ref, _ = setup(family)
    model = load_model(model_dir)
    delta = distill(model, plan, random_prompts(8, seed=9),
                    config=DistillConfig(params=("router", "norm", "lora"), steps=4, batch_size=4,
                                         max_new_tokens=8, lr=5e-2, lora_targets=targets, progress=False))
    assert delta.lora_pairs() and delta.routers() and delta.norms()
    assert {name.rpartition(".")[2] for name in delta.lora_pairs()} \
        == set(resolve_lora_targets(model, targets))
    delta.save(tmp_path / "delta")
    reference = PhaseSplitEngine(model, plan=plan, delta=tmp_path / "delta")
    want = [o.token_ids for o in reference.generate(PROMPTS, "distilled", CONFIG)]
    assert want != ref["slimwise"], "the delta changed nothing: the test could not tell"
    assert [t[0] for t in want] == [t[0] for t in ref["full"]]
    if family != "qwen3_moe":  # the shared expert's LoRA alone moves tokens, so vLLM must apply it to match
        partial = Delta({k: v for k, v in delta.tensors.items() if ".shared_expert" not in k}, delta.manifest)
        without = PhaseSplitEngine(model, plan=plan, delta=partial).generate(PROMPTS, "distilled", CONFIG)
        assert [o.token_ids for o in without] != want
    engine = VllmEngine(model_dir, plan, delta=tmp_path / "delta", enforce_eager=eager, share_engine=True)
    try:
        assert [o.token_ids for o in engine.generate(PROMPTS, "distilled", CONFIG)] == want
        assert totals(engine.counters()) == (sum(len(t) - 1 for t in want), sum(len(p) for p in PROMPTS))
        # the same engine in mode full: nothing masked, no delta row, so the full model's tokens
        assert [o.token_ids for o in engine.generate(PROMPTS, "full", CONFIG)] == ref["full"]
        assert engine._kind == "shared-delta"  # no second engine was started
        with pytest.raises(Exception, match="decode-only delta"):  # uniform must not use SlimWise's delta
            engine.llm.collective_rpc("slimwise_set_mode", args=("uniform",))
    finally:
        engine.close()


def greedy_gaps(model_dir, plan, outputs, decode_pruned: bool, prompts=None) -> list[float]:
    """Teacher-forced on the float32 reference: per generated token, best log-prob minus the token's log-prob,
    prompt tokens routed to every expert and fed-back generated tokens to the kept ones (decode_pruned)."""
    model = load_model(model_dir)
    mask = ExpertMask(model, plan)
    gaps = []
    for prompt, tokens in zip(PROMPTS if prompts is None else prompts, outputs, strict=True):
        ids = torch.tensor([prompt + tokens[:-1]])
        generated = torch.arange(ids.shape[1]) >= len(prompt)
        with torch.no_grad(), mask.pruned(decode_pruned, generated):
            logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)[len(prompt) - 1:]
        gaps += (logprobs.max(dim=-1).values - logprobs[torch.arange(len(tokens)), tokens]).tolist()
    mask.remove()
    return gaps


# qwen2_moe: testbed-b (test_testbed_shipped.py) and test_distilled_delta_in_vllm_equals_reference.
# Compiled runs: qwen3_moe (testbed-a and the distilled delta) in CI; deepseek_v3 compiled, where
# torch.compile traces the router's selection mask once, in `make test-matrix` (a CPU compile costs more than
# the eager run itself); compiled equals the float32 reference token for token, as eager does.
SERVED_FAMILIES = [*(pytest.param(f, True, id=f) for f in ("mixtral", "olmoe", "gpt_oss", "deepseek_v3",
                                                              "qwen3_next")),
                   pytest.param("deepseek_v3", False, marks=pytest.mark.matrix, id="deepseek_v3-compiled")]


@pytest.mark.parametrize(("family", "eager"), SERVED_FAMILIES)
def test_other_served_families(family, eager, setup):
    """Every family whose stock vLLM model runs on this CPU (qwen2_moe, qwen3_next: routed + shared expert;
    deepseek_v3: sigmoid + correction bias + grouped top-k, masked at the selection, eager and compiled;
    qwen3_next: hybrid Gated DeltaNet, bf16 only on CPU, so checked greedy-consistent with the float32
    reference instead of token-equal)."""
    model_dir, plan, ref, _ = setup(family)
    engine = VllmEngine(model_dir, plan, dtype=VLLM_DTYPE.get(family, "float32"),
                        enforce_eager=eager)
    try:
        got = [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG)]
        counters = totals(engine.counters())
    finally:
        engine.close()
    assert counters == (sum(len(t) - 1 for t in got), sum(len(p) for p in PROMPTS))
    if family not in VLLM_DTYPE:
        assert got == ref["slimwise"]
        return
    right, wrong = (greedy_gaps(model_dir, plan, got, decode_pruned=pruned) for pruned in (True, False))
    assert sum(right) / len(right) <= BF16_MEAN_GAP, right
    # the check tells routings apart
    assert sum(wrong) / len(wrong) >= BF16_WRONG_GAP and max(wrong) > 1.0, wrong


def test_deepseek_selection_mask_equals_reference_router():
    """`masked_grouped_topk` (vLLM side) = vLLM's CPU grouped top-k on prompt rows, bit for bit,
    and = the reference adapter's masked router on decode rows, with a bias that makes logit
    masking pick pruned experts."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.router.cpu_router import _grouped_topk

    from slimwise.serving.gate_hooks import masked_grouped_topk

    model = build_tiny_model("deepseek_v3", seed=0, initializer_range=TINY_INIT)
    router = model.model.layers[1].mlp.gate
    pruned = torch.ones(16, dtype=torch.bool)
    pruned[[0, 1, 6, 7, 9, 10, 12, 15]] = False  # 2 kept per group of 4
    with torch.no_grad():
        router.e_score_correction_bias.copy_(pruned.float() * 0.8 + 0.1 * torch.randn(16))
    hidden = torch.randn(10, 64, generator=torch.Generator().manual_seed(0))
    decode = torch.arange(10) < 5
    vllm_router = SimpleNamespace(scoring_func="sigmoid",
                                  e_score_correction_bias=router.e_score_correction_bias,
                                  use_grouped_topk=True, num_expert_group=4, topk_group=2, top_k=4,
                                  renormalize=True, routed_scaling_factor=2.5)
    logits = F.linear(hidden, router.weight)
    weights, ids = masked_grouped_topk(logits, decode[:, None] & pruned[None, :], vllm_router)
    stock_weights, stock_ids = _grouped_topk(logits, 4, True, 4, 2, "sigmoid", 2.5,
                                             router.e_score_correction_bias)
    assert torch.equal(ids[~decode], stock_ids[~decode]) \
        and torch.equal(weights[~decode], stock_weights[~decode])
    # unmasked selection (or masked logits) would use pruned experts
    assert pruned[stock_ids[decode].long()].any()
    assert not pruned[ids[decode].long()].any()
    with torch.no_grad():
        _, ref_weights, ref_ids = get_adapter(model).route(router, hidden, pruned)
    order, ref_order = ids[decode].sort(dim=-1), ref_ids[decode].sort(dim=-1)
    assert torch.equal(order.values.long(), ref_order.values)
    torch.testing.assert_close(weights[decode].gather(1, order.indices),
                               ref_weights[decode].gather(1, ref_order.indices))


# the gate variants and the fallback (slimwise.decode_gates): qwen3_moe renormalizes the top-k, qwen2_moe does
# not, deepseek_v3 selects with a biased sigmoid router (compiled: test_substitute_gates_equal_reference,
# whose routing is drop's, runs qwen3_moe compiled)
GATE_CASES = [("qwen3_moe", DecodeGates("renorm", 0.3), True), ("qwen2_moe", DecodeGates("drop", 0.0), True),
              ("deepseek_v3", DecodeGates("drop", 0.4), True)]


@pytest.mark.parametrize(("family", "gates", "eager"), GATE_CASES)
def test_gate_variants_and_fallback_equal_reference(family, gates, eager, setup):
    """Greedy tokens equal the reference engine's with the same gates, float32; eager engines also count
    the fallbacks per layer, equal to the reference mask's counters (same rows, same decisions)."""
    model_dir, plan, ref, _ = setup(family)
    model = load_model(model_dir)
    with PhaseSplitEngine(model, plan=plan, gates=gates) as reference:
        want = [o.token_ids for o in reference.generate(PROMPTS, "slimwise", CONFIG)]
        counts = {i: [int(x) for x in c] for i, c in reference.mask.counts.items()}
    assert want != ref["slimwise"]
    if gates.fallback == 0.0:  # tau = 0 under drop: the full model
        assert want == ref["full"]
    engine = VllmEngine(model_dir, plan, gates=gates, enforce_eager=eager, count_experts=eager)
    try:
        got = [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG)]
        counters = engine.counters()[0]
    finally:
        engine.close()
    assert got == want
    if eager:
        assert {int(k): v for k, v in counters["fallback"].items()} == counts


@pytest.mark.parametrize(("family", "eager"), [("qwen2_moe", True),
                                              pytest.param("qwen3_moe", False, marks=pytest.mark.matrix)])
def test_substitute_gates_equal_reference(family, eager, setup, tmp_path):
    """`--gates substitute` with a fallback: the MoE block adds the pruned slots' weighted mean outputs
    (vectors from a calibration with output sums); tokens equal the reference engine's, float32, eager and
    compiled, and differ from drop's."""
    model_dir, plan, _, _ = setup(family)
    model = load_model(model_dir)
    stats = calibrate(model, random_prompts(8, seed=1), config=CalibrationConfig(max_new_tokens=8,
                                                                                output_sums=True),
                      progress=False)
    stats.save(tmp_path / "sums.safetensors")
    gates = DecodeGates("substitute", 0.5, str(tmp_path / "sums.safetensors"))
    with PhaseSplitEngine(model, plan=plan, gates=gates) as reference:
        want = [o.token_ids for o in reference.generate(PROMPTS, "slimwise", CONFIG)]
    with PhaseSplitEngine(model, plan=plan, gates=DecodeGates("drop", 0.5)) as reference:
        assert [o.token_ids for o in reference.generate(PROMPTS, "slimwise", CONFIG)] != want
    engine = VllmEngine(model_dir, plan, gates=gates, enforce_eager=eager)
    try:
        got = [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG)]
    finally:
        engine.close()
    assert got == want


def test_sensitivity_budget_plan_equals_reference(setup):
    """A `--budget-model` plan keeps a different number of experts in each layer (masking only): vLLM's
    tokens equal the reference engine's, float32."""
    from slimwise.layer_budgets import capture_decode_inputs, grid, layer_errors, sensitivity_plan

    model_dir, _, _, stats = setup("qwen3_moe")
    model = load_model(model_dir)
    counts = grid(stats.num_experts, int(stats.meta["top_k"]))
    inputs = capture_decode_inputs(model, random_prompts(8, seed=2), max_new_tokens=8, max_tokens=64)
    plan = sensitivity_plan(stats, "reap", 0.5, layer_errors(model, stats, "reap", inputs, counts), counts)
    assert len({len(v) for v in plan.kept_experts.values()}) > 1  # the budget moved between layers
    with PhaseSplitEngine(model, plan=plan) as reference:
        want = [o.token_ids for o in reference.generate(PROMPTS, "slimwise", CONFIG)]
    engine = VllmEngine(model_dir, plan)
    try:
        assert [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG)] == want
    finally:
        engine.close()


# ----- batch budgets (`--budget`, `--budget-share`, `--extra`): greedy tokens equal the reference engine's
# under the same budget (the same rows in every step: all prompts prefill in one step and decode together),
# eager and compiled, for a softmax router and a grouped biased one; the dial's ends are the full model's and
# the static plan's tokens; two plans in one step each choose their own S from their own rows; an eager
# engine's expert counters never exceed the budget.


def budget_reference(model, plan, gates, prompts=PROMPTS):
    with PhaseSplitEngine(model, plan=plan, gates=gates) as engine:
        return [o.token_ids for o in engine.generate(prompts, "slimwise", CONFIG)]


def budget_served(model_dir, plan, gates, names=None, **kwargs):
    engine = VllmEngine(model_dir, plan, gates=gates, **kwargs)
    try:
        tokens = [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG, plans=names)]
        return tokens, engine.counters()[0]
    finally:
        engine.close()


@pytest.mark.parametrize(("family", "budget", "eager"), [
    ("qwen3_moe", dict(budget=6), True),       # top-4 of 16: at most 6 experts per layer and step
    ("qwen3_moe", dict(extra=1), False),       # compiled: the budget's ops traced with the gate hook
    ("deepseek_v3", dict(budget_share=0.5), True),  # grouped top-k with a correction bias
    ("qwen2_moe", dict(budget=6, fallback=0.5), True)])  # no top-k renormalization; the per-token fallback
def test_budget_equals_reference(family, budget, eager, setup):
    model_dir, plan, ref, _ = setup(family)
    model = load_model(model_dir)
    gates = DecodeGates(**budget)
    want = budget_reference(model, plan, gates)
    assert want not in (ref["full"], ref["slimwise"])
    got, counters = budget_served(model_dir, plan, gates, enforce_eager=eager, count_experts=eager)
    assert got == want
    if eager and "budget" in budget and "fallback" not in budget:  # every counted step reads at most E
        touched, steps = counters["experts_touched_sum"], counters["experts_counted_steps"]
        assert steps and all(touched[layer] <= budget["budget"] * steps[layer] for layer in steps)


def test_budget_ends_are_the_full_model_and_the_static_plan(setup):
    model_dir, plan, ref, _ = setup("qwen3_moe")
    assert budget_served(model_dir, plan, DecodeGates(budget_share=1.0), enforce_eager=True)[0] == ref["full"]
    assert budget_served(model_dir, plan, DecodeGates(extra=0), enforce_eager=True)[0] == ref["slimwise"]


def test_two_plans_in_one_step_each_choose_from_their_own_rows(setup):
    """A mixed batch, half the requests on each plan: each plan group's S comes from its own rows only, so
    each half's tokens equal the reference engine's run of that half alone under its plan and the budget."""
    from slimwise.baseline_plans import random_plan

    model_dir, plan_a, _, _ = setup("qwen3_moe")
    model = load_model(model_dir)
    plan_b = random_plan(model, 0.5, seed=3)
    gates = DecodeGates(extra=1)
    names = ["a", "b"] * 4
    half = {n: [p for p, m in zip(PROMPTS, names, strict=True) if m == n] for n in ("a", "b")}
    want = {"a": budget_reference(model, plan_a, gates, half["a"]),
            "b": budget_reference(model, plan_b, gates, half["b"])}
    assert want["a"] != budget_reference(model, plan_a, DecodeGates(), half["a"])
    assert want["b"] != budget_reference(model, plan_b, DecodeGates(), half["b"])
    got, _ = budget_served(model_dir, {"a": plan_a, "b": plan_b}, gates, enforce_eager=True, names=names)
    assert [got[i] for i, n in enumerate(names) if n == "a"] == want["a"]
    assert [got[i] for i, n in enumerate(names) if n == "b"] == want["b"]
