"""Plans, criteria and statistics: formulas on hand-made numbers, constraints and refusals."""

from __future__ import annotations

import pytest
import torch

from slimwise.criteria import CRITERIA, plan_from_stats, register_criterion, score_experts
from slimwise.errors import SlimWiseError
from slimwise.plan import PrunePlan, make_plan
from slimwise.stats import ExpertStats


def hand_stats() -> ExpertStats:
    s = ExpertStats.zeros([0, 2], 4, meta={"family": "qwen3_moe", "top_k": 1, "fingerprint": {"a": "b"}})
    # layer 0: expert 0 fires 10 times with small gates, expert 1 twice with big gates and big outputs
    s.count[0] = torch.tensor([10.0, 2.0, 5.0, 0.0])
    s.gate_sum[0] = torch.tensor([1.0, 1.8, 2.5, 0.0])
    s.norm_sum[0] = torch.tensor([10.0, 20.0, 5.0, 0.0])
    s.norm_sq_sum[0] = torch.tensor([10.0, 200.0, 5.0, 0.0])
    s.gate_norm_sum[0] = torch.tensor([1.0, 18.0, 2.5, 0.0])
    s.count[1] = torch.tensor([1.0, 1.0, 1.0, 1.0])
    s.gate_sum[1] = torch.tensor([0.4, 0.3, 0.2, 0.1])
    s.norm_sum[1] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    s.norm_sq_sum[1] = s.norm_sum[1] ** 2
    s.gate_norm_sum[1] = s.gate_sum[1] * s.norm_sum[1]
    s.tokens[:] = torch.tensor([17.0, 4.0])
    return s


def test_criteria_formulas():
    s = hand_stats()
    assert score_experts(s, "frequency")[0].tolist() == [10, 2, 5, 0]
    assert torch.allclose(
        score_experts(s, "soft")[0], torch.tensor([1.0, 1.8, 2.5, 0.0], dtype=torch.float64)
    )
    assert score_experts(s, "ean")[0].tolist() == [10, 20, 5, 0]
    reap = score_experts(s, "reap")[0]
    assert torch.allclose(reap, torch.tensor([0.1, 9.0, 0.5, 0.0], dtype=torch.float64))
    assert not torch.isnan(reap).any()  # never-fired expert scores 0, not NaN
    assert torch.allclose(s.norm_mean()[0], torch.tensor([1.0, 10.0, 1.0, 0.0], dtype=torch.float64))
    assert torch.allclose(s.norm_std()[0], torch.tensor([0.0, 0.0, 0.0, 0.0], dtype=torch.float64))


def test_criterion_registry_is_one_function():
    @register_criterion("always_first")
    def always_first(stats):
        out = torch.zeros_like(stats.count)
        out[:, 0] = 1
        return out

    try:
        plan = plan_from_stats(hand_stats(), "always_first", 0.75)
        assert plan.kept_experts == {0: [0], 2: [0]}
    finally:
        CRITERIA.pop("always_first")
    with pytest.raises(SlimWiseError, match="unknown criterion"):
        score_experts(hand_stats(), "nope")


def test_criteria_choose_differently():
    s = hand_stats()
    assert plan_from_stats(s, "frequency", 0.5).kept_experts[0] == [0, 2]
    assert plan_from_stats(s, "reap", 0.5).kept_experts[0] == [1, 2]
    assert plan_from_stats(s, "ean", 0.5).kept_experts[0] == [0, 1]
    assert plan_from_stats(s, "soft", 0.5).kept_experts[2] == [0, 1]


def test_make_plan_uniform_counts_and_ties():
    scores = torch.zeros(3, 8)  # all tied: lowest ids are kept, deterministically
    plan = make_plan(scores, [1, 2, 3], 0.25, family="qwen3_moe", top_k=2)
    assert all(v == list(range(6)) for v in plan.kept_experts.values())
    assert plan.is_uniform and plan.num_kept == 6
    assert make_plan(scores, [1, 2, 3], 0.0, family="qwen3_moe", top_k=2).is_empty


