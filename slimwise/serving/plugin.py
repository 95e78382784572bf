"""vLLM general plugin (entry point `vllm.general_plugins: slimwise`), run in every vLLM process.

0. Lets vLLM's Qwen3.5/3.6 model file import on a CPU build without torchvision (`compat.py`; no-op elsewhere).
1. Registers the SlimWise model classes with vLLM's ModelRegistry (lazily, by import path).
2. Wraps the model runner's `_model_forward` (the documented per-step override point, outside any compiled
   region or CUDA graph) so that, before each forward, the model's `DecodeRouting` learns which scheduled
   tokens are generated tokens: position >= the request's prompt length.
Both steps are idempotent (vLLM may load plugins several times per process).
"""

from __future__ import annotations

import logging

import numpy as np

from slimwise.serving.compat import install_torchvision_free_qwen_vl
from slimwise.serving.models import STOCK_ARCHS, slimwise_arch

logger = logging.getLogger("vllm.slimwise")  # under "vllm": printed by vLLM's log config in every process
_NO_ROUTING = object()


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
            prompt_lens = np.repeat(self.input_batch.num_prompt_tokens[:num_reqs], np.diff(starts))
            routing.set_step(positions[0] if positions.dim() == 2 else positions, prompt_lens)
        return original(self, input_ids=input_ids, positions=positions, intermediate_tensors=intermediate_tensors,
                        inputs_embeds=inputs_embeds, **model_kwargs)

    GPUModelRunner._model_forward = _model_forward
    GPUModelRunner._slimwise_patched = True


def register() -> None:
    from vllm import ModelRegistry

    install_torchvision_free_qwen_vl()  # stock Qwen3.5/3.6 classes import too (CPU build without torchvision)

    for stock in STOCK_ARCHS:
        name = slimwise_arch(stock)
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, f"slimwise.serving.models:{name}")
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
    """For `LLM.collective_rpc("slimwise_set_mode", ...)`: switch the worker's served mode (see DecodeRouting)."""
    from slimwise.errors import SlimWiseError

    routing = getattr(worker.model_runner.get_model(), "slimwise", None)
    if routing is None:
        if mode != "full":
            raise SlimWiseError(f"mode {mode!r}: this engine runs a stock model class; serve it with a SlimWise plan")
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
