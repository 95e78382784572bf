"""Decode-only distillation on tiny random models: training, decode-only application, delta files, refusals,
resume, export with the delta folded in, CLI."""

from __future__ import annotations

import json
import shutil
from contextlib import nullcontext, suppress

import numpy as np
import pytest
import torch
from conftest import ALL_FAMILIES, TINY_INIT, random_prompts
from test_pipeline import cache_tensors
from tiny import build_tiny_model

from lab.testbed.tokenizer import build_tokenizer
from slimwise.calibrate import CalibrationConfig, calibrate
from slimwise.cli import main as cli_main
from slimwise.criteria import plan_from_stats
from slimwise.delta import Delta, plan_hash
from slimwise.distill import DistillConfig, TeacherData, build_teacher, distill, init_delta
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.errors import SlimWiseError
from slimwise.export import export_pruned, load_pruned
from slimwise.models import load_model, load_tokenizer
from slimwise.testbed import export_jsonl, make_split
from slimwise.trainable import ATTENTION_TARGETS, DENSE_MLP_TARGETS

GREEDY = GenerationConfig(max_new_tokens=12, batch_size=4)
FAST = dict(steps=6, batch_size=8, max_new_tokens=10, lr=1e-2, progress=False)


def tokens(engine, prompts, mode):
    return [o.token_ids for o in engine.generate(prompts, mode=mode, config=GREEDY)]


def make_plan(model, ratio=0.5):
    stats = calibrate(model, random_prompts(8, seed=1),
                      config=CalibrationConfig(max_new_tokens=8, batch_size=4), progress=False)
    return plan_from_stats(stats, "reap", ratio)


@pytest.fixture(scope="module")
def setup(tiny_dirs):
    """family -> (model, plan at 50% REAP)."""
    cache = {}

    def get(family="qwen3_moe"):
        if family not in cache:
            model = load_model(tiny_dirs(family))
            cache[family] = (model, make_plan(model))
        return cache[family]

    return get


def perturbed_delta(model, plan, params=("router", "norm", "lora"), mode="slimwise", scale=0.5) -> Delta:
    """A delta with every tensor visibly moved (what training would do), without paying for training."""
    delta = init_delta(model, plan, DistillConfig(params=params, mode=mode))
    g = torch.Generator().manual_seed(0)
    for t in delta.tensors.values():
        t.add_(torch.randn(t.shape, generator=g) * scale * (t.abs().mean() + 0.05))
    return delta


def test_loss_decreases_and_only_the_delta_trains(setup):
    model, plan = setup()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    prompts = random_prompts(8, seed=2)
    delta = distill(model, plan, prompts, config=DistillConfig(params=("router", "norm", "lora"), **FAST))
    history = delta.manifest["loss_history"]
    # one full batch: the same data each step
    assert len(history) == 6 and history[-1] < 0.8 * history[0], history
    # the model itself is untouched (weights bit-identical, flags restored); only the delta moved
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    start = init_delta(model, plan, DistillConfig(params=("router", "norm", "lora")))
    assert set(delta.tensors) == set(start.tensors)
    for i, w in delta.routers().items():
        pruned = plan.pruned_mask(i)
        # pruned rows never train
        assert torch.equal(w[pruned], start.tensors[f"layers.{i}.router.weight"][pruned])
        assert not torch.equal(w[~pruned], start.tensors[f"layers.{i}.router.weight"][~pruned])
    assert all(not torch.equal(w, start.tensors[f"layers.{i}.moe_norm.weight"])
               for i, w in delta.norms().items())
    assert all(b.abs().sum() > 0 for _, b in delta.lora_pairs().values())


@pytest.mark.parametrize("params", [("router",), ("norm",), ("lora",)])
def test_only_the_chosen_set_is_in_the_delta(setup, params):
    model, plan = setup()
    delta = distill(model, plan, random_prompts(8, seed=2), config=DistillConfig(params=params, **FAST))
    kinds = {"router": ".router.weight", "norm": ".moe_norm.weight", "lora": ".lora_"}
    assert all(any(kinds[p] in name for p in params) for name in delta.tensors)
    assert delta.params == list(params)


def test_trainable_share_reported(setup):
    model, plan = setup()
    cfg = DistillConfig(params=("router", "norm", "lora"),
                        lora_targets=("q_proj", "o_proj"), lora_rank=4, **FAST)
    delta = distill(model, plan, random_prompts(8, seed=2), config=cfg)
    hidden = model.config.hidden_size
    layers = list(plan.kept_experts)
    routers = sum(len(plan.kept(i)) for i in layers) * hidden  # the kept rows only
    norms = len(layers) * hidden
    lora = sum(4 * (m.in_features + m.out_features) for n, m in model.named_modules()
               if n.endswith(("q_proj", "o_proj")))
    total = sum(p.numel() for p in model.parameters())
    m = delta.manifest
    assert m["trainable_params"] == routers + norms + lora
    assert m["model_params"] == total \
        and m["trainable_share"] == pytest.approx((routers + norms + lora) / total)
    assert m["steps"] == 6 and m["seconds"] > 0 and m["peak_memory_mb"] > 0


