"""The streamed export (`slimwise.export_stream`) writes what the in-memory export writes, without loading the
model: for every family's tiny checkpoint, both exports of the same plan hold the same tensors (names, shapes,
dtypes, bytes), the same config.json and generation config, the same plan, and load with transformers to the
same state dict. Also: the stored layouts and dtypes the streaming path maps (fused experts, a multimodal
checkpoint's prefix and vision tower, tied embeddings, keep-in-fp32 modules, --dtype casts, a sharded
source), and its one-line refusals. Real files and real transformers loads throughout.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ALL_FAMILIES, TINY_INIT
from safetensors import safe_open
from tiny import build_tiny_model, tiny_config

from slimwise import export_stream
from slimwise.adapters import get_adapter
from slimwise.baseline_plans import random_plan
from slimwise.cli import main
from slimwise.errors import SlimWiseError
from slimwise.export import export_pruned
from slimwise.export_stream import StreamingUnsupported, export_checkpoint, stream_pruned, verify_streamed
from slimwise.models import load_config, load_model


def stored(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                out[name] = f.get_tensor(name)
    return out


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same_checkpoint(in_memory: Path, streamed: Path, n_keep: int) -> None:
    """Same tensors byte for byte, same configs and plan, expert counts n_keep, equal loaded state dicts."""
    a, b = stored(in_memory), stored(streamed)
    assert sorted(a) == sorted(b)
    for name in a:
        assert (a[name].dtype, a[name].shape) == (b[name].dtype, b[name].shape), name
        assert raw(a[name]) == raw(b[name]), name
    for name in ("config.json", "generation_config.json", "slimwise_plan.json"):
        assert json.loads((in_memory / name).read_text()) == json.loads((streamed / name).read_text()), name
    for path in (in_memory, streamed):
        config = load_config(path)
        assert get_adapter(config).num_experts(config) == n_keep
    manifests = [json.loads((p / "slimwise_manifest.json").read_text()) for p in (in_memory, streamed)]
    source = manifests[1].pop("source_fingerprint")
    assert source.items() <= manifests[0].pop("source_fingerprint").items()
    assert manifests[0] == manifests[1]
    state_a, state_b = load_model(in_memory).state_dict(), load_model(streamed).state_dict()
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        assert state_a[name].dtype == state_b[name].dtype and torch.equal(state_a[name], state_b[name]), name


def both_exports(src: Path, tmp_path: Path, dtype: str = "auto", **stream_kw):
    plan = random_plan(load_model(src, dtype=dtype), 0.5, seed=1)
    export_pruned(load_model(src, dtype=dtype), plan, tmp_path / "in-memory", source_dir=src)
    done = stream_pruned(src, plan, tmp_path / "streamed", dtype=dtype, **stream_kw)
    assert done.path == tmp_path / "streamed" and done.tensors == len(stored(done.path))
    return plan, done


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_streamed_export_equals_the_in_memory_export(family, tiny_dirs, tmp_path):
    src = tiny_dirs(family)
    plan, done = both_exports(src, tmp_path)
    assert done.shards == 1 and done.dropped == ()
    names = [sorted(p.name for p in path.iterdir()) for path in (done.path, tmp_path / "in-memory")]
    assert names[0] == names[1]
    assert_same_checkpoint(tmp_path / "in-memory", done.path, plan.num_kept)


def _save(family: str, path: Path, dtype=torch.float32, save_kw=None, **overrides) -> Path:
    build_tiny_model(family, dtype=dtype, initializer_range=TINY_INIT, **overrides).save_pretrained(
        path, **(save_kw or {}))
    return path


LAYOUTS = {
    # stored fused (transformers' own layout, not converted back on save): written fused, rows sliced
    "qwen3_moe-fused": dict(family="qwen3_moe", save_kw={"save_original_format": False}),
    "qwen3_moe-tied": dict(family="qwen3_moe", tie_word_embeddings=True),
    # e_score_correction_bias is kept in float32 when the model loads in bf16
    "deepseek_v3-bf16": dict(family="deepseek_v3", dtype=torch.bfloat16),
    "deepseek_v3-as-bf16": dict(family="deepseek_v3", load="bfloat16"),
    # GPT-OSS keeps its norms in float32 when it loads in float16
    "gpt_oss-as-fp16": dict(family="gpt_oss", load="float16"),
    "qwen3_moe-as-bf16": dict(family="qwen3_moe", load="bfloat16"),
}


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_stored_layouts_and_dtypes(case, tmp_path, monkeypatch):
    spec = dict(LAYOUTS[case])
    load = spec.pop("load", "auto")
    src = _save(spec.pop("family"), tmp_path / "source", **spec)
    monkeypatch.setattr(export_stream, "CHUNK_BYTES", 1000)  # many chunks per tensor, casts across chunks
    plan, done = both_exports(src, tmp_path, dtype=load)
    assert_same_checkpoint(tmp_path / "in-memory", done.path, plan.num_kept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multimodal_checkpoint_keeps_its_prefix_and_drops_the_vision_tower(dtype, tmp_path):
    """A published Qwen3.5-MoE checkpoint (model.language_model.*, a vision tower) exports as the text-only
    model the in-memory path loads and saves: prefixed weights, no vision tensors. Its text config carries no
    dtype: "auto" is the stored weights' (bf16 here too)."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen3_5MoeForConditionalGeneration(tiny_config("qwen3_5_moe")).to(dtype)
    model.save_pretrained(tmp_path / "source")
    plan, done = both_exports(tmp_path / "source", tmp_path)
    assert done.dropped and all("visual" in name for name in done.dropped)
    assert all(name.startswith(("model.language_model.", "lm_head.")) for name in stored(done.path))
    assert {t.dtype for t in stored(done.path).values()} == {dtype}
    assert_same_checkpoint(tmp_path / "in-memory", done.path, plan.num_kept)


