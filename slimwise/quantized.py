"""Quantized checkpoints as files: which formats `slimwise prune` slices, which stored tensors travel with a
weight, and the pruned model's `quantization_config`.

A quantized checkpoint stores, next to (or instead of) each quantized module's `weight`, tensors that belong
to that module only: block scales (`weight_scale_inv`, FP8 block-wise), per-channel or per-group scales and
zero points, `g_idx`, a packed int4 weight with its `weight_shape` (compressed-tensors `pack-quantized`),
activation scales. Pruning an expert removes its module, so every one of those tensors goes with it; a kept
expert's tensors are renamed with its new id; where experts are stored fused (leading dim = the expert count)
every tensor of that module keeps the plan's rows. Nothing is dequantized: bytes are copied as stored.

Invariants: only formats whose tensors all sit under their module's name are pruned (`PRUNABLE`); others are
refused in one line, because the in-memory export would silently write the dequantized model instead. The
pruned `quantization_config` names the same modules as the original, renamed: literal module names of pruned
experts are dropped and kept experts' are renumbered; a regex entry (`re:...`) must select the same kept
modules before and after, else the prune is refused (it selects experts by number).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable

from slimwise.errors import SlimWiseError

#: `quant_method` values whose checkpoints are pruned from their files (the formats tested with real files)
PRUNABLE = ("fp8", "compressed-tensors")
#: the keys of a quantization_config whose string lists name modules (or module regexes, or class names)
_MODULE_LISTS = ("modules_to_not_convert", "ignore", "targets")
#: a packed weight stands in for `weight`; its logical shape is stored next to it
PACKED_SUFFIX, SHAPE_SUFFIX = "_packed", "_shape"
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)(?P<rest>\..+)?$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def quantization_config(config) -> dict | None:
    """The checkpoint's quantization_config as a dict (top level, else the text config's), None when the
    weights are not quantized."""
    for holder in (config, config.get_text_config() if hasattr(config, "get_text_config") else None):
        found = getattr(holder, "quantization_config", None) if holder is not None else None
        if found:
            return dict(found) if isinstance(found, dict) else found.to_dict()
    return None


def without_quantization(config):
    """A copy of `config` without quantization_config: the model's structure, unquantized."""
    config = copy.deepcopy(config)
    for holder in (config, config.get_text_config() if hasattr(config, "get_text_config") else None):
        if holder is not None and hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    return config


def check_prunable(qconfig: dict, dtype) -> None:
    """Refuse, in one line, a format this export does not slice, or a dtype change (a quantized checkpoint is
    written in its stored dtypes)."""
    method = qconfig.get("quant_method")
    if method not in PRUNABLE:
        raise SlimWiseError(f"cannot prune a checkpoint quantized with {method!r}: SlimWise prunes "
                            f"{' and '.join(PRUNABLE)} checkpoints from their files; prune the unquantized "
                            "model and quantize the result")
    if dtype not in (None, "auto"):
        raise SlimWiseError(f"--dtype {dtype} cannot apply to a {method} checkpoint: its tensors are written "
                            "as stored (quantized weights, their scales); drop --dtype")


def owner(name: str, weights: Iterable[str] | dict) -> str | None:
    """The weight a stored tensor belongs to: itself, or `<module>.weight` for a tensor of that module
    (scales, zero points, packed weight, g_idx, activation scales); None when no such weight exists."""
    if name in weights:
        return name
    module = name.rpartition(".")[0]
    return f"{module}.weight" if module and f"{module}.weight" in weights else None


def packed_weights(names: Iterable[str]) -> dict[str, str]:
    """`<module>.weight` -> the stored tensor holding its logical shape, for each weight stored packed
    (`weight_packed` without `weight`)."""
    names = set(names)
    out = {}
    for name in names:
        if name.endswith(".weight" + PACKED_SUFFIX):
            weight = name[: -len(PACKED_SUFFIX)]
            if weight not in names:
                out[weight] = weight + SHAPE_SUFFIX
    return out


def renamed_module(name: str, kept: Callable[[int], list[int] | None]) -> str | None:
    """A module (or tensor) name in the pruned model: a kept expert's renumbered, a pruned expert's None,
    anything else unchanged. `kept(layer)` gives the layer's kept expert ids, None for a layer not pruned."""
    match = _EXPERT.match(name)
    layer = _LAYER.search(name)
    if match is None or layer is None or (ids := kept(int(layer.group(1)))) is None:
        return name
    new = {old: i for i, old in enumerate(ids)}.get(int(match["expert"]))
    return None if new is None else f"{match['prefix']}.{new}{match['rest'] or ''}"


def pruned_config(qconfig: dict, kept: Callable[[int], list[int] | None], before: Iterable[str],
                  after: Iterable[str]) -> dict:
    """`qconfig` for the pruned model. `before` / `after`: the module names of the original and the pruned
    checkpoint, to check that every regex entry selects the same (renamed) modules."""
    before, after = sorted(set(before)), sorted(set(after))

    def fix(values: list) -> list:
        out = []
        for value in values:
            if not isinstance(value, str):
                out.append(value)
            elif value.startswith("re:"):
                _check_regex(value, before, after, kept)
                out.append(value)
            elif (new := renamed_module(value, kept)) is not None:
                out.append(new)
        return out

    def walk(node):
        if isinstance(node, dict):
            return {k: fix(v) if k in _MODULE_LISTS and isinstance(v, list) else walk(v)
                    for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(copy.deepcopy(qconfig))


def _check_regex(entry: str, before: list[str], after: list[str], kept) -> None:
    pattern = re.compile(entry[3:])
    want = {new for name in before if pattern.match(name) and (new := renamed_module(name, kept)) is not None}
    found = {name for name in after if pattern.match(name)}
    if want != found:
        example = sorted(want ^ found)[0]
        raise SlimWiseError(f"quantization_config entry {entry!r} selects experts by number ({example} "
                            "changes side after renumbering the kept experts); name the modules literally "
                            "and prune again")


__all__ = ["PRUNABLE", "check_prunable", "owner", "packed_weights", "pruned_config", "quantization_config",
           "renamed_module", "without_quantization"]
