"""`slimwise.footprint` against the real thing: the shipped testbeds' loaded weights, the KV arithmetic of
`slimwise.models`, the trainable sets' own starting tensors and the roofline's parameter census.

Full-size models are built on the meta device only (the preset), never in memory."""

from __future__ import annotations

import pytest
import torch

from slimwise.adapters import get_adapter
from slimwise.distill import DistillConfig
from slimwise.errors import SlimWiseError
from slimwise.footprint import COMMANDS, GIB, estimate_seconds, footprint
from slimwise.models import kv_bytes_per_token, load_model, resolve_model_dir, state_bytes_per_layer
from slimwise.perf.presets import preset_config
from slimwise.perf.roofline import RooflineConfig
from slimwise.trainable import trainable_sets

PRESET = "qwen3.6-35b-a3b"


@pytest.fixture(scope="module")
def testbed_a():
    return load_model("testbed-a", dtype="float32")


def test_weights_row_is_the_loaded_models_bytes(testbed_a):
    real = sum(p.numel() * p.element_size() for p in testbed_a.parameters())
    for command in ("calibrate", "generate", "eval", "distill"):
        assert footprint("testbed-a", command, dtype="float32").bytes_of("weights") == real
    in_memory = footprint("testbed-a", "prune", dtype="float32", in_memory=True)
    assert in_memory.bytes_of("weights (whole model)") == real


