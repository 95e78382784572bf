"""`slimwise` command line: a thin layer over the Python API (one function per subcommand)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from slimwise.argtypes import OneLineParser, integer, number
from slimwise.decode_gates import (
    BUDGET_HELP,
    BUDGET_SHARE_HELP,
    EXTRA_HELP,
    FALLBACK_HELP,
    GATES,
    GATES_HELP,
    SUBSTITUTES_HELP,
    DecodeGates,
)
from slimwise.devices import parse_max_memory, resolve_device
from slimwise.embedded import EMBEDDED
from slimwise.errors import SlimWiseError, run_command
from slimwise.io import atomic_write_text, refuse_blocked_parent, refuse_existing
from slimwise.options import add_dataclass_options, config_from_args

MODEL_HELP = f"local checkpoint directory (or an embedded name: {', '.join(EMBEDDED)})"


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights dtype (default auto: as saved on the CPU, bf16 on a GPU)")


def _add_device(p: argparse.ArgumentParser) -> None:
    from slimwise.devices import DEVICE_HELP, MAX_MEMORY_HELP

    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--max-memory", default=None, metavar="DEV=SIZE,...", help=MAX_MEMORY_HELP)


def _load(args, path=None, dtype=None):
    """The model of a command, on its --device / --max-memory."""
    from slimwise.models import load_model

    return load_model(path or args.model, dtype=dtype or args.dtype, device=args.device,
                      max_memory=args.max_memory)


def _add_dry_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true",
                   help="print what the command holds in memory (computed from config.json on the meta "
                        "device; MODEL may also be a full-size preset such as qwen3.6-35b-a3b) and exit "
                        "without loading anything")


def _dry_run(args, command: str, **sizes) -> bool:
    """`--dry-run`: print the command's memory footprint (`slimwise.footprint`) and return True."""
    if not getattr(args, "dry_run", False):
        return False
    from slimwise.footprint import footprint

    gpus = sum(isinstance(k, int) for k in parse_max_memory(getattr(args, "max_memory", None)) or {})
    print(footprint(args.model, command, dtype=_footprint_dtype(args, command), devices=max(1, gpus),
                    **sizes).report())
    return True


def _footprint_dtype(args, command: str) -> str:
    """The dtype the command would load in: --dtype, else its default on the chosen device."""
    from slimwise.devices import auto_dtype_on
    from slimwise.perf.presets import PRESETS

    device = resolve_device(getattr(args, "device", "cpu"))
    dtype = args.dtype or ("float32" if device == "cpu" else "auto")  # None: distill's device default
    if dtype != "auto":
        return dtype
    if str(args.model) in PRESETS:
        return "bfloat16"
    from slimwise.models import load_config

    config = load_config(args.model)
    saved = str(getattr(config.get_text_config(), "dtype", None) or "float32").removeprefix("torch.")
    return auto_dtype_on(device, saved) or saved


def cmd_calibrate(args) -> None:
    from slimwise.calibrate import CalibrationConfig, vllm_continuations
    from slimwise.data import load_prompts
    from slimwise.models import load_tokenizer, resolve_model_dir

    refuse_blocked_parent(args.out)  # an unwritable output is refused before calibration runs, not after
    if Path(args.out).is_dir():
        raise SlimWiseError(f"output {args.out} is a directory; pass a file path (.safetensors)")
    if args.vllm_args and args.engine != "vllm":
        raise SlimWiseError(f"unrecognized arguments: {' '.join(args.vllm_args)} (vLLM options need "
                            "--engine vllm)")
    if _dry_run(args, "calibrate", batch_size=args.batch_size, max_new_tokens=args.max_new_tokens):
        return
    prompts = load_prompts(args.data, limit=args.max_samples)
    config = CalibrationConfig(phase=args.phase, max_new_tokens=args.max_new_tokens,
                               batch_size=args.batch_size, max_samples=args.max_samples, seed=args.seed,
                               output_sums=args.output_sums)
    tokenizer = load_tokenizer(args.model)
    continuations, source = None, None
    if args.continuations:
        if args.engine == "vllm":
            raise SlimWiseError("--continuations and --engine vllm both give the continuations: pick one")
        continuations, source = _read_continuations(args.continuations, len(prompts)), {
            "continuations": str(args.continuations)}
    elif args.engine == "vllm" and args.phase != "prompt":  # vLLM generates; the transformers model counts
        from slimwise.engines.vllm_engine import vllm_engine_kwargs

        engine_kwargs = vllm_engine_kwargs(args.vllm_args)
        continuations = vllm_continuations(resolve_model_dir(args.model), prompts, tokenizer, config,
                                           dtype=args.dtype, engine_kwargs=engine_kwargs)
        source = {"continuations": "vllm", "vllm_options": engine_kwargs}
    model = _load(args)
    stats = _statistics(model, prompts, continuations, tokenizer, config)
    if source is not None:
        stats.meta["engine"] = source
    stats.meta["data"] = str(args.data)
    stats.save(args.out)
    print(f"wrote {args.out}: {len(stats.layers)} MoE layers x {stats.num_experts} experts, "
          f"{int(stats.tokens[0])} {args.phase} tokens counted per layer in {stats.meta['seconds']:.1f}s")


