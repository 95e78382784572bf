"""Quantized checkpoints: `slimwise prune` slices FP8 block-wise and compressed-tensors checkpoints from their
files (scales, zero points and packed weights travel with their expert), and the pruned checkpoint loads in
transformers as the original does, giving the masked model's tokens.

Fixtures (tests/quantized.py) are built from testbed-a's weights, nothing downloaded: FP8 with several block
sizes (32x32, 128x128 = larger than every matrix, and 48x40, which divides none), compressed-tensors W4A16
(int4 packed, groups of 32) and W8A8 (int8 per channel). What transformers 5.19 does with each on the CPU:
FP8 is dequantized on load (into the dtype it loads in), W4A16 is decompressed on load; FP8 with blocks that
do not divide a weight does not load (its dequantizer requires the scale grid to divide the weight's shape),
nor do W8A8 (`int-quantized`) MoE experts (their per-expert int8 `weight` keys meet no conversion): those
pruned files are checked tensor by tensor, not loaded.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from quantized import compressed_checkpoint, fp8_checkpoint
from safetensors.torch import load_file

from slimwise.baseline_plans import random_plan
from slimwise.cli import main
from slimwise.embedded import embedded_model_dir
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.errors import SlimWiseError
from slimwise.export import load_pruned
from slimwise.export_stream import stream_pruned
from slimwise.models import load_config, load_model, load_tokenizer
from slimwise.testbed import export_jsonl, make_split

BUILDERS = {
    "fp8-32x32": lambda src, out: fp8_checkpoint(src, out, (32, 32)),
    "fp8-128x128": lambda src, out: fp8_checkpoint(src, out, (128, 128)),
    "fp8-48x40": lambda src, out: fp8_checkpoint(src, out, (48, 40)),
    "w4a16": lambda src, out: compressed_checkpoint(src, out, "W4A16", group_size=32),
    "w8a8": lambda src, out: compressed_checkpoint(src, out, "W8A8"),
}
LOADS_IN_TRANSFORMERS = ("fp8-32x32", "fp8-128x128", "w4a16")
_LAYER = re.compile(r"\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^(?P<prefix>.*\.layers\.(?P<layer>\d+)\..*\.experts)\.(?P<expert>\d+)\.(?P<rest>.+)$")


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory):
    root, built = tmp_path_factory.mktemp("quantized"), {}

    def get(fmt: str) -> Path:
        if fmt not in built:
            built[fmt] = BUILDERS[fmt](embedded_model_dir("testbed-a"), root / fmt)
        return built[fmt]

    return get


def structure_plan(seed: int = 3):
    """A 50% plan for testbed-a's structure with no weights checksum (the files are the quantized copy's)."""
    plan = random_plan(load_model(embedded_model_dir("testbed-a"), dtype="float32"), 0.5, seed=seed)
    plan.fingerprint = None
    return plan


def source_of(name: str, plan) -> str:
    """The original tensor a pruned checkpoint's tensor was copied from."""
    match = _EXPERT.match(name)
    if match is None or int(match["layer"]) not in plan.kept_experts:
        return name
    return f"{match['prefix']}.{plan.kept(int(match['layer']))[int(match['expert'])]}.{match['rest']}"


@pytest.mark.parametrize("fmt", list(BUILDERS))
def test_pruned_tensors_are_the_kept_slices_scales_included(fmt, quantized_dir, tmp_path):
    src = quantized_dir(fmt)
    plan = structure_plan()
    out = stream_pruned(src, plan, tmp_path / "pruned").path
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    kept_names = {source_of(n, plan) for n in after}
    dropped = {n for n in before if n not in kept_names}
    # exactly the pruned experts' tensors are gone: weights and every scale / packed tensor with them
    assert dropped and all(_EXPERT.match(n) for n in dropped)
    suffixes = {n.rsplit(".", 1)[1] for n in dropped}
    if fmt.startswith("fp8"):
        assert suffixes == {"weight", "weight_scale_inv"}
    else:
        assert suffixes > {"weight_scale"}
    assert len(dropped) == len(before) - len(after)
    for name, tensor in after.items():
        original = before[source_of(name, plan)]
        if original.shape != tensor.shape:  # the router: the kept experts' rows
            assert name.endswith("mlp.gate.weight"), name
            original = original[plan.kept(int(_LAYER.search(name).group(1)))]
        assert tensor.dtype == original.dtype and tensor.shape == original.shape, name
        assert torch.equal(tensor.view(-1).view(torch.uint8), original.view(-1).view(torch.uint8)), name
    config, pruned_config = (json.loads((d / "config.json").read_text()) for d in (src, out))
    assert pruned_config["quantization_config"] == config["quantization_config"]
    assert pruned_config["num_experts"] == plan.num_kept
    method = config["quantization_config"]["quant_method"]
    assert load_config(out).quantization_config["quant_method"] == method


