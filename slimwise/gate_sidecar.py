"""What a pruned checkpoint's decode instance needs for `--gates drop` / `--gates substitute`: a small file.

A pruned checkpoint keeps only the kept experts' router rows, so on its own it routes over the kept experts
(`renorm`). `drop` and `substitute` route with the full router (its softmax over every expert, its top-k) and
either drop the pruned slots' weight or replace each pruned slot with the expert's calibration mean. The file
carries, per MoE layer, the kept and pruned expert ids of the plan, the full router's rows (and bias) for the
pruned experts, and under `substitute` their mean output vectors: layers x pruned x hidden, a fraction of one
expert's weights. The decode instance rebuilds the full router's logits as [kept rows from its own router |
pruned rows from this file] and routes as the colocated engine does (`slimwise.serving.pruned_gates`).

Invariant: the rows are read from the full checkpoint the plan was made for (`check_plan_for_checkpoints`),
bit for bit in the router's stored dtype; nothing here loads a model's weights.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from slimwise.decode_gates import DecodeGates
from slimwise.errors import SlimWiseError
from slimwise.io import atomic_path
from slimwise.plan import PrunePlan

#: gates a pruned checkpoint can decode with (the fallback needs the pruned experts' weights: colocated only)
SIDECAR_GATES = ("drop", "substitute")
FORMAT = "slimwise-gates-v1"
#: sigmoid scores + correction bias + grouped top-k: the selection needs every expert's group
GROUPED_FAMILIES = ("deepseek_v3",)


@dataclass
class LayerGates:
    kept: torch.Tensor  # [K] int64, ascending: the pruned checkpoint's expert j is the full model's kept[j]
    pruned: torch.Tensor  # [P] int64
    rows: torch.Tensor  # [P, hidden]: the full router's rows of the pruned experts
    bias: torch.Tensor | None  # [P] the router bias of the pruned experts, where the router has one
    vectors: torch.Tensor | None  # [P, hidden] float32 under `substitute`


@dataclass
class GateSidecar:
    gates: str
    num_experts: int
    top_k: int
    family: str
    layers: dict[int, LayerGates]

    @classmethod
    def load(cls, path: str | Path) -> GateSidecar:
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
            head = json.loads(meta["slimwise"])
            if head.get("format") != FORMAT:
                raise ValueError(f"format {head.get('format')!r}")
            layers = {}
            for layer in head["layers"]:
                p = f"{layer}."
                layers[int(layer)] = LayerGates(tensors[p + "kept"], tensors[p + "pruned"],
                                                tensors[p + "rows"], tensors.get(p + "bias"),
                                                tensors.get(p + "vectors"))
        except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
            raise SlimWiseError(f"{path} is not a SlimWise gates file ({type(exc).__name__}: {exc}); write "
                                "it again with `slimwise serve --disaggregated --gates ...`") from exc
        return cls(head["gates"], int(head["num_experts"]), int(head["top_k"]), head["family"], layers)


def _router_names(source_dir: Path, plan: PrunePlan) -> tuple[dict[int, str], int]:
    """MoE layer -> the router's module name in the full model, and the hidden size (meta device: nothing
    loaded)."""
    from slimwise.adapters import get_adapter
    from slimwise.models import structure_model

    model = structure_model(source_dir)
    adapter = get_adapter(model)
    names = {id(m): n for n, m in model.named_modules()}
    return ({layer.index: names[id(layer.router)] for layer in adapter.moe_layers(model)
             if layer.index in plan.kept_experts}, int(adapter.text_config(model.config).hidden_size))


def refuse_unservable(plan: PrunePlan, gates: DecodeGates) -> None:
    """What a pruned checkpoint cannot decode with: a fallback (it needs the pruned experts' weights), the
    plain gates (nothing to carry) and grouped routers; `slimwise serve` asks before anything starts."""
    if gates.gates not in SIDECAR_GATES or gates.fallback is not None:
        raise SlimWiseError(f"a pruned checkpoint decodes with --gates {' or '.join(SIDECAR_GATES)} and no "
                            "--fallback (falling back needs the pruned experts' weights: serve colocated)")
    if plan.family in GROUPED_FAMILIES:
        raise SlimWiseError(f"--gates {gates.gates} on a pruned {plan.family} checkpoint: its router selects "
                            "within expert groups with a per-expert bias, which the pruned checkpoint no "
                            "longer has; serve colocated")


def write_gate_sidecar(source_dir: str | Path, plan: PrunePlan, gates: DecodeGates, out: str | Path) -> Path:
    """Write the gates file of `plan` on the full checkpoint `source_dir` (atomically; see the module doc)."""
    from slimwise.models import resolve_model_dir
    from slimwise.safetensors_files import stored_tensors, weight_files

    refuse_unservable(plan, gates)
    source = Path(resolve_model_dir(source_dir))
    stored = stored_tensors(weight_files(source))
    routers, hidden = _router_names(source, plan)
    vectors = None if gates.gates != "substitute" else \
        gates.vectors(sorted(routers), plan.num_experts, hidden)
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    with ExitStack() as stack:
        files = {path: stack.enter_context(safe_open(str(path), "pt"))  # each file's header parsed once
                 for path in sorted({s.file for s in stored.values()})}
        for layer, name in sorted(routers.items()):
            pruned = plan.pruned_mask(layer).nonzero().flatten().to(torch.int64)
            if pruned.numel() == 0:
                continue
            key = f"{name}.weight"
            if key not in stored:
                raise SlimWiseError(f"{source}: the router weight {key} is not in the checkpoint's files; "
                                    "this layout cannot decode with --gates drop/substitute on a pruned "
                                    "checkpoint")
            tensors[f"{layer}.rows"] = files[stored[key].file].get_tensor(key)[pruned].contiguous()
            if f"{name}.bias" in stored:
                bias = files[stored[f"{name}.bias"].file].get_tensor(f"{name}.bias")
                tensors[f"{layer}.bias"] = bias[pruned].contiguous()
            tensors[f"{layer}.kept"] = torch.tensor(sorted(plan.kept(layer)), dtype=torch.int64)
            tensors[f"{layer}.pruned"] = pruned
            if vectors is not None:
                tensors[f"{layer}.vectors"] = vectors[layer][pruned].float().contiguous()
            layers.append(layer)
    head = {"format": FORMAT, "gates": gates.gates, "num_experts": plan.num_experts, "top_k": plan.top_k,
            "family": plan.family, "layers": layers}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        save_file(tensors, str(tmp), metadata={"slimwise": json.dumps(head)})
    return out
