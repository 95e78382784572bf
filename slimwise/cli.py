"""`slimwise` command line: a thin layer over the Python API (one function per subcommand)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from slimwise.argtypes import OneLineParser
from slimwise.devices import parse_max_memory, resolve_device
from slimwise.errors import SlimWiseError, run_command
from slimwise.io import atomic_write_text, refuse_blocked_parent, refuse_existing
from slimwise.options import add_dataclass_options, config_from_args


def _add_layout(p: argparse.ArgumentParser, layout) -> None:
    """Options from several config dataclasses, interleaved: `layout` is (config class, field names) pairs in
    --help's order."""
    for config_cls, names in layout:
        add_dataclass_options(p, config_cls, names)


def _load(args, path=None, dtype=None):
    """The model of a command (its parsed options, or its config), on its --device / --max-memory."""
    from slimwise.models import load_model

    return load_model(path or args.model, dtype=dtype or args.dtype, device=args.device,
                      max_memory=args.max_memory)


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
    from slimwise.calibrate import CalibrateCommand, CalibrationConfig, vllm_continuations
    from slimwise.data import load_prompts
    from slimwise.models import load_tokenizer, resolve_model_dir

    job, config = config_from_args(CalibrateCommand, args), config_from_args(CalibrationConfig, args)
    refuse_blocked_parent(job.out)  # an unwritable output is refused before calibration runs, not after
    if Path(job.out).is_dir():
        raise SlimWiseError(f"output {job.out} is a directory; pass a file path (.safetensors)")
    if args.vllm_args and job.engine != "vllm":
        raise SlimWiseError(f"unrecognized arguments: {' '.join(args.vllm_args)} (vLLM options need "
                            "--engine vllm)")
    if _dry_run(job, "calibrate", batch_size=config.batch_size, max_new_tokens=config.max_new_tokens):
        return
    prompts = load_prompts(job.data, limit=config.max_samples)
    tokenizer = load_tokenizer(job.model)
    continuations, source = None, None
    if job.continuations:
        if job.engine == "vllm":
            raise SlimWiseError("--continuations and --engine vllm both give the continuations: pick one")
        continuations, source = _read_continuations(job.continuations, len(prompts)), {
            "continuations": str(job.continuations)}
    elif job.engine == "vllm" and config.phase != "prompt":  # vLLM generates; the transformers model counts
        from slimwise.engines.vllm_engine import vllm_engine_kwargs

        engine_kwargs = vllm_engine_kwargs(args.vllm_args)
        continuations = vllm_continuations(resolve_model_dir(job.model), prompts, tokenizer, config,
                                           dtype=job.dtype, engine_kwargs=engine_kwargs)
        source = {"continuations": "vllm", "vllm_options": engine_kwargs}
    model = _load(job)
    stats = _statistics(model, prompts, continuations, tokenizer, config)
    if source is not None:
        stats.meta["engine"] = source
    stats.meta["data"] = str(job.data)
    stats.save(job.out)
    print(f"wrote {job.out}: {len(stats.layers)} MoE layers x {stats.num_experts} experts, "
          f"{int(stats.tokens[0])} {config.phase} tokens counted per layer in {stats.meta['seconds']:.1f}s")


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


def _plan_from(job, ratio: float | None = None):
    """The plan of `slimwise prune` (a `PruneCommand`: its --plan file, else from statistics) or of one
    ratio of `slimwise plan` (a `PlanCommand`)."""
    from slimwise.criteria import plan_from_stats
    from slimwise.plan import PrunePlan
    from slimwise.stats import ExpertStats

    if getattr(job, "plan", None):
        return PrunePlan.load(job.plan)
    if not job.stats:
        raise SlimWiseError("give --plan PLAN, or --stats STATS with --criterion and --ratio")
    return plan_from_stats(ExpertStats.load(job.stats), job.criterion, job.ratio if ratio is None else ratio,
                           scope=job.scope, ep_size=getattr(job, "ep_size", 1),
                           ep_placement=getattr(job, "ep_placement", "linear"))