@pytest.mark.parametrize("name", ["testbed-a", "testbed-b", "testbed-c"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_rows_are_models_kv_arithmetic(name, dtype):
    model_dir = resolve_model_dir(name)
    fp = footprint(name, "generate", dtype=dtype, batch_size=3, prompt_len=40, max_new_tokens=9)
    assert fp.bytes_of("KV cache") == 3 * (40 + 9) * kv_bytes_per_token(model_dir, dtype)
    rows = dict(fp.rows)
    if name == "testbed-c":  # the hybrid: 3 Gated-DeltaNet layers beside one attention layer
        assert rows["linear-attention state"] == 3 * 3 * state_bytes_per_layer(model_dir) > 0
    else:
        assert "linear-attention state" not in rows


@pytest.mark.parametrize("name", ["testbed-a", "testbed-c"])
def test_trainable_row_counts_the_sets_starting_tensors(name, testbed_a):
    """Router rows, norms and LoRA (auto targets: attention on testbed-a, the shared expert on testbed-c) as
    the trainer creates them; at float32 every element costs 20 bytes (delta copy, parameter, gradient, two
    AdamW moments)."""
    model = testbed_a if name == "testbed-a" else load_model(name, dtype="float32")
    config = DistillConfig()
    adapter = get_adapter(model.config)
    layers = {layer.index: layer for layer in adapter.moe_layers(model)}
    elements = sum(t.numel() for s in trainable_sets(config.params)
                   for t in s.init(model, adapter, layers, config)[0].values())
    fp = footprint(name, "distill", dtype="float32")
    assert fp.bytes_of("trainable delta + grads + AdamW") == 20 * elements


def test_every_trainable_set_says_what_it_holds():
    """The footprint sums what each chosen set reports (`TrainableSet.memory`), so every registered set
    reports it, and the distill row is the sum of the chosen sets' rows, set by set."""
    from slimwise.trainable import TRAINABLE_SETS, TrainableSet

    assert all(type(s).memory is not TrainableSet.memory for s in TRAINABLE_SETS.values())

    def trainable(*params):
        return footprint("testbed-c", "distill", dtype="float32", distill=DistillConfig(params=params)) \
            .bytes_of("trainable delta + grads + AdamW")

    alone = [trainable(name) for name in TRAINABLE_SETS]
    assert all(alone) and trainable(*TRAINABLE_SETS) == sum(alone)


def test_preset_weights_match_the_roofline_census():
    roof = RooflineConfig.from_hf(preset_config(PRESET)).total_params
    fp = footprint(PRESET, "calibrate")
    assert abs(fp.bytes_of("weights") - 2 * roof) <= 0.01 * 2 * roof
    assert fp.bytes_of("weights") > 60 * GIB  # the 35 B model, not a scaled-down build
    for command in ("calibrate", "distill"):
        got = footprint(PRESET, command)
        assert got.total > got.bytes_of("weights")
        assert got.per_device == got.device_total  # one device


def test_distill_grows_with_lora_rank_and_teacher_cache():
    base = footprint(PRESET, "distill")
    assert footprint(PRESET, "distill", distill=DistillConfig(lora_rank=16)).total > base.total
    bigger = footprint(PRESET, "distill", distill=DistillConfig(teacher_cache_mb=4096))
    assert bigger.bytes_of("teacher log-prob cache") > base.bytes_of("teacher log-prob cache")
    assert bigger.total > base.total
    assert "teacher log-prob cache" in base.host_rows


def test_teacher_cache_is_all_or_nothing():
    """distill caches every prompt's log-probs when they fit under teacher_cache_mb, else none: then the full
    model continues a copy of each batch's prefill cache instead."""
    per_prompt = 128 * 248320 * 4
    few = footprint(PRESET, "distill", prompts=2)
    assert few.bytes_of("teacher log-prob cache") == 2 * per_prompt
    assert few.bytes_of("teacher log-probs of one batch") == 2 * per_prompt  # padded on the host each step
    eight = footprint(PRESET, "distill", prompts=8)
    assert eight.bytes_of("teacher log-probs of one batch") == 8 * per_prompt
    assert {"teacher log-prob cache", "teacher log-probs of one batch"} <= set(few.host_rows)
    many = footprint(PRESET, "distill", prompts=500)
    assert many.bytes_of("teacher log-prob cache") == 0
    assert many.bytes_of("teacher's copy of the KV cache") == few.bytes_of("KV cache")


def test_streamed_prune_holds_two_chunks_whatever_the_model():
    from slimwise.export_stream import CHUNK_BYTES

    for model in (PRESET, "testbed-a"):
        fp = footprint(model, "prune", ratio=0.5)
        assert fp.total == fp.host_total == 2 * CHUNK_BYTES and fp.device_total == 0
        assert any(note.startswith("disk: ") for note in fp.notes)


def test_prune_is_host_ram_and_names_the_disk_bytes():
    fp = footprint(PRESET, "prune", ratio=0.5, in_memory=True)
    assert fp.device_total == 0 and fp.host_total == fp.total > fp.bytes_of("weights (whole model)")
    disk = fp.bytes_of("reloaded pruned checkpoint (export check)")
    assert fp.bytes_of("weights (whole model)") / 2 < disk < fp.bytes_of("weights (whole model)")
    assert any("disk" in note and f"{disk:,} bytes" in note for note in fp.notes)
    assert footprint(PRESET, "prune", ratio=0.25, in_memory=True).bytes_of(
        "reloaded pruned checkpoint (export check)") > disk


def test_table_and_per_device_split():
    fp = footprint(PRESET, "generate", devices=8)
    assert fp.per_device == -(-fp.device_total // 8)
    table = fp.table()
    assert f"| **total** | **{fp.total / GIB:.2f}** | |" in table
    assert "per device (8 devices, even split)" in table
    assert all(len(line) <= 110 for line in fp.report().splitlines()[:12])


def test_decode_bound_is_below_reading_every_weight():
    fp = footprint(PRESET, "generate")
    weights = fp.bytes_of("weights")
    assert 0 < fp.step_bytes < weights / 4  # 8 of 256 experts per layer are a small share of the model
    assert estimate_seconds(fp, 4800, 96) == pytest.approx(96 * fp.step_bytes / 4.8e12)
    with pytest.raises(SlimWiseError):
        estimate_seconds(footprint(PRESET, "prune"), 4800, 96)


@pytest.mark.parametrize("call", [
    lambda: footprint("testbed-a", "serve"),
    lambda: footprint("no-such-model", "calibrate"),
    lambda: footprint("testbed-a", "calibrate", dtype="int3"),
    lambda: footprint("testbed-a", "prune", ratio=1.0),
    lambda: footprint("testbed-a", "generate", batch_size=0),
    lambda: footprint("testbed-a", "distill", distill=DistillConfig(lora_targets=("nope_proj",))),
])
def test_refusals_are_one_line(call):
    with pytest.raises(SlimWiseError) as info:
        call()
    assert "\n" not in str(info.value) and str(info.value)


def test_every_command_has_a_footprint():
    for command in COMMANDS:
        fp = footprint("testbed-b", command)
        assert fp.total > 0 and fp.rows and fp.notes
        assert torch.tensor([b for _, b in fp.rows]).ge(0).all()


def test_dry_run_prints_the_footprint_and_loads_nothing(tmp_path, capsys):
    """`--dry-run` on calibrate, distill and prune, as a user runs it: the table on stdout, exit 0, no output
    written; a full-size preset name works where no checkpoint exists (nothing is read but its config)."""
    import subprocess
    import sys

    data = tmp_path / "calib.jsonl"
    data.write_text('{"prompt": "add 1+2\\n"}\n{"prompt": "add 3+4\\n"}\n')
    plan = tmp_path / "plan.json"
    from slimwise.calibrate import CalibrationConfig, calibrate
    from slimwise.criteria import plan_from_stats
    from slimwise.models import load_model, load_tokenizer

    model = load_model("testbed-a", dtype="float32")
    stats = calibrate(model, ["add 1+2\n"], load_tokenizer("testbed-a"), CalibrationConfig(max_new_tokens=8),
                      progress=False)
    plan_from_stats(stats, "reap", 0.5).save(plan)
    commands = {
        "calibrate": ["calibrate", "qwen3.6-35b-a3b", "--data", str(data), "--out", str(tmp_path / "s"),
                      "--max-memory", "0=70GiB,1=70GiB"],
        "distill": ["distill", "testbed-a", "--plan", str(plan), "--data", str(data), "--out",
                    str(tmp_path / "delta")],
        "prune": ["prune", "testbed-a", "--plan", str(plan), "--out", str(tmp_path / "pruned")],
    }
    printed = {}
    for command, argv in commands.items():
        if command == "calibrate":  # one real process, as a user runs it; the others through the same main()
            proc = subprocess.run([sys.executable, "-m", "slimwise.cli", *argv, "--dry-run"],
                                  capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stderr
            out = proc.stdout
        else:
            from slimwise.cli import main

            capsys.readouterr()
            assert main([*argv, "--dry-run"]) == 0
            out = capsys.readouterr().out
        assert out.startswith(f"slimwise {command} "), out[:200]
        assert "| **total** |" in out
        printed[command] = out
    assert "| weights | 64.56 |" in printed["calibrate"] and "per device (2 devices" in printed["calibrate"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.jsonl", "plan.json"]