@pytest.mark.parametrize("fmt", ["fp8-32x32", "w4a16"])
def test_dry_run_sizes_the_output_as_stored(fmt, quantized_dir, tmp_path):
    """`prune --dry-run` on a quantized checkpoint: the output's bytes from the stored tensors (quantized
    weights and scales), equal to what the export then writes, and no in-memory fallback offered."""
    from slimwise.footprint import footprint

    plan = structure_plan()
    fp = footprint(quantized_dir(fmt), "prune", ratio=0.5)
    written = stream_pruned(quantized_dir(fmt), plan, tmp_path / "pruned").bytes
    disk = next(n for n in fp.notes if n.startswith("disk:"))
    assert f"about {written:,} bytes" in disk, (disk, written)
    assert any("never exported in memory" in n for n in fp.notes)


def _prompts(n: int) -> list[str]:
    return [s.prompt for s in make_split("test", 1)][:n]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", LOADS_IN_TRANSFORMERS)
def test_calibrate_plan_prune_and_the_pruned_checkpoint_gives_the_masked_tokens(fmt, quantized_dir, tmp_path,
                                                                                capsys):
    """The user's path on a quantized checkpoint: calibrate it (transformers dequantizes it on the CPU), plan,
    prune from the files; the pruned checkpoint loads in transformers and decodes the masked model's tokens,
    alone (uniform) and as SlimWise's decode model."""
    src = quantized_dir(fmt)
    export_jsonl(make_split("calib", 1), tmp_path / "calib.jsonl")
    # float32 here and below: transformers dequantizes into the dtype it loads in, and a plan is checked
    # against the weights it was calibrated on
    assert main(["calibrate", str(src), "--dtype", "float32", "--data", str(tmp_path / "calib.jsonl"),
                 "--max-samples", "16",
                 "--max-new-tokens", "8", "--out", str(tmp_path / "stats.safetensors")]) == 0
    assert main(["plan", "--stats", str(tmp_path / "stats.safetensors"), "--ratio", "0.5",
                 "--out", str(tmp_path / "plan.json")]) == 0
    assert main(["prune", str(src), "--plan", str(tmp_path / "plan.json"),
                 "--out", str(tmp_path / "pruned")]) == 0
    printed = capsys.readouterr().out
    assert "in memory" not in printed and "verified against the source" in printed
    model, tok = load_model(src, dtype="float32"), load_tokenizer(src)
    pruned, plan = load_pruned(tmp_path / "pruned", dtype="float32")
    assert plan is not None and pruned.config.num_experts == plan.num_kept
    prompts, greedy = _prompts(8), GenerationConfig(max_new_tokens=16)

    def tokens(engine, mode):
        return [o.token_ids for o in engine.generate(prompts, mode, greedy)]

    masked = PhaseSplitEngine(model, tok, plan=plan)
    assert tokens(PhaseSplitEngine(pruned, tok), "full") == tokens(masked, "uniform")
    sliced = PhaseSplitEngine(model, tok, plan=plan, decode_model=pruned)
    assert tokens(sliced, "slimwise") == tokens(masked, "slimwise") != tokens(masked, "full")
    if fmt == "fp8-32x32":  # distillation trains on the dequantized model as on any other
        from slimwise.distill import DistillConfig, distill

        delta = distill(model, plan, prompts[:4], tok,
                        DistillConfig(steps=2, batch_size=4, max_new_tokens=8, progress=False))
        losses = delta.manifest["loss_history"]
        assert len(losses) == 2 and all(0 < x < 100 for x in losses)


