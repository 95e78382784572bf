"""The seams through which each vLLM model runner tells `DecodeRouting` which scheduled rows are generated.

A row is a generated (decode) token iff its position is at or past its request's prompt length. Both runners
reach that rule through `step_rows`, from host bookkeeping only (no device sync):

* **V1** (`vllm.v1.worker.gpu_model_runner.GPUModelRunner`; the CPU runner subclasses it): `_model_forward`
  is wrapped (the documented per-step override point, outside compiled regions and CUDA graphs);
  `_dummy_run` (profiling, warm-up, capture, DP padding) is wrapped to set an all-full dummy step.
* **V2** (`vllm.v1.worker.gpu.model_runner.GPUModelRunner`, CUDA's default in vLLM 0.32 and the only GPU
  runner in 0.34): V2 never calls `_model_forward`. The SlimWise model classes return a `ModelState`
  (`get_model_state_cls`, V2's model-owned seam) that records each request's prompt length and plan in
  `add_request`, sets the step in `preprocess_state` ("run on real batches before the forward pass") and a
  dummy step in `prepare_inputs` / `prepare_dummy_inputs` when no real batch was prepared.

Either way the model's forward calls `DecodeRouting.take_step`, which raises when no seam set the state for
that forward: a runner that calls neither seam fails at its first (profiling) forward instead of serving the
full model. Where no Python runs per step (full CUDA-graph replay), the row counter inside the graph
(`row_counts.py`) and the start-up self-check (`selfcheck.py`) catch it.
"""

from __future__ import annotations

import logging
import os

import numpy as np

logger = logging.getLogger("vllm.slimwise")

#: vLLM's switch between its model runners (config/vllm.py `use_v2_model_runner`); SlimWise pins V1 on 0.32
#: until a V2 engine has passed the self-check on a GPU (docs/serving.md, "What ran where")
V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def pin_v1_runner(environ=os.environ) -> str:
    """Set VLLM_USE_V2_MODEL_RUNNER=0 unless the user chose; returns what is in force ("0", "1")."""
    return environ.setdefault(V2_ENV, "0")


