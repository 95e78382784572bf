"""Devices: `--device` / `--max-memory` plumbing on the CPU, and the prepared GPU check's smoke run (what CI
can run of it; the GPU run itself is published in docs/results/gpu.md)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slimwise.devices import auto_dtype_on, input_device, parse_max_memory, placement, resolve_device
from slimwise.errors import SlimWiseError
from slimwise.models import load_model

ROOT = Path(__file__).resolve().parents[1]


def test_device_names_resolve_or_are_refused_in_one_line():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("gpu", "cuda:x", "tpu:0", ""):
        with pytest.raises(SlimWiseError, match="expected auto, cpu, cuda or cuda:N"):
            resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(SlimWiseError, match="sees no CUDA device"):
            resolve_device("cuda:0")


def test_max_memory_parses_to_accelerates_dict():
    assert parse_max_memory("0=70GiB, 1=70GiB,cpu=200GiB") == {0: "70GiB", 1: "70GiB", "cpu": "200GiB"}
    assert parse_max_memory(None) is None
    for bad in ("0:70GiB", "gpu=1GiB", "0=lots"):
        with pytest.raises(SlimWiseError, match="expected DEVICE=SIZE"):
            parse_max_memory(bad)


def test_cpu_placement_is_the_plain_load_and_gpu_dtype_defaults_to_bf16():
    assert placement("cpu").from_pretrained_kwargs() == {}
    spread = placement("cpu", "cpu=1GiB").from_pretrained_kwargs()
    assert spread.pop("offload_folder") and spread == {"device_map": "auto", "max_memory": {"cpu": "1GiB"}}
    assert auto_dtype_on("cuda:0", "float32") == "bfloat16"
    assert auto_dtype_on("cuda", "float16") == "float16"
    assert auto_dtype_on("cpu", "bfloat16") is None


def _computation(model, tok, prompts: list[str]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """What a placement must not change: greedy tokens (full mode), teacher-forced logits along them."""
    from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine

    with PhaseSplitEngine(model, tok) as engine:
        gens = engine.generate(prompts, "full", GenerationConfig(max_new_tokens=8, batch_size=len(prompts)))
    with torch.no_grad():
        logits = [model(torch.tensor([g.prompt_ids + g.token_ids], device=input_device(model))).logits.cpu()
                  for g in gens]
    return [g.token_ids for g in gens], logits


def _differences(got, want) -> list[str]:
    """Which of tokens and logits differ (bit for bit) between two `_computation`s."""
    out = ["tokens"] if got[0] != want[0] else []
    if any(not torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True)):
        out.append("logits")
    return out


def test_device_cpu_is_placed_through_devices_and_computes_the_plain_load(monkeypatch, tmp_path):
    """`--device cpu` is resolved by `devices.resolve_device` and placed by `devices.placement` (at the
    command line and in `load_model`), and the model it places computes what transformers' own plain load of
    the checkpoint computes, token for token and logit for logit. The comparison bites: a wrong placement of
    the same weights (the same device in half precision, as a GPU's `--dtype auto` loads them) differs."""
    from transformers import AutoModelForCausalLM

    from slimwise import devices
    from slimwise.cli import main
    from slimwise.models import load_tokenizer, resolve_model_dir
    from slimwise.testbed import make_split

    resolved = []
    real = devices.resolve_device
    monkeypatch.setattr(devices, "resolve_device", lambda spec: resolved.append(spec) or real(spec))
    tok = load_tokenizer("testbed-a")
    prompts = [s.prompt for s in make_split("calib", 1, seed=0, domain="arithmetic")][:4]
    assert len(prompts) >= 2
    plain = AutoModelForCausalLM.from_pretrained(resolve_model_dir("testbed-a"), dtype=torch.float32,
                                                 local_files_only=True).eval()
    reference = _computation(plain, tok, prompts)
    placed = load_model("testbed-a", dtype="float32", device="cpu")
    assert resolved == ["cpu"] and input_device(placed) == torch.device("cpu")
    assert _differences(_computation(placed, tok, prompts), reference) == []
    wrong = load_model("testbed-a", dtype="bfloat16", device="cpu")
    assert "logits" in _differences(_computation(wrong, tok, prompts), reference)

    resolved.clear()
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    assert main(["generate", "testbed-a", "--device", "cpu", "--dtype", "float32", "--mode", "full",
                 "--prompts", str(tmp_path / "p.jsonl"), "--max-new-tokens", "8",
                 "--batch-size", str(len(prompts)), "--out", str(tmp_path / "out.jsonl")]) == 0
    assert resolved == ["cpu"]
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["token_ids"] for r in rows] == reference[0]