def test_sharded_source_streams_into_a_sharded_checkpoint_with_an_index(tmp_path):
    src = _save("mixtral", tmp_path / "source", save_kw={"max_shard_size": "300KB"})
    assert len(list(src.glob("*.safetensors"))) >= 2 and (src / "model.safetensors.index.json").is_file()
    plan, done = both_exports(src, tmp_path, max_shard_bytes=250_000)
    shards = sorted(p.name for p in done.path.glob("*.safetensors"))
    assert done.shards == len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((done.path / "model.safetensors.index.json").read_text())
    tensors = stored(done.path)
    assert sorted(index["weight_map"]) == sorted(tensors) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for name in shards:  # bounded, unless a tensor alone is larger
        with safe_open(done.path / name, framework="pt") as f:
            sizes = [f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()]  # noqa: SIM118
        assert sum(sizes) <= 250_000 or len(sizes) == 1
    assert_same_checkpoint(tmp_path / "in-memory", done.path, plan.num_kept)


# ----- refusals and fallbacks -------------------------------------------------------------------------------

def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and text
    return text


def _nothing_written(out: Path) -> None:
    assert not out.exists()
    if out.parent.is_dir():
        assert not list(out.parent.glob(f".{out.name}.*"))


def test_a_plan_for_other_weights_is_refused_before_anything_is_written(tiny_dirs, tmp_path):
    src = tiny_dirs("qwen3_moe")
    other = _save("qwen3_moe", tmp_path / "other", seed=1)
    plan = random_plan(load_model(other), 0.5, seed=1)
    out = tmp_path / "out" / "pruned"
    with pytest.raises(SlimWiseError) as exc:
        stream_pruned(src, plan, out)
    assert _one_line(exc).startswith("plan fingerprint") and "other weights" in str(exc.value)
    _nothing_written(out)
    assert not out.parent.exists()