def step_rows(query_start_loc: np.ndarray, num_computed: np.ndarray, prompt_lens: np.ndarray,
              plans: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Per scheduled token: its index in its request's sequence (tokens already computed, prefix-cache hits
    and earlier chunks included, plus its offset in this step's query), its request's prompt length and
    plan. Inputs are per request, in batch order; query_start_loc has one more entry."""
    starts = np.asarray(query_start_loc)
    counts = np.diff(starts)
    offsets = np.arange(int(starts[-1]) - int(starts[0])) - np.repeat(starts[:-1] - starts[0], counts)
    positions = np.repeat(np.asarray(num_computed, dtype=np.int64), counts) + offsets
    token_plans = None if plans is None else np.repeat(np.asarray(plans, dtype=np.int64), counts)
    return positions, np.repeat(np.asarray(prompt_lens, dtype=np.int64), counts), token_plans


# ---------------------------------------------------------------------------------------------------- V1 --

_NO_ROUTING = object()


def routing_of(runner):
    """The active `DecodeRouting` of a runner's model (cached on the runner), or None."""
    cached = getattr(runner, "_slimwise_routing", None)
    if cached is None:
        model = runner.get_model()
        routing = getattr(model, "slimwise", None)
        cached = routing if routing is not None and routing.active else _NO_ROUTING
        runner._slimwise_routing = cached
        if cached is not _NO_ROUTING:
            routing.runner = f"V1 ({type(runner).__module__}.{type(runner).__name__})"
            logger.info("SlimWise: decode rows set per step by vLLM's V1 model runner (%s)",
                        type(runner).__name__)
    return None if cached is _NO_ROUTING else cached


def patch_v1_runner() -> bool:
    """Wrap V1's `_model_forward` and `_dummy_run` (idempotent); False where this vLLM has no V1 runner."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    if getattr(GPUModelRunner, "_slimwise_patched", False):
        return True
    forward, dummy = GPUModelRunner._model_forward, GPUModelRunner._dummy_run

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                       **model_kwargs):
        routing = routing_of(self)
        if routing is not None and positions is not None:
            num_reqs = self.input_batch.num_reqs
            plans = None
            if routing.multi_plan:  # each request's own plan (SamplingParams.extra_args)
                req_ids = self.input_batch.req_ids[:num_reqs]
                plans = routing.request_plans(req_ids, [self.requests[r].sampling_params for r in req_ids])
            token_positions, prompt_lens, token_plans = step_rows(
                self.query_start_loc.np[: num_reqs + 1], self.input_batch.num_computed_tokens_cpu[:num_reqs],
                self.input_batch.num_prompt_tokens[:num_reqs], plans)
            routing.set_step(token_positions, prompt_lens, positions, token_plans)
        return forward(self, input_ids=input_ids, positions=positions,
                       intermediate_tensors=intermediate_tensors, inputs_embeds=inputs_embeds, **model_kwargs)

    def _dummy_run(self, *args, **kwargs):
        routing = routing_of(self) if getattr(self, "model", None) is not None else None
        if routing is not None:
            routing.set_dummy_step()
        return dummy(self, *args, **kwargs)

    GPUModelRunner._model_forward = _model_forward
    GPUModelRunner._dummy_run = _dummy_run
    GPUModelRunner._slimwise_patched = True
    GPUModelRunner._slimwise_stock = {"_model_forward": forward, "_dummy_run": dummy}
    return True


def v1_problem() -> str | None:
    """Why V1's seam cannot be wrapped in this vLLM (None: it can, or there is no V1 runner)."""
    import inspect

    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return None
    forward = getattr(GPUModelRunner, "_model_forward", None)
    if forward is None or "positions" not in inspect.signature(forward).parameters:
        return "GPUModelRunner._model_forward(positions=...) is gone"
    if getattr(GPUModelRunner, "_dummy_run", None) is None:
        return "GPUModelRunner._dummy_run is gone"
    return None


# ---------------------------------------------------------------------------------------------------- V2 --

_V2_STATES: dict[type, type] = {}


def v2_problem() -> str | None:
    """Why V2's ModelState seam cannot be used in this vLLM (None: it can, or there is no V2 runner)."""
    import inspect

    try:
        from vllm.v1.worker.gpu.model_states.interface import ModelState
    except ImportError:
        return None
    for name in ("add_request", "remove_request", "preprocess_state", "prepare_inputs",
                 "prepare_dummy_inputs"):
        if not callable(getattr(ModelState, name, None)):
            return f"ModelState.{name} is gone"
    if "input_batch" not in inspect.signature(ModelState.preprocess_state).parameters:
        return "ModelState.preprocess_state(input_batch, ...) changed"
    return None


def model_state_cls(vllm_config, base: type | None = None) -> type:
    """The `ModelState` class V2 would pick for this model (`base` where the stock class names its own;
    hybrids: Mamba's; else the default, as `resolve_model_state_cls` decides for decoder-only models), with
    the SlimWise seam mixed in. vLLM calls this through the model's `get_model_state_cls`."""
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    model_config = vllm_config.model_config
    if base is not None:
        pass
    elif model_config.is_hybrid or model_config.is_attention_free:
        from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

        base = MambaHybridModelState
    else:
        base = DefaultModelState
    cls = _V2_STATES.get(base)
    if cls is None:
        cls = type(f"SlimWise{base.__name__}", (SlimWiseStateMixin, base), {"__module__": __name__})
        _V2_STATES[base] = cls
    return cls


class SlimWiseStateMixin:
    """V2's per-request, per-step seam for `DecodeRouting` (mixed over V2's own ModelState class). Arguments
    SlimWise does not read pass through untouched (`*args`), so a release that adds some keeps working; what
    it reads (the batch's host arrays, a new request's prompt length and sampling parameters) is checked by
    `v2_problem` and the start-up self-check."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        routing = getattr(self.model, "slimwise", None)
        self.slimwise = routing if routing is not None and routing.active else None
        # per request slot (V2's req_index): prompt length and plan index, set in add_request
        self.slimwise_prompt_len = np.zeros(self.max_num_reqs, dtype=np.int64)
        self.slimwise_plan = np.zeros(self.max_num_reqs, dtype=np.int64)
        self.slimwise_real_step = False
        if self.slimwise is not None:
            self.slimwise.runner = f"V2 ({type(self).__bases__[1].__name__})"
            logger.info("SlimWise: decode rows set per step by vLLM's Model Runner V2 (ModelState seam)")

    def add_request(self, req_index: int, new_req_data, *args, **kwargs) -> None:
        super().add_request(req_index, new_req_data, *args, **kwargs)
        if self.slimwise is None:
            return
        self.slimwise_prompt_len[req_index] = new_req_data.prompt_len
        self.slimwise_plan[req_index] = self.slimwise.plan_of(new_req_data.req_id,
                                                              new_req_data.sampling_params)

    def preprocess_state(self, input_batch, *args, **kwargs) -> None:
        super().preprocess_state(input_batch, *args, **kwargs)
        routing = self.slimwise
        if routing is None:
            return
        n_reqs = input_batch.num_reqs
        slots = input_batch.idx_mapping_np[:n_reqs]
        token_positions, prompt_lens, token_plans = step_rows(
            input_batch.query_start_loc_np[: n_reqs + 1], input_batch.num_computed_tokens_np[:n_reqs],
            self.slimwise_prompt_len[slots], self.slimwise_plan[slots] if routing.multi_plan else None)
        routing.set_step(token_positions, prompt_lens, input_batch.positions, token_plans)
        self.slimwise_real_step = True

    def prepare_inputs(self, input_batch, *args, **kwargs):
        # called for real and dummy batches alike; a real one came through preprocess_state first
        if self.slimwise is not None and not self.slimwise_real_step:
            self.slimwise.set_dummy_step()
        self.slimwise_real_step = False
        return super().prepare_inputs(input_batch, *args, **kwargs)

    def prepare_dummy_inputs(self, *args, **kwargs):
        if self.slimwise is not None:  # CUDA-graph capture: no request
            self.slimwise.set_dummy_step()
        return super().prepare_dummy_inputs(*args, **kwargs)