def test_commands_take_device_and_refuse_a_missing_gpu(tmp_path):
    from slimwise.cli import build_parser

    parser = build_parser()
    for command in ("calibrate", "generate", "distill", "eval", "demo"):
        sub = parser._subparsers._group_actions[0].choices[command]
        options = {o for a in sub._actions for o in a.option_strings}
        assert {"--device", "--max-memory"} <= options, command
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "add 1+2\\n"}\n')
    proc = subprocess.run([sys.executable, "-m", "slimwise.cli", "calibrate", "testbed-a", "--data",
                           str(prompts), "--out", str(tmp_path / "s.safetensors"), "--device", "cuda:99"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert re.fullmatch(r"slimwise: error: --device cuda:99: (this torch build sees no CUDA device; use "
                        r"--device cpu|only \d+ CUDA device\(s\) visible)", line), line
    assert not (tmp_path / "s.safetensors").exists()


@pytest.fixture(scope="module")
def smoke_report(tmp_path_factory) -> dict:
    """The prepared GPU check's JSON from a run with tiny sizes on the CPU, as a user runs it."""
    out = tmp_path_factory.mktemp("gpu-check")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu",
                           "--smoke", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out / "gpu_check.json").read_text())


def test_gpu_check_smoke_runs_on_cpu(smoke_report):
    """The prepared GPU check with tiny sizes on the CPU: every section runs, every check passes and the JSON
    names its environment (so the script cannot rot between GPU sessions)."""
    report = smoke_report
    assert report["schema"] == "slimwise-gpu-check/1" and report["ok"] and not report["errors"]
    assert set(report["sections"]) == {"testbed", "synthetic"}
    assert len(report["checks"]) == 16 and all(c["ok"] for c in report["checks"])
    tb = report["sections"]["testbed"]["device_float32"]
    assert tb["stats_vs_cpu"]["counts_equal"] and tb["plan_vs_cpu"]["identical_share"] == 1.0
    assert all(tb["tokens_vs_cpu"][m]["identical_share"] == 1.0 for m in ("full", "uniform", "slimwise"))
    assert tb["distill"]["steps"] == 2
    spread = report["sections"]["testbed"]["spread"]  # memory + disk on the CPU
    assert spread["placements"] == 2 and spread["stats_vs_whole"]["counts_equal"]
    assert all(spread["tokens_vs_whole"][m]["identical_share"] == 1.0 for m in ("full", "slimwise"))
    streamed = spread["streamed"]  # the layer-streamed passes on the spread model: the CPU is deterministic
    assert streamed["offloaded_layers"] == 2 and streamed["vs_in_memory"]["norm_sum_max_rel"] == 0.0
    assert streamed["logprobs_max_abs_diff"] <= 1e-4
    dist = report["sections"]["synthetic"]["bfloat16"]["distill"]
    assert dist["first_loss_equal"] and dist["loss_max_rel_diff"] == 0.0  # the CPU is deterministic


#: checks `scripts/gpu_check.py` gained after the published H200 run (docs/results/gpu.md lists them under
#: "What did not run on a GPU"), and the one it renamed since: published name -> the name it writes today
ADDED_SINCE_PUBLISHED = ("testbed-c float32 spread: layer-streamed statistics equal the in-memory pass",
                         "testbed-c float32 spread: layer-streamed log-probs equal the in-memory scoring")
RENAMED_SINCE_PUBLISHED = {
    "testbed-c float32 spread over placements: calibration counts equal the whole model's":
        "testbed-c float32 spread: calibration counts equal the whole model's"}


def test_published_gpu_check_is_todays_check_less_what_was_added_since(smoke_report):
    """The published H200 run is a passed, full-size CUDA run of the schema this script writes, and its checks
    are today's checks, in today's order, less the checks added since and with the one renamed check mapped:
    a check the script drops, adds or renames again, or a published JSON edited by hand, fails here until the
    lists above and docs/results/gpu.md say what the published run did and did not check."""
    published = json.loads((ROOT / "docs/results/gpu/gpu_check_h200.json").read_text())
    assert published["schema"] == smoke_report["schema"] and set(published) == set(smoke_report)
    assert published["ok"] and not published["smoke"] and not published["errors"]
    assert published["env"]["gpu"] == "NVIDIA H200" and published["env"]["device"] == "cuda"
    assert set(published["sections"]) == set(smoke_report["sections"])
    assert all(c["ok"] for c in published["checks"])
    names = [c["name"] for c in published["checks"]]
    today = [c["name"] for c in smoke_report["checks"]]
    assert set(RENAMED_SINCE_PUBLISHED) <= set(names) and not set(RENAMED_SINCE_PUBLISHED) & set(today)
    assert set(ADDED_SINCE_PUBLISHED) <= set(today) and not set(ADDED_SINCE_PUBLISHED) & set(names)
    assert [RENAMED_SINCE_PUBLISHED.get(n, n) for n in names] == [n for n in today
                                                                   if n not in ADDED_SINCE_PUBLISHED]
    page = (ROOT / "docs/results/gpu.md").read_text()
    assert f"all {len(names)} checks passed" in page
    assert "layer-streamed passes" in page.split("## What did not run on a GPU")[1]


