"""vLLM general plugin (entry point `vllm.general_plugins: slimwise`), run in every vLLM process.

0. Lets vLLM's Qwen3.5/3.6 model file import on a CPU build without torchvision (`compat.py`; no-op
   elsewhere).
1. Registers the SlimWise model classes with vLLM's ModelRegistry (lazily, by import path).
2. Registers the tokenizer mode "slimwise" (`tokenizer.py`): the checkpoint's own tokenizer.json, as the
   reference engine loads it; `slimwise serve` and `VllmEngine` select it.
3. Wraps the model runner's `_model_forward` (the documented per-step override point, outside any compiled
   region or CUDA graph) so that, before each forward, the model's `DecodeRouting` learns which scheduled
   tokens are generated tokens: position >= the request's prompt length.
Every step is idempotent (vLLM may load plugins several times per process).
"""

from __future__ import annotations

import logging

import numpy as np

from slimwise.serving.compat import install_torchvision_free_qwen_vl
from slimwise.serving.models import STOCK_ARCHS, slimwise_arch

logger = logging.getLogger("vllm.slimwise")  # under "vllm": printed by vLLM's log config in every process
_NO_ROUTING = object()
#: vLLM releases whose internals the plugin was tested against (it wraps `GPUModelRunner._model_forward` and
#: reads the runner's `input_batch` and `query_start_loc`, and replaces routers' `_compute_routing`);
#: pyproject pins the same
TESTED_VLLM = ("0.32.",)
ALLOW_UNTESTED_ENV = "SLIMWISE_ALLOW_UNTESTED_VLLM"


def vllm_problem() -> str | None:
    """Why SlimWise cannot run in this vLLM, or None. An untested release is refused unless
    ALLOW_UNTESTED_ENV=1; missing internals are refused always."""
    import inspect
    import os

    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(TESTED_VLLM) and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        return (
            f"SlimWise's vLLM plugin is tested with vLLM {', '.join(v + 'x' for v in TESTED_VLLM)}, not "
            f"{version}: install a tested release (pip install 'slimwise[gpu]' or [cpu]), or set "
            f"{ALLOW_UNTESTED_ENV}=1 to try"
        )
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError as exc:
        return (
            f"vLLM {version} has no vllm.v1.worker.gpu_model_runner ({exc}); SlimWise cannot hook its steps"
        )
    forward = getattr(GPUModelRunner, "_model_forward", None)
    if forward is None or "positions" not in inspect.signature(forward).parameters:
        return (
            f"vLLM {version}'s GPUModelRunner._model_forward(positions=...) is gone; SlimWise "
            "cannot hook its steps"
        )
    return None


def require_known_vllm() -> None:
    """Refuse, with one line, a vLLM whose internals the plugin does not know (before any engine starts)."""
    from slimwise.errors import SlimWiseError

    problem = vllm_problem()
    if problem:
        raise SlimWiseError(problem)


def _routing_of(runner):
    cached = getattr(runner, "_slimwise_routing", None)
    if cached is None:
        model = runner.get_model()
        routing = getattr(model, "slimwise", None)
        cached = routing if routing is not None and routing.active else _NO_ROUTING
        runner._slimwise_routing = cached
    return None if cached is _NO_ROUTING else cached


def _patch_model_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_slimwise_patched", False):
        return
    original = GPUModelRunner._model_forward

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                       **model_kwargs):
        routing = _routing_of(self)
        if routing is not None and positions is not None:
            num_reqs = self.input_batch.num_reqs
            starts = self.query_start_loc.np[: num_reqs + 1]
            counts = np.diff(starts)
            prompt_lens = np.repeat(self.input_batch.num_prompt_tokens[:num_reqs], counts)
            # each token's index in its sequence, from host data (no device sync): tokens already computed for
            # its request (prefix-cache hits and earlier chunks included) plus its offset in this step's query
            offsets = np.arange(int(starts[-1])) - np.repeat(starts[:-1], counts)
            token_positions = np.repeat(self.input_batch.num_computed_tokens_cpu[:num_reqs], counts) + offsets
            token_plans = None
            if routing.multi_plan:  # each request's own plan (SamplingParams.extra_args), per token
                req_ids = self.input_batch.req_ids[:num_reqs]
                plans = routing.request_plans(req_ids, [self.requests[r].sampling_params for r in req_ids])
                token_plans = np.repeat(plans, counts)
            routing.set_step(token_positions, prompt_lens, positions, token_plans)
        return original(
            self,
            input_ids=input_ids,
            positions=positions,
            intermediate_tensors=intermediate_tensors,
            inputs_embeds=inputs_embeds,
            **model_kwargs,
        )

    GPUModelRunner._model_forward = _model_forward
    GPUModelRunner._slimwise_patched = True


def register() -> None:
    from vllm import ModelRegistry

    install_torchvision_free_qwen_vl()  # stock Qwen3.5/3.6 classes import too (CPU build without torchvision)
    problem = vllm_problem()
    if problem:
        # stock vLLM keeps working; SlimWise's own entry points refuse with this line (require_known_vllm)
        logger.warning("SlimWise plugin inactive: %s", problem)
        return

    for stock in STOCK_ARCHS:
        name = slimwise_arch(stock)
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, f"slimwise.serving.models:{name}")
    from slimwise.serving.tokenizer import register_tokenizer_mode

    register_tokenizer_mode()
    _patch_model_runner()
    _add_worker_method()


def _add_worker_method() -> None:
    """`LLM.collective_rpc("slimwise_counters")` reads each worker's routing counters,
    `collective_rpc("slimwise_describe")` names the modules its routing hooks and
    `collective_rpc("slimwise_set_mode", args=(mode, min_decode_batch))` switches full / slimwise / uniform
    between steps (by method name: no pickled callables)."""
    from vllm.v1.worker.worker_base import WorkerBase

    if not hasattr(WorkerBase, "slimwise_counters"):
        WorkerBase.slimwise_counters = read_counters
    if not hasattr(WorkerBase, "slimwise_set_mode"):
        WorkerBase.slimwise_set_mode = set_mode
    if not hasattr(WorkerBase, "slimwise_describe"):
        WorkerBase.slimwise_describe = describe


def set_mode(worker, mode: str, min_decode_batch: int | None = None) -> dict:
    """For `LLM.collective_rpc("slimwise_set_mode", ...)`: switch the worker's served mode (see
    DecodeRouting)."""
    from slimwise.errors import SlimWiseError

    routing = getattr(worker.model_runner.get_model(), "slimwise", None)
    if routing is None:
        if mode != "full":
            raise SlimWiseError(
                f"mode {mode!r}: this engine runs a stock model class; serve it with a SlimWise plan"
            )
        return {"mode": "full", "min_decode_batch": 0}
    return routing.set_mode(mode, min_decode_batch)


def describe(worker) -> dict:
    """For `LLM.collective_rpc("slimwise_describe")`: where this worker's routing acts (vLLM module names)."""
    routing = getattr(worker.model_runner.get_model(), "slimwise", None)
    return routing.describe() if routing is not None else {}


def read_counters(worker) -> dict:
    """For `LLM.collective_rpc(read_counters)`: the routing counters of a worker's model."""
    routing = _routing_of(worker.model_runner)
    return routing.counters.as_dict() if routing is not None else {}