def _with_quantization_lists(src: Path, dst: Path, **lists) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].update(lists)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_module_lists_follow_the_renumbered_experts(quantized_dir, tmp_path):
    """Literal module names of experts in `modules_to_not_convert` / `ignore` / `targets`: a pruned expert's
    are dropped, a kept one's renumbered; other names, and regexes that do not select experts by number,
    stay."""
    plan = structure_plan()
    kept, pruned = plan.kept(1)[5], next(e for e in range(plan.num_experts) if e not in plan.kept(1))
    names = [f"model.layers.1.mlp.experts.{kept}.down_proj", f"model.layers.1.mlp.experts.{pruned}.up_proj",
             f"model.layers.1.mlp.experts.{kept}", "lm_head", r"re:.*mlp\.gate$"]
    src = _with_quantization_lists(quantized_dir("fp8-32x32"), tmp_path / "src", modules_to_not_convert=names)
    out = stream_pruned(src, plan, tmp_path / "pruned").path
    written = json.loads((out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert written == ["model.layers.1.mlp.experts.5.down_proj", "model.layers.1.mlp.experts.5", "lm_head",
                       r"re:.*mlp\.gate$"]
    ct = quantized_dir("w8a8")
    groups = json.loads((ct / "config.json").read_text())["quantization_config"]["config_groups"]
    groups["group_0"]["targets"] = ["Linear", f"model.layers.1.mlp.experts.{kept}.gate_proj"]
    src = _with_quantization_lists(ct, tmp_path / "ct", config_groups=groups)
    out = stream_pruned(src, plan, tmp_path / "ct-pruned").path
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    want = ["Linear", "model.layers.1.mlp.experts.5.gate_proj"]
    assert config["config_groups"]["group_0"]["targets"] == want


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_what_cannot_be_pruned_from_the_files_is_refused_before_writing(quantized_dir, tmp_path, capsys):
    plan = structure_plan()
    src = _with_quantization_lists(quantized_dir("w8a8"), tmp_path / "regex",
                                   ignore=["lm_head", r"re:.*experts\.1\d\.down_proj$"])
    with pytest.raises(SlimWiseError) as exc:
        stream_pruned(src, plan, tmp_path / "out")
    assert "selects experts by number" in _one_line(exc)
    for args, why in ((["--dtype", "float32"], "drop --dtype"),
                      (["--distilled", str(tmp_path)], "distilled delta cannot be exported")):
        plan.save(tmp_path / "plan.json")
        assert main(["prune", str(quantized_dir("fp8-32x32")), "--plan", str(tmp_path / "plan.json"), *args,
                     "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
    with pytest.raises(SlimWiseError) as exc:  # transformers 5.19 has no conversion for its int8 experts
        load_model(quantized_dir("w8a8"))
    assert "transformers cannot load the compressed-tensors checkpoint" in _one_line(exc)
    gptq = _with_quantization_lists(quantized_dir("fp8-32x32"), tmp_path / "gptq", quant_method="gptq")
    with pytest.raises(SlimWiseError) as exc:
        stream_pruned(gptq, plan, tmp_path / "out")
    assert "quantized with 'gptq'" in _one_line(exc) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["fp8-32x32", "w4a16", "w8a8"])
def test_the_bench_counts_expert_bytes_as_stored(fmt, quantized_dir):
    """`slimwise bench` reports expert bytes read per step as expert count x `expert_params * expert_bytes`
    of `RooflineConfig.from_dir`: for a quantized checkpoint that product is one expert's stored bytes,
    quantized weights and scales (here every expert is stored alike), not the bf16 size."""
    from safetensors import safe_open

    from slimwise.perf.roofline import RooflineConfig

    path = quantized_dir(fmt)
    rc, bf16 = RooflineConfig.from_dir(path), RooflineConfig.from_dir(embedded_model_dir("testbed-a"))
    one_expert = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            if ".layers.0.mlp.experts.0." in name:
                t = f.get_tensor(name)
                one_expert += t.numel() * t.element_size()
    assert rc.expert_params == bf16.expert_params
    assert rc.expert_params * rc.expert_bytes == pytest.approx(one_expert, rel=1e-12)
    assert bf16.linear_bytes is None and bf16.expert_params * bf16.expert_bytes == 2 * bf16.expert_params
    assert one_expert < bf16.expert_params * bf16.expert_bytes
