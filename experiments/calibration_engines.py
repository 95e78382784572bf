"""How often vLLM's greedy continuations differ from the reference engine's, and whether calibration cares.

`slimwise calibrate --engine vllm` lets vLLM generate the decode-phase continuations and counts them with one
teacher-forced pass of the transformers model. The pass itself is exact (tests/test_statistics_pass.py); what
can differ is the continuations. For each shipped testbed this generates the calibration prompts'
continuations with both engines (greedy, the dtype each runs on this CPU by default), then counts both sets
with the same float32 pass and compares the REAP 50% plans:

    python -m experiments.calibration_engines --out docs/results/calibration-engines

writes calibration_engines.json and prints the table of docs/results/calibration-engines.md. The prompts are
the testbed's calib split (arithmetic, seed 0, 8 per family); nothing else is random.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from slimwise.calibrate import CalibrationConfig, continuation_stats, vllm_continuations
from slimwise.criteria import plan_from_stats
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.hardware import BF16_ONLY_ON_CPU, describe, resolve_dtype
from slimwise.models import load_model, load_tokenizer, resolve_model_dir
from slimwise.serving.platform import vllm_on_cpu
from slimwise.testbed import TARGET_DOMAIN, make_split

TESTBEDS = ("testbed-a", "testbed-b", "testbed-c")


def first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def vllm_dtypes(name: str) -> list[str]:
    """vLLM's `--dtype auto` on this CPU, and float32 where vLLM's CPU kernels for the family have it (the
    hybrids' Gated DeltaNet kernel is bf16 only)."""
    model_dir = resolve_model_dir(name)
    auto = resolve_dtype("auto", model_dir, vllm_on_cpu())[0]
    hybrid = json.loads((model_dir / "config.json").read_text()).get("model_type") in BF16_ONLY_ON_CPU
    return [auto] if hybrid or auto == "float32" else [auto, "float32"]


def compare(name: str, vllm_dtype: str, prompts: list[str], config: CalibrationConfig) -> dict:
    model_dir = resolve_model_dir(name)
    tok = load_tokenizer(name)
    vllm = vllm_continuations(model_dir, prompts, tok, config, dtype=vllm_dtype)
    row: dict = {"model": name, "prompts": len(prompts), "vllm_dtype": vllm_dtype, "by_hf_dtype": {}}
    f32 = load_model(name, dtype="float32")
    for hf_dtype in sorted({"float32", vllm_dtype}):
        model = f32 if hf_dtype == "float32" else load_model(name, dtype=hf_dtype)
        with PhaseSplitEngine(model, tok) as engine:
            gen = GenerationConfig(max_new_tokens=config.max_new_tokens, batch_size=config.batch_size)
            hf = [g.token_ids for g in engine.generate(prompts, "full", gen)]
        firsts = [first_difference(a, b) for a, b in zip(hf, vllm, strict=True)]
        hf_stats = continuation_stats(f32, prompts, hf, tok, config, progress=False)
        vllm_stats = continuation_stats(f32, prompts, vllm, tok, config, progress=False)
        hf_plan, vllm_plan = (plan_from_stats(s, "reap", 0.5).kept_experts for s in (hf_stats, vllm_stats))
        row["by_hf_dtype"][hf_dtype] = {
            "identical": sum(f is None for f in firsts),
            "first_differences": sorted(f for f in firsts if f is not None),
            "counted_tokens": [int(hf_stats.tokens[0]), int(vllm_stats.tokens[0])],
            "counts_equal": bool((hf_stats.count == vllm_stats.count).all()),
            "plan_layers_identical": sum(hf_plan[i] == vllm_plan[i] for i in hf_plan),
            "plan_layers": len(hf_plan),
            "plan_overlap": round(sum(len(set(hf_plan[i]) & set(vllm_plan[i])) for i in hf_plan)
                                  / sum(len(v) for v in hf_plan.values()), 4)}
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | vLLM dtype | HF dtype | identical continuations | first difference at (tokens) | "
             "decode counts equal | REAP 50% plan: identical layers, kept-set overlap |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        for dtype, c in r["by_hf_dtype"].items():
            firsts = c["first_differences"]
            where = "–" if not firsts else f"median {firsts[len(firsts) // 2]}, min {firsts[0]}"
            lines.append(f"| {r['model']} | {r['vllm_dtype']} | {dtype} | "
                         f"{c['identical']} / {r['prompts']} | {where} | "
                         f"{'yes' if c['counts_equal'] else 'no'} | "
                         f"{c['plan_layers_identical']} / {c['plan_layers']}, {c['plan_overlap']:.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--per-family", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    prompts = [s.prompt for s in make_split("calib", args.per_family, seed=0, domain=TARGET_DOMAIN)]
    config = CalibrationConfig(phase="decode", max_new_tokens=args.max_new_tokens, batch_size=16)
    rows = [compare(name, dtype, prompts, config) for name in TESTBEDS for dtype in vllm_dtypes(name)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration_engines.json").write_text(json.dumps({"machine": describe(), "rows": rows,
                                                              "per_family": args.per_family,
                                                              "max_new_tokens": args.max_new_tokens},
                                                             indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
