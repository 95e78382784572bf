"""The lab's performance studies: `roofline`, `calib-cost` and `policy-quality`.

    python -m lab.perf.cli roofline --preset qwen3.6-35b-a3b --hardware h200 --ratio 0.5
    python -m lab.perf.cli calib-cost --synthetic qwen3-30b-a3b --layers 2 --out calib-cost.json
    python -m lab.perf.cli policy-quality testbed-a --threshold 16 --concurrency 1 8 64

They model and measure what pruning buys rather than prune or serve a model, so they live outside the
installed package; their options are those the `slimwise` subcommands of the same names had. Refusals print
one line and exit 2, as the product's commands do (`slimwise.errors.run_command`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from slimwise.argtypes import OneLineParser, integer, number
from slimwise.errors import SlimWiseError, run_command
from slimwise.io import atomic_write_text
from slimwise.perf.bench_config import PRESET_NAMES

PROG = "python -m lab.perf.cli"

DEFAULT_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


@dataclass(frozen=True)
class PaperReference:
    """A reported speedup to hold the prediction against."""

    preset: str
    ratio: float
    speedup: float
    source: str


PAPER_REFERENCES = [
    PaperReference("qwen3.6-35b-a3b", 0.5, 1.81,
                   "SlimWise paper (arXiv 2609.34117) abstract: 'up to 1.81x decode throughput at 50% expert "
                   "pruning on Qwen3.6-35B-A3B' (batch size and hardware not public)"),
]


def _load_config(path: str):
    from transformers import AutoConfig

    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise SlimWiseError(f"{p} has no config.json")
        return AutoConfig.from_pretrained(p, local_files_only=True)
    if p.is_file():
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise SlimWiseError(f"{p} is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise SlimWiseError(f"{p} is not a model config (a JSON object with model_type)")
        model_type = data.pop("model_type", None)
        if not model_type:
            raise SlimWiseError(f"{p} has no model_type")
        return AutoConfig.for_model(model_type, **data)
    raise SlimWiseError(f"config {path} does not exist: pass a checkpoint directory or a config.json")


def _same_shape(a, b) -> bool:
    keys = ("num_layers", "num_experts", "top_k", "hidden_size", "vocab_size", "expert_params",
            "shared_params", "linear_attention_layers")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def _reference_for(preset: str | None, rc, ratio: float) -> PaperReference | None:
    """The paper reference for this model and ratio: by preset name, or a --config of the same shapes."""
    from slimwise.perf.presets import preset_config
    from slimwise.perf.roofline import RooflineConfig

    for ref in PAPER_REFERENCES:
        if abs(ref.ratio - ratio) > 1e-9:
            continue
        if preset == ref.preset:
            return ref
        if preset is None and _same_shape(rc, RooflineConfig.from_hf(preset_config(ref.preset))):
            return ref
    return None


def cmd_roofline(args) -> None:
    import torch

    from slimwise.perf.presets import preset_config
    from slimwise.perf.roofline import (
        RooflineConfig,
        batch_reaching,
        capacity_comparison,
        format_table,
        get_hardware,
        plot_speedup,
        predict,
        weights_only_limit,
    )

    if bool(args.config) == bool(args.preset):
        raise SlimWiseError("give exactly one of --config CONFIG_DIR_OR_JSON and --preset PRESET")
    if args.preset:
        config, name = preset_config(args.preset, layers=args.layers), args.preset
    else:
        path = Path(args.config)
        config, name = _load_config(args.config), path.stem if path.is_file() else path.name
    rc = RooflineConfig.from_hf(config, name=name, dtype=args.dtype, kv_dtype=args.kv_dtype,
                                state_dtype=args.state_dtype, quant=args.quant)
    shares = None
    if args.stats:
        from slimwise.stats import ExpertStats

        shares = ExpertStats.load(args.stats).usage_share().to(torch.float64)
    batches = sorted(set(args.batch or DEFAULT_BATCHES))
    ref = None if args.reference is not None else _reference_for(args.preset, rc, args.ratio)
    target = args.reference if args.reference is not None else (ref.speedup if ref else None)

    if args.sensitivity:
        _sensitivity(args, rc, name, target, ref)
        return
    limit = weights_only_limit(rc, args.ratio)
    print(_roofline_header(rc, args, name))
    print(f"weights-only ceiling (every expert touched, no KV/state, memory-bound): {limit:.3f}x")
    curves, report = {}, {"model": name, "config": rc.__dict__, "ratio": args.ratio,
                          "context_len": args.context, "stats": args.stats,
                          "weights_only_limit": limit, "hardware": {}}
    for hw_name in args.hardware:
        hw = get_hardware(hw_name, dtype=args.dtype, overhead_s=args.overhead_us * 1e-6)
        preds = predict(rc, hw, args.ratio, batches, args.context, shares)
        curves[hw.name] = preds
        print(f"\n## {hw.name}: {hw.bandwidth / 1e9:,.1f} GB/s, {hw.peak_flops / 1e12:,.3f} TFLOP/s"
              f"{f', overhead {args.overhead_us:g} us/step' if args.overhead_us else ''} ({hw.note})")
        print(format_table(preds))
        entry = {"bandwidth": hw.bandwidth, "peak_flops": hw.peak_flops, "memory": hw.memory, "note": hw.note,
                 "overhead_s": hw.overhead_s, "predictions": [p.as_dict() for p in preds]}
        if target is not None:
            reach = batch_reaching(rc, hw, args.ratio, target, args.context, shares)
            label = "paper" if ref else "reference"
            if reach.first_batch is not None:
                line = f"reaches the {label}'s {target:.2f}x at batch {reach.first_batch}"
            else:
                line = f"never reaches the {label}'s {target:.2f}x for batch <= 4096"
            line += (f"; peak {reach.peak_speedup:.3f}x at batch {reach.peak_batch}; weights-only asymptote "
                     f"{reach.weights_limit:.3f}x")
            if reach.fitting_peak_batch is not None:
                line += ("; among batches that fit beside the full weights: peak "
                         f"{reach.fitting_peak_speedup:.3f}x at batch {reach.fitting_peak_batch}")
            print(f"{hw.name}: {line}")
            entry["reference"] = {"speedup": target, "first_batch": reach.first_batch,
                                  "peak_speedup": reach.peak_speedup, "peak_batch": reach.peak_batch,
                                  "fitting_peak_speedup": reach.fitting_peak_speedup,
                                  "fitting_peak_batch": reach.fitting_peak_batch}
        cap = capacity_comparison(rc, hw, args.ratio, args.context, shares)
        if cap is not None:
            print(f"{hw.name} at max batch (90% of {hw.memory / 1e9:.0f} GB; PD-disaggregated decoder holds "
                  f"only the pruned weights): full B={cap.batch_full} {cap.tokens_per_s_full:,.0f} tok/s, "
                  f"pruned B={cap.batch_pruned} {cap.tokens_per_s_pruned:,.0f} tok/s: {cap.speedup:.2f}x")
            entry["capacity"] = {"batch_full": cap.batch_full, "batch_pruned": cap.batch_pruned,
                                 "tokens_per_s_full": cap.tokens_per_s_full,
                                 "tokens_per_s_pruned": cap.tokens_per_s_pruned, "speedup": cap.speedup}
        report["hardware"][hw.name] = entry
    if ref:
        print(f"reference: {ref.source}")
    if args.out or args.plot:
        out = Path(args.out) if args.out else None
        title = f"{name}: {int(round(args.ratio * 100))}% experts pruned, context {args.context}"
        png = Path(args.plot) if args.plot else out / f"roofline_{name}.png"
        plot_speedup(curves, png, title=title, reference=target,
                     reference_label="paper" if ref else "reference", ceiling=limit)
        if out:
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_text((out / f"roofline_{name}.json"), json.dumps(report, indent=2) + "\n")
            md = "\n\n".join(f"### {k}\n\n{format_table(v)}" for k, v in curves.items())
            atomic_write_text((out / f"roofline_{name}.md"), md + "\n")
        print(f"\nwrote {png}" + (f" and {out}/roofline_{name}.json/.md" if out else ""))


def _sensitivity(args, rc, name: str, target: float | None, ref) -> None:
    """`--sensitivity`: one table row and one plotted curve per assumption (first --hardware only)."""
    from lab.perf.sensitivity import batch_floor, format_sensitivity, plot_sensitivity, run_sensitivity
    from slimwise.perf.roofline import get_hardware

    if target is None:
        raise SlimWiseError("--sensitivity needs a target speedup: --reference X (or a "
                            "preset with a paper figure)")
    hw = get_hardware(args.hardware[0], dtype=args.dtype, overhead_s=args.overhead_us * 1e-6)
    rows, curves = run_sensitivity(rc, hw, args.ratio, target, args.context)
    floor = batch_floor(rc, args.ratio, target)
    print(f"{name} on {hw.name}, {int(round(args.ratio * 100))}% pruned, target {target:.2f}x"
          f"{' (paper)' if ref else ''}; same-batch curves over batch 1..2048, uniform routing")
    print(f"batch floor: below B={floor} the expected expert unions alone give < {target:.2f}x, whatever "
          "else the step reads" if floor else f"no batch: the experts-only ratio never reaches {target:.2f}x")
    table = format_sensitivity(rows, target)
    print(table)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
        data = {"model": name, "hardware": hw.name, "ratio": args.ratio, "target": target,
                "batch_floor": floor, "rows": [{**r.__dict__, "reaches": r.reaches} for r in rows]}
        atomic_write_text((out / f"sensitivity_{name}.json"), json.dumps(data, indent=2) + "\n")
        atomic_write_text((out / f"sensitivity_{name}.md"), table + "\n")
    if out or args.plot:
        png = Path(args.plot) if args.plot else out / f"sensitivity_{name}.png"
        plot_sensitivity(rc, curves, rows, args.ratio, target, png, context_len=args.context,
                         title=f"{name} on {hw.name}: {int(round(args.ratio * 100))}% experts pruned, what "
                               f"reaches {target:.2f}x")
        print(f"wrote {png}" + (f" and {out}/sensitivity_{name}.json/.md" if out else ""))


def _roofline_header(rc, args, name: str) -> str:
    from slimwise.perf.roofline import kept_experts, resident_bytes

    stored = f"{args.dtype}, linear layers {args.quant}" if args.quant else args.dtype
    return (f"{name}: {rc.total_params / 1e9:.2f}B params ({resident_bytes(rc) / 1e9:.1f} GB "
            f"{stored}), {rc.moe_layers} MoE layers x {rc.num_experts} experts top-{rc.top_k}, "
            f"{rc.active_params() / 1e9:.2f}B active per token; ratio {args.ratio} keeps "
            f"{kept_experts(rc.num_experts, args.ratio, rc.top_k)}; context {args.context}; "
            f"routing {'measured shares: ' + args.stats if args.stats else 'uniform'}")


def add_roofline_parser(subparsers) -> argparse.ArgumentParser:
    """Register `roofline` on an argparse subparsers object (cheap: heavy imports happen on run)."""
    p = subparsers.add_parser("roofline",
                              help="predict decode speedup of expert pruning vs batch size (no engine)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="a checkpoint directory or a config.json (only the config is read)")
    src.add_argument("--preset", choices=PRESET_NAMES, help="a built-in real configuration")
    p.add_argument("--layers", type=integer(1), default=None,
                   help="with --preset: layer count (default: the real one)")
    p.add_argument("--hardware", nargs="+", default=["h200"],
                   help="h100 | h200 | cpu-measured (several allowed)")
    p.add_argument("--ratio", type=number(0, 1, hi_open=True), default=0.5,
                   help="share of routed experts pruned (default 0.5)")
    p.add_argument("--batch", type=integer(1), nargs="+",
                   help=f"decode batch sizes (default {DEFAULT_BATCHES})")
    p.add_argument("--context", type=integer(1), default=1024,
                   help="context length per sequence (KV reads), default 1024")
    p.add_argument("--stats",
                   help="calibration stats: use the measured expert usage shares instead of uniform")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "fp8"],
                   help="weight dtype")
    p.add_argument("--quant", default=None, choices=["fp8", "w4a16"],
                   help="linear layers (experts, shared experts, attention) stored quantized, scales "
                        "included: fp8 = e4m3 + a float32 scale per 128x128 block (the official FP8 "
                        "releases), w4a16 = int4 + a bf16 scale per group of 128 (llm-compressor W4A16); "
                        "embeddings, LM head, norms and routers stay in --dtype")
    p.add_argument("--kv-dtype", default=None, choices=["bfloat16", "float16", "float32", "fp8"],
                   help="KV cache dtype (default: --dtype)")
    p.add_argument("--state-dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="linear-attention recurrent state dtype "
                        "(default: config mamba_ssm_dtype, else --dtype)")
    p.add_argument("--overhead-us", type=number(0), default=0.0,
                   help="fixed per-step overhead in microseconds")
    p.add_argument("--reference", type=number(0, lo_open=True), default=None,
                   help="speedup to find the batch for (default: the paper's figure where one applies)")
    p.add_argument("--sensitivity", action="store_true",
                   help="which assumptions (state dtype, context, shared-expert / attention / cache bytes, "
                        "PD max batch, overhead) reach the reference speedup: "
                        "table + plot, first --hardware only")
    p.add_argument("--out", help="directory for roofline_<model>.json/.md/.png")
    p.add_argument("--plot", help="PNG path for the speedup plot (default: inside --out)")
    p.set_defaults(func=cmd_roofline)
    return p



# ----- calib-cost / policy-quality -------------------------------------------------------------------------

def cmd_calib_cost(args) -> None:
    from lab.perf.calib_cost import CalibCostConfig, run_calib_cost

    if bool(args.model) == bool(args.synthetic):
        raise SlimWiseError("give exactly one of MODEL and --synthetic PRESET")
    run_calib_cost(CalibCostConfig(model=args.model, synthetic=args.synthetic, layers=args.layers,
                                   synthetic_dir=args.synthetic_dir, dtype=args.dtype, phase=args.phase,
                                   num_prompts=args.num_prompts, prompt_len=args.prompt_len,
                                   max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                   repetitions=args.repetitions, seed=args.seed, out=args.out))


def cmd_policy_quality(args) -> None:
    from lab.perf.policy import PolicyQualityConfig, format_policy_table, run_policy_quality

    result = run_policy_quality(PolicyQualityConfig(
        model=args.model, threshold=args.threshold, concurrencies=tuple(args.concurrency), plan=args.plan,
        ratio=args.ratio, domain=args.domain, n_per_family=args.n_per_family,
        max_new_tokens=args.max_new_tokens, dtype=args.dtype, seed=args.seed, out=args.out))
    print(format_policy_table(result))


def add_calib_cost_parser(subparsers) -> argparse.ArgumentParser:
    """Register `calib-cost` (cheap: heavy imports happen on run)."""
    c = subparsers.add_parser("calib-cost",
                              help="calibration statistics pass vs an all-experts (REAP-style) observer")
    c.add_argument("model", nargs="?", help="checkpoint directory (or an embedded name), or use --synthetic")
    c.add_argument("--synthetic", choices=PRESET_NAMES)
    c.add_argument("--layers", type=integer(1))
    c.add_argument("--synthetic-dir")
    c.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    c.add_argument("--phase", default="prompt", choices=["prompt", "decode", "all"])
    c.add_argument("--num-prompts", type=integer(1), default=16)
    c.add_argument("--prompt-len", type=integer(1), default=64)
    c.add_argument("--max-new-tokens", type=integer(1), default=16)
    c.add_argument("--batch-size", type=integer(1), default=8)
    c.add_argument("--repetitions", type=integer(1), default=3)
    c.add_argument("--seed", type=integer(0), default=0)
    c.add_argument("--out", help="JSON path for the result")
    c.set_defaults(func=cmd_calib_cost)

    return c


def add_policy_quality_parser(subparsers) -> argparse.ArgumentParser:
    """Register `policy-quality` (cheap: heavy imports happen on run)."""
    q = subparsers.add_parser("policy-quality",
                              help="accuracy of SlimWise with and without the load-aware policy, "
                                   "against concurrency")
    q.add_argument("model", nargs="?", default="testbed-a",
                   help="trained MoE (default: the embedded testbed-a)")
    q.add_argument("--threshold", type=integer(0), required=True,
                   help="min decode batch of the policy (from bench)")
    q.add_argument("--concurrency", type=integer(1), nargs="+", default=[1, 8, 64],
                   help="vLLM max_num_seqs values")
    q.add_argument("--plan", help="plan JSON (default: decode-phase calibration + REAP at --ratio)")
    q.add_argument("--ratio", type=number(0, 1, hi_open=True), default=0.5)
    q.add_argument("--domain", help="testbed domain (default: the target domain)")
    q.add_argument("--n-per-family", type=integer(1), default=16)
    q.add_argument("--max-new-tokens", type=integer(1), default=160)
    q.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    q.add_argument("--seed", type=integer(0), default=0)
    q.add_argument("--out", help="JSON path for the result")
    q.set_defaults(func=cmd_policy_quality)
    return q


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description="The lab's performance studies (outside the slimwise CLI).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=OneLineParser)
    for add in (add_roofline_parser, add_calib_cost_parser, add_policy_quality_parser):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: args.func(args), prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
