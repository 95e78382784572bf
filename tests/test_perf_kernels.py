"""The fused-MoE kernel model (slimwise/perf/kernels.py): the fit on exact data, and the measurement on vLLM's
real `cpu_fused_moe` op at tiny shapes (structure and routing counts only: speed is the experiment's to
report)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slimwise.perf.kernels import (
    KernelSample,
    MoEKernelModel,
    fit_moe_kernel,
    kernel_isa,
    measure_fused_moe,
    predict_from_full,
)

ROOT = Path(__file__).resolve().parents[1]


def exact_samples(a: float, b: float, c: float) -> list[KernelSample]:
    out = []
    for batch in (1, 4, 16, 64):
        for avail, read in ((8, min(8.0, batch * 4.0)), (64, min(60.0, batch * 3.5))):
            out.append(KernelSample(batch, avail, read, batch * 4, a * read + b * batch * 4 + c, 80))
    return out


def test_fit_recovers_the_coefficients_of_exact_data():
    model = fit_moe_kernel(exact_samples(1e-4, 2e-5, 3e-5), bytes_per_expert=3 << 20)
    assert model.per_expert_s == pytest.approx(1e-4, rel=1e-9)
    assert model.per_pair_s == pytest.approx(2e-5, rel=1e-9)
    assert model.per_call_s == pytest.approx(3e-5, rel=1e-6)
    assert model.r2 == pytest.approx(1.0) and model.max_rel_error < 1e-9
    assert model.streaming_bandwidth == pytest.approx((3 << 20) / 1e-4)
    # the byte model's share of a call: a*U over the whole call
    assert model.pair_share(10, 40) == pytest.approx(1 - 1e-3 / (1e-3 + 8e-4 + 3e-5))
    assert model.as_dict()["streaming_bandwidth"] == model.streaming_bandwidth


def test_no_fitted_cost_is_negative():
    """Data whose free fit would put the per-call cost below zero: it is fixed at 0 and a, b refitted."""
    data = exact_samples(1e-4, 2e-5, -2e-5)
    model = fit_moe_kernel(data, 1)
    assert model.per_call_s == 0 and model.per_expert_s > 0 and model.per_pair_s > 0
    assert model.max_rel_error < 0.5


def test_fit_needs_three_samples():
    with pytest.raises(ValueError, match="at least 3 samples"):
        fit_moe_kernel(exact_samples(1e-4, 2e-5, 3e-5)[:2], 1)


def test_a_model_without_streaming_cost_has_no_finite_bandwidth():
    assert MoEKernelModel(0.0, 1e-5, 0.0, 100, 1.0, 0.0).streaming_bandwidth == float("inf")


def test_the_pruned_step_is_the_full_step_less_the_experts_no_longer_read():
    """8 MoE layers, 10 us per expert, 2 us per pair, 5 us per call; B = 32, top-4; 50 -> 30 experts read in a
    20 ms full step: 8 x 10 us x 20 = 1.6 ms saved, the pairs and calls stay."""
    model = MoEKernelModel(10e-6, 2e-6, 5e-6, 1 << 20, 1.0, 0.0)
    row = predict_from_full(model, 8, 4, 32, 0.020, 50.0, 30.0)
    assert row["kernel_full_s"] == pytest.approx(8 * (500e-6 + 256e-6 + 5e-6))
    assert row["pruned_step_s"] == pytest.approx(0.020 - 1.6e-3)
    assert row["predicted_speedup"] == pytest.approx(0.020 / 0.0184) and row["applies"]
    assert row["pair_share_pruned"] > row["pair_share_full"]  # fewer experts: pairs weigh more
    # a kernel model slower than the measured step (other threads, a compiled graph): it does not apply
    slow = predict_from_full(model, 8, 4, 32, 0.005, 50.0, 30.0)
    assert not slow["applies"] and slow["predicted_speedup"] is None


def test_measure_runs_vllms_kernel_and_counts_the_experts_read():
    """Every (batch, available experts) pair is timed with `steps` x `layers` calls; experts read is the mean
    number of distinct routed experts: exactly top_k at batch 1, never more than the experts available or the
    pairs."""
    samples = measure_fused_moe(hidden=64, inter=32, experts=16, top_k=4, batches=[1, 8], layers=2, rounds=2,
                                steps=3, progress=False)
    assert kernel_isa() in ("vec", "amx")
    assert [(s.batch, s.available) for s in samples] == [(1, 4), (1, 8), (1, 16), (8, 4), (8, 8), (8, 16)]
    for s in samples:
        assert s.pairs == s.batch * 4 and s.calls == 6 and s.seconds > 0
        assert 4 <= s.experts_read <= min(s.available, s.pairs)
        if s.batch == 1 or s.available == 4:
            assert s.experts_read == 4
    assert {s.available: s.experts_read for s in samples if s.batch == 8}[16] > 4


def test_the_experiment_writes_its_report(tmp_path):
    """experiments/kernel_roofline.py end to end at tiny settings: it re-executes itself with the threads
    bound as vLLM binds them, fits, and checks the fit against a step profile and bench traffic of the same
    dtype."""
    profile = {
        "dtype": {"used": "bfloat16"},
        "steps": {
            v: {"8": {"wall_s": w, "ops": {"_C::cpu_fused_moe": [k, 8]}}}
            for v, w, k in (("full", 0.05, 0.025), ("pruned", 0.045, 0.021), ("slimwise", 0.043, 0.02))
        },
    }
    traffic = {"traffic": {v: {"batches": {"8": {"touched_mean": u}}}
                           for v, u in (("full", 25.4), ("pruned", 19.9), ("slimwise", 20.3))}}
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    (tmp_path / "bench.json").write_text(json.dumps(traffic))
    out = tmp_path / "kr"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.kernel_roofline",
            "--preset",
            "smoke",
            "--batches",
            "1",
            "8",
            "--rounds",
            "1",
            "--steps",
            "2",
            "--profile",
            str(tmp_path / "profile.json"),
            "--bench",
            str(tmp_path / "bench.json"),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    # smoke: 16 experts, top-4: 4, 8, 16
    assert report["preset"] == "smoke" and len(report["samples"]) == 2 * 3
    assert [c["variant"] for c in report["checks"]] == ["full", "pruned", "slimwise"]
    assert report["checks"][0]["step_speedup_measured"] == pytest.approx(1.0)
    assert (
        "GOMP_CPU_AFFINITY" in out.with_suffix(".md").read_text()
        and out.with_suffix(".png").stat().st_size > 0
    )