def test_a_model_spread_over_memory_and_disk_computes_what_the_whole_model_does():
    """The two placements accelerate allows on a CPU: testbed-c under a 20 MiB --max-memory keeps the
    embeddings and two layers in memory and offloads the other two layers and the head to disk (their
    weights come back only while they run). Calibration, the fingerprint, the masked (pruned) decoder and
    generation in every mode equal the whole model's, bit for bit; a distilled delta, which needs resident
    weights, is refused in one line."""
    from slimwise.calibrate import CalibrationConfig, calibrate
    from slimwise.criteria import plan_from_stats
    from slimwise.distill import DistillConfig, init_delta
    from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
    from slimwise.fingerprint import model_fingerprint
    from slimwise.models import load_tokenizer
    from slimwise.testbed import make_split

    whole = load_model("testbed-c", dtype="float32")
    spread = load_model("testbed-c", dtype="float32", max_memory="cpu=20MiB")
    assert set(spread.hf_device_map.values()) == {"cpu", "disk"}
    assert model_fingerprint(spread) == model_fingerprint(whole)
    tok = load_tokenizer("testbed-c")
    prompts = [s.prompt for s in make_split("calib", 1, seed=0, domain="arithmetic")]
    config = CalibrationConfig(max_new_tokens=16, batch_size=8)
    stats = [calibrate(m, prompts, tok, config, progress=False) for m in (whole, spread)]
    assert torch.equal(stats[0].count, stats[1].count) and torch.equal(stats[0].tokens, stats[1].tokens)
    for field in ("gate_sum", "norm_sum"):
        torch.testing.assert_close(getattr(stats[1], field), getattr(stats[0], field), rtol=1e-6, atol=0)
    plan = plan_from_stats(stats[0], "reap", 0.5)
    assert plan_from_stats(stats[1], "reap", 0.5).kept_experts == plan.kept_experts
    gen = GenerationConfig(max_new_tokens=16, batch_size=8)
    for mode in ("full", "uniform", "slimwise"):
        tokens = []
        for model in (whole, spread):
            with PhaseSplitEngine(model, tok, plan=plan) as engine:
                tokens.append([g.token_ids for g in engine.generate(prompts, mode, gen)])
        assert tokens[0] == tokens[1], mode
    delta = init_delta(whole, plan, DistillConfig())
    with pytest.raises(SlimWiseError, match="needs every weight resident"):
        PhaseSplitEngine(spread, tok, plan=plan, delta=delta)


@pytest.mark.vllm
@pytest.mark.slow
def test_gpu_check_vllm_smoke_runs_on_cpu(tmp_path):
    """`scripts/gpu_check.py --vllm`, the serving part of the GPU check, with tiny sizes on the CPU as a user
    runs it: the runner is named, the self-check ran with one plan and with two, compiled equals eager equals
    the reference in every mode, the mixed batch's forward-counted rows are exact, and the bench ran; so the
    script a GPU user runs cannot rot here."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--vllm", "--device",
                           "cpu", "--smoke", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["ok"] and not report["errors"] and set(report["sections"]) == {"vllm"}
    section = report["sections"]["vllm"]
    assert section["runner"].startswith("V1") and section["vllm"].startswith("0.32")
    assert set(section["self_check_two_plans"]["rows"]) == {"math", "general"}
    assert len(report["checks"]) == 9 and all(c["ok"] for c in report["checks"]), report["checks"]
    assert all(section[f"{m}_default_vs_eager"] == 1.0 for m in ("full", "slimwise", "uniform"))
    assert section["mixed_rows"]["want"]["math"] > 0
    # the CPU's unquantized experts: modular kernels, which call the router SlimWise's masks reach
    assert section["moe_kernels"] and not any(mono for _, mono in section["moe_kernels"].values())
    assert section["decode_step"]["report"] is not None
