"""PD-disaggregated serving on every served family, at the engine level: the two instances `slimwise serve
--disaggregated` starts (a full-model prefill instance with `SlimWiseConnector` as kv_producer, and a decode
instance on the exported pruned checkpoint as kv_consumer), driven as the proxy drives them: the prompt with
max_tokens 1, then prompt + first token as token ids. The decode instance must compute no prompt token (every
prompt position is loaded from the full model) and the tokens must be the reference engine's SlimWise tokens:
equal in float32, within the bf16 gap bound for the hybrid (vLLM's CPU Gated DeltaNet kernel is bf16 only).
Through HTTP and the openai client with text: tests/test_vllm_clients.py (testbed-a, -b, -c),
tests/test_vllm_serve.py (TP 2) and tests/test_vllm_hybrid.py (Qwen3.5-MoE).
"""

from __future__ import annotations

import json

import pytest
from conftest import TINY_INIT, random_prompts
from test_vllm_plugin import (
    BF16_MEAN_GAP,
    BF16_WRONG_GAP,
    VLLM_DTYPE,
    VLLM_TINY,
    greedy_gaps,
    set_selection_bias,
)
from tiny import build_tiny_model

from slimwise.calibrate import CalibrationConfig, calibrate
from slimwise.criteria import plan_from_stats
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.export import export_pruned
from slimwise.models import load_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.vllm_in_process]
CONFIG = GenerationConfig(max_new_tokens=10, eos_token_id=-1)
# a 1-token prompt; 33 spans several blocks
PROMPTS = random_prompts(6, seed=11, lengths=(5, 9, 1, 14, 3, 33))


