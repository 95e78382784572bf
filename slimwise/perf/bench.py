"""`slimwise bench`: decode throughput of full / SlimWise / pruned / uniform
models in vLLM, against batch size.

Variants (identical engine settings; the masked ones share one engine):
  full          the checkpoint as is (stock architecture, its own engine);
  slimwise      SlimWise colocated: full-model prefill, decode tokens routed to the kept experts (masking);
  pruned        the exported pruned checkpoint alone (what a PD-disaggregated decode instance runs);
  uniform       every token routed to the kept experts inside the full checkpoint (classic pruning);
  slimwise-minN SlimWise with the load-aware policy: prune only on steps with >= N decode tokens;
  mix-P, mixfull-P  one engine with two plans, P% of each batch on the plan (`slimwise.perf.mixes`).
slimwise, uniform and slimwise-minN are one SlimWise engine (one weight copy, as colocated serving runs it)
whose mode is switched before each measurement (`slimwise_set_mode`, outside the timed window); the mixes
share another; full and pruned are separate stock engines.

Method: B random-token prompts of `prompt_len` tokens, `output_len` tokens each with ignore_eos and greedy
sampling. Decode time comes from vLLM's per-request metrics (engine-core timestamps): from the first token
(the end of the prefill step) to the last, so prefill is excluded; decode throughput = tokens generated after
the first / decode time; time per output token = decode time / (output_len - 1). Requests are enqueued while
the scheduler is paused (`LLM.sleep(level=0)`, `enqueue`, `wake_up`, `wait_for_completion`) and
max_num_batched_tokens >= B x prompt_len, so every prompt is prefilled in the same step and every decode step
holds exactly B decode tokens; `prefill_spread_s` in the JSON proves it (0 = one prefill step). Per batch
size: a warm-up generate for every variant, then `repetitions` rounds in which every variant runs once, the
order rotated each round (A B C, B C A, ...). Speedups are paired: variant / full within the same round;
medians and min-max are reported. Engine start (construction of `vllm.LLM`) is timed separately and excluded.

Engines stay resident (all alive at once) unless `restart` is set: then each round starts and closes one
engine at a time (for machines where the engines do not fit together).

Expert traffic (`count_experts`): a separate pass with counting engines (the plugin's
`slimwise_count_experts` hook, eager mode; one for the checkpoint, where full runs as mode "full", and one for
the pruned checkpoint) runs each batch once more and reads, per layer and decode step,
the distinct experts the decode tokens selected; beside it the uniform expectation E'(1-(1-k/E')^B) and the
expert bytes read. Counting costs a top-k and a sync per layer per step, so it
never runs in the timed engines.

Roofline (`hardware`, default cpu-measured): `slimwise.perf.roofline` predicts the same speedups for the
model's configuration at context prompt_len + output_len/2; the JSON holds predicted vs measured.
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from slimwise.baseline_plans import random_plan
from slimwise.errors import SlimWiseError
from slimwise.hardware import scoped_environ
from slimwise.io import atomic_write_text
from slimwise.perf.bench_config import BASE_VARIANTS, GATED, BenchConfig
from slimwise.perf.bench_report import (
    bytes_split_table,
    check_bars,
    compare_roofline,
    format_tables,
    jsonable,
    plot_bench,
    suggest_threshold,
    summarize_runs,
    threshold_report,
)
from slimwise.perf.mixes import mix_of, plan_b_path, variant_plans
from slimwise.perf.roofline import RooflineConfig
from slimwise.perf.timing import (
    engines_closed_on_sigterm,
    kv_bytes_per_token,
    make_prompts,
    measure,
    shutdown_llm,
    state_bytes_per_layer,
    vocab_size,
)

POLICY_PREFIX = "slimwise-min"


@dataclass
class Variant:
    """One engine configuration."""

    name: str
    model_dir: str
    overrides: dict
    available_experts: int  # experts a decode token can reach
    stock_arch: str
    min_decode_batch: int = 0
    # set on a shared SlimWise engine before each run; None: a stock engine of its own
    mode: str | None = None
    meta: dict = field(default_factory=dict)

    @property
    def engine_key(self) -> str:
        """Variants with equal keys run on one engine."""
        return json.dumps([self.model_dir, self.overrides], sort_keys=True, default=str)


def select(llm, variant: Variant) -> None:
    """Put a shared engine in the variant's mode (a no-op for a stock engine)."""
    if variant.mode is not None:
        llm.collective_rpc("slimwise_set_mode", args=(variant.mode, variant.min_decode_batch))


