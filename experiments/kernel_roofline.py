"""A roofline of the kernel vLLM runs: the fused-MoE op measured at the `cpu` preset's shapes, fitted as
t = a * experts read + b * (token, expert) pairs + c per call, then checked against the decode-step profile.

What it prints and writes (`--out`): the fit (a, b, c; the kernel's streaming rate 4 x hidden x inter x bytes
/ a against this machine's read bandwidth), the measured calls against the fit, and, at the batches the step
profile measured, the MoE kernel's time and the step's speedup as (1) the byte model predicts them (experts
read only), (2) the kernel model predicts them (experts read and pairs), against (3) what the profile
measured. The experts read per layer and step come from the bench's plugin counters (`--bench`), the measured
kernel and step times from `--profile`; the non-kernel part of each step is taken from the profile as measured
(pruning does not change it), so the step prediction tests the kernel model only.

  python -m experiments.kernel_roofline --out docs/results/perf/kernel-roofline   # ~3 min on 2 cores

The process re-executes itself with the threads bound as vLLM's CPU worker binds them (GOMP_CPU_AFFINITY =
every allowed core, OMP_NUM_THREADS = their number) unless the caller set them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DTYPES = ("bfloat16", "float16", "float32")


def bind_threads_like_vllm() -> None:
    """Re-exec with vLLM's CPU-worker binding; OpenMP reads these once, when torch starts."""
    if "GOMP_CPU_AFFINITY" in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "GOMP_CPU_AFFINITY": " ".join(map(str, cores)), "OMP_NUM_THREADS": str(len(cores))}
    os.execve(sys.executable, [sys.executable, "-m", "experiments.kernel_roofline", *sys.argv[1:]], env)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="cpu")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="calls per layer per round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bench", type=Path, default=Path("docs/results/perf/bench-cpu.json"),
                   help="a `slimwise bench` result with traffic counters (experts read per layer and step)")
    p.add_argument("--profile", type=Path, default=Path("docs/results/perf/step-profile.json"),
                   help="an experiments.step_profile result (measured kernel and step times)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    bind_threads_like_vllm()

    import torch

    from slimwise.hardware import describe
    from slimwise.perf.kernels import fit_moe_kernel, kernel_isa, measure_fused_moe
    from slimwise.perf.presets import get_preset
    from slimwise.perf.roofline import DTYPE_BYTES, measure_cpu

    preset = get_preset(args.preset)
    cfg = preset.text
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    experts, top_k, layers = cfg["num_experts"], cfg["num_experts_per_tok"], preset.real_layers
    bytes_per_expert = int(3 * hidden * inter * DTYPE_BYTES[args.dtype])
    read_bw = measure_cpu(budget_s=4.0).bandwidth
    samples = measure_fused_moe(hidden, inter, experts, top_k, args.batches, layers=layers, dtype=args.dtype,
                                rounds=args.rounds, steps=args.steps, seed=args.seed)
    model = fit_moe_kernel(samples, bytes_per_expert)
    lines = [
        f"# Fused-MoE kernel roofline ({args.preset} preset, {args.dtype}, vLLM `cpu_fused_moe`, isa "
        f"{kernel_isa(args.dtype)})",
        "",
        f"Machine: {json.dumps(describe())}; {torch.get_num_threads()} threads bound "
        f"(GOMP_CPU_AFFINITY={os.environ['GOMP_CPU_AFFINITY']!r}); read bandwidth {read_bw / 1e9:.1f} GB/s.",
        "Command: `python -m experiments.kernel_roofline "
        f"{' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        "## Fit: t per call = a * experts read + b * pairs + c",
        "",
        f"- a = {model.per_expert_s * 1e6:.1f} us per expert read ({bytes_per_expert / 2**20:.1f} MiB each): "
        f"streaming at {model.streaming_bandwidth / 1e9:.1f} GB/s, "
        f"{model.streaming_bandwidth / read_bw:.0%} of the read bandwidth",
        f"- b = {model.per_pair_s * 1e6:.2f} us per (token, expert) pair",
        f"- c = {model.per_call_s * 1e6:.1f} us per call",
        f"- R^2 {model.r2:.4f}; largest error on its own {len(samples)} samples {model.max_rel_error:.1%}",
        "",
        "| batch | available experts | experts read | pairs | measured us/call | fitted | pairs' share |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in samples:
        fit = model.seconds(s.experts_read, s.pairs)
        lines.append(
            f"| {s.batch} | {s.available} | {s.experts_read:.1f} | {s.pairs} | {s.seconds * 1e6:.0f} | "
            f"{fit * 1e6:.0f} | {model.pair_share(s.experts_read, s.pairs):.0%} |"
        )
    report = {
        "machine": describe(),
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "preset": args.preset,
        "read_bandwidth": read_bw,
        "model": model.as_dict(),
        "samples": [vars(s) for s in samples],
        "seed": args.seed,
        "checks": [],
    }
    profile = json.loads(args.profile.read_text()) if args.profile.is_file() else None
    if profile is not None and profile["dtype"]["used"] != args.dtype:
        lines += ["", f"(No check against {args.profile}: it profiled {profile['dtype']['used']}.)"]
        profile = None
    if args.bench.is_file() and profile is not None:
        traffic = json.loads(args.bench.read_text())["traffic"]
        steps = profile["steps"]
        lines += [
            "",
            f"## Against the step profile ({args.profile}; experts read from {args.bench})",
            "",
            "| batch | variant | experts read | kernel ms: measured | kernel model | step speedup: measured "
            "| byte model | kernel model |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for batch in sorted(steps["full"], key=int):
            full = steps["full"][batch]
            u_full = traffic["full"]["batches"][batch]["touched_mean"]
            k_full = full["ops"]["_C::cpu_fused_moe"][0]
            for variant, counter in (("full", "full"), ("pruned", "pruned"), ("slimwise", "slimwise")):
                step = steps[variant][batch]
                u = traffic[counter]["batches"][batch]["touched_mean"]
                k_meas = step["ops"]["_C::cpu_fused_moe"][0]
                k_model = layers * model.seconds(u, int(batch) * top_k)
                rest = step["wall_s"] - k_meas  # what pruning does not touch, as measured
                rest_full = full["wall_s"] - k_full
                byte_step = (rest_full + k_full) / (rest + k_full * u / u_full)  # kernel time scaled by bytes
                model_step = ((rest_full + layers * model.seconds(u_full, int(batch) * top_k))
                              / (rest + k_model))
                measured = full["wall_s"] / step["wall_s"]
                lines.append(f"| {batch} | {variant} | {u:.1f} | {k_meas * 1e3:.1f} | {k_model * 1e3:.1f} | "
                             f"{measured:.3f}x | {byte_step:.3f}x | {model_step:.3f}x |")
                report["checks"].append(
                    {
                        "batch": int(batch),
                        "variant": variant,
                        "experts_read": u,
                        "kernel_measured_s": k_meas,
                        "kernel_model_s": k_model,
                        "step_speedup_measured": measured,
                        "step_speedup_byte_model": byte_step,
                        "step_speedup_kernel_model": model_step,
                    }
                )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(args.out.with_suffix(".json"))
        args.out.with_suffix(".md").write_text(text)
        plot(samples, model, args.out.with_suffix(".png"))


def plot(samples, model, path: Path) -> None:
    """Per batch size: measured time per call against experts read, with the fitted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for batch in sorted({s.batch for s in samples}):
        pts = sorted((s for s in samples if s.batch == batch), key=lambda s: s.experts_read)
        xs = [s.experts_read for s in pts]
        line = ax.plot(xs, [s.seconds * 1e6 for s in pts], "o", label=f"B={batch}")[0]
        ax.plot(xs, [model.seconds(s.experts_read, s.pairs) * 1e6 for s in pts], "-", color=line.get_color())
    ax.set_xlabel("experts read per call")
    ax.set_ylabel("us per fused-MoE call")
    ax.set_title(f"vLLM cpu_fused_moe: a={model.per_expert_s * 1e6:.0f} us/expert, "
                 f"b={model.per_pair_s * 1e6:.1f} us/pair, c={model.per_call_s * 1e6:.0f} us")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