@pytest.mark.parametrize(("family", "want"),
                         [("qwen2_moe", DENSE_MLP_TARGETS), ("deepseek_v3", DENSE_MLP_TARGETS),
                          ("qwen3_moe", ATTENTION_TARGETS)])
def test_auto_lora_targets_pick_the_shared_expert_where_there_is_one(setup, family, want):
    """The default LoRA goes on the shared expert's gate/up/down (every decode token runs it) where the model
    has one, else on q/k/v/o; the manifest records what "auto" became; explicit targets pass through."""
    model, plan = setup(family)
    delta = init_delta(model, plan, DistillConfig())
    names = list(delta.lora_pairs())
    assert {n.rpartition(".")[2] for n in names} == set(want) \
        and delta.manifest["lora"]["targets"] == list(want)
    if want == DENSE_MLP_TARGETS:  # the shared expert's, and a dense layer's MLP where the model has one
        assert any(".shared_expert" in n for n in names)
        assert all(".shared_expert" in n or ".mlp." in n for n in names)
    explicit = init_delta(model, plan, DistillConfig(lora_targets=("o_proj",)))
    assert {n.rpartition(".")[2] for n in explicit.lora_pairs()} == {"o_proj"}
    assert explicit.manifest["lora"]["targets"] == ["o_proj"]


def test_trainable_set_registry():
    """Sets act in registry order (what optimizer checkpoints index by); a taken name is refused; every LoRA
    target `auto` can pick has a vLLM module to be served colocated on."""
    from slimwise.serving.delta_hooks import VLLM_INSTALLERS, VLLM_LORA_TARGETS
    from slimwise.trainable import TRAINABLE_SETS, TrainableSet, register_set, trainable_sets

    assert list(TRAINABLE_SETS) == ["router", "norm", "lora"]
    assert [s.name for s in trainable_sets(("lora", "router"))] == ["router", "lora"]
    with pytest.raises(SlimWiseError, match="unknown trainable set"):
        trainable_sets(())

    class Another(TrainableSet):
        name = "norm"

    with pytest.raises(SlimWiseError, match="already registered"):
        register_set(Another)
    assert type(TRAINABLE_SETS["norm"]).__name__ == "NormSet"
    assert set(ATTENTION_TARGETS + DENSE_MLP_TARGETS) <= set(VLLM_LORA_TARGETS)
    assert set(VLLM_INSTALLERS) == set(TRAINABLE_SETS)  # every set is served colocated


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_prefill_stays_the_full_model_with_a_delta(family, setup):
    """With a delta loaded, prompt-position cache entries and the first token are bit-identical to full."""
    model, plan = setup(family)
    delta = perturbed_delta(model, plan)
    engine = PhaseSplitEngine(model, plan=plan, delta=delta)
    prompts = random_prompts()
    full_cache, full_logits, *_ = engine.prefill(prompts, "full")
    d_cache, d_logits, *_ = engine.prefill(prompts, "distilled")
    assert torch.equal(full_logits, d_logits)
    a, b = cache_tensors(full_cache), cache_tensors(d_cache)
    assert len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    full = tokens(engine, prompts, "full")
    dist = tokens(engine, prompts, "distilled")
    slim = tokens(engine, prompts, "slimwise")
    assert [t[0] for t in full] == [t[0] for t in dist]
    assert dist != slim, "the delta changed nothing"
    engine.close()
    if family == "qwen3_moe":  # slimwise stays training-free with a delta loaded
        plain = PhaseSplitEngine(model, plan=plan)
        assert tokens(plain, prompts, "slimwise") == slim
        plain.close()
    assert not [n for n, m in model.named_modules() if "forward" in m.__dict__]


def test_uniform_delta_acts_in_both_phases(setup):
    model, plan = setup()
    delta = perturbed_delta(model, plan, params=("router", "norm"), mode="uniform")
    engine = PhaseSplitEngine(model, plan=plan, delta=delta)
    prompts = random_prompts()
    _, uni_logits, *_ = engine.prefill(prompts, "uniform")
    _, dist_logits, *_ = engine.prefill(prompts, "distilled")
    assert not torch.equal(uni_logits, dist_logits)
    engine.close()
    trained = distill(model, plan, random_prompts(8, seed=2), config=DistillConfig(mode="uniform", **FAST))
    assert trained.mode == "uniform" \
        and trained.manifest["loss_history"][-1] < trained.manifest["loss_history"][0]