def cmd_plan(args) -> None:
    from slimwise.criteria import nested_plans, plan_from_stats
    from slimwise.plan_config import PlanCommand
    from slimwise.stats import ExpertStats

    job = config_from_args(PlanCommand, args)
    ratios = sorted(set(job.ratio))
    if job.budget_model:
        plans = _sensitivity_plans(job, ratios)
        if len(plans) == 1:
            plans[0].save(job.out)
            _report_plan(plans[0], job.out)
            return
        _write_plans(plans, Path(job.out))
        return
    if len(ratios) == 1 and not job.nested:
        plan = _plan_from(job, ratios[0])
        plan.save(job.out)
        _report_plan(plan, job.out)
        return
    if not job.stats:
        raise SlimWiseError("several --ratio values or --nested plan from statistics: give --stats STATS")
    options = dict(scope=job.scope, ep_size=job.ep_size, ep_placement=job.ep_placement)
    stats = ExpertStats.load(job.stats)
    if job.nested:
        plans = nested_plans(stats, job.criterion, ratios, **options)
    else:
        plans = [plan_from_stats(stats, job.criterion, r, **options) for r in ratios]
    _write_plans(plans, Path(job.out))
    if job.nested:
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


def _sensitivity_plans(job, ratios: list[float]):
    """`--budget-model MODEL --budget-data DATA`: the per-layer budgets from measured sensitivity
    (`slimwise.layer_budgets`), one plan per ratio from one measurement."""
    from slimwise.data import load_prompts
    from slimwise.fingerprint import fingerprints_match, model_fingerprint
    from slimwise.layer_budgets import capture_decode_inputs, grid, layer_errors, sensitivity_plan
    from slimwise.models import load_model, load_tokenizer
    from slimwise.stats import ExpertStats

    if not job.stats or not job.budget_data:
        raise SlimWiseError("--budget-model measures layers for a plan from statistics: give --stats STATS "
                            "and --budget-data PROMPTS")
    if job.global_budget or job.nested or job.ep_size > 1:
        raise SlimWiseError("--budget-model sets each layer's count itself: drop --global, --nested and "
                            "--ep-size")
    stats = ExpertStats.load(job.stats)
    prompts = load_prompts(job.budget_data)
    model = load_model(job.budget_model)
    if not fingerprints_match(stats.meta.get("fingerprint"), model_fingerprint(model)):
        raise SlimWiseError(f"{job.stats} was calibrated on other weights than {job.budget_model}: "
                            "measure the model the statistics come from")
    inputs = capture_decode_inputs(model, prompts, load_tokenizer(job.budget_model),
                                   max_tokens=job.budget_tokens)
    counts = grid(stats.num_experts, int(stats.meta["top_k"]))
    errors = layer_errors(model, stats, job.criterion, inputs, counts)
    return [sensitivity_plan(stats, job.criterion, r, errors, counts) for r in ratios]


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
    from slimwise.plan_config import PruneCommand

    job = config_from_args(PruneCommand, args)
    plan = _plan_from(job)
    if _dry_run(job, "prune", ratio=plan.ratio, in_memory=bool(job.distilled)):
        return
    out = export_checkpoint(job.model, plan, job.out, dtype=job.dtype, force=job.force, delta=job.distilled)
    print(f"wrote {out}: {plan.num_kept} of {plan.num_experts} experts per layer, verified against the source"
          + (f", distilled delta {job.distilled} folded in" if job.distilled else ""))