def engine_groups(variants: list[Variant]) -> dict[str, list[Variant]]:
    """engine key -> its variants, in the variants' order."""
    groups: dict[str, list[Variant]] = {}
    for v in variants:
        groups.setdefault(v.engine_key, []).append(v)
    return groups


# ----- preparation ------------------------------------------------------------------------------------------

def _check_config(config: BenchConfig) -> None:
    if bool(config.model) == bool(config.synthetic):
        raise SlimWiseError("give exactly one of a model directory and --synthetic PRESET")
    if not config.batches or min(config.batches) < 1:
        raise SlimWiseError(f"batch sizes must be >= 1, got {list(config.batches)}")
    if config.output_len < 2:
        raise SlimWiseError("output_len must be >= 2: decode time is measured from "
                            "the first to the last token")
    if config.prompt_len < 1 or config.repetitions < 1:
        raise SlimWiseError("prompt_len and repetitions must be >= 1")
    for v in config.variants:
        policy = v.startswith(POLICY_PREFIX) and v[len(POLICY_PREFIX):].isdigit()
        if v not in (*BASE_VARIANTS, GATED) and not policy and mix_of(v) is None:
            raise SlimWiseError(f"unknown variant {v!r}; have: {', '.join(BASE_VARIANTS)}, {GATED}, "
                                f"{POLICY_PREFIX}N, mix-P and mixfull-P (P = 0..100: percent of requests on "
                                "the plan)")
    gates = config.decode_gates  # refuses an unknown variant, threshold or a missing --substitutes
    if (GATED in config.variants) == gates.plain:
        raise SlimWiseError(f"variant {GATED!r} benches --gates / --fallback / --substitutes beside plain "
                            f"slimwise: give both the variant and at least one of them")
    if "full" not in config.variants:
        raise SlimWiseError("variant 'full' is needed: every ratio is against the "
                            "full model of the same round")
    if len(set(config.variants)) != len(config.variants):
        raise SlimWiseError("variants must be distinct")


def synthetic_dir(config: BenchConfig) -> Path:
    from slimwise.perf.presets import get_preset

    if config.synthetic_dir:
        return Path(config.synthetic_dir)
    preset = get_preset(config.synthetic)
    name = f"synthetic-{preset.name}"
    if config.layers is not None and config.layers != preset.build_layers:
        name += f"-L{config.layers}"
    if config.top_k is not None:
        name += f"-k{config.top_k}"
    if config.routing_skew:
        name += "-skew-" + Path(config.routing_skew).stem
    if config.seed:
        name += f"-s{config.seed}"
    return Path("runs") / name


def prepare_model(config: BenchConfig, log: Callable[[str], None] = print) -> Path:
    """The full model's directory: the given checkpoint, or a synthetic preset (built once, then reused)."""
    if config.model:
        from slimwise.models import resolve_model_dir

        return Path(resolve_model_dir(config.model))
    from slimwise.perf.presets import build_synthetic, get_preset

    preset = get_preset(config.synthetic)
    out = synthetic_dir(config)
    layers = preset.build_layers if config.layers is None else config.layers
    manifest = out / "slimwise_synthetic.json"
    if manifest.is_file():
        m = json.loads(manifest.read_text())
        want = {"preset": preset.name, "layers": layers, "seed": config.seed, "top_k": config.top_k,
                "routing_skew_from": str(config.routing_skew) if config.routing_skew else None}
        have = {k: m.get(k) for k in want}
        if have != want:
            raise SlimWiseError(f"{out} holds another synthetic model ({have}, wanted {want}): "
                                "pass --synthetic-dir")
        log(f"synthetic {preset.name}: reusing {out} ({m.get('gb')} GB)")
        return out
    log(f"synthetic {preset.name}: building {layers} layers into {out} (random weights, bf16) ...")
    t0 = time.perf_counter()
    build_synthetic(preset.name, out, layers=layers, seed=config.seed, routing_skew_from=config.routing_skew,
                    top_k=config.top_k)
    log(f"built in {time.perf_counter() - t0:.0f}s")
    return out


