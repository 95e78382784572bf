"""A deployment's traffic mix in one vLLM engine: several plans served at once, each request routed to
the plan its domain maps to (e.g. arithmetic -> `math`, everything else -> `full`), against the same
engine serving every request with every expert. Reports accuracy per domain and overall,
generated-token shares per plan (the engine's counters) and the generate time of both runs: what a
routing policy costs and buys on mixed traffic.

  slimwise eval testbed-a --engine vllm --plan math=plan.json --route arithmetic=math --route '*=full' \
    --domain all
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from slimwise.engines.reference import GenerationConfig
from slimwise.errors import SlimWiseError
from slimwise.evaluation.metrics import accuracy_metrics, length_metrics, paired_difference
from slimwise.evaluation.samples import domain_of, load_samples, make_grader
from slimwise.io import atomic_write_text

DEFAULT_ROUTE = "*"  # the route of domains no --route names


@dataclass
class MixConfig:
    """What to serve (`plans`: name -> plan JSON) and how traffic is routed (`routes`: domain -> plan name or
    "full"; "*" for every other domain, default "full")."""

    plans: dict[str, str]
    routes: dict[str, str]
    data: str | None = None  # JSONL (prompt, answer, optional domain/family) instead of the testbed
    grader: str = "testbed"
    split: str = "test"
    n_per_family: int = 40
    max_samples: int | None = None
    seed: int = 0
    max_new_tokens: int = 160
    batch_size: int = 64
    dtype: str = "float32"
    out_dir: str | None = None
    engine_kwargs: dict = field(default_factory=dict)


def check_mix(config: MixConfig) -> None:
    if not config.plans:
        raise SlimWiseError("a traffic mix needs named plans: --plan NAME=PLAN (repeatable)")
    if not config.routes:
        raise SlimWiseError("a traffic mix needs routes: --route DOMAIN=NAME (NAME a plan or full; DOMAIN * "
                            "for the rest)")
    unknown = sorted({p for p in config.routes.values() if p != "full" and p not in config.plans})
    if unknown:
        raise SlimWiseError(f"--route names plans {unknown} that no --plan NAME=PLAN gives "
                            f"({', '.join(config.plans)})")


def evaluate_mix(model: str, config: MixConfig, tokenizer=None, keep_outputs: bool = False) -> dict:
    """Serve `config.plans` in one vLLM engine and route each sample by its domain; then the same samples with
    every expert (`full` for all) in the same engine. Returns (and writes to out_dir) the report;
    `keep_outputs` adds each run's generated token ids to the returned report (not to the files)."""
    from slimwise.engines.vllm_engine import VllmEngine
    from slimwise.models import load_tokenizer, resolve_model_dir, structure_model
    from slimwise.plan import PrunePlan

    check_mix(config)
    model_dir = str(resolve_model_dir(model))
    plans = {name: PrunePlan.load(path) for name, path in config.plans.items()}
    structure = structure_model(model_dir)
    for plan in plans.values():  # before any engine starts
        plan.check_model(structure, check_fingerprint=False)
    tok = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
    samples = load_samples(config.data, split=config.split, n_per_family=config.n_per_family,
                           seed=config.seed, domain="all", max_samples=config.max_samples)
    domains = [domain_of(s) for s in samples]
    routed = [config.routes.get(d, config.routes.get(DEFAULT_ROUTE, "full")) for d in domains]
    grader = make_grader(config.grader)
    gen = GenerationConfig(max_new_tokens=config.max_new_tokens, batch_size=config.batch_size)
    engine = VllmEngine(model_dir, plans, tok, dtype=config.dtype, default_plan="full", share_engine=True,
                        engine_kwargs=config.engine_kwargs)
    runs, outputs = {}, {}
    try:
        for label, names in (("routed", routed), ("full", ["full"] * len(samples))):
            before = (engine.counters() or [{}])[0].get("plan_tokens", {})
            t0 = time.perf_counter()
            outs = engine.generate([s.prompt for s in samples], "slimwise", gen, plans=names)
            seconds = time.perf_counter() - t0
            after = engine.counters()[0].get("plan_tokens", {})
            outputs[label] = [o.token_ids for o in outs]
            correct = [bool(grader(s, o)) for s, o in zip(samples, outs, strict=True)]
            runs[label] = {"seconds": round(seconds, 3), "correct": [int(c) for c in correct],
                           "lengths": [len(o.token_ids) for o in outs],
                           "generated_tokens": sum(len(o.token_ids) for o in outs),
                           "plan_tokens": {k: after.get(k, 0) - before.get(k, 0) for k in after},
                           **accuracy_metrics(correct, config.seed),
                           **length_metrics(outs, config.max_new_tokens)}
    finally:
        engine.close()
    report = {"schema": "slimwise-mix/1", "model": model_dir, "config": asdict(config), "routes": {},
              "runs": {k: {m: v for m, v in r.items() if m not in ("correct", "lengths")}
                       for k, r in runs.items()}}
    for d in dict.fromkeys(domains):
        idx = [i for i, x in enumerate(domains) if x == d]
        r = {k: accuracy_metrics([runs[k]["correct"][i] for i in idx], config.seed)["accuracy"] for k in runs}
        report["routes"][d] = {"plan": routed[idx[0]], "n": len(idx), "accuracy_routed": r["routed"],
                               "accuracy_full": r["full"],
                               "mean_length_routed": sum(runs["routed"]["lengths"][i]
                                                         for i in idx) / len(idx),
                               "mean_length_full": sum(runs["full"]["lengths"][i] for i in idx) / len(idx)}
    report["routed_minus_full"] = paired_difference([float(c) for c in runs["routed"]["correct"]],
                                                    [float(c) for c in runs["full"]["correct"]],
                                                    seed=config.seed)
    report["per_sample"] = {"domains": domains, "plans": routed,
                            **{f"correct_{k}": r["correct"] for k, r in runs.items()}}
    if config.out_dir:
        out = Path(config.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "mix.json", json.dumps(report, indent=1) + "\n")
        atomic_write_text(out / "mix.md", mix_table(report))
    if keep_outputs:
        report["outputs"] = outputs
    return report