def test_make_plan_groups_keep_every_group():
    # high ids score high: group 0 is weakest
    scores = torch.arange(16, dtype=torch.float64)[None].repeat(2, 1)
    plan = make_plan(scores, [0, 1], 0.5, family="deepseek_v3", top_k=4, num_groups=4, min_kept_per_group=2)
    for kept in plan.kept_experts.values():
        assert [sum(1 for e in kept if e // 4 == g) for g in range(4)] == [2, 2, 2, 2]
    with pytest.raises(SlimWiseError, match="group"):
        make_plan(scores, [0, 1], 0.75, family="deepseek_v3", top_k=4, num_groups=4, min_kept_per_group=2)


def test_global_plan_spends_one_budget_and_respects_top_k():
    scores = torch.tensor([[1.0, 1.0, 1.0, 1.0], [10.0, 0.1, 0.1, 0.1]])
    plan = make_plan(scores, [0, 1], 0.5, family="qwen3_moe", top_k=1, scope="global")
    assert sum(len(v) for v in plan.kept_experts.values()) == 4
    assert plan.kept_experts[1] == [0]  # the layer with one dominant expert gives up the most
    assert not plan.is_uniform
    with pytest.raises(SlimWiseError, match="non-uniform|different number"):
        _ = plan.num_kept


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5, float("nan")])
def test_ratio_outside_range_refused(ratio):
    with pytest.raises(SlimWiseError, match="outside"):
        make_plan(torch.ones(1, 8), [0], ratio, family="qwen3_moe", top_k=2)


def test_plan_below_top_k_refused():
    with pytest.raises(SlimWiseError, match="top-k"):
        make_plan(torch.ones(1, 8), [0], 0.9, family="qwen3_moe", top_k=2)


def test_plan_and_stats_roundtrip(tmp_path):
    s = hand_stats()
    s.save(tmp_path / "s.safetensors")
    t = ExpertStats.load(tmp_path / "s.safetensors")
    assert t.layers == s.layers and t.meta == s.meta and torch.equal(t.count, s.count)
    plan = plan_from_stats(t, "reap", 0.5)
    plan.save(tmp_path / "p.json")
    again = PrunePlan.load(tmp_path / "p.json")
    assert again == plan and again.fingerprint == {"a": "b"} and again.phase is None
    (tmp_path / "bad.json").write_text("{\"x\": 1}")
    with pytest.raises(SlimWiseError, match="not a SlimWise plan"):
        PrunePlan.load(tmp_path / "bad.json")
    with pytest.raises(SlimWiseError, match="slimwise calibrate"):
        ExpertStats.load(tmp_path / "p.json")


def test_registries_refuse_a_name_twice():
    """A second registration under a taken name would silently replace the first: refused (lm-eval does the
    same)."""
    from slimwise.adapters import register_adapter
    from slimwise.adapters.qwen3_moe import Qwen3MoeAdapter

    with pytest.raises(SlimWiseError, match="already registered"):
        register_criterion("reap")(lambda stats: stats.count)
    assert CRITERIA["reap"].__name__ != "<lambda>"

    class Impostor(Qwen3MoeAdapter):
        pass

    with pytest.raises(SlimWiseError, match="already have an adapter"):
        register_adapter(Impostor)
    assert register_adapter(Qwen3MoeAdapter) is Qwen3MoeAdapter  # the same class again is a no-op


GOOD_PLAN = {"family": "qwen3_moe", "num_experts": 8, "top_k": 2, "kept_experts": {"0": [0, 1, 2, 3]},
             "format": "slimwise-plan/1"}
BAD_PLANS = {
    "kept_experts as a list": dict(GOOD_PLAN, kept_experts=[[0, 1]]),
    "id 'abc'": dict(GOOD_PLAN, kept_experts={"0": ["abc", 1]}),
    "num_experts as a string": dict(GOOD_PLAN, num_experts="8"),
    "no top_k": {k: v for k, v in GOOD_PLAN.items() if k != "top_k"},
    "an extra key": dict(GOOD_PLAN, colour="blue"),
    "layer key 'x'": dict(GOOD_PLAN, kept_experts={"x": [0, 1]}),
    "duplicate ids": dict(GOOD_PLAN, kept_experts={"0": [1, 1, 2]}),
    "fractional id": dict(GOOD_PLAN, kept_experts={"0": [1.5, 2, 3]}),
    "ratio NaN": dict(GOOD_PLAN, ratio=float("nan")),
    "fewer than top-k": dict(GOOD_PLAN, kept_experts={"0": [0]}),
    "id out of range": dict(GOOD_PLAN, kept_experts={"0": [0, 9]}),
    "boolean top_k": dict(GOOD_PLAN, top_k=True),
    "top_k above num_experts": dict(GOOD_PLAN, top_k=9),
    "groups not dividing": dict(GOOD_PLAN, num_groups=3),
    "no layer": dict(GOOD_PLAN, kept_experts={}),
    "a JSON array": [1, 2],
}


@pytest.mark.parametrize("case", sorted(BAD_PLANS))
def test_plan_schema_refuses_bad_plans_in_one_line(case, tmp_path):
    import json

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(BAD_PLANS[case]))
    with pytest.raises(SlimWiseError) as err:
        PrunePlan.load(path)
    assert "\n" not in str(err.value) and "slimwise plan" in str(err.value)


def test_plan_schema_accepts_what_slimwise_writes(tmp_path):
    plan = PrunePlan.from_dict(GOOD_PLAN)
    plan.save(tmp_path / "p.json")
    assert PrunePlan.load(tmp_path / "p.json") == plan


