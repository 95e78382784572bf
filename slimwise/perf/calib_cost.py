"""`slimwise calib-cost`: the statistics pass (`ExpertObserver`) against an all-experts observer, in tokens/s.

REAP's observer runs every expert on every token (E/k times the expert FLOPs of the model's own forward);
SlimWise's `ExpertObserver` runs each expert only on the tokens routed to it, as the model itself does. Both
observers here produce the same routed-token statistics (the all-experts one additionally records every
expert's output norm on every token, which is what its extra work buys), so the comparison is on equal
output, same model, same data, same generation loop. Rounds alternate ours / all-experts; medians are
reported. The issue's bar: ours >= (E/k)/2 times the all-experts observer's tokens/s.
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


class AllExpertsObserver(ExpertObserver):
    """Every expert on every token (REAP-style). Model outputs and routed statistics equal ExpertObserver's;
    `all_norm_sum[row, e]` additionally sums ||f_e(x)|| over every counted token."""

    def __init__(self, model, phase: Phase, adapter=None):
        super().__init__(model, phase, adapter)
        self.all_norm_sum = torch.zeros(len(self.layers), self.stats.num_experts, dtype=torch.float64)

    def _make_forward(self, row: int, layer):
        adapter, experts, stats = self.adapter, layer.experts, self.stats

        def forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            out = torch.zeros_like(hidden_states)
            rows = self.rows if self.rows is not None and self.rows.numel() == hidden_states.shape[0] else None
            for e in range(stats.num_experts):
                y_all = adapter.expert_forward(experts, e, hidden_states)  # every token, routed or not
                token_idx, slot = torch.where(top_k_index == e)
                y = y_all[token_idx]
                gate = top_k_weights[token_idx, slot]
                out.index_add_(0, token_idx, (y * gate[:, None]).to(out.dtype))
                if rows is None:
                    continue
                self.all_norm_sum[row, e] += y_all[rows].double().norm(dim=-1).sum()
                keep = rows[token_idx]
                if not keep.any():
                    continue
                norms = y[keep].double().norm(dim=-1)
                g = gate[keep].double()
                stats.count[row, e] += norms.numel()
                stats.gate_sum[row, e] += g.sum()
                stats.norm_sum[row, e] += norms.sum()
                stats.norm_sq_sum[row, e] += (norms * norms).sum()
                stats.gate_norm_sum[row, e] += (g * norms).sum()
            if rows is not None:
                stats.tokens[row] += rows.sum()
            return out

        return forward


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
    from slimwise.generate import GenerationConfig, PhaseSplitEngine

    observer = observer_cls(model, config.phase)
    engine = PhaseSplitEngine(model, None)
    new = 0 if config.phase == "prompt" else config.max_new_tokens
    gen = GenerationConfig(max_new_tokens=new, temperature=0.0, seed=config.seed, batch_size=config.batch_size,
                           eos_token_id=-1)
    processed = 0
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            for start in range(0, len(prompts), config.batch_size):
                outs = engine.generate(list(prompts[start:start + config.batch_size]), mode="full", config=gen,
                                       observer=observer)
                processed += sum(len(o.prompt_ids) + max(len(o.token_ids) - 1, 0) for o in outs)
    finally:
        observer.remove()
    seconds = time.perf_counter() - t0
    return {"tokens": processed, "counted": observer.counted_tokens, "seconds": seconds,
            "tokens_per_s": processed / seconds, "stats": observer.stats}


def run_calib_cost(config: CalibCostConfig, log: Callable[[str], None] | None = None) -> dict:
    """Alternate ours / all-experts for `repetitions` rounds; return tokens/s medians, the ratio and the bar."""
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
    log(f"{Path(str(model_dir)).name}: {num_experts} experts top-{top_k}, dtype {next(model.parameters()).dtype}, "
        f"{torch.get_num_threads()} threads; {config.num_prompts} prompts x {config.prompt_len} tokens, phase "
        f"{config.phase}, batch {config.batch_size}")
    observe(model, prompts[: config.batch_size], ExpertObserver, config)  # warm-up
    rates: dict[str, list[float]] = {"ours": [], "all_experts": []}
    last: dict[str, dict] = {}
    for r in range(config.repetitions):
        for name, cls in (("ours", ExpertObserver), ("all_experts", AllExpertsObserver))[:: 1 if r % 2 == 0 else -1]:
            m = observe(model, prompts, cls, config)
            rates[name].append(m["tokens_per_s"])
            last[name] = m
            log(f"  round {r} {name:<12} {m['tokens_per_s']:9.1f} tokens/s ({m['tokens']} tokens in "
                f"{m['seconds']:.1f}s)")
    same = all(torch.allclose(getattr(last["ours"]["stats"], f), getattr(last["all_experts"]["stats"], f),
                              rtol=1e-3, atol=1e-3) for f in ("count", "gate_sum", "norm_sum", "tokens"))
    ours, full = statistics.median(rates["ours"]), statistics.median(rates["all_experts"])
    pairs = [a / b for a, b in zip(rates["ours"], rates["all_experts"], strict=True)]
    target = (num_experts / top_k) / 2
    result = {"model_dir": str(model_dir), "config": asdict(config), "num_experts": num_experts, "top_k": top_k,
              "dtype": str(next(model.parameters()).dtype), "threads": torch.get_num_threads(),
              "tokens_per_s": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                               for k, v in rates.items()},
              "speedup": {"median": ours / full, "paired_min": min(pairs), "paired_max": max(pairs)},
              "bar": {"target": target, "met": ours / full >= target}, "same_routed_stats": same}
    log(f"ours {ours:.1f} tokens/s vs all-experts {full:.1f}: {ours / full:.2f}x (bar (E/k)/2 = {target:.1f}x: "
        f"{'met' if ours / full >= target else 'NOT met'}); routed statistics equal: {same}")
    if config.out:
        Path(config.out).parent.mkdir(parents=True, exist_ok=True)
        Path(config.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


__all__ = ["AllExpertsObserver", "CalibCostConfig", "observe", "run_calib_cost"]