def cmd_generate(args) -> None:
    from slimwise.data import load_prompts
    from slimwise.engines.reference import GenerateCommand, GenerationConfig, PhaseSplitEngine
    from slimwise.export import load_pruned
    from slimwise.models import load_tokenizer
    from slimwise.plan import PrunePlan

    # the cheap inputs first: a bad plan, prompt file or option is refused before any weights load
    job = config_from_args(GenerateCommand, args)
    plan = PrunePlan.load(job.plan) if job.plan else None
    if job.mode != "full" and plan is None and not job.decode_model:
        raise SlimWiseError(f"mode {job.mode} needs --plan PLAN or --decode-model DIR")
    gates = job.decode_gates
    if not gates.plain and (plan is None or job.decode_model):
        raise SlimWiseError("--gates drop, --fallback and --budget/--extra route pruned tokens from the full "
                            "router: give --plan (the masked view), not --decode-model")
    if gates.budgeted and job.mode != "slimwise":
        raise SlimWiseError(f"--budget/--budget-share/--extra choose decode steps' experts: mode {job.mode} "
                            "has none (use --mode slimwise)")
    prompts = load_prompts(job.prompts)
    config = config_from_args(GenerationConfig, args, progress=True)
    model = _load(job)
    tokenizer = load_tokenizer(job.model)
    decode_model = None
    if job.decode_model:
        decode_model, decode_plan = load_pruned(job.decode_model, dtype=job.dtype, device=job.device,
                                                max_memory=job.max_memory)
        if plan is not None and decode_plan is not None and plan.kept_experts != decode_plan.kept_experts:
            raise SlimWiseError(f"--plan keeps other experts than the plan {job.decode_model} was exported "
                                "with: drop --plan, or export the decode model from it (`slimwise prune`)")
        plan = plan or decode_plan
    engine = PhaseSplitEngine(model, tokenizer, plan=plan, decode_model=decode_model, gates=gates)
    outs = engine.generate(prompts, mode=job.mode, config=config)
    if engine.mask is not None and not gates.plain and job.mode != "full":
        s = engine.mask.fallback_summary()
        if gates.budgeted:
            print(f"batch budget {_budget_label(gates)}: {s['routed']} decode token-layer pairs, "
                  f"{100 * s['touching_pruned_share']:.1f}% with an expert outside the step's set in the "
                  "full top-k", file=sys.stderr)
        print(f"gates {s['gates']}, fallback {s['fallback']}: {s['routed']} pruned token-layer pairs, "
              f"{100 * s['touching_pruned_share']:.1f}% with a pruned expert in the full top-k, "
              f"{100 * s['fallback_share']:.1f}% fell back to every expert", file=sys.stderr)
    lines = [json.dumps({"prompt_ids": o.prompt_ids, "token_ids": o.token_ids, "text": o.text,
                         "finish_reason": o.finish_reason, "mode": job.mode}) for o in outs]
    if job.out:
        atomic_write_text(Path(job.out), "\n".join(lines) + "\n")
        print(f"wrote {len(outs)} generations to {job.out}")
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
    from slimwise.distill_config import DistillCommand
    from slimwise.models import load_tokenizer, resolve_model_dir
    from slimwise.plan import PrunePlan

    job = config_from_args(DistillCommand, args)
    out = Path(job.out)
    refuse_existing(out, job.force)
    refuse_blocked_parent(out)  # before minutes of training, not after
    if job.dry_run:
        _dry_run(job, "distill", distill=config_from_args(DistillConfig, args),
                 prompts=len(load_prompts(job.data, limit=job.max_samples)))
        return
    source = resolve_model_dir(job.model).resolve()
    if out.resolve() == source or source in out.resolve().parents:
        raise SlimWiseError(f"output {out} is inside the source model {source}; write "
                            "the delta somewhere else")
    plan = PrunePlan.load(job.plan)
    prompts = load_prompts(job.data, limit=job.max_samples)
    if args.vllm_args and job.teacher_engine != "vllm":
        raise SlimWiseError(f"unrecognized arguments: {' '.join(args.vllm_args)} (vLLM options need "
                            "--teacher-engine vllm)")
    # training defaults to float32 on the CPU (the published bars) and bf16 on a GPU
    dtype = job.dtype or ("float32" if resolve_device(job.device) == "cpu" else "auto")
    checkpoint = out.with_name(out.name + ".ckpt.pt")
    config = config_from_args(DistillConfig, args, checkpoint=str(checkpoint))
    tokenizer = load_tokenizer(job.model)
    shared = bool(job.teacher) and Path(job.teacher).is_file()
    # vLLM builds the teacher data before the transformers model loads: the two never share the memory
    from_vllm = _vllm_teacher_parts(job, args.vllm_args, prompts, tokenizer, config, dtype) \
        if job.teacher_engine == "vllm" and not shared else None
    model = _load(job, dtype=dtype)
    teacher = None
    if shared:  # shared between runs on the same model and prompts (other plans, ratios, the baseline)
        teacher = TeacherData.load(job.teacher)
    elif from_vllm is not None:
        teacher = teacher_from_parts(model, *from_vllm, config)
    elif job.teacher:
        teacher = build_teacher(model, prompts, tokenizer, config)
    if job.teacher and not shared:
        teacher.save(job.teacher)
        print(f"wrote teacher data {job.teacher} ({len(teacher.continuations)} prompts, "
              f"{teacher.seconds:.0f}s)")
    delta = distill(model, plan, prompts, tokenizer, config, teacher=teacher)
    delta.save(out, force=job.force)
    checkpoint.unlink(missing_ok=True)
    m = delta.manifest
    print(f"wrote {out}: {'+'.join(m['params'])} delta ({m['mode']}), {m['trainable_params']:,} trainable "
          f"parameters ({100 * m['trainable_share']:.3f}% of the model), {m['steps']} steps, loss "
          f"{m['loss_history'][0]:.4f} -> {m['loss_history'][-1]:.4f}, {m['seconds']:.0f}s wall, peak memory "
          f"{m['peak_memory_mb']:.0f} MB")