def test_checkpoint_fingerprint_reads_files_not_models(tmp_path):
    """The files checksum `slimwise serve` compares before any engine starts: same for the same weights
    however they are sharded or upcast, different for other weights of the same shape, part of what
    `load_model` reports, and matched only on the parts both fingerprints carry (plans from before it existed
    still load)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from tiny import save_tiny_model

    from slimwise.fingerprint import (
        checkpoint_fingerprint,
        fingerprints_match,
        memory_fingerprint,
        model_fingerprint,
    )
    from slimwise.models import load_model

    a = save_tiny_model("qwen3_moe", tmp_path / "a", dtype=torch.bfloat16)
    b = save_tiny_model("qwen3_moe", tmp_path / "b", seed=1, dtype=torch.bfloat16)
    fp_a = checkpoint_fingerprint(a)
    assert fp_a and fp_a != checkpoint_fingerprint(b)
    # resharded into two files and upcast to float32: the same weights, the same checksum
    tensors = load_file(a / "model.safetensors")
    names = sorted(tensors)
    shutil.copytree(a, tmp_path / "c")
    (tmp_path / "c" / "model.safetensors").unlink()
    save_file(
        {n: tensors[n].float().contiguous() for n in names[::2]}, tmp_path / "c" / "model-00001.safetensors"
    )
    save_file(
        {n: tensors[n].float().contiguous() for n in names[1::2]}, tmp_path / "c" / "model-00002.safetensors"
    )
    assert checkpoint_fingerprint(tmp_path / "c") == fp_a
    # one value changed in the middle of a layer tensor is seen; unreadable or missing files give None
    gate = next(n for n in names if n.endswith("mlp.gate.weight"))  # a router: what a plan depends on
    tensors[gate].view(-1)[tensors[gate].numel() // 2] += 1
    save_file(tensors, tmp_path / "a2.safetensors")
    (tmp_path / "d").mkdir()
    shutil.move(tmp_path / "a2.safetensors", tmp_path / "d" / "model.safetensors")
    assert checkpoint_fingerprint(tmp_path / "d") not in (None, fp_a)
    (tmp_path / "d" / "model.safetensors").write_bytes(b"\x00" * 5)
    assert checkpoint_fingerprint(tmp_path / "d") is None and checkpoint_fingerprint(tmp_path) is None

    full = model_fingerprint(load_model(a))
    assert full["files_sha256"] == fp_a and set(memory_fingerprint(full)) == {
        "config_sha256",
        "weights_sha256",
    }
    assert fingerprints_match(full, memory_fingerprint(full))  # a plan made before the files checksum existed
    # what the preflight knows
    files_only = {"config_sha256": full["config_sha256"], "files_sha256": "0" * 16}
    assert not fingerprints_match(full, files_only) and fingerprints_match(
        full, {**files_only, "files_sha256": fp_a}
    )
    # in memory the weights' checksum decides
    assert fingerprints_match(full, {**full, "files_sha256": "0" * 16})
    assert not fingerprints_match(full, {**full, "weights_sha256": "0" * 16})
    assert fingerprints_match(None, None) and not fingerprints_match(full, None)


def test_checkpoint_fingerprint_is_the_same_for_both_qwen3_5_layouts(tmp_path):
    """The published multimodal class (model.language_model.*, a vision tower) and the text-only class saved
    from it hold the same decoder weights: the same files checksum, so a plan made on one serves the other; a
    plan made on the one fits the model loaded from the other in process too (the weights' checksum
    decides)."""
    from tiny import tiny_config
    from transformers import Qwen3_5MoeForConditionalGeneration

    from slimwise.fingerprint import checkpoint_fingerprint, fingerprints_match, model_fingerprint
    from slimwise.models import load_model

    torch.manual_seed(0)
    Qwen3_5MoeForConditionalGeneration(tiny_config("qwen3_5_moe")).save_pretrained(tmp_path / "multimodal")
    model = load_model(tmp_path / "multimodal")
    model.save_pretrained(tmp_path / "text")
    assert checkpoint_fingerprint(tmp_path / "multimodal") == checkpoint_fingerprint(tmp_path / "text")
    assert fingerprints_match(model_fingerprint(model), model_fingerprint(load_model(tmp_path / "text")))


def random_stats(layers: int = 3, experts: int = 16, top_k: int = 2, seed: int = 0, groups: int = 1
                 ) -> ExpertStats:
    g = torch.Generator().manual_seed(seed)
    meta = {"family": "qwen3_moe", "top_k": top_k, "num_groups": groups, "fingerprint": {"a": "b"}}
    s = ExpertStats.zeros(list(range(layers)), experts, meta=meta)
    s.count[:] = torch.randint(1, 50, (layers, experts), generator=g).double()
    s.gate_sum[:] = s.count * torch.rand(layers, experts, generator=g, dtype=torch.float64)
    s.norm_sum[:] = s.count * torch.rand(layers, experts, generator=g, dtype=torch.float64)
    s.norm_sq_sum[:] = s.norm_sum ** 2
    s.gate_norm_sum[:] = s.gate_sum * s.norm_sum / s.count
    s.tokens[:] = 100.0
    return s


def kept_sets(plan: PrunePlan) -> dict[int, set[int]]:
    return {layer: set(ids) for layer, ids in plan.kept_experts.items()}


@pytest.mark.parametrize("options", [{}, {"scope": "global"}, {"ep_size": 4}, {"ep_size": 2, "groups": 2}],
                         ids=["layer", "global", "ep4", "ep2-groups2"])
def test_nested_plans_nest_and_equal_the_independent_plans_of_one_ranking(options):
    """Every plan keeps a subset of the previous (lower-ratio) plan's experts in every layer. With one stats
    file and one criterion, the plans at each ratio nest already (one ranking cut at fewer experts): nesting
    then changes nothing, which the plans made one by one show."""
    from slimwise.criteria import nested_plans

    options = dict(options)
    stats = random_stats(groups=options.pop("groups", 1))
    ratios = [0.75, 0.25, 0.5]
    plans = nested_plans(stats, "reap", ratios, **options)
    assert [p.ratio for p in plans] == [0.25, 0.5, 0.75]
    for wide, narrow in zip(plans, plans[1:], strict=False):
        assert all(kept_sets(narrow)[layer] <= kept_sets(wide)[layer] for layer in stats.layers)
    for plan in plans:
        assert plan.meta["nested_ratios"] == [0.25, 0.5, 0.75]
        assert plan.kept_experts == plan_from_stats(stats, "reap", plan.ratio, **options).kept_experts


def test_a_plan_within_another_keeps_only_its_experts():
    """`within` restricts the kept set even where the scores rank other experts first: the best experts of a
    second calibration, inside the first plan's set."""
    first = plan_from_stats(random_stats(seed=1), "reap", 0.5)
    other = random_stats(seed=2)
    inside = plan_from_stats(other, "reap", 0.75, within=first)
    alone = plan_from_stats(other, "reap", 0.75)
    assert all(kept_sets(inside)[layer] <= kept_sets(first)[layer] for layer in other.layers)
    assert inside.kept_experts != alone.kept_experts  # the second ranking alone leaves the first plan's set
    scores = score_experts(other, "reap")
    for row, layer in enumerate(other.layers):  # and inside the set, the highest scores
        allowed = sorted(first.kept(layer), key=lambda e: (-scores[row, e].item(), e))
        assert sorted(allowed[: len(inside.kept(layer))]) == inside.kept(layer)
    for scope in ("layer", "global"):
        with pytest.raises(SlimWiseError, match="nested plans need ratios that grow"):
            plan_from_stats(other, "reap", 0.25, within=first, scope=scope)


