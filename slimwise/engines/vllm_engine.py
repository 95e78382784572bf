"""`VllmEngine`: the evaluation engine protocol (generate(prompts, mode, config)) on real vLLM engines.

One vLLM engine per mode, built on demand with the SlimWise plugin's model class:
  full      stock architecture, no plan;
  slimwise  SlimWise class + plan: prompt tokens use every expert, generated tokens the kept ones;
  uniform   SlimWise class + plan with `slimwise_mask_all`: every token pruned (classic pruning);
  distilled slimwise + a decode-only delta.
With `share_engine=True`, full / slimwise / uniform run in one SlimWise engine (one start, one weight copy):
the mode switches between calls by `collective_rpc("slimwise_set_mode")` and the prefix cache is reset, "full"
being the SlimWise class with no token masked (its hooks pass every input through: stock tokens, tested).
An engine with a delta serves distilled and full (the delta acts on decode rows only); it refuses uniform.
Greedy outputs equal the reference engine's (`PhaseSplitEngine`) for the same token-id prompts.
vLLM spawns workers: construct this under an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Sequence
from pathlib import Path

from slimwise.decode_gates import PLAIN, DecodeGates
from slimwise.engines.reference import Generation, GenerationConfig, encode_prompts
from slimwise.errors import SlimWiseError
from slimwise.plan import PrunePlan
from slimwise.serving.models import register_config_hooks
from slimwise.serving.overrides import PlanLike, full_model_overrides, slimwise_overrides
from slimwise.serving.plugin import require_known_vllm
from slimwise.serving.routing import REQUEST_PLAN_ARG
from slimwise.serving.tokenizer import TOKENIZER_MODE


class VllmEngine:
    """Generate with vLLM in full / uniform / slimwise mode (one engine alive at a time)."""

    def __init__(
        self,
        model_dir: str | Path,
        plan: PrunePlan | dict[str, PlanLike] | None = None,
        tokenizer=None,
        *,
        dtype: str | None = None,
        enforce_eager: bool | None = None,
        max_model_len: int | None = None,
        min_decode_batch: int = 0,
        delta: str | Path | None = None,
        engine_kwargs: dict | None = None,
        share_engine: bool = False,
        default_plan: str | None = None,
        gates: DecodeGates = PLAIN,
        count_experts: bool = False,
        on_cpu: bool | None = None,
    ):
        """`dtype` / `enforce_eager` None: the platform's default (`engine_defaults`); `on_cpu` None: whether
        vLLM runs on its CPU backend here (`slimwise.serving.platform.vllm_on_cpu`)."""
        require_known_vllm()
        self.count_experts = count_experts
        self.gates = gates  # what pruned rows' gates do, and the fallback (slimwise.decode_gates)
        self.model_dir = str(model_dir)
        self.plan = plan
        self.tokenizer = tokenizer
        self.kwargs = engine_defaults(dtype, enforce_eager, engine_kwargs, on_cpu=on_cpu,
                                      count_experts=count_experts, routed=plan is not None or count_experts)
        register_config_hooks()  # this module may have been imported before vLLM: see models.py
        if max_model_len is not None:
            self.kwargs["max_model_len"] = max_model_len
        if "vision_config" in json.loads((Path(model_dir) / "config.json").read_text()):
            # a multimodal checkpoint (Qwen3.5/3.6-MoE's published class) fed text only: vLLM skips the vision
            # tower
            self.kwargs.setdefault("limit_mm_per_prompt", {"image": 0, "video": 0})
        self.min_decode_batch = min_decode_batch
        self.delta = delta  # applied in mode "distilled" (= slimwise + decode-only delta)
        self.share_engine = share_engine and plan is not None
        self.default_plan = default_plan  # several plans (`plan` a dict): the plan of prompts that name none
        self._mode: str | None = None
        self._kind: str | None = None  # the running engine: a mode, or "shared"
        self._shm_before: set[str] = set()
        self._checks = 0
        # whether any plan prunes an expert (an empty plan serves the full model: no mask for the self-check)
        plans = [] if plan is None else plan.values() if isinstance(plan, dict) else [plan]
        self._prunes = any(gates.drops_experts(p if isinstance(p, PrunePlan) else PrunePlan.load(Path(p)))
                           for p in plans)
        self.self_check: dict | None = None  # what the last start-up self-check verified (selfcheck.py)
        self.llm = None

    def _load_tokenizer(self) -> None:
        """Text prompts and no tokenizer given: the checkpoint's own (as `slimwise serve` loads it). Token-id
        prompts keep the tokenizer-free engine (no EOS unless the config names one), so the tokenizer can only
        join before the first engine starts. A checkpoint without one leaves it None: `encode_prompts` refuses
        the text."""
        if self.llm is not None:
            raise SlimWiseError("text prompts on an engine started without a tokenizer (token-id prompts "
                                "came first): pass VllmEngine(..., tokenizer=load_tokenizer(model_dir))")
        from slimwise.models import load_tokenizer

        self.tokenizer = load_tokenizer(self.model_dir)

    def _engine(self, mode: str):
        if mode == self._mode:
            return self.llm
        from vllm import LLM

        if mode != "full" and self.plan is None:
            raise SlimWiseError(f"mode {mode!r} needs a plan")
        if mode == "distilled" and self.delta is None:
            raise SlimWiseError("mode 'distilled' needs a delta (VllmEngine(..., delta=DIR))")
        kind = self._kind_of(mode)
        if kind.startswith("shared") and kind == self._kind:
            self._mode = mode
            self._switch()
            return self.llm
        self.close()
        if kind == "full":
            overrides = full_model_overrides(self.model_dir)
        else:
            overrides = slimwise_overrides(
                self.model_dir,
                self.plan,
                mask_all=mode == "uniform",
                default_plan=self.default_plan,
                min_decode_batch=self.min_decode_batch,
                delta=self.delta if kind in ("distilled", "shared-delta") else None,
                gates=self.gates,
                count_experts=self.count_experts,
            )
        from slimwise.serving import shm
        from slimwise.serving.runners import pin_v1_runner

        pin_v1_runner()  # before vLLM reads its environment for this engine (the plugin does it too)
        self._shm_before = shm.segments()  # tensor/pipeline-parallel workers leave segments there when killed
        with _cpu_rank_binding(self.kwargs):
            self.llm = LLM(model=self.model_dir, hf_overrides=overrides or None,
                           skip_tokenizer_init=self.tokenizer is None, seed=0, **self.kwargs)
        self._mode, self._kind = mode, kind
        if kind != "full" and self._prunes:  # fail closed: the mask must be in effect before any prompt
            from slimwise.serving.selfcheck import check_llm

            self._checks += 1
            try:
                self.self_check = check_llm(self.llm, int(self.kwargs.get("tensor_parallel_size") or 1),
                                            seed=self._checks)
            except BaseException:
                self.close()
                raise
        if kind.startswith("shared"):
            self._switch()
        return self.llm

    def _switch(self) -> None:
        """Put the running shared engine in `self._mode` with `self.min_decode_batch` (worker counters
        restart) and drop its prefix cache, whose blocks may have been computed under another mode."""
        self.llm.collective_rpc(
            "slimwise_set_mode",
            args=("slimwise" if self._mode == "distilled" else self._mode, self.min_decode_batch),
        )
        self.llm.reset_prefix_cache()

    def set_min_decode_batch(self, n: int) -> None:
        """Change the load-aware threshold; a running shared engine takes it at once (counters restart, prefix
        cache reset)."""
        self.min_decode_batch = int(n)
        if self.llm is not None and (self._kind or "").startswith("shared"):
            self._switch()
        elif self.llm is not None and self._mode != "full":
            self.close()  # an engine of its own read the threshold at start: the next call starts a new one

    def _kind_of(self, mode: str) -> str:
        """Which engine runs `mode`: its own (the mode's name), "shared" (full / slimwise / uniform) or
        "shared-delta" (full / distilled: the delta acts on decode rows only, so mode full is the full
        model)."""
        if not self.share_engine:
            return mode
        if mode == "distilled":
            return "shared-delta"
        if mode == "full" and self._kind in ("shared", "shared-delta"):
            return self._kind
        return "shared"

    def close(self) -> None:
        if self.llm is not None:
            # stop the EngineCore process now: relying on garbage collection left it running after the engine
            core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            del self.llm
            self.llm = None
            self._mode = self._kind = None
            gc.collect()
            if parallel_ranks_of(self.kwargs) > 1:
                # vLLM's shutdown force-kills the workers: unlink what they held
                from slimwise.serving import shm

                shm.remove_after_exit(self._shm_before)

    def counters(self) -> list[dict]:
        return self.llm.collective_rpc("slimwise_counters") if self.llm is not None else []

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        mode: str = "slimwise",
        config: GenerationConfig | None = None,
        plans: Sequence[str | None] | None = None,
    ) -> list[Generation]:
        """Greedy or sampled generation in `mode`; with several plans (`plan` a dict), `plans` names each
        prompt's plan (None: the default), as the OpenAI server's model names do."""
        from vllm import SamplingParams

        config = config or GenerationConfig()
        if self.tokenizer is None and any(isinstance(p, str) for p in prompts):
            self._load_tokenizer()
        ids = encode_prompts(self.tokenizer, prompts)
        eos = config.eos_token_id if config.eos_token_id is not None else (
            self.tokenizer.eos_token_id if self.tokenizer is not None else None)
        eos_ids = set(
            eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None and eos >= 0 else [])
        )
        params = SamplingParams(
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k if config.top_k > 0 else -1,
            max_tokens=config.max_new_tokens,
            seed=config.seed,
            stop=list(config.stop) or None,
            stop_token_ids=sorted(eos_ids) or None,
            ignore_eos=not eos_ids,
            detokenize=self.tokenizer is not None,
        )
        if plans is not None:
            if len(plans) != len(ids):
                raise SlimWiseError(f"{len(plans)} plan names for {len(ids)} prompts: give one per prompt")
            known = set(self.plan) if isinstance(self.plan, dict) else set()
            unknown = sorted({str(n) for n in plans if n is not None and n != "full" and n not in known})
            if unknown:
                raise SlimWiseError(
                    f"unknown plan names {unknown}: this engine serves {sorted(known)} and 'full'"
                )
            params = [params.clone() if n is None else _with_plan(params, n) for n in plans]
        outs = self._engine(mode).generate(
            [{"prompt_token_ids": p} for p in ids], params, use_tqdm=config.progress
        )
        results = []
        for p, out in zip(ids, outs, strict=True):
            o = out.outputs[0]
            tokens = list(o.token_ids)
            if tokens and tokens[-1] in eos_ids:
                reason = "eos"
            elif o.finish_reason == "stop":
                reason = "stop"
            else:
                reason = "length"
            text = o.text if self.tokenizer is not None else None
            if reason == "eos" and self.tokenizer is not None:
                text = self.tokenizer.decode(tokens[:-1])
            results.append(Generation(list(p), tokens, reason, text))
        return results


    def prompt_logprobs(self, sequences: Sequence[Sequence[int]], first: Sequence[int],
                        top_k: int = -1, mode: str = "full") -> list[tuple]:
        """Teacher-forced log-probs of `mode`'s model along each token sequence, from position `first[i]` on:
        for each sequence, (ids [T, K] long, log-probs [T, K] float32) where row t is the distribution of
        token first[i] + t given the tokens before it (vLLM's prompt log-probs: one prefill, no sampling).
        `top_k` -1 keeps the whole vocabulary; the engine needs `max_logprobs` at least that large
        (`engine_kwargs={"max_logprobs": -1}`)."""
        import torch
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k, detokenize=False)
        outs = self._engine(mode).generate([{"prompt_token_ids": list(q)} for q in sequences], params,
                                           use_tqdm=False)
        results = []
        for out, start in zip(outs, first, strict=True):
            rows = out.prompt_logprobs[start:]
            width = max(len(r) for r in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            values = torch.full((len(rows), width), float("-inf"))
            for t, row in enumerate(rows):  # order does not matter: the ids say where each value goes
                ids[t, :len(row)] = torch.tensor(list(row))
                values[t, :len(row)] = torch.tensor([v.logprob for v in row.values()])
            results.append((ids, values))
        return results


#: what `VllmEngine` sets on vLLM's CPU backend unless the caller chose otherwise: float32 (the tiny and
#: testbed models' reference dtype; bf16 is emulated on CPUs without bf16 units), eager mode, and an explicit
#: KV budget (the CPU backend otherwise reserves most of the RAM and refuses to start on a busy box). On a GPU
#: vLLM's own defaults stand: the checkpoint's dtype, CUDA graphs, `gpu_memory_utilization`.
CPU_DEFAULTS: dict = {"dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 512 << 20}


def engine_defaults(dtype: str | None = None, enforce_eager: bool | None = None,
                    engine_kwargs: dict | None = None, *, on_cpu: bool | None = None,
                    count_experts: bool = False, routed: bool = True) -> dict:
    """A `VllmEngine`'s `LLM(...)` keyword arguments: what the caller chose (`dtype`, `enforce_eager`, then
    `engine_kwargs`, which win) over the platform's defaults (`CPU_DEFAULTS` on vLLM's CPU backend, none
    elsewhere; an explicit `gpu_memory_utilization` drops the CPU KV budget; expert counting defaults to eager
    mode) and the checkpoint's own tokenizer (`TOKENIZER_MODE`: vLLM's AutoTokenizer may swap in a family
    class, serving/tokenizer.py). `on_cpu` None: `slimwise.serving.platform.vllm_on_cpu()`. Refuses, in one
    line, what SlimWise's routing (`routed`) cannot serve: micro-batching, and counting on a GPU engine that
    is not eager (`slimwise.serving.guards`)."""
    from slimwise.serving import guards
    from slimwise.serving.platform import vllm_on_cpu

    on_cpu = vllm_on_cpu() if on_cpu is None else on_cpu
    chosen = {k: v for k, v in (("dtype", dtype), ("enforce_eager", enforce_eager)) if v is not None}
    chosen.update(engine_kwargs or {})
    defaults = dict(CPU_DEFAULTS) if on_cpu else {}
    if "gpu_memory_utilization" in chosen:
        defaults.pop("kv_cache_memory_bytes", None)
    if count_experts:
        defaults["enforce_eager"] = True  # the counting hook runs in eager mode only
    kwargs = {**defaults, "tokenizer_mode": TOKENIZER_MODE, **chosen}
    parallel = {k: kwargs[k] for k in guards.PARALLEL_FIELDS if k in kwargs}
    if routed and parallel:
        guards.refuse_micro_batching(guards.parallel_settings(parallel))
    problem = guards.counting_problem(count_experts, bool(kwargs.get("enforce_eager", False)), not on_cpu)
    if problem:
        raise SlimWiseError(problem)
    return kwargs


def vllm_engine_kwargs(options: Sequence[str]) -> dict:
    """vLLM's own command-line options (`--tensor-parallel-size 2`, `--max-num-seqs=64`, `--enforce-eager`)
    as `LLM(...)` keyword arguments; values are read as JSON where they parse (numbers, booleans, objects)."""
    kwargs: dict = {}
    items = list(options)
    while items:
        option = items.pop(0)
        if not option.startswith("--") or option == "--":
            raise SlimWiseError(f"unexpected argument {option!r}: vLLM options look like --name VALUE")
        name, eq, value = option[2:].partition("=")
        if not eq:
            value = items.pop(0) if items and not items[0].startswith("--") else "true"
        try:
            kwargs[name.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[name.replace("-", "_")] = value
    return kwargs


def _with_plan(params, name: str):
    out = params.clone()
    out.extra_args = {**(out.extra_args or {}), REQUEST_PLAN_ARG: name}
    return out


@contextlib.contextmanager
def _cpu_rank_binding(kwargs: dict):
    """While the engine starts its workers: the per-rank core binding vLLM's CPU backend needs for tensor /
    pipeline parallel ranks on a single-NUMA-node machine (`slimwise.hardware.cpu_binding_env`), then the
    environment as it was."""
    from slimwise.hardware import cpu_binding_env, scoped_environ
    from slimwise.serving.platform import vllm_on_cpu

    with scoped_environ(cpu_binding_env(parallel_ranks_of(kwargs), vllm_on_cpu())):
        yield


def parallel_ranks_of(kwargs: dict) -> int:
    """Local ranks of an engine from its keyword arguments: tensor x pipeline parallel size."""
    return int(kwargs.get("tensor_parallel_size", 1)) * int(kwargs.get("pipeline_parallel_size", 1))
