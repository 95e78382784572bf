"""vLLM configurations under which SlimWise's decode routing would be silently wrong are refused in
one line (slimwise/serving/guards.py), and the engine defaults / config hooks that differed from stock vLLM.

No vLLM engine starts here: the checks run on vLLM's own config objects and MoE layers (built on the CPU in a
one-rank gloo group), and the config hooks on a `VllmConfig` built from a tiny checkpoint's config.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from transformers import PretrainedConfig

from slimwise.engines.vllm_engine import CPU_DEFAULTS, VllmEngine, engine_defaults
from slimwise.errors import SlimWiseError
from slimwise.plan import PrunePlan
from slimwise.serving import guards
from slimwise.serving.routing import COUNT_EXPERTS_KEY, PLAN_KEY, DecodeRouting
from slimwise.serving.tokenizer import TOKENIZER_MODE

HIDDEN, EXPERTS, TOP_K = 64, 8, 2  # vLLM's CPU experts need hidden / intermediate sizes in multiples of 32
TESTS = Path(__file__).resolve().parent


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


@pytest.fixture
def checkpoint(tmp_path):
    """A directory `VllmEngine` accepts without starting an engine (it reads config.json only)."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"]}))
    return tmp_path


def half_plan(layers=(0, 1)) -> PrunePlan:
    return PrunePlan(family="qwen3_moe", num_experts=EXPERTS, top_k=TOP_K,
                     kept_experts={layer: [0, 1, 2, 3] for layer in layers})


def routing_config(**settings) -> PretrainedConfig:
    return PretrainedConfig(num_experts=EXPERTS, num_experts_per_tok=TOP_K, hidden_size=HIDDEN, **settings)


# ----- a. micro-batching: DBO and sequence-parallel MoE -------------------------------------------------
SERVE_HAZARDS = [
    (["--enable-dbo"], "--enable-dbo"),
    (["--enable_dbo"], "--enable-dbo"),  # vLLM's parser reads underscores as dashes
    (["--ubatch-size", "2"], "--ubatch-size 2"),
    (["-tp", "2", "-dp", "2", "-ep"], "sequence-parallel MoE"),
    (["--tensor-parallel-size=2", "--data-parallel-size", "2", "--enable-expert-parallel",
      "--all2all-backend", "deepep_low_latency"], "sequence-parallel MoE"),
]


@pytest.mark.parametrize(("args", "named"), SERVE_HAZARDS)
def test_serve_preflight_refuses_micro_batching(tmp_path, args, named):
    from slimwise.serving.config import ServeConfig
    from slimwise.serving.server import preflight

    (tmp_path / "config.json").write_text("{}")
    cfg = ServeConfig(model=str(tmp_path), plan=str(tmp_path / "plan.json"), vllm_args=args)
    with pytest.raises(SlimWiseError) as exc:
        preflight(cfg)  # refused before the (absent) plan is read: no engine, no plan needed
    assert named in one_line(exc) and "per-token decode mask" in str(exc.value)


@pytest.mark.parametrize("args", [
    [],
    ["--enable-dbo", "--no-enable-dbo"],
    ["-tp", "2", "-ep"],  # expert parallel over tensor parallel alone: every rank sees every row
    # a backend that is not sequence-parallel
    ["-tp", "2", "-dp", "2", "-ep", "--all2all-backend", "flashinfer_nvlink_two_sided"],
])
def test_parallel_settings_vllm_serves_whole_steps_pass(args):
    settings = guards.parallel_settings(guards.parallel_values_from_args(args))
    assert guards.micro_batching_problem(settings) is None


def test_vllm_engine_refuses_micro_batching_with_a_plan(checkpoint):
    for options in ({"enable_dbo": True}, {"ubatch_size": 2},
                    {"tensor_parallel_size": 2, "data_parallel_size": 2, "enable_expert_parallel": True}):
        with pytest.raises(SlimWiseError) as exc:
            VllmEngine(checkpoint, half_plan(), engine_kwargs=options, on_cpu=False)
        assert "per-token decode mask" in one_line(exc)
    # the full model alone (no plan, no counting) is stock vLLM: nothing to refuse
    assert VllmEngine(checkpoint, None, engine_kwargs={"enable_dbo": True}, on_cpu=False).kwargs["enable_dbo"]