def _statistics(model, prompts, continuations, tokenizer, config):
    """calibrate's pass: layer-streamed when --max-memory left decoder layers offloaded and no generation is
    needed; else the teacher-forced pass over given continuations, or counting while the model generates."""
    from slimwise.calibrate import calibrate, continuation_stats
    from slimwise.sequential import offloaded_share, streamed_statistics

    offloaded, layers = offloaded_share(model)
    if offloaded and (continuations is not None or config.phase == "prompt"):
        print(f"calibrate: {offloaded} of {layers} decoder layers do not fit --max-memory: the statistics "
              "pass runs one layer at a time (each layer's weights read once)", file=sys.stderr)
        return streamed_statistics(model, prompts, continuations, tokenizer, config)
    if offloaded:
        print(f"calibrate: {offloaded} of {layers} decoder layers do not fit --max-memory, and generation "
              "needs every layer for every token: their weights are brought in per forward (slow). "
              "--engine vllm or --continuations FILE count in one layer-streamed pass instead",
              file=sys.stderr)
    if continuations is not None:
        return continuation_stats(model, prompts, continuations, tokenizer, config)
    return calibrate(model, prompts, tokenizer, config)


def _read_continuations(path: str, n: int) -> list[list[int]]:
    """Token ids of earlier continuations, one JSON object per line in prompt order: `slimwise generate
    --out`'s files (field token_ids)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SlimWiseError(f"--continuations {path}: cannot read it ({exc.__class__.__name__})") from exc
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            ids = json.loads(line).get("token_ids")
        except (json.JSONDecodeError, AttributeError):
            ids = None
        if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
            raise SlimWiseError(f"--continuations {path} line {lineno}: expected an object with a non-empty "
                                "'token_ids' list of token ids (what `slimwise generate --out` writes)")
        out.append(ids)
    if len(out) < n:
        raise SlimWiseError(f"--continuations {path} has {len(out)} continuations for {n} prompts: give one "
                            "per prompt, in the same order")
    return out


def _plan_from_args(args):
    from slimwise.criteria import plan_from_stats
    from slimwise.plan import PrunePlan
    from slimwise.stats import ExpertStats

    if args.plan:
        return PrunePlan.load(args.plan)
    if not args.stats:
        raise SlimWiseError("give --plan PLAN, or --stats STATS with --criterion and --ratio")
    return plan_from_stats(ExpertStats.load(args.stats), args.criterion, args.ratio,
                           scope="global" if args.global_budget else "layer",
                           ep_size=getattr(args, "ep_size", 1),
                           ep_placement=getattr(args, "ep_placement", "linear"))


def _add_plan_source(p: argparse.ArgumentParser, plan_option: bool = True) -> None:
    if plan_option:
        p.add_argument("--plan", help="a plan JSON (instead of --stats/--criterion/--ratio)")
    p.add_argument("--stats", help="calibration statistics from `slimwise calibrate`")
    p.add_argument("--criterion", default="reap", help="frequency | soft | ean | reap (default: reap)")
    if plan_option:
        p.add_argument("--ratio", type=number(0, 1, hi_open=True), default=0.5,
                       help="share of routed experts to prune, in [0, 1)")
    else:  # `slimwise plan`: one plan, or one per ratio into a directory
        p.add_argument("--ratio", type=number(0, 1, hi_open=True), nargs="+", default=[0.5],
                       help="share of routed experts to prune, in [0, 1); several ratios write one plan "
                            "each into the --out directory")
    p.add_argument("--global", dest="global_budget", action="store_true",
                   help="one budget across layers (non-uniform; served by masking, not exportable)")


def cmd_plan(args) -> None:
    from slimwise.criteria import nested_plans, plan_from_stats
    from slimwise.stats import ExpertStats

    ratios = sorted(set(args.ratio))
    if args.budget_model:
        plans = _sensitivity_plans(args, ratios)
        if len(plans) == 1:
            plans[0].save(args.out)
            _report_plan(plans[0], args.out)
            return
        _write_plans(plans, Path(args.out))
        return
    if len(ratios) == 1 and not args.nested:
        args.plan, args.ratio = None, ratios[0]
        plan = _plan_from_args(args)
        plan.save(args.out)
        _report_plan(plan, args.out)
        return
    if not args.stats:
        raise SlimWiseError("several --ratio values or --nested plan from statistics: give --stats STATS")
    options = dict(scope="global" if args.global_budget else "layer", ep_size=args.ep_size,
                   ep_placement=args.ep_placement)
    stats = ExpertStats.load(args.stats)
    if args.nested:
        plans = nested_plans(stats, args.criterion, ratios, **options)
    else:
        plans = [plan_from_stats(stats, args.criterion, r, **options) for r in ratios]
    _write_plans(plans, Path(args.out))
    if args.nested:
        print(f"nested: every plan keeps a subset of the previous plan's experts in every layer "
              f"(ratios {', '.join(f'{r:g}' for r in ratios)})")


def _write_plans(plans, out: Path) -> None:
    from slimwise.io import atomic_dir

    refuse_existing(out)
    with atomic_dir(out) as tmp:  # every plan or none
        for plan in plans:
            plan.save(Path(tmp) / _plan_file_name(plan))
    for plan in plans:
        _report_plan(plan, out / _plan_file_name(plan))


def _sensitivity_plans(args, ratios: list[float]):
    """`--budget-model MODEL --budget-data DATA`: the per-layer budgets from measured sensitivity
    (`slimwise.layer_budgets`), one plan per ratio from one measurement."""
    from slimwise.data import load_prompts
    from slimwise.fingerprint import fingerprints_match, model_fingerprint
    from slimwise.layer_budgets import capture_decode_inputs, grid, layer_errors, sensitivity_plan
    from slimwise.models import load_model, load_tokenizer
    from slimwise.stats import ExpertStats

    if not args.stats or not args.budget_data:
        raise SlimWiseError("--budget-model measures layers for a plan from statistics: give --stats STATS "
                            "and --budget-data PROMPTS")
    if args.global_budget or args.nested or args.ep_size > 1:
        raise SlimWiseError("--budget-model sets each layer's count itself: drop --global, --nested and "
                            "--ep-size")
    stats = ExpertStats.load(args.stats)
    prompts = load_prompts(args.budget_data)
    model = load_model(args.budget_model)
    if not fingerprints_match(stats.meta.get("fingerprint"), model_fingerprint(model)):
        raise SlimWiseError(f"{args.stats} was calibrated on other weights than {args.budget_model}: "
                            "measure the model the statistics come from")
    inputs = capture_decode_inputs(model, prompts, load_tokenizer(args.budget_model),
                                   max_tokens=args.budget_tokens)
    counts = grid(stats.num_experts, int(stats.meta["top_k"]))
    errors = layer_errors(model, stats, args.criterion, inputs, counts)
    return [sensitivity_plan(stats, args.criterion, r, errors, counts) for r in ratios]


def _plan_file_name(plan) -> str:
    return f"{plan.criterion}-{plan.ratio:g}.json"


def _report_plan(plan, path) -> None:
    sizes = sorted({len(v) for v in plan.kept_experts.values()})
    print(f"wrote {path}: {plan.criterion} at ratio {plan.ratio}, keeps {sizes} of {plan.num_experts} "
          f"experts in {len(plan.kept_experts)} layers ({plan.scope} scope"
          + (f", {plan.meta['ep_size']} EP ranks alike" if plan.meta.get("ep_size") else "") + ")")


def cmd_prune(args) -> None:
    """Streamed from the safetensors files (`slimwise.export_stream`); in memory with --distilled or for a
    checkpoint streaming cannot reproduce exactly (it says so in one line)."""
    from slimwise.export_stream import export_checkpoint

    plan = _plan_from_args(args)
    if _dry_run(args, "prune", ratio=plan.ratio, in_memory=bool(args.distilled)):
        return
    out = export_checkpoint(args.model, plan, args.out, dtype=args.dtype, force=args.force,
                            delta=args.distilled)
    print(f"wrote {out}: {plan.num_kept} of {plan.num_experts} experts per layer, verified against the source"
          + (f", distilled delta {args.distilled} folded in" if args.distilled else ""))


def cmd_generate(args) -> None:
    from slimwise.data import load_prompts
    from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
    from slimwise.export import load_pruned
    from slimwise.models import load_tokenizer
    from slimwise.plan import PrunePlan

    # the cheap inputs first: a bad plan, prompt file or option is refused before any weights load
    plan = PrunePlan.load(args.plan) if args.plan else None
    if args.mode != "full" and plan is None and not args.decode_model:
        raise SlimWiseError(f"mode {args.mode} needs --plan PLAN or --decode-model DIR")
    gates = DecodeGates.of(args)
    if not gates.plain and (plan is None or args.decode_model):
        raise SlimWiseError("--gates drop, --fallback and --budget/--extra route pruned tokens from the full "
                            "router: give --plan (the masked view), not --decode-model")
    if gates.budgeted and args.mode != "slimwise":
        raise SlimWiseError(f"--budget/--budget-share/--extra choose decode steps' experts: mode {args.mode} "
                            "has none (use --mode slimwise)")
    prompts = load_prompts(args.prompts)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()),
                              batch_size=args.batch_size, progress=True)
    model = _load(args)
    tokenizer = load_tokenizer(args.model)
    decode_model = None
    if args.decode_model:
        decode_model, decode_plan = load_pruned(args.decode_model, dtype=args.dtype, device=args.device,
                                                max_memory=args.max_memory)
        if plan is not None and decode_plan is not None and plan.kept_experts != decode_plan.kept_experts:
            raise SlimWiseError(f"--plan keeps other experts than the plan {args.decode_model} was exported "
                                "with: drop --plan, or export the decode model from it (`slimwise prune`)")
        plan = plan or decode_plan
    engine = PhaseSplitEngine(model, tokenizer, plan=plan, decode_model=decode_model, gates=gates)
    outs = engine.generate(prompts, mode=args.mode, config=config)
    if engine.mask is not None and not gates.plain and args.mode != "full":
        s = engine.mask.fallback_summary()
        if gates.budgeted:
            print(f"batch budget {_budget_label(gates)}: {s['routed']} decode token-layer pairs, "
                  f"{100 * s['touching_pruned_share']:.1f}% with an expert outside the step's set in the "
                  "full top-k", file=sys.stderr)
        print(f"gates {s['gates']}, fallback {s['fallback']}: {s['routed']} pruned token-layer pairs, "
              f"{100 * s['touching_pruned_share']:.1f}% with a pruned expert in the full top-k, "
              f"{100 * s['fallback_share']:.1f}% fell back to every expert", file=sys.stderr)
    lines = [json.dumps({"prompt_ids": o.prompt_ids, "token_ids": o.token_ids, "text": o.text,
                         "finish_reason": o.finish_reason, "mode": args.mode}) for o in outs]
    if args.out:
        atomic_write_text(Path(args.out), "\n".join(lines) + "\n")
        print(f"wrote {len(outs)} generations to {args.out}")
    else:
        for o in outs:
            print(json.dumps({"text": o.text, "finish_reason": o.finish_reason, "tokens": len(o.token_ids)}))


def _budget_label(gates) -> str:
    return ", ".join(f"{k} {v}" for k, v in gates.describe().items()
                     if k in ("budget", "budget_share", "extra"))


def cmd_serve(args) -> None:
    from slimwise.serving.config import ServeConfig
    from slimwise.serving.server import serve

    plan, plans = serve_plans(args.plan or [])
    code = serve(config_from_args(ServeConfig, args, plan=plan, plans=plans, vllm_args=list(args.vllm_args)))
    if code:
        raise SystemExit(code)


def serve_plans(values: list[str]) -> tuple[str | None, dict[str, str]]:
    """`--plan PLAN` (one plan) or `--plan NAME=PLAN ...` (several, each its own model name)."""
    named = [v for v in values if "=" in v]
    if not named:
        if len(values) > 1:
            raise SlimWiseError("several --plan values need names: --plan NAME=PLAN "
                                "(each served as MODEL:NAME)")
        return (values[0] if values else None), {}
    if len(named) != len(values):
        raise SlimWiseError("give plans either all named (--plan NAME=PLAN) or one unnamed (--plan PLAN)")
    plans: dict[str, str] = {}
    for value in named:
        name, _, path = value.partition("=")
        if not name or not path:
            raise SlimWiseError(f"--plan {value!r}: expected NAME=PLAN_JSON")
        if name in plans:
            raise SlimWiseError(f"--plan name {name!r} given twice: each plan needs its own name")
        plans[name] = path
    return None, plans


def cmd_distill(args) -> None:
    from slimwise.data import load_prompts
    from slimwise.devices import resolve_device
    from slimwise.distill import DistillConfig, TeacherData, build_teacher, distill, teacher_from_parts
    from slimwise.models import load_tokenizer, resolve_model_dir
    from slimwise.plan import PrunePlan

    out = Path(args.out)
    refuse_existing(out, args.force)
    refuse_blocked_parent(out)  # before minutes of training, not after
    if args.dry_run:
        _dry_run(args, "distill", distill=config_from_args(DistillConfig, args),
                 prompts=len(load_prompts(args.data, limit=args.max_samples)))
        return
    source = resolve_model_dir(args.model).resolve()
    if out.resolve() == source or source in out.resolve().parents:
        raise SlimWiseError(f"output {out} is inside the source model {source}; write "
                            "the delta somewhere else")
    plan = PrunePlan.load(args.plan)
    prompts = load_prompts(args.data, limit=args.max_samples)
    if args.vllm_args and args.teacher_engine != "vllm":
        raise SlimWiseError(f"unrecognized arguments: {' '.join(args.vllm_args)} (vLLM options need "
                            "--teacher-engine vllm)")
    # training defaults to float32 on the CPU (the published bars) and bf16 on a GPU
    dtype = args.dtype or ("float32" if resolve_device(args.device) == "cpu" else "auto")
    checkpoint = out.with_name(out.name + ".ckpt.pt")
    config = config_from_args(DistillConfig, args, checkpoint=str(checkpoint))
    tokenizer = load_tokenizer(args.model)
    shared = bool(args.teacher) and Path(args.teacher).is_file()
    # vLLM builds the teacher data before the transformers model loads: the two never share the memory
    from_vllm = _vllm_teacher_parts(args, prompts, tokenizer, config, dtype) \
        if args.teacher_engine == "vllm" and not shared else None
    model = _load(args, dtype=dtype)
    teacher = None
    if shared:  # shared between runs on the same model and prompts (other plans, ratios, the baseline)
        teacher = TeacherData.load(args.teacher)
    elif from_vllm is not None:
        teacher = teacher_from_parts(model, *from_vllm, config)
    elif args.teacher:
        teacher = build_teacher(model, prompts, tokenizer, config)
    if args.teacher and not shared:
        teacher.save(args.teacher)
        print(f"wrote teacher data {args.teacher} ({len(teacher.continuations)} prompts, "
              f"{teacher.seconds:.0f}s)")
    delta = distill(model, plan, prompts, tokenizer, config, teacher=teacher)
    delta.save(out, force=args.force)
    checkpoint.unlink(missing_ok=True)
    m = delta.manifest
    print(f"wrote {out}: {'+'.join(m['params'])} delta ({m['mode']}), {m['trainable_params']:,} trainable "
          f"parameters ({100 * m['trainable_share']:.3f}% of the model), {m['steps']} steps, loss "
          f"{m['loss_history'][0]:.4f} -> {m['loss_history'][-1]:.4f}, {m['seconds']:.0f}s wall, peak memory "
          f"{m['peak_memory_mb']:.0f} MB")


def _vllm_teacher_parts(args, prompts, tokenizer, config, dtype: str) -> tuple:
    """(prompt ids, continuations, log-probs, source) of `--teacher-engine vllm`."""
    from slimwise.distill import vllm_teacher
    from slimwise.engines.reference import encode_prompts
    from slimwise.engines.vllm_engine import vllm_engine_kwargs
    from slimwise.models import load_config, resolve_model_dir

    ids = encode_prompts(tokenizer, prompts)
    vocab = int(load_config(args.model).get_text_config().vocab_size)
    continuations, logprobs, source = vllm_teacher(
        resolve_model_dir(args.model), ids, config, vocab, tokenizer, dtype=dtype,
        engine_kwargs=vllm_engine_kwargs(args.vllm_args), top_k=args.teacher_top_k or -1)
    return ids, continuations, logprobs, source


def cmd_demo(args) -> None:
    from slimwise.demo import run_demo

    run_demo(out_dir=args.out, samples=args.samples, seed=args.seed, device=args.device,
             max_memory=args.max_memory)


def cmd_eval(args) -> None:
    from slimwise.evaluation import EvalConfig, run_eval

    if args.route:
        _eval_mix(args)
        return
    no_mixes = {"calib_mixes": ()} if args.no_calib_mixes else {}
    run_eval(args.models, config_from_args(EvalConfig, args, **no_mixes))


def _eval_mix(args) -> None:
    from slimwise.evaluation.mix import MixConfig, evaluate_mix, mix_table
    from slimwise.hardware import resolve_dtype
    from slimwise.models import resolve_model_dir

    if args.engine != "vllm":
        raise SlimWiseError("--route evaluates a traffic mix in one vLLM engine: add --engine vllm")
    if len(args.models) != 1:
        raise SlimWiseError("--route evaluates one model at a time")
    unnamed, plans = serve_plans(args.plan or [])
    if unnamed:
        raise SlimWiseError("--route needs named plans: --plan NAME=PLAN")
    routes: dict[str, str] = {}
    for value in args.route:
        domain, _, name = value.partition("=")
        if not domain or not name:
            raise SlimWiseError(f"--route {value!r}: expected DOMAIN=NAME (NAME a --plan name or full)")
        routes[domain] = name
    model_dir = resolve_model_dir(args.models[0])
    config = MixConfig(plans=plans, routes=routes, data=args.data, grader=args.grader, split=args.split,
                       n_per_family=args.per_family, max_samples=args.max_samples, seed=args.seed,
                       max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                       dtype=resolve_dtype(args.dtype, model_dir)[0], out_dir=args.out)
    print(mix_table(evaluate_mix(str(model_dir), config)))


def build_parser() -> argparse.ArgumentParser:
    from slimwise.perf.cli import add_bench_parser, add_roofline_parser

    parser = OneLineParser(
        prog="slimwise",
        description="Decode-only expert pruning for MoE serving: full-model prefill, pruned decode.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=OneLineParser)
    for add in (_add_calibrate, _add_plan, _add_prune, _add_generate, _add_distill, _add_eval, _add_serve,
                _add_demo, add_roofline_parser, add_bench_parser):
        add(sub)
    return parser


def _add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="record per-expert routing statistics on calibration data")
    _add_model(p)
    _add_device(p)
    p.add_argument("--data", required=True,
                   help="prompts: a .jsonl file ('prompt' field) or a directory of them")
    p.add_argument("--phase", default="decode", choices=["prompt", "decode", "all"],
                   help="which positions count: prompt tokens, the model's own generated tokens, or both")
    p.add_argument("--out", required=True, help="statistics file to write (.safetensors)")
    p.add_argument("--max-new-tokens", type=integer(1), default=96,
                   help="continuation length for --phase decode/all")
    p.add_argument("--batch-size", type=integer(1), default=16)
    p.add_argument("--max-samples", type=integer(1), default=None)
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--output-sums", action="store_true",
                   help="also sum each expert's outputs (layers x experts x hidden, float64): the vectors "
                        "--gates substitute adds in place of pruned experts")
    _add_dry_run(p)
    p.add_argument("--engine", default="hf", choices=["hf", "vllm"],
                   help="who generates the decode-phase continuations: hf (the transformers model, observed "
                        "as it generates) or vllm (vLLM generates, greedy; one teacher-forced pass of the "
                        "transformers model then counts the same statistics). With vllm, unknown options "
                        "(--tensor-parallel-size 2, ...) go to vLLM")
    p.add_argument("--continuations", metavar="FILE",
                   help="count over continuations made earlier instead of generating: JSONL with token_ids "
                        "per prompt, in order (`slimwise generate --out`)")
    p.epilog = ("With --max-memory too small for the model, the statistics pass runs one decoder layer at a "
                "time (each layer's weights read once) for --phase prompt, --engine vllm and "
                "--continuations. Generation cannot be streamed (every token needs every layer): --engine hf "
                "decode-phase calibration then brings offloaded weights in per forward.")
    p.set_defaults(func=cmd_calibrate, vllm_args=[])


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="score experts with a criterion and write a prune plan (JSON)")
    _add_plan_source(p, plan_option=False)
    p.add_argument("--ep-size", type=integer(1), default=1,
                   help="expert-parallel size to balance for: keep the same number of experts in every EP "
                        "rank's block, so no rank's decode step waits on a fuller one "
                        "(default 1: unbalanced)")
    p.add_argument("--ep-placement", default="linear", choices=["linear", "round_robin"],
                   help="vLLM's expert placement the plan balances for (--expert-placement-strategy)")
    p.add_argument("--nested", action="store_true",
                   help="with several --ratio values: each plan keeps a subset of the next lower ratio's "
                        "kept experts in every layer, so an engine serving them together reads at most the "
                        "lowest ratio's experts in a mixed step")
    p.add_argument("--budget-model", metavar="MODEL",
                   help="spread the per-layer plan's kept experts over the layers by each layer's measured "
                        "output error on MODEL's decode tokens (the model --stats was calibrated on; "
                        "non-uniform: served by masking, not exportable)")
    p.add_argument("--budget-data", metavar="PROMPTS",
                   help="--budget-model: prompts whose generations are measured (.jsonl, .txt or a "
                        "directory)")
    p.add_argument("--budget-tokens", type=integer(1), default=4096,
                   help="--budget-model: decode tokens measured per layer (default 4096)")
    p.add_argument("--out", required=True,
                   help="plan JSON to write; a new directory with several --ratio values or --nested "
                        "(one CRITERION-RATIO.json per ratio)")
    p.set_defaults(func=cmd_plan)


def _add_prune(sub) -> None:
    p = sub.add_parser("prune", help="write a pruned checkpoint that stock transformers and vLLM load",
                       description="Write the pruned checkpoint tensor by tensor from the source's "
                                   "safetensors files, without loading the model (at most two 64 MiB "
                                   "chunks of tensor data held); checkpoints it cannot reproduce exactly, "
                                   "and --distilled, are exported in memory, which loads the whole model.")
    _add_model(p)
    _add_plan_source(p)
    p.add_argument("--out", required=True, help="new directory for the pruned checkpoint")
    p.add_argument("--distilled",
                   help="a `slimwise distill` delta for this plan, folded in (pruned-and-distilled "
                        "decoder for the decode instance); exported in memory: loads the whole model")
    p.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    _add_dry_run(p)
    p.set_defaults(func=cmd_prune)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate",
                       help="generate with full, uniform-pruned or SlimWise (full prefill, pruned decode)")
    _add_model(p)
    _add_device(p)
    p.add_argument("--plan", help="prune plan (the pruned decoder is a masked view of the model)")
    p.add_argument("--decode-model", help="a pruned checkpoint to decode with instead of the masked view")
    p.add_argument("--mode", default="slimwise", choices=["full", "uniform", "slimwise"])
    p.add_argument("--gates", default="renorm", choices=GATES, help=GATES_HELP)
    p.add_argument("--fallback", type=number(0, 1), default=None, metavar="TAU", help=FALLBACK_HELP)
    p.add_argument("--substitutes", metavar="STATS", help=SUBSTITUTES_HELP)
    p.add_argument("--budget", type=integer(1), metavar="E", help=BUDGET_HELP)
    p.add_argument("--budget-share", type=number(0, 1, lo_open=True), metavar="SHARE", help=BUDGET_SHARE_HELP)
    p.add_argument("--extra", type=integer(0), metavar="M", help=EXTRA_HELP)
    p.add_argument("--prompts", required=True, help=".jsonl ('prompt' field) or .txt (one per line)")
    p.add_argument("--max-new-tokens", type=integer(1), default=128)
    p.add_argument("--temperature", type=number(0), default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=number(0, 1, lo_open=True), default=1.0)
    p.add_argument("--top-k", type=integer(0), default=0)
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--batch-size", type=integer(1), default=16)
    p.add_argument("--out", help="write generations as JSONL here instead of printing")
    p.set_defaults(func=cmd_generate)


#: the options of `slimwise distill` from DistillConfig, in --help's order (--max-samples between the two)
DISTILL_OPTIONS = (("params", "mode", "steps", "max_minutes", "batch_size", "teacher_batch_size", "lr",
                    "lora_lr", "loss", "ce_weight", "on_policy", "max_new_tokens"),
                   ("lora_rank", "lora_alpha", "lora_targets", "seed", "checkpoint_every", "resume",
                    "activation_checkpointing"))


def _add_distill(sub) -> None:
    from slimwise.distill import DistillConfig

    p = sub.add_parser("distill",
                       help="distil a decode-only delta (router / norm / LoRA) so the pruned decoder "
                            "continues full-model caches like the full model")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights dtype for training (default: float32 on the CPU, bf16 on a GPU)")
    _add_device(p)
    p.add_argument("--plan", required=True, help="the prune plan JSON to distil the decoder of")
    p.add_argument("--data", required=True,
                   help="calibration prompts: .jsonl ('prompt' field), .txt or a directory")
    p.add_argument("--out", required=True, help="delta directory to write (delta.safetensors + delta.json)")
    add_dataclass_options(p, DistillConfig, DISTILL_OPTIONS[0])
    # the prompts' limit, applied as they load: DistillConfig.max_samples (and the delta's record) stays None
    p.add_argument("--max-samples", type=integer(1), default=None)
    add_dataclass_options(p, DistillConfig, DISTILL_OPTIONS[1])
    p.add_argument("--teacher",
                   help="teacher-data file (.pt) shared between runs on the same model and data: "
                        "built and written there if absent, reused (and checked) if present")
    p.add_argument("--teacher-engine", default="hf", choices=["hf", "vllm"],
                   help="who builds the teacher data (the full model's continuations and log-probs): hf (the "
                        "transformers model) or vllm (generation and teacher-forced log-probs in vLLM, "
                        "before the student loads). With vllm, unknown options go to vLLM")
    p.add_argument("--teacher-top-k", type=integer(1), default=None,
                   help="with --teacher-engine vllm: keep vLLM's top K log-probs per position and spread the "
                        "rest evenly (default: the whole vocabulary, exact)")
    p.add_argument("--force", action="store_true", help="replace a non-empty output")
    _add_dry_run(p)
    p.set_defaults(func=cmd_distill, vllm_args=[])


#: the options of `slimwise eval` from EvalConfig, in the order --help lists them (--no-calib-mixes between)
EVAL_OPTIONS = (("dtype", "device", "max_memory", "out_dir", "plans", "stats", "criteria", "ratios", "phases",
                 "uniform_phase", "scope", "modes", "distilled", "engine", "gates", "fallback", "substitutes",
                 "budget", "budget_share", "extra", "data",
                 "grader", "domain",
                 "families", "split",
                 "n_per_family", "max_samples", "calib_data", "calib_domain", "calib_per_family",
                 "calib_max_new_tokens", "calib_seed", "calib_mixes"),
                ("other_domains", "other_per_family", "max_new_tokens", "batch_size", "seed", "threads", "kl",
                 "traffic", "plots", "cache", "cache_dir"))


def _add_eval(sub) -> None:
    from slimwise.evaluation.config import EvalConfig

    p = sub.add_parser("eval",
                       help="accuracy, length, fidelity and decode traffic of full / uniform / SlimWise "
                            "over criteria x ratios x calibration phases; JSON + Markdown report + plots")
    p.add_argument("models", nargs="+", help="model directories or embedded names (testbed-a testbed-b)")
    add_dataclass_options(p, EvalConfig, EVAL_OPTIONS[0])
    p.add_argument("--no-calib-mixes", action="store_true", help="no mixed-domain calibrations")
    add_dataclass_options(p, EvalConfig, EVAL_OPTIONS[1])
    p.add_argument("--route", action="append", metavar="DOMAIN=NAME",
                   help="evaluate a traffic mix instead of the grid (--engine vllm): plans given as --plan "
                        "NAME=PLAN served in one engine, each problem routed by its domain to plan NAME (or "
                        "full); DOMAIN * routes the rest (default full). Problems of every domain; writes "
                        "OUT/mix.json and mix.md")
    p.set_defaults(func=cmd_eval)


#: the options of `slimwise serve` after MODEL and --plan, in the order --help lists them
SERVE_OPTIONS = ("default_plan", "delta", "disaggregated", "decode_model", "prefill_url", "decode_url",
                 "nixl", "host", "port", "served_model_name", "max_n", "min_decode_batch", "gates",
                 "fallback", "substitutes", "budget", "budget_share", "extra", "log_every",
                 "kv_dir_max_bytes", "decode_cache_dir")


def _add_serve(sub) -> None:
    from slimwise.serving.config import ServeConfig

    p = sub.add_parser("serve",
                       help="OpenAI-compatible server in vLLM: colocated (one engine) or disaggregated PD",
                       description="Serve MODEL with SlimWise in vLLM's OpenAI server. Unknown options are "
                                   "passed to `vllm serve` unchanged "
                                   "(e.g. --tensor-parallel-size, --max-num-seqs).")
    add_dataclass_options(p, ServeConfig, ("model",))
    p.add_argument("--plan", action="append", metavar="[NAME=]PLAN",
                   help="prune plan; without it the model is served unpruned. Repeat as NAME=PLAN to serve "
                        "several plans in one engine, each request choosing by model name MODEL:NAME "
                        "(MODEL:full: every expert)")
    # the command line logs routing counters by default; ServeConfig from Python does not
    add_dataclass_options(p, ServeConfig, SERVE_OPTIONS, overrides={"log_every": {"default": 100}})
    p.set_defaults(func=cmd_serve, vllm_args=[])


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the main job on the embedded default model: "
                                    "calibrate, prune 50%%, compare modes")
    p.add_argument("--out", default="runs/demo", help="where to write the report")
    p.add_argument("--samples", type=integer(1), default=64, help="test prompts per mode")
    p.add_argument("--seed", type=integer(0), default=0)
    _add_device(p)
    p.set_defaults(func=cmd_demo)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if args.command not in ("serve", "calibrate", "distill"):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.vllm_args = extra
    return run_command(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
