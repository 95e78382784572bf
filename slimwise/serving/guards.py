"""vLLM configurations under which SlimWise's decode routing would be silently wrong: refused in one line.

Found by reading vLLM 0.32's source. Each check reads what vLLM itself exposes (its config
properties, its MoE layers' attributes), so vLLM's own logic decides whether a hazard is on. They run twice:
before any engine starts (`slimwise serve`'s preflight, `VllmEngine`), from the options given, and inside
every worker when a SlimWise model class is built (`models.SlimWiseMixin`), from the `VllmConfig` and the
built model, which also covers a user's own `vllm serve` with a SlimWise class.

1. Micro-batching. The per-token decode buffers (`DecodeRouting.decode_mask` / `row_plan`) are filled for the
   step's rows in order and every gate hook reads rows [0, n) of them. vLLM's dual-batch overlap
   (`--enable-dbo`, or `--ubatch-size` > 1: `ParallelConfig.use_ubatching`) runs the step as micro-batches,
   each forward seeing a slice of the rows; sequence-parallel MoE (`ParallelConfig.use_sequence_parallel_moe`:
   expert parallel with tensor and data parallel > 1 and a dispatching all2all backend, the default
   allgather_reducescatter among them) hands each tensor-parallel rank rows [rank * n / tp, ...) before the
   gate (`sequence_parallel_chunk`, vllm/model_executor/models/utils.py:1084; qwen3_moe.py:227-228). Either
   way a hook would read another row's mask.
2. Expert counting (`slimwise_count_experts`) calls `int(tensor)` in every gate hook: a host sync, illegal
   while a CUDA graph is captured, and a replayed graph runs no Python, so the counts would miss every
   replayed step. Counting therefore runs eager-only (`counting_paused` in the hook) and a CUDA engine that
   counts must be `enforce_eager`.
3. Monolithic MoE kernels (`FusedMoEExpertsMonolithic`, vllm/model_executor/layers/fused_moe/
   modular_kernel.py:966) take the router logits and route inside the kernel: the runner hands them
   `router_logits` and never calls `router.select_experts` (runner/moe_runner.py:620-626, against the
   modular path at :627-634), and the CPU ones build a fresh `CPURouter` (router/cpu_router.py:255-293). So a
   routing SlimWise installs by replacing a router's `_compute_routing` -- DeepSeek-V3's selection mask,
   `--gates drop` / `substitute` (pre-routed logits), a pruned decode instance's gates file -- is bypassed,
   and the kernel would read pre-routed or masked-only logits as plain ones. Where such a kernel is chosen
   (the FlashInfer TRT-LLM bf16/FP8 kernels, first on CUDA except Hopper: oracle/unquantized.py:68-79,
   112-118; oracle/fp8.py:149-155), the layer is refused with the fix: `--moe-backend triton` (vLLM's
   `KernelConfig.moe_backend`, config/kernel.py:294), whose kernels are modular and call the router.
   The plain logit mask on the gate's OUTPUT (Qwen, Mixtral, OLMoE, GPT-OSS) is NOT bypassed: the runner
   calls the gate module itself (`router_logits, _ = self.gate(hidden_states)`, runner/moe_runner.py:913,
   inside `_forward_impl`), or the model calls it and passes the result (mixtral.py:139, qwen2_moe.py:188,
   olmoe.py:112, gpt_oss.py:416), so `nn.Module.__call__` runs the SlimWise forward hook and the kernel gets
   the masked (-inf) logits, monolithic or not. One exception: GPT-OSS on ROCm computes its router logits
   with `rocm_unquantized_gemm(..., self.router.weight, ...)` (gpt_oss.py:411-414), never calling the router
   module, so no hook runs there: refused too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import SimpleNamespace

import torch

from slimwise.errors import SlimWiseError

#: the `ParallelConfig` fields that `use_ubatching` and `use_sequence_parallel_moe` read (vllm/config/
#: parallel.py:641, :764)
PARALLEL_FIELDS = ("enable_dbo", "ubatch_size", "all2all_backend", "enable_expert_parallel",
                   "tensor_parallel_size", "data_parallel_size")
#: vLLM's option (`--moe-backend`, `LLM(moe_backend=...)`) that selects modular Triton MoE kernels
MOE_BACKEND_FIX = "--moe-backend triton"


# ----- 1. micro-batching ------------------------------------------------------------------------------------
def parallel_settings(values: Mapping | None = None) -> SimpleNamespace:
    """The fields of `PARALLEL_FIELDS` as vLLM's `ParallelConfig()` defaults them, overridden by `values`
    (engine keyword arguments, or `parallel_values_from_args` of a command line)."""
    from vllm.config import ParallelConfig

    base, values = ParallelConfig(), dict(values or {})
    out = SimpleNamespace(**{name: values.get(name, getattr(base, name)) for name in PARALLEL_FIELDS})
    if out.all2all_backend in ("pplx", "naive"):  # removed backends, replaced as vLLM does (parallel.py:533)
        out.all2all_backend = "allgather_reducescatter"
    return out


def parallel_values_from_args(args: Sequence[str]) -> dict:
    """The `PARALLEL_FIELDS` a vLLM command line sets (flags `--enable-dbo` / `--no-enable-dbo`,
    `--enable-expert-parallel` / `-ep`; vLLM's parser also takes `--enable_dbo`); absent ones are left out."""
    from slimwise.argtypes import option_count, option_value

    args = [_dashed(a) for a in args]
    values: dict = {}
    for arg in args:
        key = arg.partition("=")[0]
        if key in ("--enable-dbo", "--no-enable-dbo"):
            values["enable_dbo"] = key == "--enable-dbo"
        elif key in ("--enable-expert-parallel", "-ep", "--no-enable-expert-parallel"):
            values["enable_expert_parallel"] = key != "--no-enable-expert-parallel"
    ubatch = option_value(args, "--ubatch-size")
    if ubatch is not None and ubatch.isdigit():
        values["ubatch_size"] = int(ubatch)
    backend = option_value(args, "--all2all-backend")
    if backend is not None:
        values["all2all_backend"] = backend
    for name, flags in (("tensor_parallel_size", ("--tensor-parallel-size", "-tp")),
                        ("data_parallel_size", ("--data-parallel-size", "-dp"))):
        if option_value(args, *flags) is not None:
            values[name] = option_count(args, *flags)
    return values


def _dashed(arg: str) -> str:
    """`--enable_dbo=x` as vLLM's parser reads it: `--enable-dbo=x`."""
    if not arg.startswith("--"):
        return arg
    key, eq, value = arg.partition("=")
    return key.replace("_", "-") + eq + value


def micro_batching_problem(parallel) -> str | None:
    """Why SlimWise's per-token decode mask cannot serve this parallel configuration (vLLM's `ParallelConfig`
    or `parallel_settings`), or None. vLLM's own properties decide."""
    from vllm.config import ParallelConfig

    if ParallelConfig.use_ubatching.fget(parallel):
        what = "--enable-dbo" if parallel.enable_dbo else f"--ubatch-size {parallel.ubatch_size}"
        return (f"{what} (vLLM's micro-batching, dual-batch overlap) runs each step as micro-batches, and "
                "SlimWise's per-token decode mask assumes the step's rows whole: serve without it")
    if ParallelConfig.use_sequence_parallel_moe.fget(parallel):
        return ("sequence-parallel MoE (--enable-expert-parallel with tensor parallel "
                f"{parallel.tensor_parallel_size} x data parallel {parallel.data_parallel_size}, all2all "
                f"backend {parallel.all2all_backend}) gives each tensor-parallel rank a slice of the step's "
                "rows, and SlimWise's per-token decode mask assumes them whole: serve with "
                "--tensor-parallel-size 1 under data + expert parallel, or without expert parallel")
    return None


def refuse_micro_batching(parallel) -> None:
    problem = micro_batching_problem(parallel)
    if problem:
        raise SlimWiseError(problem)


def refuse_micro_batching_args(args: Sequence[str]) -> None:
    """`refuse_micro_batching` for a vLLM command line (`slimwise serve`'s pass-through options)."""
    refuse_micro_batching(parallel_settings(parallel_values_from_args(args)))


# ----- 2. expert counting -----------------------------------------------------------------------------------
def counting_paused() -> bool:
    """While torch.compile traces or a CUDA graph is captured: the counting hook's host syncs (`int(...)`)
    are illegal there and a replay would not run them, so the hook does nothing."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def counting_problem(count_experts: bool, enforce_eager: bool, on_cuda: bool) -> str | None:
    """Why expert counting cannot run on this engine, or None: a CUDA engine that is not eager replays CUDA
    graphs, in which the counting hook never runs."""
    if count_experts and on_cuda and not enforce_eager:
        return ("expert counting (slimwise_count_experts) runs in eager mode only: CUDA-graph replays skip "
                "its hook, so the counts would miss every replayed step; start the engine with "
                "enforce_eager=True (--enforce-eager)")
    return None


# ----- 3. monolithic MoE kernels ----------------------------------------------------------------------------
def moe_kernel_name(runner) -> str:
    """The experts kernel class a vLLM MoE layer (`MoERunner`) runs, or will run once its weights are
    processed (`FusedMoEMethodBase.is_monolithic` reads the same: fused_moe_method_base.py:135)."""
    method = runner.routed_experts.quant_method
    kernel = getattr(method, "moe_kernel", None)
    if kernel is not None:
        return type(kernel.fused_experts).__name__
    experts_cls = getattr(method, "experts_cls", None)
    return experts_cls.__name__ if experts_cls is not None else type(method).__name__


def moe_kernels(model: torch.nn.Module) -> dict[str, list]:
    """Per vLLM MoE layer: [the experts kernel it runs, whether it is monolithic] (what an operator checks on
    a GPU: `scripts/gpu_check.py --vllm`, `collective_rpc("slimwise_describe")`)."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import MoERunnerInterface

    return {name: [moe_kernel_name(module), bool(module.is_monolithic)]
            for name, module in model.named_modules() if isinstance(module, MoERunnerInterface)}


def routing_replaced(router) -> bool:
    """Whether SlimWise replaced this vLLM router's `_compute_routing` (an instance attribute: selection mask,
    pre-routed gates, a gates file), which only modular kernels call."""
    return router is not None and "_compute_routing" in vars(router)


def monolithic_problems(model: torch.nn.Module, on_cpu: bool | None = None) -> list[str]:
    """One line per MoE layer of `model` whose monolithic kernel bypasses a routing SlimWise installed on
    its router. The fix: vLLM's modular Triton kernels (`MOE_BACKEND_FIX`) on a GPU; on vLLM's CPU backend,
    whose int4 MoE kernels are all monolithic (oracle/int_wna16.py:128-129, 96-109), the unquantized
    checkpoint. `on_cpu` None: vLLM's platform here."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import MoERunnerInterface

    if on_cpu is None:
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
    fix = ("serve the unquantized checkpoint (vLLM's CPU int4 MoE kernels are all monolithic)" if on_cpu
           else f"serve with {MOE_BACKEND_FIX} (vLLM's modular kernels)")
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, MoERunnerInterface) or not module.is_monolithic:
            continue
        if routing_replaced(getattr(module, "router", None)):
            out.append(f"{name}: vLLM chose the monolithic MoE kernel {moe_kernel_name(module)}, which "
                       "routes inside the kernel and bypasses SlimWise's routing on this layer (selection "
                       f"mask or --gates drop/substitute): {fix}")
    return out


def rocm_router_problem(model: torch.nn.Module, hooked_gates: Sequence[str], on_rocm: bool) -> str | None:
    """GPT-OSS on ROCm computes router logits from the router's weight without calling the router module, so
    the SlimWise gate hook never runs (vllm/model_executor/models/gpt_oss.py:411-414)."""
    if on_rocm and hooked_gates and "GptOss" in type(model).__name__:
        return (f"{hooked_gates[0]}: vLLM's GPT-OSS on ROCm computes router logits without calling the "
                "router module, which bypasses SlimWise's gate hook: serve GPT-OSS with SlimWise on CUDA or "
                "CPU")
    return None


# ----- inside the worker ------------------------------------------------------------------------------------
def check_worker(model: torch.nn.Module, vllm_config, routing) -> None:
    """Every check above on a built SlimWise model (`models.SlimWiseMixin`): the first problem is raised."""
    from vllm.platforms import current_platform

    if routing.active:
        refuse_micro_batching(vllm_config.parallel_config)
    problem = counting_problem(routing.count_experts,
                               bool(getattr(vllm_config.model_config, "enforce_eager", False)),
                               current_platform.is_cuda_alike())
    problem = problem or rocm_router_problem(model, routing.hooked.get("gates", []),
                                             current_platform.is_rocm())
    if problem:
        raise SlimWiseError(problem)
    monolithic = monolithic_problems(model)
    if monolithic:
        more = f" (and {len(monolithic) - 1} more layers)" if len(monolithic) > 1 else ""
        raise SlimWiseError(monolithic[0] + more)