def test_worker_refuses_micro_batching_from_vllm_config():
    """Inside the worker the check reads vLLM's own `ParallelConfig` (what a user's `vllm serve --enable-dbo`
    builds) and refuses when the model carries active routing."""
    from vllm.config import ParallelConfig, VllmConfig

    fake = nn.Module()
    fake.model = nn.Module()
    fake.model.layers = nn.ModuleList([nn.Module()])
    fake.model.layers[0].mlp = nn.Module()
    fake.model.layers[0].mlp.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
    routing = DecodeRouting(fake, routing_config(**{PLAN_KEY: half_plan((0,)).to_dict()}), 32)
    assert routing.active
    # vLLM's CPU platform turns DBO off in a VllmConfig (platforms/cpu.py:347): its ParallelConfig alone
    for parallel in (ParallelConfig(enable_dbo=True), ParallelConfig(ubatch_size=2)):
        with pytest.raises(SlimWiseError) as exc:
            guards.refuse_micro_batching(parallel)  # what check_worker runs on vllm_config.parallel_config
        assert "per-token decode mask" in one_line(exc)
    sequence_parallel = VllmConfig(parallel_config=ParallelConfig(
        tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True))
    assert sequence_parallel.parallel_config.use_sequence_parallel_moe
    with pytest.raises(SlimWiseError) as exc:
        guards.check_worker(fake, sequence_parallel, routing)
    assert "sequence-parallel MoE" in one_line(exc)
    guards.check_worker(fake, VllmConfig(), routing)
    idle = DecodeRouting(fake, routing_config(), 32)  # no plan, no counting: stock routing
    guards.check_worker(fake, sequence_parallel, idle)


# ----- b. expert counting: eager only -----------------------------------------------------------------------
def test_counting_refused_on_a_gpu_engine_that_is_not_eager(checkpoint):
    assert guards.counting_problem(True, enforce_eager=False, on_cuda=True)
    assert guards.counting_problem(True, enforce_eager=True, on_cuda=True) is None
    assert guards.counting_problem(False, enforce_eager=False, on_cuda=True) is None
    assert guards.counting_problem(True, enforce_eager=False, on_cuda=False) is None  # CPU: no CUDA graphs
    with pytest.raises(SlimWiseError) as exc:
        VllmEngine(checkpoint, half_plan(), count_experts=True, enforce_eager=False, on_cpu=False)
    assert "enforce_eager" in one_line(exc)
    # counting without a choice: eager, on a GPU too (where vLLM's default is CUDA graphs)
    counting = VllmEngine(checkpoint, half_plan(), count_experts=True, on_cpu=False)
    assert counting.kwargs["enforce_eager"] is True
    assert "enforce_eager" not in VllmEngine(checkpoint, half_plan(), on_cpu=False).kwargs


def test_counting_hook_counts_eager_steps_only():
    """The installed hook counts an eager forward and does nothing (no host sync, no error) while
    torch.compile traces; `counting_paused` adds CUDA-graph capture, which needs a GPU to show."""
    assert not guards.counting_paused()
    fake = nn.Module()
    fake.model = nn.Module()
    fake.model.layers = nn.ModuleList([nn.Module()])
    fake.model.layers[0].mlp = nn.Module()
    gate = fake.model.layers[0].mlp.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
    routing = DecodeRouting(fake, routing_config(**{COUNT_EXPERTS_KEY: True}), 32)
    routing.set_step(np.array([0, 1, 5]), np.array([4, 4, 4]))  # two prompt tokens, one decode token
    x = torch.randn(3, HIDDEN)
    with torch.no_grad():
        gate(x)
        assert routing.counters.experts_counted_steps == {0: 1}
        assert routing.counters.experts_touched_sum == {0: TOP_K}
        torch.compile(lambda t: gate(t), backend="eager", fullgraph=True)(x)
    assert routing.counters.experts_counted_steps == {0: 1}  # the compiled forward did not count


