"""Caches keyed by content, never by a path: the disaggregated decode checkpoint export, the decode
gates file, and the hf_overrides that vLLM's compile cache keys on."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_INIT, random_prompts
from safetensors.torch import load_file
from tiny import save_tiny_model

from slimwise.calibrate import CalibrationConfig, calibrate
from slimwise.criteria import plan_from_stats
from slimwise.distill import DistillConfig, init_delta
from slimwise.export_stream import export_checkpoint
from slimwise.fingerprint import content_sha256
from slimwise.models import load_model
from slimwise.plan import PrunePlan
from slimwise.serving.config import ServeConfig
from slimwise.serving.overrides import pruned_gates_overrides, slimwise_overrides
from slimwise.serving.server import (
    EXPORT_MARKER,
    _decode_checkpoint,
    _decode_gates_file,
    checkpoint_identity,
    decode_cache_summary,
    decode_export_key,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(root, tiny qwen3_moe checkpoint, its 50% REAP plan, two different deltas for that plan)."""
    root = tmp_path_factory.mktemp("content_keys")
    src = save_tiny_model("qwen3_moe", root / "src", initializer_range=TINY_INIT)
    model = load_model(src)
    stats = calibrate(model, random_prompts(8, seed=1),
                      config=CalibrationConfig(max_new_tokens=8, batch_size=4), progress=False)
    plan = plan_from_stats(stats, "reap", 0.5)
    deltas = []
    for seed in (0, 1):  # what two distillations would give: every tensor moved, differently
        delta = init_delta(model, plan, DistillConfig(params=("router", "norm", "lora")))
        g = torch.Generator().manual_seed(seed)
        for t in delta.tensors.values():
            t.add_(torch.randn(t.shape, generator=g) * 0.5 * (t.abs().mean() + 0.05))
        deltas.append(delta)
    return root, src, plan, deltas


def swapped(plan: PrunePlan) -> PrunePlan:
    """The plan with its first layer's first kept expert swapped for its first pruned one."""
    layer, kept = min(plan.kept_experts.items())
    pruned = next(e for e in range(plan.num_experts) if e not in kept)
    return dataclasses.replace(plan, kept_experts={**plan.kept_experts, layer: [pruned, *kept[1:]]})


