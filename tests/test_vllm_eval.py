"""`slimwise eval --engine vllm` (colocated plugin) gives the reference engine's greedy generations."""

from __future__ import annotations

import json

import pytest
from tiny import save_tiny_model

from lab.testbed.tokenizer import build_tokenizer
from slimwise.cli import main as cli_main

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.vllm_in_process]


def generations(cache_dir) -> dict[tuple[str, int], list[list[int]]]:
    """(mode, problems) -> generated token ids per sample, from the eval run cache (one plan, so one run per
    mode and sample set: the target problems and the other domains')."""
    out = {}
    for f in sorted(cache_dir.glob("*/run-*.json")):
        gens = [g["token_ids"] for g in json.loads(f.read_text())["gens"]]
        out[(f.name.split("-")[1], len(gens))] = gens
    return out


def test_eval_engine_parity(tmp_path):
    tok = build_tokenizer(tmp_path / "model")
    save_tiny_model("qwen3_moe", tmp_path / "model", initializer_range=0.15, vocab_size=len(tok),
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    common = [
        "eval",
        str(tmp_path / "model"),
        "--criteria",
        "reap",
        "--ratios",
        "0.5",
        "--phases",
        "decode",
        "--per-family",
        "2",
        "--max-new-tokens",
        "16",
        "--calib-per-family",
        "1",
        "--no-kl",
        "--no-traffic",
        "--no-plots",
        "--threads",
        "1",
        "--other-per-family",
        "1",
        "--no-calib-mixes",
    ]
    assert cli_main([*common, "--out", str(tmp_path / "hf"), "--cache-dir", str(tmp_path / "hf-cache")]) == 0
    assert cli_main([*common, "--engine", "vllm", "--out", str(tmp_path / "vllm"),
                     "--cache-dir", str(tmp_path / "vllm-cache")]) == 0
    hf, vllm = generations(tmp_path / "hf-cache"), generations(tmp_path / "vllm-cache")
    # full, uniform, slimwise; on the target and the other domains
    assert len(hf) == 6 and hf.keys() == vllm.keys()
    assert hf == vllm
    hf_report = json.loads((tmp_path / "hf" / "report.json").read_text())
    vllm_report = json.loads((tmp_path / "vllm" / "report.json").read_text())
    for a, b in zip(hf_report["runs"], vllm_report["runs"], strict=True):
        assert a["metrics"]["correct"] == b["metrics"]["correct"]
        assert a["metrics"]["lengths"] == b["metrics"]["lengths"]


def test_eval_traffic_mix_routes_each_domain_to_its_plan(tmp_path):
    """`slimwise eval --engine vllm --route`: one engine holding two plans; each problem's tokens equal the
    reference engine's for the plan its domain routes to (float32), the full run's the full model's; per-plan
    token counts."""
    from slimwise.baseline_plans import random_plan
    from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
    from slimwise.evaluation.mix import MixConfig, evaluate_mix
    from slimwise.models import load_model, load_tokenizer

    tok = build_tokenizer(tmp_path / "model")
    save_tiny_model("qwen3_moe", tmp_path / "model", initializer_range=0.15, vocab_size=len(tok),
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model, tok = load_model(tmp_path / "model"), load_tokenizer(tmp_path / "model")
    plans = {"math": random_plan(model, 0.5, seed=1), "lists": random_plan(model, 0.5, seed=2)}
    for name, plan in plans.items():
        plan.save(tmp_path / f"{name}.json")
    config = MixConfig(plans={n: str(tmp_path / f"{n}.json") for n in plans},
                       routes={"arithmetic": "math", "lists": "lists", "*": "full"}, n_per_family=1,
                       max_new_tokens=10, out_dir=str(tmp_path / "mix"))
    report = evaluate_mix(str(tmp_path / "model"), config, keep_outputs=True)
    domains, routed = report["per_sample"]["domains"], report["per_sample"]["plans"]
    assert set(domains) == {"arithmetic", "lists", "text"}
    assert {d: p for d, p in zip(domains, routed, strict=True)} == {"arithmetic": "math", "lists": "lists",
                                                                     "text": "full"}
    from slimwise.evaluation.samples import load_samples

    prompts = [s.prompt for s in load_samples(n_per_family=1, domain="all")]
    gen = GenerationConfig(max_new_tokens=10)
    ref = {
        name: [
            o.token_ids for o in PhaseSplitEngine(model, tok, plan=plan).generate(prompts, "slimwise", gen)
        ]
        for name, plan in plans.items()
    }
    ref["full"] = [o.token_ids for o in PhaseSplitEngine(model, tok).generate(prompts, "full", gen)]
    assert len({tuple(map(tuple, v)) for v in ref.values()}) == 3  # the routings differ on these prompts
    assert report["outputs"]["routed"] == [ref[p][i] for i, p in enumerate(routed)]
    assert report["outputs"]["full"] == ref["full"]
    fed_back = {n: sum(len(ref[n][i]) - 1 for i, p in enumerate(routed) if p == n) for n in plans}
    assert report["runs"]["routed"]["plan_tokens"] == fed_back
    assert report["runs"]["full"]["plan_tokens"] == {"math": 0, "lists": 0}
    assert (tmp_path / "mix" / "mix.md").read_text().startswith("# Traffic mix")
    assert "outputs" not in json.loads((tmp_path / "mix" / "mix.json").read_text())
