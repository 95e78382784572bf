"""`python -m lab.perf.cli calib-cost`: the statistics pass (`ExpertObserver`) against all-experts observers,
in tokens/s.

SlimWise's `ExpertObserver` runs each expert only on the tokens routed to it, sorted by expert, as the
model's own experts forward does. Two all-experts baselines run every expert on every token:

- `ReapHookObserver` is what REAP's observer does (CerebrasResearch/reap, `observer.py`): a forward hook on
  the MoE block, so the model's own MoE forward runs as usual and then every expert runs again on every token
  for the statistics. This is the baseline of the issue's bar.
- `AllExpertsObserver` is a cheaper all-experts pass that also reuses those outputs as the layer's output
  (no separate model forward). It bounds what any all-experts observer can cost.

All three produce the same routed-token statistics (the all-experts ones additionally record every expert's
output norm on every token, which is what their extra work buys), so the comparison is on equal output, same
model, same data, same generation loop. Rounds rotate the order of the observers; medians are reported. The
bar: ours >= (E/k)/2 times the REAP observer's tokens/s.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from slimwise.calibrate import ExpertObserver, Phase
from slimwise.errors import SlimWiseError
from slimwise.io import atomic_write_text


class AllExpertsObserver(ExpertObserver):
    """Every expert on every token (REAP-style). Model outputs and routed statistics equal ExpertObserver's;
    `all_norm_sum[row, e]` additionally sums ||f_e(x)|| over every counted token."""

    def __init__(self, model, phase: Phase, adapter=None):
        super().__init__(model, phase, adapter)
        self.all_norm_sum = torch.zeros(len(self.layers), self.stats.num_experts, dtype=torch.float64)

    def _expert_outputs(self, row, experts, hidden_states, token_of, counts, rows):
        y = torch.empty(token_of.numel(), hidden_states.shape[-1], dtype=hidden_states.dtype)
        start = 0
        for e, n in enumerate(counts.tolist()):
            y_all = self.adapter.expert_forward(experts, e, hidden_states)  # every token, routed or not
            if rows is not None:
                self.all_norm_sum[row, e] += torch.linalg.vector_norm(
                    y_all[rows], dim=-1, dtype=torch.float64
                ).sum()
            y[start:start + n] = y_all[token_of[start:start + n]]
            start += n
        return y, torch.linalg.vector_norm(y, dim=-1, dtype=torch.float64)  # no float64 copy of y


class ReapHookObserver(AllExpertsObserver):
    """REAP's observer: the model's own experts forward gives the layer output; a hook then runs every expert
    on every token for the statistics (REAP keeps them all in one (E, tokens, hidden) tensor; we only
    reduce)."""

    def _make_forward(self, row: int, layer):
        statistics_pass = super()._make_forward(row, layer)
        experts = layer.experts
        own_forward = type(experts).forward

        def forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            out = own_forward(experts, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
            statistics_pass(hidden_states, top_k_index, top_k_weights)  # the hook; its output is discarded
            return out

        return forward


class ExpertLoopObserver(ExpertObserver):
    """The observer before the grouped one (the "before" of the statistics-pass benchmark): the hit experts in
    a Python loop, one `expert_forward` and one norm per expert, `counts` copied to the host once per layer
    and forward; the same statistics."""

    def _expert_outputs(self, row, experts, hidden_states, token_of, counts, rows):
        x = hidden_states[token_of]
        y = torch.zeros_like(x)
        norms = torch.zeros(token_of.numel(), dtype=torch.float64, device=x.device)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                y[start:start + n] = self.adapter.expert_forward(experts, e, x[start:start + n])
                norms[start:start + n] = torch.linalg.vector_norm(y[start:start + n], dim=-1,
                                                                  dtype=torch.float64)
                start += n
        return y, norms


#: name -> observer run while the full model generates; "reap_hook" is the bar's baseline, "expert_loop" the
#: observer the grouped one replaced. "teacher_forced" (below) is the pass `calibrate --engine vllm` runs.
OBSERVERS: dict[str, type[ExpertObserver]] = {"ours": ExpertObserver, "reap_hook": ReapHookObserver,
                                              "all_experts": AllExpertsObserver,
                                              "expert_loop": ExpertLoopObserver}
TEACHER_FORCED = "teacher_forced"


@dataclass
class CalibCostConfig:
    """Model (a checkpoint or a synthetic preset built by `slimwise bench`), data shape and rounds."""

    model: str | None = None
    synthetic: str | None = None
    layers: int | None = None
    synthetic_dir: str | None = None
    dtype: str = "auto"
    phase: str = "prompt"  # prompt: every prompt position counts (the usual REAP setting)
    num_prompts: int = 16
    prompt_len: int = 64
    max_new_tokens: int = 16  # decode / all phases
    batch_size: int = 8
    repetitions: int = 3
    seed: int = 0
    out: str | None = None  # JSON path


def observe(model, prompts: Sequence[Sequence[int]], observer_cls: type, config: CalibCostConfig) -> dict:
    """One statistics pass over `prompts` with `observer_cls`; tokens processed per second."""
    from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine

    observer = observer_cls(model, config.phase)
    engine = PhaseSplitEngine(model, None)
    new = 0 if config.phase == "prompt" else config.max_new_tokens
    gen = GenerationConfig(
        max_new_tokens=new, temperature=0.0, seed=config.seed, batch_size=config.batch_size, eos_token_id=-1
    )
    processed = 0
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            for start in range(0, len(prompts), config.batch_size):
                outs = engine.generate(
                    list(prompts[start : start + config.batch_size]),
                    mode="full",
                    config=gen,
                    observer=observer,
                )
                processed += sum(len(o.prompt_ids) + max(len(o.token_ids) - 1, 0) for o in outs)
    finally:
        observer.remove()
    seconds = time.perf_counter() - t0
    return {"tokens": processed, "counted": observer.counted_tokens, "seconds": seconds,
            "tokens_per_s": processed / seconds, "stats": observer.stats, "observer": observer}


def teacher_forced(model, prompts: Sequence[Sequence[int]], continuations: list[list[int]],
                   config: CalibCostConfig) -> dict:
    """The teacher-forced statistics pass over given continuations (`continuation_stats`), timed like
    `observe`: the same tokens processed (prompt + continuation[:-1] per sequence), the same statistics."""
    from slimwise.calibrate import CalibrationConfig, continuation_stats

    t0 = time.perf_counter()
    stats = continuation_stats(model, prompts, continuations, None,
                               CalibrationConfig(phase=config.phase, batch_size=config.batch_size),
                               progress=False)
    seconds = time.perf_counter() - t0
    processed = stats.meta["tokens_processed"]
    return {"tokens": processed, "counted": int(stats.tokens[0]), "seconds": seconds,
            "tokens_per_s": processed / seconds, "stats": stats}


def _continuations(model, prompts, config: CalibCostConfig) -> list[list[int]]:
    from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine

    new = 0 if config.phase == "prompt" else config.max_new_tokens
    gen = GenerationConfig(max_new_tokens=new, batch_size=config.batch_size, eos_token_id=-1)
    with PhaseSplitEngine(model, None) as engine:
        return [g.token_ids for g in engine.generate(prompts, mode="full", config=gen)]


def run_calib_cost(config: CalibCostConfig, log: Callable[[str], None] | None = None) -> dict:
    """Alternate ours / all-experts for `repetitions` rounds; return tokens/s medians, the ratio and the
    bar."""
    import json

    from slimwise.adapters import get_adapter
    from slimwise.models import load_model

    log = log or (lambda s: print(s, flush=True))
    if bool(config.model) == bool(config.synthetic):
        raise SlimWiseError("give exactly one of a model directory and --synthetic PRESET")
    if config.phase not in ("prompt", "decode", "all"):
        raise SlimWiseError(f"phase {config.phase!r} is not prompt, decode or all")
    if config.synthetic:
        from slimwise.perf.bench import BenchConfig, prepare_model

        model_dir = prepare_model(BenchConfig(synthetic=config.synthetic, layers=config.layers,
                                              synthetic_dir=config.synthetic_dir, seed=config.seed), log)
    else:
        model_dir = config.model
    model = load_model(str(model_dir), dtype=config.dtype).eval()
    adapter = get_adapter(model.config)
    num_experts, top_k = adapter.num_experts(model.config), adapter.top_k(model.config)
    vocab = int(getattr(model.config, "text_config", model.config).vocab_size)
    g = torch.Generator().manual_seed(config.seed)
    prompts = torch.randint(4, vocab, (config.num_prompts, config.prompt_len), generator=g).tolist()
    log(
        f"{Path(str(model_dir)).name}: {num_experts} experts top-{top_k}, dtype "
        f"{next(model.parameters()).dtype}, {torch.get_num_threads()} threads; {config.num_prompts} prompts "
        f"x {config.prompt_len} tokens, phase {config.phase}, batch {config.batch_size}"
    )
    observe(model, prompts[: config.batch_size], ExpertObserver, config)  # warm-up
    continuations = _continuations(model, prompts, config)  # untimed: vLLM's job in `--engine vllm`
    names = [*OBSERVERS, TEACHER_FORCED]
    rates: dict[str, list[float]] = {name: [] for name in names}
    last: dict[str, dict] = {}
    for r in range(config.repetitions):
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotate the order every round
            m = teacher_forced(model, prompts, continuations, config) if name == TEACHER_FORCED \
                else observe(model, prompts, OBSERVERS[name], config)
            rates[name].append(m["tokens_per_s"])
            last[name] = m
            log(f"  round {r} {name:<12} {m['tokens_per_s']:9.1f} tokens/s ({m['tokens']} tokens in "
                f"{m['seconds']:.1f}s)")
    same = all(torch.allclose(getattr(last["ours"]["stats"], f), getattr(last[other]["stats"], f),
                              rtol=1e-3, atol=1e-3)
               for other in names[1:] for f in ("count", "gate_sum", "norm_sum", "tokens"))
    medians = {k: statistics.median(v) for k, v in rates.items()}
    target = (num_experts / top_k) / 2
    speedup = {}
    for other in names[1:]:
        pairs = [a / b for a, b in zip(rates["ours"], rates[other], strict=True)]
        speedup[other] = {"median": medians["ours"] / medians[other], "paired_min": min(pairs),
                          "paired_max": max(pairs)}
    ratio = speedup["reap_hook"]["median"]
    result = {
        "model_dir": str(model_dir),
        "config": asdict(config),
        "num_experts": num_experts,
        "top_k": top_k,
        "dtype": str(next(model.parameters()).dtype),
        "threads": torch.get_num_threads(),
        "tokens_per_s": {k: {"median": medians[k], "min": min(v), "max": max(v)} for k, v in rates.items()},
        "speedup": speedup,
        "bar": {"baseline": "reap_hook", "target": target, "met": ratio >= target},
        "same_routed_stats": same,
    }
    log(
        f"statistics pass: {medians['expert_loop']:.1f} tokens/s with the per-expert loop observer (before), "
        f"{medians['ours']:.1f} grouped ({speedup['expert_loop']['median']:.2f}x), "
        f"{medians[TEACHER_FORCED]:.1f} teacher-forced over the same continuations "
        f"({medians[TEACHER_FORCED] / medians['expert_loop']:.2f}x)"
    )
    log(
        f"ours {medians['ours']:.1f} tokens/s vs REAP's hook observer {medians['reap_hook']:.1f}: "
        f"{ratio:.2f}x (bar (E/k)/2 = {target:.1f}x: {'met' if ratio >= target else 'NOT met'}); vs the "
        f"fused all-experts pass {medians['all_experts']:.1f}: {speedup['all_experts']['median']:.2f}x; "
        f"routed statistics equal: {same}"
    )
    if config.out:
        Path(config.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(config.out), json.dumps(result, indent=1) + "\n")
    return result


__all__ = [
    "OBSERVERS",
    "TEACHER_FORCED",
    "AllExpertsObserver",
    "ExpertLoopObserver",
    "CalibCostConfig",
    "ReapHookObserver",
    "observe",
    "run_calib_cost",
    "teacher_forced",
]