def test_engines_on_one_model_close_in_reverse_order(setup):
    """Masks and deltas stack their wrappers on the shared model. Closing a SlimWise engine while a
    distilled one built after it is alive used to drop the distilled engine's wrappers silently (a
    script measured the wrong decoder that way); now it is refused, nothing is unwrapped, and closing in
    reverse order restores the model."""
    model, plan = setup()
    prompts = random_prompts(4, seed=5)
    full = tokens(PhaseSplitEngine(model), prompts, "full")
    with PhaseSplitEngine(model, plan=plan, delta=perturbed_delta(model, plan)) as alone:
        want = tokens(alone, prompts, "distilled")
    first = PhaseSplitEngine(model, plan=plan)
    second = PhaseSplitEngine(model, plan=plan, delta=perturbed_delta(model, plan))
    with pytest.raises(SlimWiseError, match="reverse order"):
        first.close()
    assert tokens(second, prompts, "distilled") == want  # still whole
    second.close()
    first.close()
    assert tokens(PhaseSplitEngine(model), prompts, "full") == full
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_delta_save_load_round_trip(setup, tmp_path):
    model, plan = setup()
    delta = perturbed_delta(model, plan)
    path = delta.save(tmp_path / "delta")
    loaded = Delta.load(path)
    assert Delta.load(path / "delta.safetensors").manifest == loaded.manifest
    assert set(loaded.tensors) == set(delta.tensors)
    assert all(torch.equal(loaded.tensors[k], delta.tensors[k]) for k in delta.tensors)
    assert loaded.manifest["plan_hash"] == plan_hash(plan) and loaded.mode == "slimwise"
    prompts = random_prompts()
    got = []
    for d in (delta, path):  # one engine at a time: masks and deltas wrap the model's own modules
        engine = PhaseSplitEngine(model, plan=plan, delta=d)
        got.append(tokens(engine, prompts, "distilled"))
        engine.close()
    assert got[0] == got[1]
    with pytest.raises(SlimWiseError, match="exists and is not empty"):
        delta.save(path)
    delta.save(path, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["delta"]  # no temporary leftovers


def test_refusals(setup, tmp_path):
    model, plan = setup()
    delta = perturbed_delta(model, plan)
    other_plan = make_plan(model, 0.25)
    with pytest.raises(SlimWiseError, match="another plan"):
        PhaseSplitEngine(model, plan=other_plan, delta=delta)
    other = build_tiny_model("qwen3_moe", seed=1, initializer_range=TINY_INIT)
    other_model_plan = make_plan(other)
    with pytest.raises(SlimWiseError, match="other weights"):
        PhaseSplitEngine(other, plan=other_model_plan, delta=delta)
    with pytest.raises(SlimWiseError, match="plan fingerprint"):  # plan/model mismatch
        PhaseSplitEngine(model, plan=other_model_plan, delta=delta)
    with pytest.raises(SlimWiseError, match="empty"):
        distill(model, plan, [], config=DistillConfig(**FAST))
    with pytest.raises(SlimWiseError, match="nothing to distil"):
        distill(model, make_plan(model, 0.0), random_prompts(4), config=DistillConfig(**FAST))
    with pytest.raises(SlimWiseError, match="unknown trainable"):
        distill(model, plan, random_prompts(4), config=DistillConfig(params=("experts",)))
    with pytest.raises(SlimWiseError, match="not a SlimWise delta"):
        Delta.load(tmp_path)
    engine = PhaseSplitEngine(model, plan=plan)
    with pytest.raises(SlimWiseError, match="needs a delta"):
        engine.generate(random_prompts(2), "distilled")
    engine.close()
    with pytest.raises(SlimWiseError, match="another plan"):
        export_pruned(load_model(model.slimwise_source_dir), other_plan, tmp_path / "x", delta=delta)
    assert not (tmp_path / "x").exists()
    assert not [n for n, m in model.named_modules() if "forward" in m.__dict__]


def test_resume_gives_the_uninterrupted_delta(setup, tmp_path):
    model, plan = setup()
    prompts = random_prompts(12, seed=4)
    cfg = dict(FAST, params=("router", "norm", "lora"), steps=5, batch_size=4, checkpoint_every=1)
    straight = distill(model, plan, prompts, config=DistillConfig(**cfg))

    def interrupt(step, loss):
        if step == 3:
            raise KeyboardInterrupt

    ckpt = tmp_path / "run.ckpt.pt"
    with pytest.raises(KeyboardInterrupt):
        distill(model, plan, prompts, config=DistillConfig(**cfg, checkpoint=str(ckpt)), callback=interrupt)
    assert ckpt.is_file() and not any("forward" in m.__dict__ for m in model.modules())
    resumed = distill(model, plan, prompts, config=DistillConfig(**cfg, checkpoint=str(ckpt), resume=True))
    assert resumed.manifest["loss_history"] == straight.manifest["loss_history"]
    assert all(torch.equal(resumed.tensors[k], straight.tensors[k]) for k in straight.tensors)
    with pytest.raises(SlimWiseError, match="another run"):
        distill(model, plan, prompts,
                config=DistillConfig(**(cfg | {"lr": 0.5}), checkpoint=str(ckpt), resume=True))


def test_export_with_delta_equals_masked_view_with_delta(setup, tmp_path):
    model, plan = setup()
    delta = distill(model, plan, random_prompts(8, seed=2),
                    config=DistillConfig(params=("router", "norm", "lora"), **FAST))
    out = export_pruned(load_model(model.slimwise_source_dir), plan, tmp_path / "distilled", delta=delta)
    pruned, saved_plan = load_pruned(out)  # stock transformers loads it
    manifest = json.loads((out / "slimwise_manifest.json").read_text())
    assert manifest["delta"]["plan_hash"] == plan_hash(plan) and manifest["delta"]["params"] == delta.params
    masked = PhaseSplitEngine(model, plan=plan, delta=delta)
    sliced = PhaseSplitEngine(model, plan=saved_plan, decode_model=pruned)
    prompts = random_prompts()
    want = tokens(masked, prompts, "distilled")
    assert want == tokens(sliced, prompts, "slimwise")
    assert want != tokens(masked, prompts, "slimwise")
    masked.close()
    with pytest.raises(SlimWiseError, match="no decode model"):
        PhaseSplitEngine(model, plan=plan, decode_model=pruned, delta=delta)


def test_cli_distill(setup, tmp_path, capsys):
    model, plan = setup()
    model_dir = tmp_path / "model"
    shutil.copytree(model.slimwise_source_dir, model_dir)
    build_tokenizer(model_dir)
    plan_path = plan.save(tmp_path / "plan.json")
    data = export_jsonl(make_split("calib", 2, seed=0, domain="arithmetic"), tmp_path / "calib.jsonl")
    out = tmp_path / "delta"
    args = ["distill", str(model_dir), "--plan", str(plan_path), "--data", str(data), "--out", str(out),
            "--steps", "3", "--batch-size", "4", "--max-new-tokens", "8", "--params", "router,norm"]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    assert "trainable parameters" in printed and "% of the model" in printed and "peak memory" in printed
    delta = Delta.load(out)
    assert delta.params == ["router", "norm"] and delta.manifest["steps"] == 3
    # no ckpt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.jsonl", "delta", "model", "plan.json"]
    pruned = tmp_path / "pruned"
    assert cli_main(["prune", str(model_dir), "--plan", str(plan_path), "--distilled", str(out),
                     "--out", str(pruned)]) == 0
    assert "folded in" in capsys.readouterr().out
    assert json.loads((pruned / "slimwise_manifest.json").read_text())["delta"]["plan_hash"] \
        == plan_hash(plan)
    shutil.rmtree(pruned)
    assert cli_main(args) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert cli_main([*args[:4], "--data", str(empty), "--out", str(tmp_path / "d2")]) == 2
    assert "no records" in capsys.readouterr().err
    assert not (tmp_path / "d2").exists()
    # --teacher: built and written by the first run, reused by the next (a uniform baseline here), checked
    teacher = tmp_path / "teacher.pt"
    shared = [*args[:-2], "--params", "router", "--teacher", str(teacher), "--force"]
    assert cli_main(shared) == 0 and "wrote teacher data" in capsys.readouterr().out
    first = Delta.load(out)
    assert cli_main([*shared, "--mode", "uniform"]) == 0 \
        and "wrote teacher data" not in capsys.readouterr().out
    assert Delta.load(out).manifest["teacher_shared"] and first.manifest["teacher_shared"]
    assert cli_main([*shared[:-1], "--max-new-tokens", "9", "--force"]) == 2
    assert "teacher data was built for a different --max-new-tokens" in capsys.readouterr().err
    assert cli_main([*shared[:-1], "--teacher-batch-size", "3", "--force"]) == 2  # the data depends on it
    assert "teacher data was built for a different --teacher-batch-size" in capsys.readouterr().err


def test_teacher_on_the_fly_equals_cached_and_losses_run(setup):
    """The per-step teacher (full model on a copy of the prefill cache) equals the cached one; other losses
    and on-policy mixing train too."""
    model, plan = setup()
    prompts = random_prompts(8, seed=2)
    cached = distill(model, plan, prompts, config=DistillConfig(**FAST))
    fly = distill(model, plan, prompts, config=DistillConfig(teacher_cache_mb=0, **FAST))
    assert fly.manifest["loss_history"] == pytest.approx(cached.manifest["loss_history"], rel=1e-4)
    for extra in (dict(loss="rkl"), dict(loss="jsd", ce_weight=0.5), dict(on_policy=0.5)):
        history = distill(model, plan, prompts,
                          config=DistillConfig(**(FAST | extra))).manifest["loss_history"]
        assert history[-1] < history[0], (extra, history)


def test_bars_check_and_report_rerender(tmp_path):
    """The bars arithmetic on a hand-made report (gap, recovery, the stricter length bar, never worse) and the
    per-problem length drift; `python -m experiments.distill_bars report` rewrites report.md
    and the bars from report.json."""
    from experiments.distill_bars import bars_check, length_drift
    from experiments.distill_bars import main as distill_main

    def run(acc, lengths, **extra):
        return {"accuracy": acc, "mean_length": sum(lengths) / len(lengths), "lengths": lengths,
                "correct": [1] * len(lengths), "kl": 0.01, "flip_pct": 0.5, **extra}

    full = [10, 20, 30, 40]
    report = {"model": "m", "full": {"test": run(90.0, full), "heldout": run(10.0, full)}, "ratios": {}}
    sw, good, bad = run(80.0, [10, 20, 30, 44]), run(86.0, [10, 20, 31, 40]), run(86.0, [10, 20, 30, 45])
    report["ratios"]["0.5"] = {m: {"test": r, "heldout": r} for m, r in [("uniform", sw), ("slimwise", sw),
                                                                          ("distilled", good),
                                                                          ("uniform_distilled", good)]}
    report["ratios"]["0.5"]["distilled"]["distill"] = \
        report["ratios"]["0.5"]["uniform_distilled"]["distill"] = {
            "seconds": 12.0, "trainable_params": 10, "trainable_share": 0.001, "peak_memory_mb": 1.0,
            "loss_first_last": [1.0, 0.1]}
    bars = bars_check(report)["0.5"]
    # gap 10, recovered 6 >= 5; length +4 tokens (4.0%) -> +1 (1.0%) <= min(5%, 2%); never worse
    assert bars["gap"] == 10 and bars["recovered"] == 6 and bars["recovery_bar"] and bars["length_bar"]
    assert bars["never_worse"] and not bars["within_3_points"]
    assert length_drift(sw, report["full"]["test"]) == pytest.approx(
        {"mean_diff": 1.0, "mean_diff_se": 1.0, "mean_abs_diff": 1.0, "changed_pct": 25.0})
    report["ratios"]["0.5"]["distilled"]["test"] = bad  # +5 tokens: longer than SlimWise's +4
    bars = bars_check(report)["0.5"]
    assert not bars["length_bar"] and not bars["never_worse"] and bars["recovery_bar"]
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert distill_main(["report", str(path)]) == 0
    assert json.loads(path.read_text())["bars"]["0.5"]["length_bar"] is False
    md = (tmp_path / "report.md").read_text()
    assert "| 0.5 | distilled | 86.0 | 26.25 (+5.00%) | +1.250 ± 1.250 / 1.25 / 25.0 |" in md
    assert not list(tmp_path.glob("*.tmp"))


def test_family_length_check():
    """Per-family drift: drifts of opposite sign that cancel in the mean are found, halving is judged only
    where SlimWise drifts beyond noise, and a drift distillation creates is reported."""
    from experiments.distill_bars import family_drift, family_length_check, length_drift

    fams = ["x"] * 4 + ["y"] * 4
    full = {"lengths": [10] * 4 + [20] * 4, "families": fams}
    sw = {"lengths": [12, 12, 13, 11, 18, 18, 17, 19]}  # x +2, y -2: the mean hides both
    assert length_drift(sw, full)["mean_diff"] == 0
    drift = family_drift(sw, full)
    assert drift["x"]["mean_diff"] == 2 and drift["y"]["mean_diff"] == -2 and drift["x"]["pct"] == 20
    assert drift["x"]["z"] == pytest.approx(2 / (np.std([2, 2, 3, 1], ddof=1) / 2))
    good = {"lengths": [11, 10, 10, 11, 20, 19, 21, 20]}  # x +0.5, y 0
    check = family_length_check(sw, good, full)
    assert check["drifting"] == ["x", "y"] and check["halved"] and check["new_drift"] == []
    sw_x_only = {"lengths": [12, 12, 13, 11, 20, 21, 19, 20]}  # y is noise around 0: not judged
    bad = {"lengths": [11, 11, 12, 11, 23, 22, 23, 22]}  # x +1.25 (not halved), y +2.5 (new)
    check = family_length_check(sw_x_only, bad, full)
    assert check["drifting"] == ["x"] and not check["halved"] and check["new_drift"] == ["y"]
    # no labels: no verdict
    assert family_length_check(sw, good, {"lengths": full["lengths"]})["halved"] is None


def test_replicate_on_fresh_samples(tmp_path, monkeypatch):
    """`python -m experiments.distill_bars replicate` re-tests a bars run's plan and delta on another
    seed's test problems: the rows are the engine's own greedy results on those problems, written
    atomically beside the report."""
    from tiny import save_tiny_model

    import experiments.distill_bars as bars
    from experiments.distill_bars import BarsConfig, evaluate_run, replicate_bars
    from slimwise.testbed import check_disjoint

    # the prompts each seed's full-model run was actually given, in seed order
    evaluated: list[list[str]] = []

    def recording(engine, samples, mode, config, *args, **kwargs):
        if mode == "full":
            evaluated.append([s.prompt for s in samples])
        return evaluate_run(engine, samples, mode, config, *args, **kwargs)

    monkeypatch.setattr(bars, "evaluate_run", recording)

    tok = build_tokenizer(tmp_path / "model")
    save_tiny_model("qwen3_moe", tmp_path / "model", initializer_range=0.15, vocab_size=len(tok),
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = load_model(tmp_path / "model")
    calib = [tok.encode(s.prompt, add_special_tokens=False)
             for s in make_split("calib", 2, domain="arithmetic")]
    plan = plan_from_stats(calibrate(model, calib, config=CalibrationConfig(max_new_tokens=8),
                                     progress=False), "reap", 0.5)
    run = tmp_path / "run"
    run.mkdir()
    plan.save(run / "plan-0.5.json")
    perturbed_delta(model, plan).save(run / "delta-distilled-0.5")
    (run / "report.json").write_text(json.dumps({"ratios": {"0.5": {}}}))
    out = replicate_bars(str(tmp_path / "model"), run, seeds=(1, 2), per_family=1, threads=1)
    # the replication samples: disjoint from the run's own sample (seed 0) and from each other
    own = {s.prompt for s in make_split("test", 1, seed=0, domain="arithmetic")}
    fresh = make_split("test", 1, seed=1, domain="arithmetic", exclude=own, allow_fewer=True)
    second = make_split("test", 1, seed=2, domain="arithmetic", exclude=own | {s.prompt for s in fresh},
                        allow_fewer=True)
    assert own.isdisjoint(s.prompt for s in fresh) and own.isdisjoint(s.prompt for s in second)
    assert {s.prompt for s in fresh}.isdisjoint(s.prompt for s in second)
    # from the data, not the report's own flag: the samples the run evaluated share no prompt with the run's
    # own sample or with each other, and the report's claim agrees
    assert len(evaluated) == 2 and all(evaluated) and check_disjoint(own, *evaluated)
    assert out["disjoint"] == check_disjoint(own, *evaluated)
    assert out["sizes"]["2"] == {f: 1 for f in ("add", "sub", "mul", "gcd", "base")}
    assert out["seeds"]["2"]["0.5"]["slimwise"]["lengths"] == evaluate_run(
        PhaseSplitEngine(model, load_tokenizer(tmp_path / "model"), plan=plan), second, "slimwise",
        BarsConfig())["lengths"]
    want = evaluate_run(PhaseSplitEngine(model, load_tokenizer(tmp_path / "model"), plan=plan), fresh,
                        "slimwise", BarsConfig())
    got = out["seeds"]["1"]["0.5"]["slimwise"]
    assert got["lengths"] == want["lengths"] and got["correct"] == want["correct"]
    assert out["seeds"]["1"]["0.5"]["distilled"]["lengths"] != got["lengths"]  # the delta was applied
    md = (run / "replicate.md").read_text().splitlines()
    assert len([line for line in md if line.startswith("| 1 | 0.5 |")]) == 1
    assert "### Pooled: seeds 1, 2 (10 problems)" in md and "| run | add | sub | mul | gcd | base |" in md
    assert any(line.startswith("- 0.5: SlimWise drifts") for line in md)
    assert json.loads((run / "replicate.json").read_text())["per_family"] == 1 and not list(run.glob("*.tmp"))


def test_shared_teacher_gives_the_same_delta(setup, tmp_path):
    """One teacher (full-model continuations and log-probs) serves every plan and both modes: the delta is the
    one `distill` gets by building its own; a teacher for other prompts or settings is refused."""
    model, plan = setup()
    prompts = random_prompts(8, seed=2)
    cfg = DistillConfig(**FAST)
    teacher = build_teacher(model, prompts, config=cfg)
    assert len(teacher.continuations) == 8 and teacher.logprobs is not None
    # through the file, as the CLI shares it
    teacher = TeacherData.load(teacher.save(tmp_path / "teacher.pt"))
    for p, mode in ((plan, "slimwise"), (make_plan(model, 0.25), "slimwise"), (plan, "uniform")):
        c = DistillConfig(**(FAST | {"mode": mode}))
        own, shared = (distill(model, p, prompts, config=c),
                       distill(model, p, prompts, config=c, teacher=teacher))
        # same data, same trajectory; float32 reductions may round differently with another allocation history
        # (uniform mode here: 1.5e-5 of a tensor's scale after 6 Adam steps), so this is not bitwise
        assert shared.manifest["loss_history"] == pytest.approx(own.manifest["loss_history"], rel=1e-4)
        for k, t in own.tensors.items():
            assert float((shared.tensors[k] - t).abs().max()) <= 1e-4 * float(t.abs().max()), k
        assert shared.manifest["teacher_shared"] and not own.manifest["teacher_shared"]
    with pytest.raises(SlimWiseError, match="different prompt set"):
        distill(model, plan, random_prompts(8, seed=3), config=cfg, teacher=teacher)
    with pytest.raises(SlimWiseError, match="different --max-new-tokens"):
        distill(model, plan, prompts, config=DistillConfig(**(FAST | {"max_new_tokens": 9})), teacher=teacher)
    # a file written before the teacher had a batch of its own (key "batch_size")
    # still serves the same settings
    old = TeacherData({k: v for k, v in teacher.key.items() if k != "teacher_batch_size"}
                      | {"batch_size": cfg.teacher_batch_size}, teacher.continuations, teacher.logprobs, 0.0)
    TeacherData.load(old.save(tmp_path / "old.pt")).check(teacher.key)
    with pytest.raises(SlimWiseError, match="different --teacher-batch-size"):
        distill(model, plan, prompts,
                config=DistillConfig(**(FAST | {"teacher_batch_size": 3})), teacher=teacher)
    (tmp_path / "bad.pt").write_bytes(b"not a teacher")
    with pytest.raises(SlimWiseError, match="unreadable"):
        TeacherData.load(tmp_path / "bad.pt")


@pytest.mark.parametrize(("family", "mode"), [("qwen3_next", "uniform"), ("qwen3_5_moe", "slimwise")])
def test_distill_trains_through_a_hybrid_cache(setup, family, mode):
    """Hybrid models keep a Gated DeltaNet recurrent state in the cache, which transformers overwrites in
    place after using it as the layer's initial state; distillation trains through it (`trainable_cache`;
    before, backward failed with "modified by an inplace operation"), the loss falls and the teacher-forced
    continuation on the trainable cache equals the stock one."""
    from slimwise.distill import trainable_cache
    from slimwise.scoring import continue_on_cache

    model, plan = setup(family)
    losses = []
    delta = distill(model, plan, random_prompts(8, seed=9),
                    config=DistillConfig(mode=mode, **(FAST | {"steps": 4})),
                    callback=lambda step, loss: losses.append(loss))
    assert delta.lora_pairs() and losses[-1] < losses[0]
    engine = PhaseSplitEngine(model, plan=plan)
    prompts, conts = random_prompts(3, seed=2), random_prompts(3, seed=3, lengths=(6, 4, 5))
    with torch.no_grad():
        outs = []
        for wrap in (lambda c: c, trainable_cache):
            cache, _, attention, positions = engine.prefill(prompts, "full")
            outs.append(continue_on_cache(engine, "slimwise", wrap(cache), attention, positions, conts, 6))
    engine.close()
    assert torch.equal(outs[0], outs[1])


class _Payload:
    """A pickle that would write a marker file when unpickled (what a crafted
    teacher/checkpoint file can carry)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_teacher_and_checkpoint_files_never_run_code(setup, tmp_path):
    """`--teacher` files are meant to be shared, and `--resume` reads a file from disk: both load with
    `weights_only=True`, so a crafted pickle is refused with one line and executes nothing."""
    model, plan = setup()
    marker = tmp_path / "pwned"
    crafted = tmp_path / "teacher.pt"
    torch.save({"format": "x", "evil": _Payload(marker)}, crafted)
    with pytest.raises(SlimWiseError, match="unreadable"):
        TeacherData.load(crafted)
    ckpt = tmp_path / "delta.ckpt"
    torch.save({"format": "x", "evil": _Payload(marker)}, ckpt)
    with pytest.raises(SlimWiseError, match="unreadable"):
        distill(model, plan, random_prompts(4, seed=9),
                config=DistillConfig(checkpoint=str(ckpt), resume=True, **(FAST | {"steps": 1})))
    assert not marker.exists()


def test_top_k_log_probs_keep_the_k_and_spread_the_rest():
    """`--teacher-top-k K`: the K given log-probs stay as they are, the rest share the remaining mass evenly,
    each row is a distribution (padding slots, -inf, are ignored)."""
    ids = torch.tensor([[3, 1, 0], [2, 0, 0]])
    values = torch.log(torch.tensor([[0.5, 0.25, 0.125], [0.9, 0.0, 0.0]]))
    values[1, 1:] = float("-inf")
    from slimwise.distill import _dense_logprobs

    dense = _dense_logprobs(ids, values, vocab_size=6)
    assert torch.allclose(dense.exp().sum(-1), torch.ones(2))
    assert torch.allclose(dense[0, [3, 1, 0]], values[0]) and torch.allclose(dense[1, 2], values[1, 0])
    assert torch.allclose(dense[0, [2, 4, 5]].exp(), torch.full((3,), 0.125 / 3))
    assert torch.allclose(dense[1, [0, 1, 3, 4, 5]].exp(), torch.full((5,), 0.1 / 5))


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_activation_checkpointing_gives_the_same_delta(setup, family):
    """Recomputing the MoE blocks in the backward pass (slimwise.checkpointing) trains the same delta: the
    recomputation sees the mask and delta switches of its forward, not those of the backward pass (they
    differ: the engine has left decode by then). Both modes; float32 CPU, bit for bit. Without the captured
    switches the slimwise mode's gradients differ (the recomputed block routes with every expert)."""
    model, plan = setup(family)
    prompts = random_prompts(8, seed=4)
    for mode in ("slimwise", "uniform"):
        deltas = [distill(model, plan, prompts, config=DistillConfig(
            mode=mode, activation_checkpointing=on, **(FAST | {"steps": 2}))) for on in (False, True)]
        assert deltas[0].tensors.keys() == deltas[1].tensors.keys()
        for name, tensor in deltas[0].tensors.items():
            assert torch.equal(tensor, deltas[1].tensors[name]), (family, mode, name)
    from slimwise.adapters import get_adapter

    # the wrappers are gone after the run
    assert all("forward" not in layer.block.__dict__ for layer in get_adapter(model.config).moe_layers(model))


def test_activation_checkpointing_needs_the_switches_it_saw(setup):
    """The premise of the captured switches: recomputing with the switches of the backward pass (mask off)
    is another computation than the forward's: torch refuses it (other saved shapes) or the gradients
    differ."""
    from torch.utils.checkpoint import CheckpointError

    from slimwise.adapters import get_adapter
    from slimwise.checkpointing import checkpointed_moe_blocks

    model, plan = setup("qwen3_moe")
    engine = PhaseSplitEngine(model, plan=plan)

    def grad(switches):
        x = torch.randn(1, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0),
                        requires_grad=True)
        with checkpointed_moe_blocks([block], switches) if switches is not None else nullcontext(), \
                engine.mask.pruned():
            out = block(x)
        return torch.autograd.grad((out[0] if isinstance(out, tuple) else out).sum(), x)[0]

    try:
        block = get_adapter(model.config).moe_layers(model)[0].block
        want = grad(None)
        assert torch.equal(grad([(engine.mask, ("active", "token_mask"))]), want)
        with suppress(CheckpointError):
            assert not torch.equal(grad(()), want)
    finally:
        engine.close()


def test_fidelity_records_each_problems_kl(setup):
    """`teacher_forced_fidelity`'s per-problem KL (the intervals of experiments.long_prompts): one value per
    continuation, each the mean over its own tokens, so the token-weighted mean is the run's KL; the full
    model against itself is 0 everywhere; SlimWise is 0 on a one-token continuation (its first token comes
    from the full prefill) and not on the longer ones."""
    from experiments.distill_bars import teacher_forced_fidelity

    model, plan = setup()
    engine = PhaseSplitEngine(model, None, plan=plan)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in (5, 9, 7)]
    conts = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in (4, 1, 6)]
    got = teacher_forced_fidelity(engine, prompts, conts, "slimwise", batch_size=2)
    per = got["kl_per_problem"]
    assert len(per) == 3 and per[1] == 0.0 and per[0] > 0 and per[2] > 0
    weighted = sum(k * len(c) for k, c in zip(per, conts, strict=True)) / sum(map(len, conts))
    assert weighted == pytest.approx(got["kl"], rel=1e-4)
    assert teacher_forced_fidelity(engine, prompts, conts, "full")["kl_per_problem"] == [0.0] * 3