def _vllm_teacher_parts(job, vllm_args: list[str], prompts, tokenizer, config, dtype: str) -> tuple:
    """(prompt ids, continuations, log-probs, source) of `--teacher-engine vllm`."""
    from slimwise.distill import vllm_teacher
    from slimwise.engines.reference import encode_prompts
    from slimwise.engines.vllm_engine import vllm_engine_kwargs
    from slimwise.models import load_config, resolve_model_dir

    ids = encode_prompts(tokenizer, prompts)
    vocab = int(load_config(job.model).get_text_config().vocab_size)
    continuations, logprobs, source = vllm_teacher(
        resolve_model_dir(job.model), ids, config, vocab, tokenizer, dtype=dtype,
        engine_kwargs=vllm_engine_kwargs(vllm_args), top_k=job.teacher_top_k or -1)
    return ids, continuations, logprobs, source


def cmd_demo(args) -> None:
    from slimwise.demo import DemoConfig, run_demo

    demo = config_from_args(DemoConfig, args)
    run_demo(out_dir=demo.out, samples=demo.samples, seed=demo.seed, device=demo.device,
             max_memory=demo.max_memory)


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
    from slimwise.serving.platform import vllm_on_cpu

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
                       dtype=resolve_dtype(args.dtype, model_dir, vllm_on_cpu())[0], out_dir=args.out)
    print(mix_table(evaluate_mix(str(model_dir), config)))