def weights(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_redistilling_into_the_same_directory_exports_the_new_delta(setup, tmp_path, capsys):
    root, src, plan, (first, second) = setup
    cache = tmp_path / "cache"
    cfg = ServeConfig(model=str(src), delta=str(tmp_path / "delta"), decode_cache_dir=str(cache))
    first.save(tmp_path / "delta")
    out1 = _decode_checkpoint(cfg, plan)
    assert Path(out1).parent == cache / "pruned" and (Path(out1) / EXPORT_MARKER).is_file()
    old = weights(out1)
    capsys.readouterr()
    second.save(tmp_path / "delta", force=True)  # `slimwise distill` again, into the same directory
    out2 = _decode_checkpoint(cfg, plan)
    assert out2 != out1 and "exporting" in capsys.readouterr().out
    # the served weights are the new delta's: what a fresh export of it gives, not the old ones
    fresh = export_checkpoint(src, plan, tmp_path / "fresh", delta=str(tmp_path / "delta"), note=print)
    new = weights(out2)
    assert same_weights(new, weights(fresh)) and not same_weights(new, old)
    marker = json.loads((Path(out2) / EXPORT_MARKER).read_text())
    assert marker["key"] == decode_export_key(cfg, plan)[0]
    assert marker["inputs"]["delta"] == content_sha256(tmp_path / "delta")
    # the start-up line: where the cache is, its exports and their size; nothing deleted
    line = decode_cache_summary(cfg)
    assert line.startswith(f"{cache}: 2 decode exports, ") and "GiB on disk" in line
    assert sorted(p.name for p in (cache / "pruned").iterdir()) == sorted([Path(out1).name, Path(out2).name])
    assert decode_cache_summary(ServeConfig(model="m", decode_cache_dir=str(tmp_path / "none"))).startswith(
        f"{tmp_path / 'none'}: 0 decode exports, 0.00 GiB")
    assert ServeConfig(model="m").decode_cache_dir == "~/.cache/slimwise"


def test_the_same_content_at_other_paths_reuses_the_export(setup, tmp_path, capsys):
    root, src, plan, (first, _) = setup
    cache = tmp_path / "cache"
    first.save(tmp_path / "delta")
    out = _decode_checkpoint(ServeConfig(model=str(src), delta=str(tmp_path / "delta"),
                                         decode_cache_dir=str(cache)), plan)
    marker = (Path(out) / EXPORT_MARKER).stat().st_mtime_ns
    capsys.readouterr()
    # the model and the delta copied elsewhere, under other names (copy, not copy2: other modification times)
    model_copy = shutil.copytree(src, tmp_path / "another-name", copy_function=shutil.copy)
    delta_copy = shutil.copytree(tmp_path / "delta", tmp_path / "elsewhere" / "d", copy_function=shutil.copy)
    assert checkpoint_identity(model_copy) == checkpoint_identity(src)
    again = _decode_checkpoint(ServeConfig(model=str(model_copy), delta=str(delta_copy / "delta.safetensors"),
                                           decode_cache_dir=str(cache)), plan)
    assert again == out and "exporting" not in capsys.readouterr().out
    assert (Path(out) / EXPORT_MARKER).stat().st_mtime_ns == marker
    # a change to the model's content is another key: here its generation config
    (model_copy / "generation_config.json").write_text(json.dumps({"max_length": 7}))
    assert checkpoint_identity(model_copy) != checkpoint_identity(src)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_an_interrupted_export_is_not_reused(setup, tmp_path, capsys):
    root, src, plan, _ = setup
    cache = tmp_path / "cache"
    cfg = ServeConfig(model=str(src), decode_cache_dir=str(cache))
    key, _ = decode_export_key(cfg, plan)
    folder = cache / "pruned"
    out = folder / f"qwen3_moe-{key[:16]}"
    # what an export killed mid-way by an older SlimWise left under the real name: config.json, broken weights
    out.mkdir(parents=True)
    shutil.copy(src / "config.json", out / "config.json")
    (out / "model.safetensors").write_bytes(b"\0" * 64)
    # and a temporary of a killed export beside it
    stale = folder / f".{out.name}.tmp-{_dead_pid()}"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    assert _decode_checkpoint(cfg, plan) == str(out)
    assert "exporting" in capsys.readouterr().out and not stale.exists()
    fresh = export_checkpoint(src, plan, tmp_path / "fresh", note=print)
    assert same_weights(weights(out), weights(fresh))
    assert sorted(p.name for p in folder.iterdir()) == [out.name]  # no temporaries left
    # a marker naming another key (say, written by hand or a copy) is not reused either
    (out / EXPORT_MARKER).write_text(json.dumps({"key": "0" * 64}))
    (out / "model.safetensors").write_bytes(b"\0" * 64)
    _decode_checkpoint(cfg, plan)
    assert same_weights(weights(out), weights(fresh))
    assert json.loads((out / EXPORT_MARKER).read_text())["key"] == key


def test_the_gates_file_is_keyed_by_content(setup, tmp_path):
    root, src, plan, _ = setup
    cfg = ServeConfig(model=str(src), gates="drop", decode_cache_dir=str(tmp_path / "cache"))
    gates = _decode_gates_file(cfg, plan)
    assert gates.parent == tmp_path / "cache" / "gates" and gates.is_file()
    copy = shutil.copytree(src, tmp_path / "copy", copy_function=shutil.copy)
    assert _decode_gates_file(ServeConfig(model=str(copy), gates="drop",
                                          decode_cache_dir=str(tmp_path / "cache")), plan) == gates
    other = swapped(plan)
    assert _decode_gates_file(cfg, other) != gates


def test_overrides_carry_content_hashes(setup, tmp_path):
    root, src, plan, (first, second) = setup
    path = tmp_path / "plan.json"
    plan.save(path)
    first.save(tmp_path / "delta")
    stats = tmp_path / "stats.safetensors"
    stats.write_bytes(b"statistics v1")
    before = slimwise_overrides(src, path, delta=tmp_path / "delta")
    assert before["slimwise_plan_sha256"] == content_sha256(path)
    assert before["slimwise_delta_sha256"] == content_sha256(tmp_path / "delta")
    # another plan written at the same path: the same path, another hash (so another hf_config)
    other = swapped(plan)
    other.save(path)
    after = slimwise_overrides(src, path, delta=tmp_path / "delta")
    assert after["slimwise_plan"] == before["slimwise_plan"]
    assert after["slimwise_plan_sha256"] != before["slimwise_plan_sha256"]
    second.save(tmp_path / "delta", force=True)
    redistilled = slimwise_overrides(src, path, delta=tmp_path / "delta")
    assert redistilled["slimwise_delta_sha256"] != after["slimwise_delta_sha256"]
    # named plans, substitution statistics and a pruned checkpoint's gates file too
    named = slimwise_overrides(src, {"a": path, "b": plan}, default_plan="a")
    assert named["slimwise_plans_sha256"] == {"a": content_sha256(path)}  # "b" is given as its content
    from slimwise.decode_gates import DecodeGates

    subst = slimwise_overrides(src, path, gates=DecodeGates("substitute", 0.0, str(stats)))
    stats.write_bytes(b"statistics v2")
    assert slimwise_overrides(src, path, gates=DecodeGates("substitute", 0.0, str(stats)))[
        "slimwise_substitutes_sha256"] != subst["slimwise_substitutes_sha256"]
    assert pruned_gates_overrides(src, stats)["slimwise_pruned_gates_sha256"] == content_sha256(stats)
    # the same content at another path: the same hash
    shutil.copy(path, tmp_path / "copy.json")
    copied = slimwise_overrides(src, tmp_path / "copy.json")
    assert copied["slimwise_plan_sha256"] == after["slimwise_plan_sha256"]
    # the SlimWise classes read their keys by name: the hashes beside them change nothing they load
    from transformers import PretrainedConfig

    from slimwise.serving.routing import load_plans

    config = PretrainedConfig(**after)
    plans, default = load_plans(config, config)
    assert plans[default].kept_experts == other.kept_experts


def test_hf_config_keys_reach_vllms_config_hash(setup):
    """vLLM renders hf_config into `ModelConfig.compute_hash` with `normalize_value` (vllm/config/utils.py):
    a changed `slimwise_*_sha256` key changes it (hf_overrides itself is not hashed)."""
    pytest.importorskip("vllm")
    from transformers import PretrainedConfig
    from vllm.config.model import ModelConfig
    from vllm.config.utils import normalize_value

    assert "hf_config" in {f.name for f in ModelConfig.__dataclass_fields__.values()}
    one, two = ({"slimwise_plan": "/p.json", "slimwise_plan_sha256": h} for h in ("a" * 64, "b" * 64))
    assert normalize_value(PretrainedConfig(**one)) != normalize_value(PretrainedConfig(**two))
    assert normalize_value(PretrainedConfig(**one)) == normalize_value(PretrainedConfig(**dict(one)))