# ----- c. monolithic MoE kernels ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_moe_layers(tmp_path_factory):
    """vLLM's own MoE layers (`FusedMoEFactory` -> `MoERunner`, CPU experts) in a one-rank gloo group: layer
    0 a softmax router (Qwen-style, masked on the gate's output), layer 1 DeepSeek-V3's sigmoid + correction
    bias + grouped top-k (masked at the router, by replacing its `_compute_routing`)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory

    init = tmp_path_factory.mktemp("dist") / "init"
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"file://{init}", backend="gloo")
        initialize_model_parallel(1, 1)
        try:
            def layers():
                model = nn.Module()
                model.model = nn.Module()
                model.model.layers = nn.ModuleList([nn.Module(), nn.Module()])
                for i, grouped in enumerate((False, True)):
                    mlp = model.model.layers[i].mlp = nn.Module()
                    mlp.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
                    extra = dict(use_grouped_topk=True, num_expert_group=2, topk_group=1,
                                 scoring_func="sigmoid", e_score_correction_bias=torch.zeros(EXPERTS)) \
                        if grouped else {}
                    mlp.experts = FusedMoEFactory(num_experts=EXPERTS, top_k=TOP_K, hidden_size=HIDDEN,
                                                  intermediate_size=HIDDEN, params_dtype=torch.bfloat16,
                                                  prefix=f"model.layers.{i}.mlp.experts", **extra)
                return model

            yield layers
        finally:
            cleanup_dist_env_and_memory()


def test_monolithic_kernel_bypassing_a_router_replacement_is_refused(vllm_moe_layers):
    from vllm.model_executor.layers.fused_moe.experts.trtllm_bf16_moe import TrtLlmBf16ExpertsMonolithic

    model = vllm_moe_layers()
    routing = DecodeRouting(model, routing_config(**{PLAN_KEY: half_plan().to_dict()}), 32)
    assert routing.hooked["gates"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert routing.hooked["selection"] == ["model.layers.1.mlp.experts.router"]
    runners = [model.model.layers[i].mlp.experts for i in (0, 1)]
    assert not guards.routing_replaced(runners[0].router) and guards.routing_replaced(runners[1].router)
    # vLLM's CPU experts are modular: they call the router SlimWise replaced
    assert not any(r.is_monolithic for r in runners)
    assert guards.monolithic_problems(model) == []
    # what vLLM's oracle picks for a bf16 MoE on Blackwell (oracle/unquantized.py): TRT-LLM monolithic
    for runner in runners:
        runner.routed_experts.quant_method.experts_cls = TrtLlmBf16ExpertsMonolithic
    assert all(r.is_monolithic for r in runners)
    problems = guards.monolithic_problems(model, on_cpu=False)
    assert len(problems) == 1  # layer 0's mask is on the gate's output, which the kernel receives
    assert problems[0].startswith("model.layers.1.mlp.experts: ")
    assert "TrtLlmBf16ExpertsMonolithic" in problems[0] and "--moe-backend triton" in problems[0]
    on_cpu = guards.monolithic_problems(model)  # here: vLLM's CPU backend, whose int4 kernels are monolithic
    assert len(on_cpu) == 1 and "unquantized checkpoint" in on_cpu[0]
    from vllm.config import VllmConfig

    with pytest.raises(SlimWiseError) as exc:
        guards.check_worker(model, VllmConfig(), routing)
    assert one_line(exc) == on_cpu[0]


def test_rocm_gpt_oss_router_bypass_is_refused():
    gpt_oss = type("SlimWiseGptOssForCausalLM", (nn.Module,), {})()
    gates = ["model.layers.0.mlp.router"]
    assert "ROCm" in guards.rocm_router_problem(gpt_oss, gates, on_rocm=True)
    assert guards.rocm_router_problem(gpt_oss, gates, on_rocm=False) is None
    assert guards.rocm_router_problem(nn.Module(), gates, on_rocm=True) is None


# ----- d. CPU defaults on the CPU only ----------------------------------------------------------------------
def test_engine_defaults_cpu_and_gpu(checkpoint):
    assert engine_defaults(on_cpu=True) == {**CPU_DEFAULTS, "tokenizer_mode": TOKENIZER_MODE}
    # a GPU keeps vLLM's defaults: the checkpoint's dtype, CUDA graphs, gpu_memory_utilization
    assert engine_defaults(on_cpu=False) == {"tokenizer_mode": TOKENIZER_MODE}
    # explicit choices win on both
    for on_cpu in (True, False):
        chosen = engine_defaults("bfloat16", False,
                                 {"kv_cache_memory_bytes": 1 << 30, "tokenizer_mode": "hf"}, on_cpu=on_cpu)
        assert chosen == {"dtype": "bfloat16", "enforce_eager": False, "kv_cache_memory_bytes": 1 << 30,
                          "tokenizer_mode": "hf"}
        overridden = engine_defaults("float32", engine_kwargs={"dtype": "float16"}, on_cpu=on_cpu)
        assert overridden["dtype"] == "float16"
    on_cpu = engine_defaults(engine_kwargs={"gpu_memory_utilization": 0.5}, on_cpu=True)
    assert "kv_cache_memory_bytes" not in on_cpu and on_cpu["gpu_memory_utilization"] == 0.5
    assert VllmEngine(checkpoint, on_cpu=True).kwargs == {**CPU_DEFAULTS, "tokenizer_mode": TOKENIZER_MODE}
    gpu = VllmEngine(checkpoint, half_plan(), on_cpu=False, max_model_len=128).kwargs
    assert gpu == {"tokenizer_mode": TOKENIZER_MODE, "max_model_len": 128}


# ----- e. vLLM's per-architecture config hooks for the SlimWise class names ------------------------------
CONFIG_HOOKS = textwrap.dedent("""
    import json, sys
    from pathlib import Path

    sys.path.insert(0, sys.argv[2])
    from tiny import tiny_config
    # a fresh process, as `vllm serve`: vLLM's plugin loader imports slimwise.serving.models
    from vllm.engine.arg_utils import EngineArgs

    root = Path(sys.argv[1])
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    tiny_config("qwen3_5_moe", mamba_ssm_dtype="float32", rope_parameters=rope).save_pretrained(root)
    out = {}
    for arch in ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"):
        for name in (arch, "SlimWise" + arch):
            config = EngineArgs(model=str(root), hf_overrides={"architectures": [name]}, dtype="bfloat16",
                                skip_tokenizer_init=True, max_model_len=256,
                                kv_cache_memory_bytes=64 << 20).create_engine_config()
            out[name] = {"mamba_ssm_cache_dtype": config.cache_config.mamba_ssm_cache_dtype,
                         "mamba_cache_dtype": config.cache_config.mamba_cache_dtype,
                         "block_size": config.cache_config.block_size,
                         "rope_parameters": config.model_config.hf_text_config.rope_parameters}
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slow  # a fresh Python process that imports vLLM (about 15 s)
def test_slimwise_hybrid_classes_get_the_stock_config_hooks(tmp_path):
    """A `VllmConfig` for a SlimWise Qwen3.5/3.6-MoE class equals the stock class's where vLLM's
    per-architecture hook acts (`MODELS_CONFIG_MAP`): the SSM cache dtype from the checkpoint's
    `mamba_ssm_dtype` (float32; on a CPU with avx512_bf16 vLLM's CPU backend forces float32 anyway, on an
    AVX2-only one the SlimWise class kept bf16) and, for the text-only class, the M-RoPE fields dropped (which
    the SlimWise class kept on every machine)."""
    done = subprocess.run([sys.executable, "-c", CONFIG_HOOKS, str(tmp_path / "qwen3_5_moe"), str(TESTS)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    for arch in ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"):
        assert out["SlimWise" + arch] == out[arch]
        assert out[arch]["mamba_ssm_cache_dtype"] == "float32"
    assert "mrope_section" not in out["SlimWiseQwen3_5MoeForCausalLM"]["rope_parameters"]


def test_config_hooks_registered_for_every_slimwise_class_with_a_stock_hook(checkpoint):
    """`VllmEngine` registers them in its own process (its caller may have imported SlimWise before vLLM)."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from slimwise.serving.models import STOCK_ARCHS, slimwise_arch

    VllmEngine(checkpoint, on_cpu=True)
    for stock in STOCK_ARCHS:
        assert MODELS_CONFIG_MAP.get(slimwise_arch(stock)) is MODELS_CONFIG_MAP.get(stock)
    assert MODELS_CONFIG_MAP.get("SlimWiseQwen3_5MoeForCausalLM") is not None
