"""Quality of the load-aware policy (`min_decode_batch`) in vLLM, against load.

With the policy, a decode step uses the pruned experts only when it holds at least `threshold` decode tokens,
so a request's output depends on how many other requests share its steps. This module measures that: the same
graded test prompts served by full, SlimWise and SlimWise + policy at several concurrencies (vLLM's
max_num_seqs), each with accuracy and the share of decode tokens that were routed to the pruned set (from the
plugin's counters). Full and SlimWise without the policy do not depend on the concurrency (up to batch-shape
numerics); SlimWise + policy moves from full-model quality at low concurrency towards SlimWise's at high.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from slimwise.errors import SlimWiseError
from slimwise.io import atomic_write_text


@dataclass
class PolicyQualityConfig:
    model: str = "testbed-a"
    threshold: int = 16
    concurrencies: tuple[int, ...] = (1, 8, 64)
    plan: str | None = None  # default: decode-phase calibration on the target domain, REAP at `ratio`
    ratio: float = 0.5
    criterion: str = "reap"
    domain: str | None = None  # default: the testbed's target domain
    n_per_family: int = 16
    max_new_tokens: int = 160
    calib_per_family: int = 16
    dtype: str = "float32"
    seed: int = 0
    out: str | None = None


def _plan(model, tokenizer, config: PolicyQualityConfig, log):
    from slimwise.calibrate import CalibrationConfig, calibrate
    from slimwise.criteria import plan_from_stats
    from slimwise.evaluation import load_samples
    from slimwise.plan import PrunePlan
    from slimwise.testbed import TARGET_DOMAIN

    if config.plan:
        return PrunePlan.load(config.plan)
    calib = load_samples(split="train", n_per_family=config.calib_per_family, seed=config.seed + 1,
                         domain=config.domain or TARGET_DOMAIN)
    t0 = time.perf_counter()
    stats = calibrate(
        model, [s.prompt for s in calib], tokenizer, CalibrationConfig(phase="decode"), progress=False
    )
    log(f"plan: decode-phase calibration on {len(calib)} train prompts ({time.perf_counter() - t0:.0f}s), "
        f"{config.criterion} at {config.ratio}")
    return plan_from_stats(stats, config.criterion, config.ratio)


def run_policy_quality(config: PolicyQualityConfig, log: Callable[[str], None] | None = None) -> dict:
    """Accuracy and pruned-routed share per (mode, concurrency); modes full, slimwise,
    slimwise-min<threshold>."""
    from slimwise.engines.reference import GenerationConfig
    from slimwise.engines.vllm_engine import VllmEngine
    from slimwise.evaluation import accuracy_metrics, load_samples, make_grader
    from slimwise.models import load_model, load_tokenizer, resolve_model_dir
    from slimwise.testbed import TARGET_DOMAIN

    log = log or (lambda s: print(s, flush=True))
    if config.threshold < 1 or not config.concurrencies or min(config.concurrencies) < 1:
        raise SlimWiseError("threshold and concurrencies must be >= 1")
    model_dir = resolve_model_dir(config.model)
    tokenizer = load_tokenizer(config.model)
    model = load_model(config.model, dtype=config.dtype)
    plan = _plan(model, tokenizer, config, log)
    del model
    samples = load_samples(split="test", n_per_family=config.n_per_family, seed=config.seed,
                           domain=config.domain or TARGET_DOMAIN)
    grader = make_grader("testbed")
    gen = GenerationConfig(max_new_tokens=config.max_new_tokens, temperature=0.0, batch_size=len(samples))
    rows: list[dict] = []
    outputs: dict[tuple[str, int], list] = {}
    modes: Sequence[tuple[str, int]] = (("full", 0), ("slimwise", 0), (f"slimwise-min{config.threshold}",
                                                                      config.threshold))
    measured: dict[tuple[str, int], tuple] = {}
    for conc in config.concurrencies:  # one engine per concurrency; the modes switch inside it
        engine = VllmEngine(
            model_dir,
            plan,
            tokenizer,
            dtype=config.dtype,
            engine_kwargs={"max_num_seqs": conc},
            share_engine=True,
        )
        try:
            for name, threshold in modes:
                engine.set_min_decode_batch(threshold)
                t0 = time.perf_counter()
                outs = engine.generate(
                    [s.prompt for s in samples], "full" if name == "full" else "slimwise", gen
                )
                measured[(name, conc)] = (outs, time.perf_counter() - t0,
                                          engine.counters()[0] if name != "full" else {})
        finally:
            engine.close()
    for name, _ in modes:
        for conc in config.concurrencies:
            outs, seconds, counters = measured[(name, conc)]
            correct = [grader(s, o) for s, o in zip(samples, outs, strict=True)]
            decode_tokens = sum(max(len(o.token_ids) - 1, 0) for o in outs)
            pruned = counters.get("pruned_tokens", 0)
            outputs[(name, conc)] = [o.token_ids for o in outs]
            row = {"mode": name, "concurrency": conc, **accuracy_metrics(correct, seed=config.seed),
                   "mean_length": sum(len(o.token_ids) for o in outs) / len(outs),
                   "decode_tokens": decode_tokens, "pruned_routed_tokens": pruned,
                   "pruned_share": pruned / decode_tokens if decode_tokens else 0.0, "seconds": seconds}
            rows.append(row)
            log(f"  {name:<16} concurrency {conc:<4} accuracy {row['accuracy']:.3f}  mean length "
                f"{row['mean_length']:.1f}  pruned-routed share of decode tokens {row['pruned_share']:.2f}")
    base = {c: outputs[("full", c)] for c in config.concurrencies}
    for row in rows:
        same = sum(
            a == b
            for a, b in zip(outputs[(row["mode"], row["concurrency"])], base[row["concurrency"]], strict=True)
        )
        row["identical_to_full"] = same / len(samples)
    result = {"model_dir": str(model_dir), "config": asdict(config), "samples": len(samples),
              "plan": {"criterion": plan.criterion, "ratio": plan.ratio, "num_experts": plan.num_experts,
                       "kept": sorted({len(v) for v in plan.kept_experts.values()})}, "rows": rows}
    if config.out:
        atomic_write_text(config.out, json.dumps(result, indent=1) + "\n")
    return result


def format_policy_table(result: dict) -> str:
    lines = ["| mode | concurrency | accuracy (95% CI) | mean length | decode tokens routed pruned | "
             "outputs identical to full |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ci = f" ({r['accuracy_ci_low']:.3f}-{r['accuracy_ci_high']:.3f})" if "accuracy_ci_low" in r else ""
        lines.append(
            f"| {r['mode']} | {r['concurrency']} | {r['accuracy']:.3f}{ci} | {r['mean_length']:.1f} | "
            f"{r['pruned_share']:.2f} | {r['identical_to_full']:.2f} |"
        )
    return "\n".join(lines) + "\n"


__all__ = ["PolicyQualityConfig", "format_policy_table", "run_policy_quality"]
