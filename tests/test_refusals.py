"""Every refusal of the core pipeline: one clear error, and nothing written or modified."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import random_prompts
from tiny import build_tiny_model, save_tiny_model

from slimwise.adapters import get_adapter
from slimwise.calibrate import CalibrationConfig, calibrate
from slimwise.criteria import plan_from_stats
from slimwise.engines.reference import PhaseSplitEngine
from slimwise.errors import SlimWiseError
from slimwise.export import export_pruned
from slimwise.models import load_model
from slimwise.plan import PrunePlan


def snapshot(root: Path) -> dict[str, str]:
    """Path -> content hash of every file under root (what 'nothing was modified' means)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("refusals")
    src = save_tiny_model("qwen3_moe", root / "src", initializer_range=0.15)
    model = load_model(src)
    stats = calibrate(model, random_prompts(4), config=CalibrationConfig(max_new_tokens=4), progress=False)
    return root, src, stats


def test_output_inside_source_refused(setup):
    root, src, stats = setup
    before = snapshot(src)
    with pytest.raises(SlimWiseError, match="inside the source model"):
        export_pruned(load_model(src), plan_from_stats(stats, "reap", 0.5), src / "pruned")
    assert snapshot(src) == before
    with pytest.raises(SlimWiseError, match="inside the source model"):
        export_pruned(load_model(src), plan_from_stats(stats, "reap", 0.5), src)
    assert snapshot(src) == before


def test_non_empty_output_needs_force(setup):
    root, src, stats = setup
    out = root / "occupied"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(SlimWiseError, match="--force"):
        export_pruned(load_model(src), plan_from_stats(stats, "reap", 0.5), out)
    assert snapshot(out) == {"keep.txt": hashlib.sha256(b"user data").hexdigest()}
    export_pruned(load_model(src), plan_from_stats(stats, "reap", 0.5), out, force=True)
    assert (out / "config.json").is_file() and not (out / "keep.txt").exists()
    assert not list(root.glob(".occupied.*")), "temporary or backup directories left behind"


def test_fingerprint_mismatch_refused(setup):
    root, src, stats = setup
    other = save_tiny_model("qwen3_moe", root / "other", seed=1, initializer_range=0.15)
    plan = plan_from_stats(stats, "reap", 0.5)
    with pytest.raises(SlimWiseError, match="fingerprint"):
        export_pruned(load_model(other), plan, root / "never")
    with pytest.raises(SlimWiseError, match="fingerprint"):
        PhaseSplitEngine(load_model(other), plan=plan)
    assert not (root / "never").exists()


def test_hand_edited_plans_refused(setup, tmp_path):
    root, src, stats = setup
    plan = plan_from_stats(stats, "reap", 0.5)
    too_few = PrunePlan(
        **{**plan.to_dict(), "kept_experts": {k: v[:2] for k, v in plan.kept_experts.items()}}
    )
    with pytest.raises(SlimWiseError, match="top-k"):
        export_pruned(load_model(src), too_few, tmp_path / "a")
    ragged = dict(plan.kept_experts)
    first = next(iter(ragged))
    ragged[first] = list(range(plan.num_experts))
    with pytest.raises(SlimWiseError, match="masking"):
        export_pruned(
            load_model(src), PrunePlan(**{**plan.to_dict(), "kept_experts": ragged}), tmp_path / "b"
        )
    bad_ids = PrunePlan(**{**plan.to_dict(), "kept_experts": {k: [99] * 8 for k in plan.kept_experts}})
    with pytest.raises(SlimWiseError, match="distinct"):
        export_pruned(load_model(src), bad_ids, tmp_path / "c")
    assert not list(tmp_path.iterdir())


def test_grouped_plan_that_empties_a_group_refused():
    model = build_tiny_model("deepseek_v3")
    adapter = get_adapter(model.config)
    full = PrunePlan.full(model)
    group = full.num_experts // full.num_groups
    # drop the whole first group but keep enough experts overall
    kept = {k: list(range(group, full.num_experts)) for k in full.kept_experts}
    with pytest.raises(SlimWiseError, match="group"):
        PrunePlan(**{**full.to_dict(), "kept_experts": kept}).validate(
            adapter.min_kept_per_group(model.config)
        )


def test_decode_model_with_other_shapes_refused(setup):
    _, src, _ = setup
    model = load_model(src)
    for change in ({"vocab_size": 256}, {"num_hidden_layers": 3}, {"num_key_value_heads": 2}):
        other = build_tiny_model("qwen3_moe", **change)
        key = next(iter(change))
        with pytest.raises(SlimWiseError, match=key):
            PhaseSplitEngine(model, decode_model=other)