def _shares_plan(model, stats_path: str, ratio: float):
    """Keep the most used experts per layer by the stats' usage shares (for models
    the stats were not made on)."""
    from slimwise.adapters import get_adapter
    from slimwise.baseline_plans import usage_share_plan
    from slimwise.perf.presets import stats_rows

    adapter = get_adapter(model.config)
    rows = stats_rows(stats_path, adapter.num_experts(model.config), len(adapter.moe_layers(model)))
    return usage_share_plan(model, rows, ratio, meta={"stats": str(stats_path)})


def prepare_plan(config: BenchConfig, model_dir: Path, out: Path, log: Callable[[str], None] = print):
    """(plan, plan path, pruned checkpoint dir or None). Loads the model once (to check
    or make the plan, to export)."""
    from slimwise.models import PLAN_FILE
    from slimwise.plan import PrunePlan

    need_pruned = "pruned" in config.variants and not config.pruned_model
    plan = PrunePlan.load(config.plan) if config.plan else None
    if plan is not None and config.synthetic and plan.fingerprint is not None:
        # random weights: a trained model's plan applies by its kept sets (family, expert count, top-k and
        # layers are still checked below), so the bench's copy names no weights
        plan = replace(plan, fingerprint=None, meta={**plan.meta, "made_for": plan.fingerprint})
        log(f"plan: {config.plan}'s kept sets on the synthetic model (the plan was made for other weights)")
    pruned_dir = Path(config.pruned_model) if config.pruned_model else None
    if plan is not None and not need_pruned:  # made for this model: refused before any engine starts
        from slimwise.models import structure_model

        plan.check_model(structure_model(model_dir), check_fingerprint=False)
        return plan, plan.save(out / "plan.json"), pruned_dir
    from slimwise.models import load_model

    model = load_model(str(model_dir), dtype="auto")
    if plan is None:
        plan = _plan_for(model, config, log)
    else:
        plan.check_model(model)
    if need_pruned:
        pruned_dir = out / "pruned"
        cached = pruned_dir / PLAN_FILE
        if cached.is_file() and PrunePlan.load(cached).to_dict() == plan.to_dict():
            log(f"pruned checkpoint: reusing {pruned_dir}")
        else:
            from slimwise.export import export_pruned

            t0 = time.perf_counter()
            export_pruned(model, plan, pruned_dir, source_dir=model_dir, force=True)
            log(f"pruned checkpoint: exported {plan.num_kept} of {plan.num_experts} experts per layer to "
                f"{pruned_dir} in {time.perf_counter() - t0:.0f}s (verified)")
    del model
    gc.collect()
    plan_path = plan.save(out / "plan.json")
    return plan, plan_path, pruned_dir


def _plan_for(model, config: BenchConfig, log: Callable[[str], None]):
    from slimwise.fingerprint import fingerprints_match, model_fingerprint

    if config.stats:
        from slimwise.criteria import plan_from_stats
        from slimwise.stats import ExpertStats

        stats = ExpertStats.load(config.stats)
        if fingerprints_match(stats.meta.get("fingerprint") or {}, model_fingerprint(model)):
            log(f"plan: {config.criterion} at ratio {config.ratio} from {config.stats}")
            return plan_from_stats(stats, config.criterion, config.ratio)
        log(f"plan: {config.stats} was calibrated on another model: keeping the most used experts by its "
            f"usage shares at ratio {config.ratio}")
        return _shares_plan(model, config.stats, config.ratio)
    log(f"plan: random {int(round(config.ratio * 100))}% per layer (seed {config.seed}); no "
        "--plan/--stats given")
    return random_plan(model, config.ratio, config.seed)


