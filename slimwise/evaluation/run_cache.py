"""Generations of one mode and plan (with traffic, KL and seconds): produced once, cached on disk as JSON.

Invariants:
- a run lives in `<cache_dir>/run-<mode>-<key>.json`, the key the digest of the model fingerprint, the prompt
  token ids, mode, engine, dtype, the delta's manifest (mode distilled only), the kept-expert set, the
  generation settings and whether KL and traffic were measured: whatever changes the outputs changes the
  key, while a plan's label or file does not (plans with identical kept sets share a run).
- the file holds {"gens": [{"token_ids", "finish_reason", "text"}], "seconds", "traffic", "kl",
  "kl_seconds"}; `cached` is added to the returned record, never stored.
- `other` runs (the other-domain problems) measure accuracy and lengths only: no traffic, no KL.
- KL(full || mode) is teacher-forced over the full model's own continuations on the main problems.
- vLLM: one engine per kept set serves full, uniform and slimwise (the mode switched in place), and mode full
  runs on the first plan's engine (`first_spec`); reference engines are made and closed per run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from slimwise.engines.reference import Generation, GenerationConfig, PhaseSplitEngine
from slimwise.evaluation.cache_keys import digest
from slimwise.evaluation.config import KL_REFERENCE_BYTES, EvalConfig, PlanSpec
from slimwise.evaluation.evaluated_model import EvaluatedModel
from slimwise.evaluation.metrics import teacher_forced_kl
from slimwise.evaluation.reference_traffic import DecodeTrafficMeter
from slimwise.evaluation.runs import active_experts, close_engine, make_engine
from slimwise.io import atomic_write_text
from slimwise.plan import PrunePlan


def gen_to_json(g: Generation) -> dict:
    return {"token_ids": g.token_ids, "finish_reason": g.finish_reason, "text": g.text}


def gen_from_json(d: dict, prompt_ids: list[int]) -> Generation:
    return Generation(prompt_ids, list(d["token_ids"]), d["finish_reason"], d.get("text"))


class RunCache:
    """Every run of one model on one set of problems (and on the other-domain problems), read from disk when
    present."""

    def __init__(self, subject: EvaluatedModel, config: EvalConfig, cache_dir: Path,
                 gen_config: GenerationConfig, delta: Any, prompt_ids: list[list[int]],
                 other_prompt_ids: list[list[int]]):
        self.subject = subject
        self.config = config
        self.cache_dir = cache_dir
        self.gen_config = gen_config
        self.delta = delta
        self.prompt_ids = prompt_ids
        self.other_prompt_ids = other_prompt_ids
        self.first_spec: PlanSpec | None = None  # the plan whose vLLM engine also runs mode full
        self._full: dict[bool, dict[str, Any]] = {}  # other -> the full model's record
        self._kl_reference: dict[int, torch.Tensor] = {}
        self._shared: tuple[str | None, Any] | None = None  # (kept_key, vLLM engine) kept across modes

    def key(self, mode: str, spec: PlanSpec | None, other: bool = False) -> str:
        g = self.gen_config
        delta = digest(self.delta.manifest) if mode == "distilled" and self.delta is not None else None
        prompts = self.other_prompt_ids if other else self.prompt_ids
        # uniform pruning keeps the static plan under a batch budget (a decode-step choice): runs are shared
        gates = self.config.decode_gates.static if mode == "uniform" else self.config.decode_gates
        # the field names and values are the cache file names of every existing run: never rename them (a
        # run with the plain gates has no "gates" field, as before there were others)
        return digest({"fp": self.subject.fingerprint, "prompts": prompts, "mode": mode,
                       "engine": self.config.engine, "dtype": self.subject.dtype, "delta": delta,
                       "kept": spec.kept_key if spec else None, "max_new": g.max_new_tokens,
                       "bs": g.batch_size, "t": g.temperature, "seed": g.seed,
                       "kl": self.config.kl and not other, "traffic": self.config.traffic and not other,
                       **({"gates": gates.describe()} if not gates.plain and mode != "full" else {})})

    def full(self, other: bool = False) -> dict[str, Any]:
        """The full model's record, generated (or read) once."""
        if other not in self._full:
            self._full[other] = self.generate("full", None, other)
        return self._full[other]

    def generate(self, mode: str, spec: PlanSpec | None, other: bool = False) -> dict[str, Any]:
        """Generations (+ traffic, KL, seconds) of one mode and plan, from the cache when present.
        `other`: the other-domain problems."""
        prompt_ids = self.other_prompt_ids if other else self.prompt_ids
        path = self.cache_dir / f"run-{mode}-{self.key(mode, spec, other)}.json"
        if self.config.cache and path.is_file():
            rec = json.loads(path.read_text())
            rec["gens"] = [gen_from_json(d, p) for d, p in zip(rec["gens"], prompt_ids, strict=True)]
            rec["cached"] = True
            return rec
        gens, seconds, meter, fallback = self._produce(mode, spec, other, prompt_ids)
        rec = {"gens": gens, "seconds": seconds, "traffic": meter.summary() if meter else None, "kl": None,
               "kl_seconds": 0.0, "fallback": fallback}
        if self.config.kl and not other and mode != "full":
            t0 = time.perf_counter()
            rec["kl"] = self._kl(mode, spec.plan if spec else None)
            rec["kl_seconds"] = time.perf_counter() - t0
        elif self.config.kl and not other:
            rec["kl"] = [0.0] * len(gens)  # full against itself: 0 at every position, no forward pass spent
        if self.config.cache:
            atomic_write_text(path, json.dumps({**rec, "gens": [gen_to_json(g) for g in gens]}))
        rec["cached"] = False
        return rec

    def _produce(self, mode: str, spec: PlanSpec | None, other: bool, prompt_ids: list[list[int]]
                 ) -> tuple[list[Generation], float, DecodeTrafficMeter | None, dict | None]:
        """Generate on the run's engine; traffic is metered by router hooks, so on reference engines only
        (and on the main problems only), as is the fallback summary (gates other than plain)."""
        engine, owned = self._engine(mode, spec)
        hf = isinstance(engine, PhaseSplitEngine)
        meter = None
        if self.config.traffic and hf and not other:
            active = active_experts(spec.plan if spec else None, mode)
            meter = DecodeTrafficMeter(self.subject.model, active, self.config.batch_size)
        try:
            t0 = time.perf_counter()
            if hf:
                gens = engine.generate(prompt_ids, mode=mode, config=self.gen_config, observer=meter)
            else:
                gens = engine.generate(prompt_ids, mode, self.gen_config)
            seconds = time.perf_counter() - t0
            mask = getattr(engine, "mask", None) if hf else None
            fallback = mask.fallback_summary() if mask is not None and not mask.gates.plain else None
        finally:
            if meter is not None:
                meter.remove()
            if owned:
                close_engine(engine)
        tokenizer = self.subject.tokenizer
        if tokenizer is not None:
            for g in gens:
                if g.text is None:
                    g.text = tokenizer.decode(g.token_ids[:-1] if g.finish_reason == "eos" else g.token_ids)
        return gens, seconds, meter, fallback

    def _kl(self, mode: str, plan: PrunePlan | None) -> list[float]:
        s = self.subject
        delta = self.delta if mode == "distilled" else None
        engine = make_engine("hf", s.model, s.tokenizer, plan, None, delta, gates=self.config.decode_gates)
        conts = [g.token_ids for g in self.full()["gens"]]
        vocab = int(getattr(s.adapter.text_config(s.model.config), "vocab_size", 0) or 0)
        # keep the full model's log-probs across plans only while they are small (testbed vocabularies)
        reference = self._kl_reference if vocab * sum(map(len, conts)) * 4 <= KL_REFERENCE_BYTES else None
        try:
            return teacher_forced_kl(engine, self.prompt_ids, conts, mode, self.config.kl_batch_size,
                                     reference)
        finally:
            engine.close()

    def _engine(self, mode: str, spec: PlanSpec | None) -> tuple[Any, bool]:
        """The engine for one run and whether the caller closes it. vLLM engines are kept across the modes
        of a plan (full runs on the first plan's engine): one engine start per plan instead of one per run."""
        s = self.subject
        delta = self.delta if mode == "distilled" else None
        if self.config.engine != "vllm" or delta is not None:
            return make_engine(self.config.engine, s.model, s.tokenizer, spec.plan if spec else None, s.path,
                               delta, gates=self.config.decode_gates), True
        spec = spec or self.first_spec
        key = spec.kept_key if spec else None
        if self._shared is None or self._shared[0] != key:
            self.release_shared_engine()
            plan = spec.plan if spec else None
            self._shared = (key, make_engine("vllm", s.model, s.tokenizer, plan, s.path, share=True,
                                             gates=self.config.decode_gates))
        return self._shared[1], False

    def release_shared_engine(self) -> None:
        """Stop the vLLM engine kept across a plan's modes (its EngineCore process holds the weights and
        the KV cache)."""
        if self._shared is not None:
            close_engine(self._shared[1])
            self._shared = None

    def close(self) -> None:
        self.release_shared_engine()
        self._kl_reference.clear()
