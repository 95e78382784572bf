"""`slimwise bench`: decode throughput of the full, SlimWise, pruned and uniform variants in vLLM.

Kept apart from slimwise/cli.py so the serving-free performance tool stays one module; slimwise/cli.py wires
it with `add_bench_parser(sub)`. The roofline, calib-cost and policy-quality studies are the lab's
(`python -m lab.perf.cli`), outside the installed package.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from slimwise.errors import SlimWiseError
from slimwise.options import add_dataclass_options, config_from_args
from slimwise.perf.bench_config import BenchConfig


def _print_threshold(rep: dict) -> None:
    measured = rep.get("measured_batch")
    line = (f"load-aware threshold for speedup >= {rep['min_speedup']:.2f}x: measured smallest batch "
            f"{measured if measured is not None else 'none (never reached)'}")
    if "roofline_batch" in rep:
        line += f"; roofline {rep['roofline_batch'] if rep['roofline_batch'] is not None else 'none'}"
    if measured is not None:
        line += f" -> serve with --min-decode-batch {measured}"
    print(line)


def cmd_bench(args) -> None:
    from slimwise.perf.bench import format_tables, run_bench, threshold_report

    if args.from_json:
        result = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
        if not isinstance(result, dict) or "summary" not in result:
            raise SlimWiseError(f"{args.from_json} is not a bench.json written by `slimwise bench`")
        print(format_tables(result))
        if args.suggest_threshold is not None:
            _print_threshold(threshold_report(result, args.suggest_threshold))
        return
    if bool(args.model) == bool(args.synthetic):
        raise SlimWiseError("give exactly one of MODEL and --synthetic PRESET (or --from-json BENCH_JSON)")
    config = config_from_args(BenchConfig, args)
    result = run_bench(config)
    print()
    print(format_tables(result))
    for name, bar in result["bars"].items():
        print(f"bar {name}: {json.dumps(bar)}")
    if "threshold" in result:
        _print_threshold(result["threshold"])
    print(f"wrote {result['files']['json']}, {result['files']['markdown']}, {result['files']['png']}")


#: the options of `slimwise bench` before --from-json, in the order --help lists them
BENCH_OPTIONS = ("model", "synthetic", "layers", "top_k", "routing_skew", "synthetic_dir", "plan", "stats",
                 "criterion", "ratio", "plan_b", "pruned_model", "variants", "batches", "prompt_len",
                 "output_len", "repetitions", "warmup_tokens", "dtype", "enforce_eager", "kv_cache_bytes",
                 "max_num_batched_tokens", "in_process", "restart", "resume", "count_experts",
                 "count_output_len", "hardware", "kernel_roofline", "suggest_threshold", "gates", "fallback",
                 "substitutes", "budget", "budget_share", "extra")


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `slimwise bench` (cheap: heavy imports happen on run)."""
    p = subparsers.add_parser(
        "bench", help="decode throughput in vLLM: full / SlimWise / pruned / uniform against batch size",
        description="Time decode (prefill excluded) of every variant in vLLM with identical engine settings, "
                    "variants interleaved over rounds; count expert traffic; compare with the roofline.")
    add_dataclass_options(p, BenchConfig, BENCH_OPTIONS)
    p.add_argument("--from-json",
                   help="re-print tables (and --suggest-threshold) from a bench.json; runs nothing")
    add_dataclass_options(p, BenchConfig, ("out_dir", "plot", "seed", "verbose"))
    p.set_defaults(func=cmd_bench)
    return p
