"""Expert-parallel placement and EP-balanced plans (slimwise/expert_parallel.py), against vLLM's own
expert map."""

from __future__ import annotations

import pytest
import torch

from slimwise.errors import SlimWiseError
from slimwise.expert_parallel import (
    balanced_plan,
    ep_mismatch,
    imbalance,
    kept_per_rank,
    rank_experts,
    served_ep_size,
)
from slimwise.plan import PrunePlan, make_plan


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize(("experts", "ep"), [(16, 2), (64, 8), (60, 8), (128, 4), (10, 3)])
def test_rank_experts_is_vllms_expert_map(experts, ep, placement):
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    ours = rank_experts(experts, ep, placement)
    for rank in range(ep):
        local, expert_map, _ = determine_expert_map(ep, rank, experts, placement)
        held = (expert_map >= 0).nonzero().flatten().tolist()
        assert ours[rank] == held and len(held) == local
        # local slot i holds global expert ours[rank][i]: the mask (global ids) reaches the right local
        # experts
        assert expert_map[ours[rank]].tolist() == list(range(local))
    assert sorted(e for r in ours for e in r) == list(range(experts))


def _scores(layers=3, experts=16, seed=0):
    return torch.rand(layers, experts, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("ep", [2, 4, 8])
def test_balanced_plan_keeps_the_same_count_per_rank_and_the_best_of_each_block(ep, placement):
    scores = _scores()
    plan = balanced_plan(scores, [0, 1, 2], 0.5, ep, placement, family="qwen3_moe", top_k=2)
    assert plan.meta["ep_size"] == ep and plan.meta["ep_placement"] == placement
    ranks = rank_experts(16, ep, placement)
    for layer, counts in kept_per_rank(plan, ep, placement).items():
        assert counts == [8 // ep] * ep
        for block in ranks:  # within each block: its highest scores
            kept = [e for e in block if e in plan.kept_experts[layer]]
            best = sorted(block, key=lambda e: -float(scores[layer, e]))[:len(kept)]
            assert sorted(kept) == sorted(best)
    assert imbalance(plan, ep, placement)["max"] == 1.0


def test_a_free_plan_can_be_unbalanced_and_imbalance_measures_it():
    scores = torch.zeros(1, 16)
    scores[0, :8] = 1.0  # the 8 best experts all on rank 0 under linear placement, EP 2
    free = make_plan(scores, [0], 0.5, family="qwen3_moe", top_k=2)
    assert kept_per_rank(free, 2) == {0: [8, 0]}
    assert imbalance(free, 2) == {"mean": 2.0, "max": 2.0, "ep_size": 2, "placement": "linear"}
    assert kept_per_rank(free, 2, "round_robin") == {0: [4, 4]}


def test_balanced_plans_nest_with_deepseek_groups_and_refuse_what_cannot_balance():
    plan = balanced_plan(_scores(experts=32), [0, 1, 2], 0.5, 8, family="deepseek_v3", top_k=4, num_groups=4)
    assert plan.num_groups == 4 and all(c == [2] * 8 for c in kept_per_rank(plan, 8).values())
    for bad, message in (
        (dict(experts=10, ep=4), "do not split evenly"),
        (dict(experts=16, ep=1), "at least 2"),
    ):
        with pytest.raises(SlimWiseError, match=message):
            balanced_plan(
                _scores(experts=bad["experts"]), [0, 1, 2], 0.5, bad["ep"], family="qwen3_moe", top_k=2
            )
    with pytest.raises(SlimWiseError, match="round_robin placement cut every group"):
        balanced_plan(_scores(experts=32), [0, 1, 2], 0.5, 8, "round_robin", family="deepseek_v3", top_k=4,
                      num_groups=4)


def test_serving_warns_when_the_served_ep_size_differs():
    plan = PrunePlan(family="qwen3_moe", num_experts=16, top_k=2, kept_experts={0: list(range(8))},
                     meta={"ep_size": 2, "ep_placement": "linear"})
    assert served_ep_size(["--tensor-parallel-size", "2"]) == 1  # no EP without --enable-expert-parallel
    assert served_ep_size(["--enable-expert-parallel", "-tp", "2", "--data-parallel-size=2"]) == 4
    assert ep_mismatch(plan, ["--enable-expert-parallel", "--tensor-parallel-size", "2"]) is None
    assert "served with EP size 4" in ep_mismatch(plan, ["--enable-expert-parallel", "-tp", "4"])
    assert "round_robin" in ep_mismatch(plan, ["--enable-expert-parallel", "-tp", "2",
                                               "--expert-placement-strategy", "round_robin"])
    free = PrunePlan(family="qwen3_moe", num_experts=16, top_k=2, kept_experts={0: list(range(8))})
    assert ep_mismatch(free, ["--enable-expert-parallel", "-tp", "8"]) is None


def test_plan_cli_writes_an_ep_balanced_plan(tiny_dirs, tmp_path, capsys):
    from conftest import random_prompts

    from slimwise.calibrate import CalibrationConfig, calibrate
    from slimwise.cli import main
    from slimwise.models import load_model

    model = load_model(tiny_dirs("qwen3_moe"))
    calibrate(model, random_prompts(4), config=CalibrationConfig(max_new_tokens=4), progress=False).save(
        tmp_path / "stats.safetensors")
    assert main(["plan", "--stats", str(tmp_path / "stats.safetensors"), "--ratio", "0.5", "--ep-size", "4",
                 "--out", str(tmp_path / "plan.json")]) == 0
    assert "4 EP ranks alike" in capsys.readouterr().out
    plan = PrunePlan.load(tmp_path / "plan.json")
    assert plan.meta["ep_size"] == 4 and imbalance(plan, 4)["max"] == 1.0


def test_ep_roofline_balanced_beats_free_and_full_equals_itself():
    from lab.perf.ep import INTERCONNECTS, predict_ep, random_plan_imbalance
    from slimwise.perf.presets import preset_config
    from slimwise.perf.roofline import HARDWARE, RooflineConfig

    rc = RooflineConfig.from_hf(preset_config("qwen3-30b-a3b"))
    hw, link = HARDWARE["h200"], INTERCONNECTS["nvlink4"]
    free = random_plan_imbalance(128, 64, 8)
    assert 1.2 < free < 1.5  # chance alone: 8 experts per rank on average, the busiest ~1.36x
    balanced = predict_ep(rc, hw, link, 0.5, [32, 256], 8, 1.0)
    unbalanced = predict_ep(rc, hw, link, 0.5, [32, 256], 8, free)
    for b, u in zip(balanced, unbalanced, strict=True):
        assert b.time_full_s == u.time_full_s and b.speedup > u.speedup > 1.0
        # the busiest rank reads more under the free plan
        assert b.expert_bytes_pruned < u.expert_bytes_pruned
    # ratio 0 with a balanced plan is the full model: speedup exactly 1
    assert all(x.speedup == 1.0 for x in predict_ep(rc, hw, link, 0.0, [64], 8, 1.0))


def test_scoped_environ_restores_set_and_unset_keys_even_on_error(monkeypatch):
    import os

    from slimwise.hardware import cpu_thread_binding, scoped_environ

    monkeypatch.setenv("SLIMWISE_T_SET", "before")
    monkeypatch.delenv("SLIMWISE_T_UNSET", raising=False)
    with pytest.raises(RuntimeError), scoped_environ({"SLIMWISE_T_SET": "x", "SLIMWISE_T_UNSET": "y"}):
        assert os.environ["SLIMWISE_T_SET"] == "x" and os.environ["SLIMWISE_T_UNSET"] == "y"
        raise RuntimeError
    assert os.environ["SLIMWISE_T_SET"] == "before" and "SLIMWISE_T_UNSET" not in os.environ
    # one equal block of cores per rank; fewer cores than ranks share them
    assert cpu_thread_binding(2, [0, 1, 2, 3]) == "0,1|2,3" and cpu_thread_binding(3, [5, 6]) == "5|6|5"
