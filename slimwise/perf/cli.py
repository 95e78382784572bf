"""`slimwise roofline`: predicted decode speedup of expert pruning against batch size, per hardware.

Kept apart from slimwise/cli.py so the serving-free performance tools stay one module; slimwise/cli.py wires
it with `add_roofline_parser(sub)`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from slimwise.errors import SlimWiseError

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
        model_type = data.pop("model_type", None)
        if not model_type:
            raise SlimWiseError(f"{p} has no model_type")
        return AutoConfig.for_model(model_type, **data)
    raise SlimWiseError(f"config {path} does not exist: pass a checkpoint directory or a config.json")


def _same_shape(a, b) -> bool:
    keys = ("num_layers", "num_experts", "top_k", "hidden_size", "vocab_size", "expert_params", "shared_params",
            "linear_attention_layers")
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
        kept_experts,
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
                                state_dtype=args.state_dtype)
    shares = None
    if args.stats:
        from slimwise.stats import ExpertStats

        shares = ExpertStats.load(args.stats).usage_share().to(torch.float64)
    batches = sorted(set(args.batch or DEFAULT_BATCHES))
    ref = None if args.reference is not None else _reference_for(args.preset, rc, args.ratio)
    target = args.reference if args.reference is not None else (ref.speedup if ref else None)

    limit = weights_only_limit(rc, args.ratio)
    print(f"{name}: {rc.total_params / 1e9:.2f}B params ({rc.total_params * rc.weight_bytes / 1e9:.1f} GB "
          f"{args.dtype}), {rc.moe_layers} MoE layers x {rc.num_experts} experts top-{rc.top_k}, "
          f"{rc.active_params() / 1e9:.2f}B active per token; ratio {args.ratio} keeps "
          f"{kept_experts(rc.num_experts, args.ratio, rc.top_k)}; context {args.context}; "
          f"routing {'measured shares: ' + args.stats if args.stats else 'uniform'}")
    print(f"weights-only ceiling (every expert touched, no KV/state, memory-bound): {limit:.3f}x")
    curves, report = {}, {"model": name, "config": rc.__dict__, "ratio": args.ratio, "context_len": args.context,
                          "stats": args.stats, "weights_only_limit": limit, "hardware": {}}
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
                line += (f"; among batches that fit beside the full weights: peak {reach.fitting_peak_speedup:.3f}x"
                         f" at batch {reach.fitting_peak_batch}")
            print(f"{hw.name}: {line}")
            entry["reference"] = {"speedup": target, "first_batch": reach.first_batch,
                                  "peak_speedup": reach.peak_speedup, "peak_batch": reach.peak_batch,
                                  "fitting_peak_speedup": reach.fitting_peak_speedup,
                                  "fitting_peak_batch": reach.fitting_peak_batch}
        cap = capacity_comparison(rc, hw, args.ratio, args.context, shares)
        if cap is not None:
            print(f"{hw.name} at max batch (90% of {hw.memory / 1e9:.0f} GB; PD-disaggregated decoder holds only the "
                  f"pruned weights): full B={cap.batch_full} {cap.tokens_per_s_full:,.0f} tok/s, pruned "
                  f"B={cap.batch_pruned} {cap.tokens_per_s_pruned:,.0f} tok/s: {cap.speedup:.2f}x")
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
        plot_speedup(curves, png, title=title, reference=target, reference_label="paper" if ref else "reference",
                     ceiling=limit)
        if out:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"roofline_{name}.json").write_text(json.dumps(report, indent=2) + "\n")
            md = "\n\n".join(f"### {k}\n\n{format_table(v)}" for k, v in curves.items())
            (out / f"roofline_{name}.md").write_text(md + "\n")
        print(f"\nwrote {png}" + (f" and {out}/roofline_{name}.json/.md" if out else ""))


# kept literal so that building the parser imports neither torch nor transformers (checked by a test)
PRESET_NAMES = ("cpu", "qwen3-30b-a3b", "qwen3.6-35b-a3b", "smoke")


def add_roofline_parser(subparsers) -> argparse.ArgumentParser:
    """Register `slimwise roofline` on an argparse subparsers object (cheap: heavy imports happen on run)."""
    p = subparsers.add_parser("roofline", help="predict decode speedup of expert pruning vs batch size (no engine)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="a checkpoint directory or a config.json (only the config is read)")
    src.add_argument("--preset", choices=PRESET_NAMES, help="a built-in real configuration")
    p.add_argument("--layers", type=int, default=None, help="with --preset: layer count (default: the real one)")
    p.add_argument("--hardware", nargs="+", default=["h200"], help="h100 | h200 | cpu-measured (several allowed)")
    p.add_argument("--ratio", type=float, default=0.5, help="share of routed experts pruned (default 0.5)")
    p.add_argument("--batch", type=int, nargs="+", help=f"decode batch sizes (default {DEFAULT_BATCHES})")
    p.add_argument("--context", type=int, default=1024, help="context length per sequence (KV reads), default 1024")
    p.add_argument("--stats", help="calibration stats: use the measured expert usage shares instead of uniform")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "fp8"],
                   help="weight dtype")
    p.add_argument("--kv-dtype", default=None, choices=["bfloat16", "float16", "float32", "fp8"],
                   help="KV cache dtype (default: --dtype)")
    p.add_argument("--state-dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="linear-attention recurrent state dtype (default: config mamba_ssm_dtype, else --dtype)")
    p.add_argument("--overhead-us", type=float, default=0.0, help="fixed per-step overhead in microseconds")
    p.add_argument("--reference", type=float, default=None,
                   help="speedup to find the batch for (default: the paper's figure where one applies)")
    p.add_argument("--out", help="directory for roofline_<model>.json/.md/.png")
    p.add_argument("--plot", help="PNG path for the speedup plot (default: inside --out)")
    p.set_defaults(func=cmd_roofline)
    return p