def test_bad_output_directories_are_refused(tiny_dirs, tmp_path):
    src = tiny_dirs("olmoe")
    plan = random_plan(load_model(src), 0.5, seed=1)
    with pytest.raises(SlimWiseError) as exc:
        stream_pruned(src, plan, src / "pruned")
    assert "inside the source model" in _one_line(exc)
    _nothing_written(src / "pruned")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine\n")
    with pytest.raises(SlimWiseError) as exc:
        stream_pruned(src, plan, tmp_path / "taken")
    assert "exists and is not empty" in _one_line(exc)
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]
    (tmp_path / "afile").write_text("a file\n")
    with pytest.raises(SlimWiseError) as exc:
        stream_pruned(src, plan, tmp_path / "afile" / "pruned")
    assert "is a file" in _one_line(exc)
    assert (tmp_path / "afile").read_text() == "a file\n"


def test_truncated_source_is_refused_in_one_line(tiny_dirs, tmp_path):
    src = tmp_path / "source"
    shutil.copytree(tiny_dirs("qwen2_moe"), src)
    plan = random_plan(load_model(src), 0.5, seed=1)
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(SlimWiseError) as exc:
        stream_pruned(src, plan, tmp_path / "pruned")
    assert "truncated or corrupt" in _one_line(exc)
    _nothing_written(tmp_path / "pruned")


def test_the_check_finds_a_changed_byte(tiny_dirs, tmp_path):
    src = tiny_dirs("qwen3_moe")
    plan = random_plan(load_model(src), 0.5, seed=1)
    out = stream_pruned(src, plan, tmp_path / "pruned").path
    verify_streamed(out, src, plan)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    with safe_open(out / "model.safetensors", framework="pt") as f:
        value = f.get_tensor(name)
    data = bytearray((out / "model.safetensors").read_bytes())
    at = data.find(raw(value))
    assert at > 0
    data[at + 5] ^= 0x01
    (out / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(SlimWiseError) as exc:
        verify_streamed(out, src, plan)
    assert _one_line(exc).startswith("export check failed") and name in str(exc.value)


def test_a_plan_without_a_files_checksum_is_exported_in_memory(tiny_dirs, tmp_path):
    """Only the loaded model can be checked against a plan that carries the weights' checksum alone:
    streaming refuses before writing, and `export_checkpoint` says so and exports in memory."""
    src = tiny_dirs("mixtral")
    plan = random_plan(load_model(src), 0.5, seed=1)
    plan.fingerprint.pop("files_sha256")
    with pytest.raises(StreamingUnsupported):
        stream_pruned(src, plan, tmp_path / "never")
    _nothing_written(tmp_path / "never")
    notes = []
    out = export_checkpoint(src, plan, tmp_path / "pruned", note=notes.append)
    assert len(notes) == 1 and notes[0].startswith("streaming export not possible (the plan carries")
    assert "weights_sha256" in json.loads((out / "slimwise_manifest.json").read_text())["source_fingerprint"]
    export_pruned(load_model(src), plan, tmp_path / "in-memory", source_dir=src)
    assert_same_checkpoint(tmp_path / "in-memory", out, plan.num_kept)


def test_cli_prune_streams_and_dry_run_loads_nothing(tiny_dirs, tmp_path, capsys):
    src = tiny_dirs("gpt_oss")
    plan = random_plan(load_model(src), 0.5, seed=1)
    plan.save(tmp_path / "plan.json")
    args = ["prune", str(src), "--plan", str(tmp_path / "plan.json"), "--out", str(tmp_path / "pruned")]
    assert main([*args, "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("slimwise prune ")
    _nothing_written(tmp_path / "pruned")
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "streaming export not possible" not in printed and "verified against the source" in printed
    manifest = json.loads((tmp_path / "pruned" / "slimwise_manifest.json").read_text())
    assert "weights_sha256" not in manifest["source_fingerprint"]  # the streamed path wrote it
    export_pruned(load_model(src), plan, tmp_path / "in-memory", source_dir=src)
    assert_same_checkpoint(tmp_path / "in-memory", tmp_path / "pruned", plan.num_kept)
