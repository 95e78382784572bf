"""vLLM general plugin (entry point `vllm.general_plugins: slimwise`), run in every vLLM process.

0. Lets vLLM's Qwen3.5/3.6 model file import on a CPU build without torchvision (`compat.py`; no-op
   elsewhere).
1. Registers the SlimWise model classes with vLLM's ModelRegistry (lazily, by import path).
2. Registers the tokenizer mode "slimwise" (`tokenizer.py`): the checkpoint's own tokenizer.json, as the
   reference engine loads it; `slimwise serve` and `VllmEngine` select it.
3. Installs the model runners' per-step seams (`runners.py`: V1's `_model_forward` and `_dummy_run`; V2's
   ModelState comes from the SlimWise model classes) so that, before each forward, the model's
   `DecodeRouting` learns which scheduled tokens are generated tokens: position >= the request's prompt
   length. On vLLM 0.32 it pins the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0) unless the user chose.
Every step is idempotent (vLLM may load plugins several times per process).
"""

from __future__ import annotations

import logging
import os

from slimwise.serving.compat import install_torchvision_free_qwen_vl
from slimwise.serving.models import STOCK_ARCHS, slimwise_arch

logger = logging.getLogger("vllm.slimwise")  # under "vllm": printed by vLLM's log config in every process
#: vLLM releases whose internals the plugin was tested against (it wraps V1's `GPUModelRunner._model_forward`
#: and `_dummy_run`, gives V2 a ModelState, and replaces routers' `_compute_routing`);
#: pyproject pins the same
TESTED_VLLM = ("0.32.",)
ALLOW_UNTESTED_ENV = "SLIMWISE_ALLOW_UNTESTED_VLLM"


def vllm_problem() -> str | None:
    """Why SlimWise cannot run in this vLLM, or None. An untested release is refused unless
    ALLOW_UNTESTED_ENV=1; missing internals are refused always."""
    import os

    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(TESTED_VLLM) and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        return (
            f"SlimWise's vLLM plugin is tested with vLLM {', '.join(v + 'x' for v in TESTED_VLLM)}, not "
            f"{version}: install a tested release (pip install 'slimwise[gpu]' or [cpu]), or set "
            f"{ALLOW_UNTESTED_ENV}=1 to try"
        )
    from slimwise.serving.runners import v1_problem, v2_problem

    for runner, problem in (("V1", v1_problem()), ("V2", v2_problem())):
        if problem:
            return f"vLLM {version}'s model runner {runner}: {problem}; SlimWise cannot set its steps"
    return None


def require_known_vllm() -> None:
    """Refuse, with one line, a vLLM whose internals the plugin does not know (before any engine starts)."""
    from slimwise.errors import SlimWiseError

    problem = vllm_problem()
    if problem:
        raise SlimWiseError(problem)


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
    from slimwise.serving.runners import V2_ENV, patch_v1_runner, pin_v1_runner

    if pin_v1_runner() != "0":
        logger.warning("SlimWise: %s=%s: Model Runner V2 sets SlimWise's steps through its ModelState seam, "
                       "which no GPU run has checked yet; the start-up self-check refuses if the plan is not "
                       "in effect", V2_ENV, os.environ.get(V2_ENV))
    patch_v1_runner()
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
    from slimwise.serving.guards import moe_kernels

    model = worker.model_runner.get_model()
    routing = getattr(model, "slimwise", None)
    return {**(routing.describe() if routing is not None else {}), "moe_kernels": moe_kernels(model)}


def read_counters(worker) -> dict:
    """For `LLM.collective_rpc(read_counters)`: the routing counters of a worker's model."""
    routing = getattr(worker.model_runner.get_model(), "slimwise", None)
    if routing is None or not routing.active:
        return {}
    return {**routing.counters.as_dict(), "runner": routing.runner, "plan_names": routing.plan_names,
            "rows_seen": routing.rows_seen.tolist(), "counted_layer": routing.counted_layer,
            "counted_prunes": routing.counted_prunes, "mode": routing.mode,
            "min_decode_batch": routing.min_decode_batch, "gates_plain": routing.gates.plain}
