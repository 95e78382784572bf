"""Export a plan as a standard pruned checkpoint that stock transformers and stock vLLM load.

Expert tensors and router rows (and biases) are sliced to the kept experts, renumbered 0..N'-1, and every
expert-count field the family's loaders read is set to N'. The plan and a manifest mapping new ids to
original ids are written beside the weights. The result is written to a temporary directory, reloaded and
checked expert by expert against the source, and only then renamed into place. With a distilled delta
(`slimwise.distill`), the delta is folded in first (trained router rows and norms, merged LoRA): the result is
the pruned-and-distilled decoder, to serve as the decode instance behind the full model's prefill.

This is the in-memory path: it needs the loaded model. `slimwise prune` streams the same checkpoint from the
safetensors files instead (`slimwise.export_stream`) and comes here only for a distilled delta or a checkpoint
streaming cannot reproduce exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from slimwise.adapters import get_adapter
from slimwise.delta import fold_delta
from slimwise.errors import SlimWiseError
from slimwise.fingerprint import model_fingerprint
from slimwise.io import atomic_dir, refuse_existing
from slimwise.models import MANIFEST_FILE, PLAN_FILE, read_manifest
from slimwise.plan import PrunePlan

#: files copied from the source directory beside the weights (unless the writer already wrote one of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "chat_template.jinja", "generation_config.json")


def check_output_dir(out_dir: Path, source_dir: Path | None, force: bool) -> None:
    """Refuse to write inside the source model or over a non-empty directory without force."""
    out = out_dir.resolve()
    if source_dir is not None:
        src = Path(source_dir).resolve()
        if out == src or src in out.parents:
            raise SlimWiseError(f"output {out_dir} is inside the source model {source_dir}; "
                                "write the pruned checkpoint somewhere else")
    refuse_existing(out_dir, force)


def export_pruned(model: nn.Module, plan: PrunePlan, out_dir: str | Path, *, tokenizer=None,
                  source_dir: str | Path | None = None, force: bool = False, delta=None) -> Path:
    """Slice `model` (modified in place: pass a copy you no longer need) to `plan` and save it to out_dir.

    `delta` (a `slimwise.delta.Delta` or its directory, distilled for this model and plan) is folded in
    before slicing; the manifest's "delta" field then describes it."""
    out_dir = Path(out_dir)
    source_dir = Path(source_dir) if source_dir else (Path(model.slimwise_source_dir)
                                                      if hasattr(model, "slimwise_source_dir") else None)
    adapter = get_adapter(model.config)
    plan.validate(adapter.min_kept_per_group(model.config))
    plan.check_model(model, adapter)
    n_keep = plan.num_kept  # refuses non-uniform plans
    check_output_dir(out_dir, source_dir, force)
    source_fp = model_fingerprint(model)
    delta_info = None
    if delta is not None:
        delta_info = fold_delta(model, delta, plan)  # checks the delta against the unmodified weights first

    originals: dict[int, dict[str, torch.Tensor]] = {}
    for layer in adapter.moe_layers(model):
        keep = torch.tensor(plan.kept(layer.index), dtype=torch.long)
        originals[layer.index] = {f"experts.{k}": v for k, v in layer.experts.state_dict().items()}
        originals[layer.index] |= {f"router.{k}": v for k, v in layer.router.state_dict().items()}
        adapter.slice_layer(layer, keep)
    adapter.set_num_experts(model.config, n_keep)

    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        cfg_path = tmp / "config.json"
        cfg = adapter.config_dict_fixups(json.loads(cfg_path.read_text()), n_keep)
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        elif source_dir is not None:
            copy_tokenizer_files(source_dir, tmp)
        write_plan_and_manifest(tmp, plan, source_fp, source_dir, delta_info)
        verify_export(tmp, plan, originals)
    return out_dir


def copy_tokenizer_files(source_dir: str | Path, out_dir: Path) -> None:
    """Copy the source's tokenizer (and generation config) files that `out_dir` does not have yet."""
    source_dir = Path(source_dir)
    for name in TOKENIZER_FILES:
        if (source_dir / name).is_file() and not (out_dir / name).exists():
            shutil.copy2(source_dir / name, out_dir / name)


def write_plan_and_manifest(out_dir: Path, plan: PrunePlan, source_fingerprint: dict | None,
                            source_dir: str | Path | None, delta_info: dict | None = None) -> None:
    """The plan beside the weights and the manifest (`slimwise-pruned/1`): the source's fingerprint, the
    kept original ids of every layer (new id i is the i-th of them) and the folded delta, if any. The one
    writer of both files, whichever export wrote the weights."""
    plan.save(out_dir / PLAN_FILE)
    manifest = {
        "format": "slimwise-pruned/1",
        "source_fingerprint": source_fingerprint,
        "source_dir": str(source_dir) if source_dir else None,
        "source_num_experts": plan.num_experts,
        "num_experts": plan.num_kept,
        "kept_original_ids": {str(k): v for k, v in plan.kept_experts.items()},
        "delta": delta_info,
    }
    (out_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")


def verify_export(path: Path, plan: PrunePlan, originals: dict[int, dict[str, torch.Tensor]]) -> None:
    """Reload the written checkpoint and compare every kept expert (and router row) with the source."""
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype="auto", local_files_only=True)
    adapter = get_adapter(reloaded.config)
    n_keep = plan.num_kept
    if adapter.num_experts(reloaded.config) != n_keep:
        raise SlimWiseError(
            f"export check failed: reloaded config has {adapter.num_experts(reloaded.config)} "
            f"experts, expected {n_keep}"
        )
    layers = adapter.moe_layers(reloaded)
    if {layer.index for layer in layers} != set(originals):
        raise SlimWiseError("export check failed: the reloaded model has different MoE layers")
    for layer in layers:
        kept = torch.tensor(plan.kept(layer.index))
        now = {f"experts.{k}": v for k, v in layer.experts.state_dict().items()}
        now |= {f"router.{k}": v for k, v in layer.router.state_dict().items()}
        for name, src in originals[layer.index].items():
            got = now.get(name)
            want = src.index_select(0, kept) if src.dim() > 0 and src.shape[0] == plan.num_experts else src
            if got is None or got.shape != want.shape or not torch.equal(got.to(want.dtype), want):
                raise SlimWiseError(
                    f"export check failed: layer {layer.index} {name} does not match the source's "
                    "kept experts; the checkpoint was not written"
                )


def load_pruned(path: str | Path, dtype: str | torch.dtype = "auto", device: str = "cpu",
                max_memory: str | dict | None = None) -> tuple[nn.Module, PrunePlan | None]:
    """A pruned checkpoint and the plan it was exported from (None for a checkpoint SlimWise did not
    write)."""
    from slimwise.models import load_model

    model = load_model(path, dtype=dtype, device=device, max_memory=max_memory)
    plan_file = Path(path) / PLAN_FILE
    plan = PrunePlan.load(plan_file) if plan_file.is_file() else None
    model.slimwise_manifest = read_manifest(path)
    return model, plan