def make_variants(config: BenchConfig, model_dir: Path, plan, plan_path: Path,
                  pruned_dir: Path | None) -> list[Variant]:
    from slimwise.serving.overrides import slimwise_overrides

    arch = (json.loads((model_dir / "config.json").read_text()).get("architectures") or [None])[0]
    kept = plan.num_kept if plan.is_uniform else max(len(v) for v in plan.kept_experts.values())
    out = []
    for name in config.variants:
        if name == "full":
            out.append(Variant(name, str(model_dir), {}, plan.num_experts, arch))
        elif name == "pruned":
            parch = (json.loads((pruned_dir / "config.json").read_text()).get("architectures") or [None])[0]
            out.append(Variant(name, str(pruned_dir), {}, kept, parch))
        elif name in ("slimwise", "uniform"):
            out.append(Variant(name, str(model_dir), slimwise_overrides(model_dir, plan_path), kept, arch,
                               mode=name))
        elif name == GATED:  # a fallback token can reach every expert
            gates = config.decode_gates
            out.append(Variant(name, str(model_dir), slimwise_overrides(model_dir, plan_path, gates=gates),
                               kept if gates.fallback is None else plan.num_experts, arch, mode="slimwise",
                               meta=gates.describe()))
        elif mix_of(name) is not None:  # one engine with both plans; each request names its own
            plans = {"a": plan_path, "b": plan_b_path(config, model_dir, plan_path)}
            out.append(Variant(name, str(model_dir), slimwise_overrides(model_dir, plans), plan.num_experts,
                               arch, mode="slimwise", meta={"mix": mix_of(name)}))
        else:
            n = int(name[len(POLICY_PREFIX):])
            out.append(Variant(name, str(model_dir), slimwise_overrides(model_dir, plan_path), kept, arch,
                               min_decode_batch=n, mode="slimwise"))
    return out


# ----- engines ----------------------------------------------------------------------------------------------

def engine_kwargs(config: BenchConfig, model_dir: str) -> dict:
    """The settings every variant's engine gets (identical across variants)."""
    max_len = config.prompt_len + max(config.output_len, config.count_output_len, config.warmup_tokens)
    max_batch = max(config.batches)
    kv = config.kv_cache_bytes
    if kv is None:
        blocks = math.ceil(max_len / 128) * 128  # generous block rounding
        kv = int(1.25 * max_batch * blocks * kv_bytes_per_token(model_dir, config.dtype)) + (64 << 20)
        state = state_bytes_per_layer(model_dir)
        if state:  # hybrids: vLLM pages every layer at the (larger) state page size; twice that, plus slack
            layers = json.loads((Path(model_dir) / "config.json").read_text())
            layers = layers.get("text_config", layers)["num_hidden_layers"]
            kv += 2 * max_batch * layers * state + (256 << 20)
    return dict(dtype=config.dtype, enforce_eager=config.enforce_eager, max_model_len=max_len,
                max_num_seqs=max_batch,
                max_num_batched_tokens=(config.max_num_batched_tokens
                                        or max(max_batch * config.prompt_len, max_len)),
                kv_cache_memory_bytes=kv, enable_prefix_caching=False, disable_log_stats=False,
                skip_tokenizer_init=True, seed=config.seed)


