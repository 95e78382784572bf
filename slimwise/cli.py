"""`slimwise` command line: a thin layer over the Python API (one function per subcommand)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from slimwise.errors import SlimWiseError


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="local checkpoint directory (or an embedded name: testbed-a, testbed-b)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights dtype (default: as saved)")


def cmd_calibrate(args) -> None:
    from slimwise.calibrate import CalibrationConfig, calibrate
    from slimwise.data import load_prompts
    from slimwise.models import load_model, load_tokenizer

    prompts = load_prompts(args.data, limit=args.max_samples)
    model = load_model(args.model, dtype=args.dtype)
    config = CalibrationConfig(phase=args.phase, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                               max_samples=args.max_samples, seed=args.seed)
    stats = calibrate(model, prompts, load_tokenizer(args.model), config)
    stats.meta["data"] = str(args.data)
    stats.save(args.out)
    print(f"wrote {args.out}: {len(stats.layers)} MoE layers x {stats.num_experts} experts, "
          f"{int(stats.tokens[0])} {args.phase} tokens counted per layer in {stats.meta['seconds']:.1f}s")


def _plan_from_args(args):
    from slimwise.criteria import plan_from_stats
    from slimwise.plan import PrunePlan
    from slimwise.stats import ExpertStats

    if args.plan:
        return PrunePlan.load(args.plan)
    if not args.stats:
        raise SlimWiseError("give --plan PLAN, or --stats STATS with --criterion and --ratio")
    return plan_from_stats(ExpertStats.load(args.stats), args.criterion, args.ratio,
                           scope="global" if args.global_budget else "layer")


def _add_plan_source(p: argparse.ArgumentParser, plan_option: bool = True) -> None:
    if plan_option:
        p.add_argument("--plan", help="a plan JSON (instead of --stats/--criterion/--ratio)")
    p.add_argument("--stats", help="calibration statistics from `slimwise calibrate`")
    p.add_argument("--criterion", default="reap", help="frequency | soft | ean | reap (default: reap)")
    p.add_argument("--ratio", type=float, default=0.5, help="share of routed experts to prune, in [0, 1)")
    p.add_argument("--global", dest="global_budget", action="store_true",
                   help="one budget across layers (non-uniform; served by masking, not exportable)")


def cmd_plan(args) -> None:
    args.plan = None
    plan = _plan_from_args(args)
    plan.save(args.out)
    sizes = sorted({len(v) for v in plan.kept_experts.values()})
    print(f"wrote {args.out}: {plan.criterion} at ratio {plan.ratio}, keeps {sizes} of {plan.num_experts} "
          f"experts in {len(plan.kept_experts)} layers ({plan.scope} scope)")


def cmd_prune(args) -> None:
    from slimwise.export import export_pruned
    from slimwise.models import load_model, resolve_model_dir

    plan = _plan_from_args(args)
    model = load_model(args.model, dtype=args.dtype)
    out = export_pruned(model, plan, args.out, source_dir=resolve_model_dir(args.model), force=args.force)
    print(f"wrote {out}: {plan.num_kept} of {plan.num_experts} experts per layer, verified against the source")


def cmd_generate(args) -> None:
    from slimwise.data import load_prompts
    from slimwise.export import load_pruned
    from slimwise.generate import GenerationConfig, PhaseSplitEngine
    from slimwise.models import load_model, load_tokenizer
    from slimwise.plan import PrunePlan

    model = load_model(args.model, dtype=args.dtype)
    tokenizer = load_tokenizer(args.model)
    plan = PrunePlan.load(args.plan) if args.plan else None
    decode_model = None
    if args.decode_model:
        decode_model, decode_plan = load_pruned(args.decode_model, dtype=args.dtype)
        plan = plan or decode_plan
    if args.mode != "full" and plan is None and decode_model is None:
        raise SlimWiseError(f"mode {args.mode} needs --plan PLAN or --decode-model DIR")
    engine = PhaseSplitEngine(model, tokenizer, plan=plan, decode_model=decode_model)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()),
                              batch_size=args.batch_size, progress=True)
    outs = engine.generate(load_prompts(args.prompts), mode=args.mode, config=config)
    lines = [json.dumps({"prompt_ids": o.prompt_ids, "token_ids": o.token_ids, "text": o.text,
                         "finish_reason": o.finish_reason, "mode": args.mode}) for o in outs]
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
        print(f"wrote {len(outs)} generations to {args.out}")
    else:
        for o in outs:
            print(json.dumps({"text": o.text, "finish_reason": o.finish_reason, "tokens": len(o.token_ids)}))


def cmd_demo(args) -> None:
    from slimwise.demo import run_demo

    run_demo(out_dir=args.out, samples=args.samples, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slimwise",
        description="Decode-only expert pruning for MoE serving: full-model prefill, pruned decode.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("calibrate", help="record per-expert routing statistics on calibration data")
    _add_model(p)
    p.add_argument("--data", required=True, help="prompts: a .jsonl file ('prompt' field) or a directory of them")
    p.add_argument("--phase", default="decode", choices=["prompt", "decode", "all"],
                   help="which positions count: prompt tokens, the model's own generated tokens, or both")
    p.add_argument("--out", required=True, help="statistics file to write (.safetensors)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="continuation length for --phase decode/all")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("plan", help="score experts with a criterion and write a prune plan (JSON)")
    _add_plan_source(p, plan_option=False)
    p.add_argument("--out", required=True, help="plan JSON to write")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("prune", help="write a pruned checkpoint that stock transformers and vLLM load")
    _add_model(p)
    _add_plan_source(p)
    p.add_argument("--out", required=True, help="new directory for the pruned checkpoint")
    p.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser("generate", help="generate with full, uniform-pruned or SlimWise (full prefill, pruned decode)")
    _add_model(p)
    p.add_argument("--plan", help="prune plan (the pruned decoder is a masked view of the model)")
    p.add_argument("--decode-model", help="a pruned checkpoint to decode with instead of the masked view")
    p.add_argument("--mode", default="slimwise", choices=["full", "uniform", "slimwise"])
    p.add_argument("--prompts", required=True, help=".jsonl ('prompt' field) or .txt (one per line)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", help="write generations as JSONL here instead of printing")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="the main job on the embedded default model: calibrate, prune 50%%, compare modes")
    p.add_argument("--out", default="runs/demo", help="where to write the report")
    p.add_argument("--samples", type=int, default=64, help="test prompts per mode")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except SlimWiseError as exc:
        print(f"slimwise: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