def _instance(model_dir, role: str, kv_dir, dtype: str, overrides: dict | None = None):
    """One instance as `slimwise serve --disaggregated` starts it (`serving.server.cpu_fix_args`: SlimWise's
    class where it fixes vLLM on CPU, DeepSeek-V3; stock vLLM elsewhere; `overrides`: the decode instance's
    under --gates)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from slimwise.serving.server import cpu_fix_args

    fix = cpu_fix_args(str(model_dir), [])
    return LLM(
        model=str(model_dir),
        dtype=dtype,
        enforce_eager=True,
        skip_tokenizer_init=True,
        seed=0,
        hf_overrides=overrides or (json.loads(fix[1]) if fix else None),
        kv_cache_memory_bytes=256 << 20,
        enable_prefix_caching=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="SlimWiseConnector",
            kv_connector_module_path="slimwise.serving.connector",
            kv_role=role,
            kv_connector_extra_config={"shared_storage_path": str(kv_dir)},
        ),
    )


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "qwen3_next"])
def test_disaggregated_instances_give_the_reference_slimwise_tokens(family, tmp_path):
    from vllm import SamplingParams

    model = build_tiny_model(family, seed=0, initializer_range=TINY_INIT, **VLLM_TINY.get(family, {}))
    if family == "deepseek_v3":
        set_selection_bias(model)
    model.save_pretrained(tmp_path / "full")
    model = load_model(tmp_path / "full")
    stats = calibrate(
        model, random_prompts(8, seed=1), config=CalibrationConfig(max_new_tokens=8), progress=False
    )
    plan = plan_from_stats(stats, "reap", 0.5)
    want = [o.token_ids for o in PhaseSplitEngine(model, plan=plan).generate(PROMPTS, "slimwise", CONFIG)]
    decode_dir = export_pruned(model, plan, tmp_path / "pruned", source_dir=tmp_path / "full")
    dtype = VLLM_DTYPE.get(family, "float32")
    greedy = dict(temperature=0.0, ignore_eos=True)
    prefill = _instance(tmp_path / "full", "kv_producer", tmp_path / "kv", dtype)
    try:
        firsts = [
            o.outputs[0].token_ids[0]
            for o in prefill.generate(
                [{"prompt_token_ids": p} for p in PROMPTS],
                SamplingParams(max_tokens=1, **greedy),
                use_tqdm=False,
            )
        ]
    finally:
        prefill.llm_engine.engine_core.shutdown()
    decode = _instance(decode_dir, "kv_consumer", tmp_path / "kv", dtype)
    try:
        outs = decode.generate([{"prompt_token_ids": p + [t]} for p, t in zip(PROMPTS, firsts, strict=True)],
                               SamplingParams(max_tokens=CONFIG.max_new_tokens - 1, **greedy), use_tqdm=False)
    finally:
        decode.llm_engine.engine_core.shutdown()
    assert [o.num_cached_tokens for o in outs] == [len(p) for p in PROMPTS]  # no prompt token recomputed
    got = [[t, *o.outputs[0].token_ids] for t, o in zip(firsts, outs, strict=True)]
    if family not in VLLM_DTYPE:
        assert got == want  # disaggregated = colocated = the reference, token for token
        return
    right, wrong = (greedy_gaps(tmp_path / "full", plan, got, decode_pruned=pruned, prompts=PROMPTS)
                    for pruned in (True, False))
    assert sum(right) / len(right) <= BF16_MEAN_GAP, right
    assert sum(wrong) / len(wrong) >= BF16_WRONG_GAP, wrong


@pytest.mark.parametrize(("family", "gates", "ratio"),
                         [("qwen2_moe", "substitute", 0.5), ("qwen3_moe", "drop", 0.75)])
def test_pruned_decode_instance_decodes_with_the_full_routers_gates(family, gates, ratio, tmp_path):
    """`slimwise serve --disaggregated --gates substitute --substitutes S`: the pruned checkpoint's decode
    instance reads the gates file (`slimwise.gate_sidecar`: the full router's rows of the pruned experts and
    their calibration means) and decodes with the full router's gates, pruned share substituted, as the
    colocated engine does: token for token the reference engine's `--gates substitute` tokens in float32.
    qwen2_moe does not renormalize its top-k, so the kept experts' weights differ from the pruned router's
    own softmax in every row (the substitute path includes drop's routing, plus the vectors); `--gates drop`
    on qwen3_moe, which renormalizes over the full top-k, at 75%: 4 kept experts = top-4, where a row routed
    to kept experts only carries no -inf to mark it pre-routed (the pruned router reads every row as such)."""
    from vllm import SamplingParams

    from slimwise.decode_gates import DecodeGates
    from slimwise.gate_sidecar import write_gate_sidecar
    from slimwise.serving.overrides import pruned_gates_overrides

    model = build_tiny_model(family, seed=0, initializer_range=TINY_INIT, **VLLM_TINY.get(family, {}))
    model.save_pretrained(tmp_path / "full")
    model = load_model(tmp_path / "full")
    stats = calibrate(model, random_prompts(8, seed=1), config=CalibrationConfig(
        max_new_tokens=8, output_sums=True), progress=False)
    plan = plan_from_stats(stats, "reap", ratio)
    sums = str(stats.save(tmp_path / "stats.safetensors")) if gates == "substitute" else None
    decode_gates = DecodeGates(gates, None, sums)
    engine = PhaseSplitEngine(model, plan=plan, gates=decode_gates)
    want = [o.token_ids for o in engine.generate(PROMPTS, "slimwise", CONFIG)]
    plain = [o.token_ids for o in PhaseSplitEngine(model, plan=plan).generate(PROMPTS, "slimwise", CONFIG)]
    assert want != plain  # the gates change tokens here, so equality below is theirs
    decode_dir = export_pruned(model, plan, tmp_path / "pruned", source_dir=tmp_path / "full")
    side = write_gate_sidecar(tmp_path / "full", plan, decode_gates, tmp_path / "gates.safetensors")
    greedy = dict(temperature=0.0, ignore_eos=True)
    prefill = _instance(tmp_path / "full", "kv_producer", tmp_path / "kv", "float32")
    try:
        firsts = [o.outputs[0].token_ids[0] for o in prefill.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=1, **greedy),
            use_tqdm=False)]
    finally:
        prefill.llm_engine.engine_core.shutdown()
    decode = _instance(decode_dir, "kv_consumer", tmp_path / "kv", "float32",
                       overrides=pruned_gates_overrides(decode_dir, side))
    try:
        outs = decode.generate([{"prompt_token_ids": p + [t]} for p, t in zip(PROMPTS, firsts, strict=True)],
                               SamplingParams(max_tokens=CONFIG.max_new_tokens - 1, **greedy), use_tqdm=False)
    finally:
        decode.llm_engine.engine_core.shutdown()
    assert [o.num_cached_tokens for o in outs] == [len(p) for p in PROMPTS]
    assert [[t, *o.outputs[0].token_ids] for t, o in zip(firsts, outs, strict=True)] == want