def start_engine(variant: Variant, kwargs: dict, overrides: dict | None = None):
    """(vllm.LLM, seconds to construct it)."""
    from vllm import LLM

    t0 = time.perf_counter()
    ov = variant.overrides if overrides is None else overrides
    try:
        llm = LLM(model=variant.model_dir, hf_overrides=ov or None, **kwargs)
    except Exception as exc:  # vLLM raises many types; the benchmark reports one clear line
        raise SlimWiseError(f"vLLM could not start variant {variant.name} ({variant.model_dir}): "
                            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    return llm, time.perf_counter() - t0



# ----- the timed runs ---------------------------------------------------------------------------------------

def _rounds(variants: list[Variant], repetitions: int) -> list[list[Variant]]:
    """Interleaved order: every variant once per round, rotated each round (A B C, B C A, C A B, ...)."""
    n = len(variants)
    return [variants[r % n:] + variants[:r % n] for r in range(repetitions)]


PARTIAL_FILE = "bench.partial.json"


def _signature(config: BenchConfig, variants: list[Variant], kwargs: dict) -> dict:
    """What must match for a partial run to be resumed."""
    return {"variants": [[v.name, v.model_dir, v.min_decode_batch, v.mode] for v in variants],
            "engine": kwargs, "prompt_len": config.prompt_len, "output_len": config.output_len,
            "repetitions": config.repetitions, "seed": config.seed}


def _load_partial(config: BenchConfig, signature: dict, log) -> tuple[dict, dict]:
    path = Path(config.out_dir) / PARTIAL_FILE
    if not (config.resume and path.is_file()):
        return {}, {}
    data = json.loads(path.read_text())
    if data.get("signature") != json.loads(json.dumps(signature)):
        log(f"resume: {path} was written with other settings; starting afresh")
        return {}, {}
    runs = {name: {int(b): ms for b, ms in per.items()} for name, per in data["runs"].items()}
    done = [b for b in config.batches
            if all(len(runs.get(n, {}).get(b, [])) >= config.repetitions for n in runs)]
    log(f"resume: batches {done} already measured in {path}")
    return runs, data.get("engine_start_s", {})


def _save_partial(config: BenchConfig, signature: dict, runs: dict, starts: dict) -> None:
    atomic_write_text(Path(config.out_dir) / PARTIAL_FILE,
                      json.dumps(jsonable({"signature": signature, "runs": runs,
                                           "engine_start_s": starts})) + "\n")


def _run_resident(config: BenchConfig, variants: list[Variant], kwargs: dict, log) -> tuple[dict, dict]:
    signature = _signature(config, variants, kwargs)
    old_runs, old_starts = _load_partial(config, signature, log)
    runs: dict[str, dict[int, list]] = {v.name: dict(old_runs.get(v.name, {})) for v in variants}
    starts: dict[str, list[float]] = {v.name: list(old_starts.get(v.name, [])) for v in variants}
    todo = [b for b in config.batches
            if any(len(runs[v.name].get(b, [])) < config.repetitions for v in variants)]
    engines = {}  # variant name -> its (possibly shared) engine
    vocab = vocab_size(variants[0].model_dir)
    try:
        for group in engine_groups(variants).values() if todo else []:
            llm, s = start_engine(group[0], kwargs)
            for v in group:
                engines[v.name] = llm
                starts[v.name].append(s)
            log(f"engine {'/'.join(v.name for v in group)}: started in {s:.1f}s")
        for b in todo:
            for v in variants:
                runs[v.name][b] = []  # a batch is measured whole (all variants, all rounds) or again
            prompts = make_prompts(b, config.prompt_len, vocab, config.seed)
            for v in variants:
                select(engines[v.name], v)
                measure(engines[v.name], prompts,
                        min(config.warmup_tokens, config.output_len), variant_plans(v, b))
            for r, order in enumerate(_rounds(variants, config.repetitions)):
                for v in order:
                    select(engines[v.name], v)
                    m = measure(engines[v.name], prompts, config.output_len, variant_plans(v, b))
                    m.update(round=r, loadavg=os.getloadavg()[0])
                    runs[v.name][b].append(m)
                    log(f"  B={b:<4} round {r} {v.name:<16} {m['tokens_per_s']:8.1f} tok/s  "
                        f"TPOT {m['tpot_ms']:7.1f} ms  (load {m['loadavg']:.1f})")
            _save_partial(config, signature, runs, starts)
    finally:
        for llm in {id(e): e for e in engines.values()}.values():
            shutdown_llm(llm)
    return runs, starts


def _run_restart(config: BenchConfig, variants: list[Variant], kwargs: dict, log) -> tuple[dict, dict]:
    runs: dict[str, dict[int, list]] = {v.name: {} for v in variants}
    starts: dict[str, list[float]] = {v.name: [] for v in variants}
    vocab = vocab_size(variants[0].model_dir)
    prompts = {b: make_prompts(b, config.prompt_len, vocab, config.seed) for b in config.batches}
    groups = list(engine_groups(variants).values())
    for r in range(config.repetitions):
        for group in groups[r % len(groups):] + groups[:r % len(groups)]:
            llm, s = start_engine(group[0], kwargs)
            log(f"round {r}: engine {'/'.join(v.name for v in group)} started in {s:.1f}s")
            try:
                for v in group:
                    starts[v.name].append(s)
                    select(llm, v)
                    for b in config.batches:
                        measure(llm, prompts[b], min(config.warmup_tokens, config.output_len),
                                variant_plans(v, b))
                        m = measure(llm, prompts[b], config.output_len, variant_plans(v, b))
                        m.update(round=r, loadavg=os.getloadavg()[0])
                        runs[v.name].setdefault(b, []).append(m)
                        log(f"  B={b:<4} round {r} {v.name:<16} {m['tokens_per_s']:8.1f} tok/s  "
                            f"TPOT {m['tpot_ms']:7.1f} ms  (load {m['loadavg']:.1f})")
            finally:
                shutdown_llm(llm)
    return runs, starts


# ----- expert traffic ---------------------------------------------------------------------------------------

def count_traffic(config: BenchConfig, variants: list[Variant], kwargs: dict, expert_bytes: float, top_k: int,
                  log) -> dict:
    """Distinct experts touched per layer per decode step, per variant and batch (separate eager engines: one
    SlimWise engine for the checkpoint, full counted in its mode "full", and one
    for the pruned checkpoint)."""
    from slimwise.perf.vllm_traffic import counters_delta, summarize_traffic
    from slimwise.serving.models import slimwise_arch
    from slimwise.serving.routing import COUNT_EXPERTS_KEY

    kw = dict(kwargs, enforce_eager=True)  # the counting hook runs in eager mode only
    vocab = vocab_size(variants[0].model_dir)
    out: dict[str, dict] = {}
    # the gated variant's engine carries other gates: it counts on its own
    shared = next((v for v in variants if v.mode is not None and not v.meta.get("mix") and v.name != GATED),
                  None)
    groups: dict[str, list[Variant]] = {}
    for v in variants:  # full joins the shared engine of its checkpoint (mode "full" masks nothing)
        on_shared = shared is not None and not v.meta.get("mix") and v.name != GATED and (
            v.mode is not None or v.model_dir == shared.model_dir)
        groups.setdefault(shared.engine_key if on_shared else v.engine_key, []).append(v)
    for key, group in groups.items():
        base = shared if shared is not None and key == shared.engine_key else group[0]
        overrides = dict(base.overrides) or {"architectures": [slimwise_arch(base.stock_arch)]}
        overrides[COUNT_EXPERTS_KEY] = True
        llm, s = start_engine(base, kw, overrides)
        for v in group:
            out[v.name] = {"engine_start_s": s, "batches": {}}
        try:
            for b, v in ((b, v) for b in config.batches for v in group):
                prompts = make_prompts(b, config.prompt_len, vocab, config.seed)
                if base.mode is not None:  # the shared engine: this variant's mode ("full" for full)
                    llm.collective_rpc("slimwise_set_mode", args=(v.mode or "full", v.min_decode_batch))
                before = llm.collective_rpc("slimwise_counters")[0]
                measure(llm, prompts, config.count_output_len, variant_plans(v, b))
                after = llm.collective_rpc("slimwise_counters")[0]
                # the load-aware variant routes small batches over every expert: E' is what it could reach
                available = v.available_experts
                if v.min_decode_batch and b < v.min_decode_batch:
                    available = next(x.available_experts for x in variants if x.name == "full")
                t = summarize_traffic(counters_delta(before, after), batch=b, available_experts=available,
                                      top_k=top_k, expert_bytes=expert_bytes)
                out[v.name]["batches"][b] = t
                log(f"  traffic {v.name:<16} B={b:<4} {t['touched_mean']:6.1f} experts/layer/step "
                    f"(uniform expectation {t['expected_uniform']:6.1f}), "
                    f"{t['expert_bytes_per_step'] / 1e6:8.1f} MB expert weights/step")
        finally:
            shutdown_llm(llm)
    return out


# ----- roofline comparison ----------------------------------------------------------------------------------

def roofline_predictions(config: BenchConfig, model_dir: Path, ratio: float, batches, log) -> tuple:
    """(RooflineConfig, Hardware, predictions, context) for this model's own config, or Nones."""
    if not config.hardware:
        return None, None, None, None
    from slimwise.perf.roofline import get_hardware, predict

    rc = RooflineConfig.from_dir(model_dir, config.dtype)
    hw = get_hardware(config.hardware, dtype=config.dtype)
    ctx = config.prompt_len + config.output_len // 2
    preds = predict(rc, hw, ratio, list(batches), ctx)
    log(f"roofline {hw.name}: {hw.note or f'{hw.bandwidth / 1e9:.0f} GB/s'}")
    return rc, hw, preds, ctx


# ----- entry point ------------------------------------------------------------------------------------------

def run_bench(config: BenchConfig, log: Callable[[str], None] | None = None) -> dict:
    """Run the benchmark; write bench.json, bench.md and the PNG into config.out_dir; return the result."""
    log = log or (lambda s: print(s, flush=True))
    _check_config(config)
    env = {} if config.verbose else {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    # engine cores in this process: an idle resident engine runs nothing (no polling loop)
    if config.in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with scoped_environ(env):  # the caller's environment (and every process it starts later) stays its own
        return _run_bench(config, log)


def _run_bench(config: BenchConfig, log: Callable[[str], None]) -> dict:
    from dataclasses import replace

    from slimwise import hardware
    from slimwise.serving.platform import vllm_on_cpu

    out = Path(config.out_dir)
    model_dir = prepare_model(config, log)
    requested = config.dtype
    dtype, why = hardware.resolve_dtype(config.dtype, model_dir, vllm_on_cpu())
    if requested == "auto":
        config = replace(config, dtype=dtype)
        log(f"dtype auto -> {dtype}: {why}")
    # creates OUT once the inputs load
    plan, plan_path, pruned_dir = prepare_plan(config, model_dir, out, log)
    out.mkdir(parents=True, exist_ok=True)
    variants = make_variants(config, model_dir, plan, plan_path, pruned_dir)
    kwargs = engine_kwargs(config, str(model_dir))
    rc, hw, preds, ctx = roofline_predictions(config, model_dir, plan.ratio, config.batches, log)
    log(f"variants {', '.join(v.name for v in variants)}; batches {list(config.batches)}; prompt "
        f"{config.prompt_len}, output {config.output_len}, {config.repetitions} rounds; engine {kwargs}")
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    with engines_closed_on_sigterm():
        runs, starts = (_run_restart if config.restart else _run_resident)(config, variants, kwargs, log)
    summary = summarize_runs(runs, config.batches)
    result: dict = {
        "model_name": config.synthetic or model_dir.name, "model_dir": str(model_dir),
        "pruned_dir": str(pruned_dir) if pruned_dir else None, "config": asdict(config), "engine": kwargs,
        "plan": {"path": str(plan_path), "criterion": plan.criterion, "ratio": plan.ratio,
                 "num_experts": plan.num_experts, "top_k": plan.top_k,
                 "kept": sorted({len(v) for v in plan.kept_experts.values()})},
        "variants": [{"name": v.name, "model_dir": v.model_dir, "available_experts": v.available_experts,
                      "min_decode_batch": v.min_decode_batch, "mode": v.mode,
                      "overrides": {k: val for k, val in v.overrides.items() if k != "slimwise_plan"}}
                     for v in variants],
        "engine_start_s": starts, "runs": runs, "summary": summary,
        "machine": hardware.describe(), "dtype": {"requested": requested, "used": config.dtype, "why": why},
        "timing": {"seconds": time.perf_counter() - t0, "loadavg_start": load0,
                   "loadavg_end": os.getloadavg(),
                   "decode_time": "engine-core timestamps, first token to last token (prefill excluded)"},
    }
    if config.count_experts:
        if rc is None:
            rc = RooflineConfig.from_dir(model_dir, config.dtype)
        with engines_closed_on_sigterm():
            result["traffic"] = count_traffic(config, variants, kwargs, rc.expert_params * rc.expert_bytes,
                                              plan.top_k, log)
    if preds is not None:
        result["roofline"] = {"hardware": hw.name, "note": hw.note, "bandwidth": hw.bandwidth,
                              "peak_flops": hw.peak_flops, "context_len": ctx,
                              "comparison": compare_roofline(summary, preds)}
    if rc is not None:
        result["bytes_split"] = bytes_split_table(rc, plan.top_k, plan.num_experts, result.get("traffic"),
                                                  config.batches,
                                                  ctx or config.prompt_len + config.output_len // 2,
                                                  plan.num_kept if plan.is_uniform else None)
    if config.kernel_roofline:
        from slimwise.perf.kernels import bench_kernel_roofline

        rc = rc or RooflineConfig.from_dir(model_dir, config.dtype)
        kept = min(len(v) for v in plan.kept_experts.values()) if plan.kept_experts else rc.num_experts
        result["kernel_roofline"] = bench_kernel_roofline(rc, kept, config.batches,
                                                          summary, result.get("traffic"),
                                                          config.dtype, config.seed, log)
    result["bars"] = check_bars(summary, config.synthetic, runs)
    if config.suggest_threshold is not None:
        result["threshold"] = threshold_report(result, config.suggest_threshold, rc, hw, ctx, plan.ratio)
    result = jsonable(result)
    atomic_write_text(out / "bench.json", json.dumps(result, indent=1) + "\n")
    atomic_write_text(out / "bench.md", format_tables(result))
    png = plot_bench(result, config.plot or out / "bench.png")
    result["files"] = {"json": str(out / "bench.json"), "markdown": str(out / "bench.md"), "png": str(png)}
    return result



__all__ = ["BenchConfig", "Variant", "check_bars", "compare_roofline", "format_tables", "make_prompts",
           "measure", "plot_bench", "run_bench", "suggest_threshold", "summarize_runs", "threshold_report"]