def test_plan_cli_writes_one_plan_per_ratio(tmp_path):
    """`slimwise plan --stats S --ratio 0.25 0.5 0.75 --nested --out DIR` as a user runs it: one
    CRITERION-RATIO.json per ratio, nested, each equal to `slimwise plan --ratio R`'s; an existing --out is
    refused in one line and left as it was."""
    import json
    import subprocess
    import sys

    stats = random_stats()
    stats.save(tmp_path / "stats.safetensors")

    def slimwise(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "slimwise.cli", "plan", "--stats",
                               str(tmp_path / "stats.safetensors"), *args],
                              capture_output=True, text=True, timeout=300)

    out = tmp_path / "plans"
    run = slimwise("--ratio", "0.25", "0.5", "0.75", "--nested", "--out", str(out))
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in out.iterdir()) == ["reap-0.25.json", "reap-0.5.json", "reap-0.75.json"]
    assert "nested: every plan keeps a subset" in run.stdout
    plans = [PrunePlan.load(out / f"reap-{r}.json") for r in ("0.25", "0.5", "0.75")]
    for wide, narrow in zip(plans, plans[1:], strict=False):
        assert all(kept_sets(narrow)[layer] <= kept_sets(wide)[layer] for layer in stats.layers)
    one = tmp_path / "one.json"
    assert slimwise("--ratio", "0.5", "--out", str(one)).returncode == 0
    assert json.loads(one.read_text())["kept_experts"] == json.loads((out / "reap-0.5.json").read_text())[
        "kept_experts"]
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = slimwise("--ratio", "0.5", "0.75", "--nested", "--out", str(out))
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1, again.stderr
    assert "exists and is not empty" in again.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