def mix_table(report: dict) -> str:
    """Markdown: per domain the plan it is routed to and accuracy routed vs full;
    overall; tokens per plan; time."""
    r, f = report["runs"]["routed"], report["runs"]["full"]
    lines = [f"# Traffic mix on {Path(report['model']).name}", "",
             "| domain | routed to | n | accuracy routed | accuracy full | mean length routed / full |",
             "|---|---|---|---|---|---|"]
    for d, x in report["routes"].items():
        lines.append(f"| {d} | {x['plan']} | {x['n']} | {100 * x['accuracy_routed']:.1f}% | "
                     f"{100 * x['accuracy_full']:.1f}% | {x['mean_length_routed']:.1f} / "
                     f"{x['mean_length_full']:.1f} |")
    diff = report["routed_minus_full"]
    lines += [f"| all | | {r['n']} | {100 * r['accuracy']:.1f}% | {100 * f['accuracy']:.1f}% | "
              f"{r['length_mean']:.1f} / {f['length_mean']:.1f} |", "",
              f"Routed minus full: {100 * diff['diff']:+.1f} points (95% CI {100 * diff['ci_low']:+.1f} to "
              f"{100 * diff['ci_high']:+.1f}, paired bootstrap).", "",
              "Generated tokens routed with each plan: "
              + (", ".join(f"{k} {v:,}" for k, v in r["plan_tokens"].items()) or "none")
              + f" of {r['generated_tokens']:,}.",
              f"Generate time (prefill included, one engine, batch {report['config']['batch_size']}): routed "
              f"{r['seconds']:.1f} s, full {f['seconds']:.1f} s. Decode speed of plan mixes: `slimwise bench "
              "--variants full mix-P mixfull-P`.", ""]
    return "\n".join(lines)