def build_parser() -> argparse.ArgumentParser:
    from slimwise.perf.cli import add_bench_parser

    parser = OneLineParser(
        prog="slimwise",
        description="Decode-only expert pruning for MoE serving: full-model prefill, pruned decode.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=OneLineParser)
    for add in (_add_calibrate, _add_plan, _add_prune, _add_generate, _add_distill, _add_eval, _add_serve,
                _add_demo, add_bench_parser):
        add(sub)
    return parser


def _add_calibrate(sub) -> None:
    from slimwise.calibrate import CalibrateCommand, CalibrationConfig

    p = sub.add_parser("calibrate", help="record per-expert routing statistics on calibration data")
    _add_layout(p, ((CalibrateCommand, ("model", "dtype", "device", "max_memory", "data")),
                    (CalibrationConfig, ("phase",)), (CalibrateCommand, ("out",)),
                    (CalibrationConfig, ("max_new_tokens", "batch_size", "max_samples", "seed",
                                         "output_sums")),
                    (CalibrateCommand, ("dry_run", "engine", "continuations"))))
    p.epilog = ("With --max-memory too small for the model, the statistics pass runs one decoder layer at a "
                "time (each layer's weights read once) for --phase prompt, --engine vllm and "
                "--continuations. Generation cannot be streamed (every token needs every layer): --engine hf "
                "decode-phase calibration then brings offloaded weights in per forward.")
    p.set_defaults(func=cmd_calibrate, vllm_args=[])


def _add_plan(sub) -> None:
    from slimwise.plan_config import PlanCommand

    p = sub.add_parser("plan", help="score experts with a criterion and write a prune plan (JSON)")
    add_dataclass_options(p, PlanCommand)
    p.set_defaults(func=cmd_plan)


def _add_prune(sub) -> None:
    from slimwise.plan_config import PRUNE_OPTIONS, PruneCommand

    p = sub.add_parser("prune", help="write a pruned checkpoint that stock transformers and vLLM load",
                       description="Write the pruned checkpoint tensor by tensor from the source's "
                                   "safetensors files, without loading the model (at most two 64 MiB "
                                   "chunks of tensor data held); checkpoints it cannot reproduce exactly, "
                                   "and --distilled, are exported in memory, which loads the whole model.")
    add_dataclass_options(p, PruneCommand, PRUNE_OPTIONS)
    p.set_defaults(func=cmd_prune)


#: `slimwise generate`'s options in --help's order: GenerationConfig's between --prompts and --out
GENERATE_OPTIONS = (("model", "dtype", "device", "max_memory", "plan", "decode_model", "mode", "gates",
                     "fallback", "substitutes", "budget", "budget_share", "extra", "prompts"), ("out",))


def _add_generate(sub) -> None:
    from slimwise.engines.reference import GenerateCommand, GenerationConfig

    p = sub.add_parser("generate",
                       help="generate with full, uniform-pruned or SlimWise (full prefill, pruned decode)")
    _add_layout(p, ((GenerateCommand, GENERATE_OPTIONS[0]), (GenerationConfig, None),
                    (GenerateCommand, GENERATE_OPTIONS[1])))
    p.set_defaults(func=cmd_generate)


#: the options of `slimwise distill`, in --help's order: DistillConfig's (the trainer's) in two runs, inside
#: DistillCommand's (the command's own), --max-samples between the two
DISTILL_OPTIONS = (("model", "dtype", "device", "max_memory", "plan", "data", "out"),
                   ("params", "mode", "steps", "max_minutes", "batch_size", "teacher_batch_size", "lr",
                    "lora_lr", "loss", "ce_weight", "on_policy", "max_new_tokens"),
                   ("max_samples",),
                   ("lora_rank", "lora_alpha", "lora_targets", "seed", "checkpoint_every", "resume",
                    "activation_checkpointing"),
                   ("teacher", "teacher_engine", "teacher_top_k", "force", "dry_run"))


def _add_distill(sub) -> None:
    from slimwise.distill import DistillConfig
    from slimwise.distill_config import DistillCommand

    p = sub.add_parser("distill",
                       help="distil a decode-only delta (router / norm / LoRA) so the pruned decoder "
                            "continues full-model caches like the full model")
    _add_layout(p, zip((DistillCommand, DistillConfig) * 2 + (DistillCommand,), DISTILL_OPTIONS, strict=True))
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
    from slimwise.demo import DEMO_OPTIONS, DemoConfig

    add_dataclass_options(p, DemoConfig, DEMO_OPTIONS)
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