def test_dense_and_unknown_models_refused(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "dense")
    with pytest.raises(SlimWiseError, match="qwen3_moe") as info:
        load_model(tmp_path / "dense")
    assert "not a supported MoE family" in str(info.value)
    dense_moe_type = build_tiny_model("qwen3_moe").config
    dense_moe_type.num_experts = 0
    with pytest.raises(SlimWiseError, match="dense"):
        get_adapter(dense_moe_type)
    with pytest.raises(SlimWiseError, match="does not exist"):
        load_model(tmp_path / "missing")


def test_bad_data_refused(tmp_path):
    from slimwise.data import load_prompts

    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(SlimWiseError, match="bad.jsonl:2"):
        load_prompts(tmp_path / "bad.jsonl")
    (tmp_path / "nofield.jsonl").write_text(json.dumps({"answer": 1}) + "\n")
    with pytest.raises(SlimWiseError, match="prompt"):
        load_prompts(tmp_path / "nofield.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SlimWiseError, match="no records"):
        load_prompts(tmp_path / "empty")


@pytest.mark.parametrize("case", ["missing", "not-a-model", "other-weights"])
def test_serve_refuses_before_any_engine_starts(setup, case, tmp_path, capsys):
    """`slimwise serve` checks the model directory and the plan before it starts vLLM: one line, exit 2, at
    once (a plan made for other weights used to be refused only inside the engine, under its start-up log)."""
    from slimwise.cli import main

    root, src, stats = setup
    plan = plan_from_stats(stats, "reap", 0.5)
    plan.save(tmp_path / "plan.json")
    other = save_tiny_model("qwen3_moe", tmp_path / "other", initializer_range=0.15, num_experts=8)
    model = {"missing": str(tmp_path / "nope"), "not-a-model": str(tmp_path), "other-weights": str(other)}[
        case
    ]
    capsys.readouterr()  # the checkpoint writer's progress bar
    assert main(["serve", model, "--plan", str(tmp_path / "plan.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert {
        "missing": "does not exist",
        "not-a-model": "no config.json",
        "other-weights": "plan is for 16 experts",
    }[case] in err


def test_an_untested_vllm_is_refused_in_one_line(monkeypatch):
    """The plugin patches vLLM internals known for the tested release only: another release is refused by
    SlimWise's entry points (stock vLLM use stays untouched: the plugin then only logs and stays inactive),
    unless the user opts in; a runner without the hooked method is refused always."""
    import vllm
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from slimwise.serving.plugin import ALLOW_UNTESTED_ENV, require_known_vllm, vllm_problem

    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    assert vllm_problem() is None  # the installed release is the tested one
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    with pytest.raises(SlimWiseError, match=r"tested with vLLM 0\.32\.x, not 0\.99\.0") as err:
        require_known_vllm()
    assert "\n" not in str(err.value)
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    assert vllm_problem() is None
    monkeypatch.delattr(GPUModelRunner, "_model_forward")
    assert "_model_forward" in vllm_problem()


def test_vllm_engine_refuses_text_without_a_tokenizer_before_starting(setup):
    """A checkpoint without tokenizer files (weights and config only) given text: one clear line, and no vLLM
    engine started; an empty token-id prompt likewise (the reference engine's refusals, shared)."""
    from slimwise.engines.vllm_engine import VllmEngine

    _, src, _ = setup
    engine = VllmEngine(src)
    with pytest.raises(SlimWiseError, match="text prompts need a tokenizer"):
        engine.generate(["1 + 2 ="], "full")
    with pytest.raises(SlimWiseError, match="an empty prompt cannot be prefilled"):
        engine.generate([[]], "full")
    assert engine.llm is None


def test_serve_refuses_prefix_caching_for_a_disaggregated_hybrid(tmp_path, capsys):
    """The shared-directory connector hands a hybrid's linear-attention state over only without vLLM's 'align'
    Mamba cache mode, which prefix caching turns on: refused before any engine starts (moved here from the
    HTTP hybrid test, where it cost a subprocess start)."""
    from slimwise.cli import main

    src = save_tiny_model("qwen3_5_moe", tmp_path / "hybrid")
    PrunePlan.full(load_model(src)).save(tmp_path / "plan.json")
    capsys.readouterr()
    argv = [
        "serve",
        str(src),
        "--plan",
        str(tmp_path / "plan.json"),
        "--disaggregated",
        "--enable-prefix-caching",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "drop --enable-prefix-caching" in err
