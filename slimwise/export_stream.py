"""Streaming export: the pruned checkpoint written from the safetensors files, tensor by tensor.

Why: the in-memory export (`slimwise.export.export_pruned`) loads the whole model, slices it, saves it and
reloads the result to check it, so its peak host RAM is several times the checkpoint. Here no weight is
loaded: the model is built on the meta device only (to learn what transformers would write), and tensor data
is held one chunk of at most `CHUNK_BYTES` at a time (two while casting or comparing), whatever the model's
size. Files are read with positioned reads, not mapped (mapped pages count towards the process's resident
memory while the file is open).

What it writes is what `export_pruned` writes for the same plan, tensor for tensor (names, shapes, dtypes,
bytes), plus the same config edits, plan, manifest and tokenizer files:
- The names, shapes and dtypes are predicted from transformers itself before a weight is read: the model on
  the meta device in the dtype `from_pretrained` would load (keep-in-fp32 modules included), passed through
  the reverse weight conversion `save_pretrained` applies for the conversions a load of these files uses.
  So a checkpoint stored per expert (`experts.{e}.gate_proj.weight`, `block_sparse_moe.experts.{e}.w1...`)
  is written per expert, one stored fused (`experts.gate_up_proj`, leading dim E; GPT-OSS) is written fused,
  and a multimodal Qwen3.5 checkpoint keeps its `model.language_model.` prefix. The prediction is made for the
  whole model (it must be a subset of the files) and for the model sliced to the plan (what is written).
- Every stored tensor is mapped onto the sliced prediction: per-expert tensors of kept experts are renamed
  0..N'-1 in ascending original order (pruned ones are skipped); a tensor whose leading dim is the expert
  count in the files and N' in the prediction (fused experts and their biases, router rows and biases,
  DeepSeek-V3's e_score_correction_bias) keeps the plan's rows of its layer; every other tensor is copied.
  A tensor is cast only where the prediction's dtype differs from the stored one (`--dtype`, keep-in-fp32).
  Stored tensors the model does not load (a vision tower, MTP layers) are not written, as the loaded model
  the in-memory export saves does not have them.
- A quantized checkpoint (FP8 block-wise, compressed-tensors: `slimwise.quantized`) is predicted from its
  unquantized structure; every stored tensor follows the weight it belongs to (scales, zero points, packed
  weights, g_idx) and is copied as stored, never cast or dequantized; its `quantization_config` is rewritten
  for the renumbered experts.
- Whatever does not map exactly (another layout, a .bin checkpoint, a tensor the model needs that the files
  lack) raises `StreamingUnsupported` before anything is written; `export_checkpoint` then says so in one line
  and exports in memory, except for a quantized checkpoint, which it refuses (in memory it would be written
  dequantized). A distilled delta (`--distilled`) changes weights of the loaded model
  (trained router rows and norms, merged LoRA) before slicing: `export_checkpoint` always exports it in
  memory.

Invariants: the plan is checked against the model's structure (meta device), its configuration checksum and
the checkpoint files' checksum (`checkpoint_fingerprint`) without loading weights, and a plan made for other
weights is refused in one line; nothing appears under the output's name until every written tensor has been
read back through safetensors' own reader (names, shapes, dtypes) and compared byte for byte with its source
slice (`atomic_dir`). The manifest's `source_fingerprint` carries the configuration and files checksums (the
in-memory weights sample needs the loaded model); `fingerprints_match` compares the parts both sides carry.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from slimwise import quantized
from slimwise.adapters import MoEAdapter, get_adapter
from slimwise.errors import SlimWiseError
from slimwise.export import check_output_dir, copy_tokenizer_files, export_pruned, write_plan_and_manifest
from slimwise.fingerprint import checkpoint_fingerprint, config_fingerprint
from slimwise.io import atomic_dir
from slimwise.models import DTYPES, load_config, resolve_model_dir
from slimwise.plan import PrunePlan
from slimwise.safetensors_files import (
    CODE_DTYPES,
    DTYPE_CODES,
    FLOAT_CODES,
    INDEX,
    SINGLE,
    StoredTensor,
    StreamingUnsupported,
    corrupt,
    itemsize,
    stored_tensors,
    weight_files,
)

#: the most tensor bytes read at once; a second chunk is held while casting it or comparing it with the output
CHUNK_BYTES = 64 * 2**20
#: output shard size; a tensor larger than this gets a shard of its own
DEFAULT_SHARD_BYTES = 2 * 10**9

# a tensor's layer: the first "layers.<n>." in its name (per-expert names: `quantized.renamed_module`)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class StreamedCheckpoint:
    """What `stream_pruned` wrote: the directory, its shard and tensor counts, tensor bytes, and the stored
    tensors it did not write because the model does not load them."""

    path: Path
    shards: int
    tensors: int
    bytes: int
    dropped: tuple[str, ...]


@dataclass(frozen=True)
class _Entry:
    """One tensor of the pruned checkpoint: its source byte ranges (file, start, length), concatenated in
    order, cast from `src_dtype` to `dtype` when they differ."""

    name: str
    source: str
    shape: tuple[int, ...]
    src_dtype: str
    dtype: str
    pieces: tuple[tuple[Path, int, int], ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * CODE_DTYPES[self.dtype].itemsize


@dataclass
class _Job:
    """Everything decided before a byte is written: the meta model (sliced, config edited on write), the
    output tensors and the source fingerprint for the manifest."""

    source_dir: Path
    plan: PrunePlan
    n_keep: int
    adapter: MoEAdapter
    model: nn.Module
    entries: list[_Entry]
    dropped: tuple[str, ...]
    fingerprint: dict[str, str]
    quantization_config: dict | None = None  # the pruned model's, for a quantized checkpoint


# ----- reading safetensors files ----------------------------------------------------------------------------

class _Reader:
    """Positioned reads from files opened once each: no memory mapping, so what is resident is what was
    read last."""

    def __init__(self) -> None:
        self._files: dict[Path, int] = {}

    def read(self, path: Path, start: int, length: int) -> bytearray:
        fd = self._files.get(path)
        if fd is None:
            fd = self._files[path] = os.open(path, os.O_RDONLY)
        buf = bytearray(length)
        view, done = memoryview(buf), 0
        while done < length:
            n = os.preadv(fd, [view[done:]], start + done)
            if n <= 0:
                raise corrupt(path, f"ends at byte {start + done}")
            done += n
        return buf

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _chunks(entry: _Entry, reader: _Reader) -> Iterator[memoryview | bytearray]:
    """The bytes of `entry` as written, in order, at most CHUNK_BYTES read at a time."""
    cast = entry.src_dtype != entry.dtype
    size = itemsize(entry.src_dtype)
    step = max(size, CHUNK_BYTES - CHUNK_BYTES % size)
    for path, start, length in entry.pieces:
        for offset in range(0, length, step):
            raw = reader.read(path, start + offset, min(step, length - offset))
            if not cast:
                yield raw
                continue
            values = torch.frombuffer(raw, dtype=torch.uint8).view(CODE_DTYPES[entry.src_dtype])
            yield memoryview(values.to(CODE_DTYPES[entry.dtype]).view(torch.uint8).numpy())


# ----- what transformers would write ------------------------------------------------------------------------

def _transformers_internals():
    """The transformers functions the prediction uses: not public API, but those `from_pretrained` and
    `save_pretrained` themselves call (pyproject pins the transformers range they were checked on). Without
    them this transformers cannot be predicted: the in-memory export runs instead."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import build_glob_alternation, revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError as exc:
        raise StreamingUnsupported(f"this transformers has no {exc.name or 'weight-conversion API'}") from exc
    return get_model_conversion_mapping, build_glob_alternation, revert_weight_conversion, \
        remove_tied_weights_from_state_dict


def _meta_model(config, dtype: torch.dtype | None) -> nn.Module:
    """The model's modules on the meta device, as `from_pretrained` builds them for `dtype` (parameters in
    `dtype`, keep-in-fp32 modules upcast as its dtype plan says)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), **({"dtype": dtype} if dtype else {}))
    if dtype is not None:
        _apply_dtype_plan(model, dtype)
    return model


def _apply_dtype_plan(model: nn.Module, dtype: torch.dtype) -> None:
    """Upcast what `from_pretrained` loads in float32 whatever `dtype` (`_keep_in_fp32_modules` in float16,
    `_keep_in_fp32_modules_strict` in float16 and bfloat16: GPT-OSS's norms, DeepSeek-V3's
    e_score_correction_bias); `from_config` does not, and the saved dtypes follow the loaded ones."""
    build_glob_alternation = _transformers_internals()[1]
    plan = model._get_dtype_plan(dtype)
    if not plan:
        return
    pattern, groups, _ = build_glob_alternation(list(plan))
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        match = pattern.search(name)
        if match is not None:
            tensor.data = tensor.data.to(plan[groups[match.lastgroup]])


def _saved_layout(model: nn.Module, conversions: list | None) -> dict[str, tuple[tuple[int, ...], object]]:
    """Name -> (shape, dtype) of what `save_pretrained` writes for `model` loaded with `conversions` used:
    tied and ignored keys dropped, the conversions reverted."""
    _, _, revert_weight_conversion, remove_tied_weights_from_state_dict = _transformers_internals()
    state = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, model)
    if conversions:
        model._weight_conversions = list(conversions)
        state = revert_weight_conversion(model, state)
    return {name: (tuple(t.shape), t.dtype) for name, t in state.items()}


def _matching_conversions(model: nn.Module, stored: dict[str, StoredTensor]) -> tuple[list, dict]:
    """The weight conversions a load of these files uses, and the whole model's saved layout with them.

    `from_pretrained` keeps the conversions that matched a stored tensor and `save_pretrained` reverts exactly
    those, so the layout written is the stored one: the largest set of the model's conversions whose saved
    layout the files hold (names and shapes; tensors the model does not load may be there too)."""
    get_model_conversion_mapping = _transformers_internals()[0]
    known = list(get_model_conversion_mapping(model, add_legacy=False) or [])
    first_missing = None
    for size in range(len(known), -1, -1):
        for subset in itertools.combinations(known, size):
            layout = _saved_layout(model, list(subset))
            missing = [k for k, (shape, _) in layout.items() if k not in stored or stored[k].shape != shape]
            if not missing:
                return list(subset), layout
            first_missing = first_missing or missing[0]
    raise StreamingUnsupported(f"the files do not hold the tensors transformers loads in any layout it saves "
                               f"back (no {first_missing} of that shape)")


def _load_dtype(dtype: str | torch.dtype | None, model_config, stored: dict[str, StoredTensor],
                first_file: Path) -> torch.dtype:
    """The dtype `load_model(dtype=...)` loads in on the CPU: the given one; for "auto" the model config's,
    else the first floating tensor's of the first file (transformers' rule)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in (None, "auto"):
        if dtype not in DTYPES:
            raise SlimWiseError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    configured = getattr(model_config, "dtype", None)
    if configured is not None:
        return configured if isinstance(configured, torch.dtype) else getattr(torch, str(configured))
    for name in sorted(stored):
        if stored[name].file == first_file and stored[name].dtype in FLOAT_CODES:
            return CODE_DTYPES[stored[name].dtype]
    return torch.get_default_dtype()


# ----- mapping the stored tensors onto the pruned checkpoint ------------------------------------------------

def _layer_of(name: str) -> int | None:
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def _kept_ids(plan: PrunePlan):
    """`plan` as `quantized.renamed_module` reads it: kept expert ids by layer, None if not pruned."""
    return lambda layer: plan.kept(layer) if layer in plan.kept_experts else None


def _output_name(name: str, plan: PrunePlan) -> str | None:
    """The name a stored tensor gets in the pruned checkpoint; None for a pruned expert's tensor."""
    return quantized.renamed_module(name, _kept_ids(plan))


def _runs(ids: list[int]) -> Iterator[tuple[int, int]]:
    """Ascending ids as (first, count) runs of consecutive ids."""
    for _, group in itertools.groupby(enumerate(ids), key=lambda pair: pair[1] - pair[0]):
        members = [e for _, e in group]
        yield members[0], len(members)


def _pieces(name: str, stored: StoredTensor, shape: tuple[int, ...], plan: PrunePlan) -> tuple:
    """The byte ranges of `stored` that make the output tensor of `shape`: all of it, or the kept rows of a
    tensor whose leading dim is the expert count."""
    if shape == stored.shape:
        return ((stored.file, stored.start, stored.nbytes),)
    layer = _layer_of(name)
    if (layer in plan.kept_experts and stored.shape[:1] == (plan.num_experts,)
            and shape == (len(plan.kept(layer)), *stored.shape[1:])):
        row = stored.nbytes // plan.num_experts
        return tuple((stored.file, stored.start + first * row, count * row)
                     for first, count in _runs(plan.kept(layer)))
    raise StreamingUnsupported(f"tensor {name} {list(stored.shape)} becomes {list(shape)} in the pruned "
                               "model, not by keeping expert rows")


def _map_tensors(stored: dict[str, StoredTensor], whole: dict, sliced: dict,
                 plan: PrunePlan) -> tuple[list[_Entry], tuple[str, ...]]:
    """The output tensors in file order, and the stored tensors the model does not load."""
    entries, dropped, seen = [], [], set()
    for name, src in sorted(stored.items(), key=lambda item: (str(item[1].file), item[1].start)):
        if name not in whole:
            dropped.append(name)
            continue
        out = _output_name(name, plan)
        if out is None:
            continue
        if out not in sliced or out in seen:
            raise StreamingUnsupported(f"tensor {name} has no place in the pruned checkpoint as {out}")
        shape, dtype = sliced[out]
        code = DTYPE_CODES.get(dtype, str(dtype))
        entry = _Entry(out, name, shape, src.dtype, code, _pieces(name, src, shape, plan))
        if entry.dtype not in CODE_DTYPES or (entry.src_dtype != entry.dtype
                                              and entry.src_dtype not in CODE_DTYPES):
            raise StreamingUnsupported(f"tensor {name} would be cast from {src.dtype} to {dtype}")
        if sum(length for *_, length in entry.pieces) != math.prod(shape) * CODE_DTYPES.get(
                src.dtype, CODE_DTYPES[entry.dtype]).itemsize:
            raise corrupt(src.file, f"{name} holds {src.nbytes} bytes for shape {list(src.shape)}")
        entries.append(entry)
        seen.add(out)
    missing = sorted(set(sliced) - seen)
    if missing:
        raise StreamingUnsupported(f"the pruned model needs {missing[0]}, which no stored tensor gives")
    return entries, tuple(dropped)


def _with_packed(stored: dict[str, StoredTensor]) -> dict[str, StoredTensor]:
    """`stored` plus, for each weight stored packed, the weight under its own name with its logical shape
    (read from `<weight>_shape`), so the layout transformers loads can be matched against the files."""
    aliases = quantized.packed_weights(stored)
    view = dict(stored)
    with _Reader() as reader:
        for weight, shape_name in aliases.items():
            packed, shape = stored[weight + quantized.PACKED_SUFFIX], stored.get(shape_name)
            if shape is None or shape.dtype not in ("I64", "I32") or len(shape.shape) != 1:
                raise SlimWiseError(f"{weight}{quantized.PACKED_SUFFIX} has no 1-D integer {shape_name}; the "
                                    "checkpoint is not a valid packed one")
            raw = reader.read(shape.file, shape.start, shape.nbytes)
            dims = torch.frombuffer(raw, dtype=CODE_DTYPES[shape.dtype])
            view[weight] = StoredTensor(packed.file, packed.dtype, tuple(int(d) for d in dims), packed.start,
                                   packed.nbytes)
    return view


def _map_quantized(stored: dict[str, StoredTensor], whole: dict, sliced: dict,
                   plan: PrunePlan) -> tuple[list[_Entry], tuple[str, ...]]:
    """`_map_tensors` for a quantized checkpoint: every stored tensor follows the weight it belongs to
    (`quantized.owner`): dropped with a pruned expert, renamed with a kept one, its expert rows kept where the
    weight's are; bytes as stored, never cast."""
    entries, dropped, written, covered = [], [], set(), set()
    for name, src in sorted(stored.items(), key=lambda item: (str(item[1].file), item[1].start)):
        weight = quantized.owner(name, whole)
        if weight is None:
            dropped.append(name)
            continue
        out, weight_out = _output_name(name, plan), _output_name(weight, plan)
        if out is None:
            continue
        if weight_out not in sliced or out in written:
            raise StreamingUnsupported(f"tensor {name} has no place in the pruned checkpoint as {out}")
        shape = src.shape
        if whole[weight][0] != sliced[weight_out][0]:  # the weight keeps expert rows: so do all its tensors
            kept = len(plan.kept(_layer_of(name)))
            if src.shape[:1] != (plan.num_experts,) or sliced[weight_out][0][:1] != (kept,):
                raise StreamingUnsupported(f"tensor {name} {list(src.shape)} belongs to {weight}, whose "
                                           "expert rows are kept, but is not stored one row per expert")
            shape = (kept, *src.shape[1:])
        if src.dtype not in CODE_DTYPES:
            raise StreamingUnsupported(f"tensor {name} is stored as {src.dtype}, which this export cannot "
                                       "copy")
        entries.append(_Entry(out, name, shape, src.dtype, src.dtype, _pieces(name, src, shape, plan)))
        written.add(out)
        covered.add(weight_out)
    missing = sorted(set(sliced) - written - covered)
    if missing:
        raise StreamingUnsupported(f"the pruned model needs {missing[0]}, which no stored tensor gives")
    return entries, tuple(dropped)


# ----- the plan against these files -------------------------------------------------------------------------

def _check_plan(plan: PrunePlan, source_dir: Path, model: nn.Module, adapter: MoEAdapter) -> dict[str, str]:
    """Refuse a plan made for another model (structure, configuration, checkpoint files) without loading
    weights; the source fingerprint for the manifest."""
    plan.validate(adapter.min_kept_per_group(model.config))
    plan.check_model(model, adapter, check_fingerprint=False)
    actual = {"config_sha256": config_fingerprint(model.config.to_dict())}
    files = checkpoint_fingerprint(source_dir)
    if files is not None:
        actual["files_sha256"] = files
    made_for = plan.fingerprint or {}
    if "files_sha256" in made_for and files is None:
        raise StreamingUnsupported("the checkpoint files' checksum cannot be read")
    if any(key in made_for and made_for[key] != actual[key] for key in actual):
        raise SlimWiseError(f"plan fingerprint {made_for} does not match the checkpoint's {actual}: the plan "
                            "was made for other weights; recalibrate or pass the right model")
    if "weights_sha256" in made_for and "files_sha256" not in made_for:
        raise StreamingUnsupported("the plan carries the loaded weights' checksum but no checkpoint-file "
                                   "checksum, so only the loaded model can be checked against it")
    return actual


def _prepare(source_dir: Path, plan: PrunePlan, dtype: str | torch.dtype | None) -> _Job:
    """Check the plan and decide every output tensor, reading only the config and the files' headers."""
    config = load_config(source_dir)
    adapter = get_adapter(config)
    qconfig = quantized.quantization_config(config)
    if qconfig is not None:  # the structure is the unquantized model's; the files say how it is stored
        quantized.check_prunable(qconfig, dtype)
        config = quantized.without_quantization(config)
    structure = _meta_model(config, None)
    files = weight_files(source_dir)
    stored = stored_tensors(files)
    fingerprint = _check_plan(plan, source_dir, structure, adapter)
    n_keep = plan.num_kept  # refuses a non-uniform plan in one line
    model = _meta_model(config, _load_dtype(dtype, structure.config, stored, files[0]))
    conversions, whole = _matching_conversions(model, stored if qconfig is None else _with_packed(stored))
    for layer in adapter.moe_layers(model):
        adapter.slice_layer(layer, torch.tensor(plan.kept(layer.index), dtype=torch.long))
    sliced = _saved_layout(model, conversions)
    if qconfig is None:
        entries, dropped = _map_tensors(stored, whole, sliced, plan)
    else:
        entries, dropped = _map_quantized(stored, whole, sliced, plan)
        qconfig = quantized.pruned_config(
            qconfig, _kept_ids(plan),
            before=(n.rpartition(".")[0] for n in stored if n not in dropped),
            after=(e.name.rpartition(".")[0] for e in entries))
    return _Job(source_dir, plan, n_keep, adapter, model, entries, dropped, fingerprint, qconfig)


# ----- writing and checking ---------------------------------------------------------------------------------

def _shards(entries: list[_Entry], max_bytes: int) -> list[list[_Entry]]:
    shards: list[list[_Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header(entries: list[_Entry]) -> bytes:
    """A safetensors header for `entries` in order (data contiguous, header padded to 8 bytes)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        header[entry.name] = {"dtype": entry.dtype, "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_shard(path: Path, entries: list[_Entry], reader: _Reader) -> None:
    with open(path, "wb") as out:
        out.write(_header(entries))
        for entry in entries:
            written = sum(out.write(chunk) for chunk in _chunks(entry, reader))
            if written != entry.nbytes:
                raise SlimWiseError(f"wrote {written} bytes for {entry.name}, expected {entry.nbytes}")


def _write_weights(out_dir: Path, entries: list[_Entry], max_bytes: int, reader: _Reader) -> int:
    """The shards (and an index when there is more than one); the shard count."""
    shards = _shards(entries, max_bytes)
    names = _shard_names(len(shards))
    for name, shard in zip(names, shards, strict=True):
        _write_shard(out_dir / name, shard, reader)
    if len(shards) > 1:
        weight_map = {e.name: name for name, shard in zip(names, shards, strict=True) for e in shard}
        index = {"metadata": {"total_parameters": sum(math.prod(e.shape) for e in entries),
                              "total_size": sum(e.nbytes for e in entries)},
                 "weight_map": weight_map}
        (out_dir / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return len(shards)


def _write_config(out_dir: Path, job: _Job) -> None:
    """config.json (and generation_config.json) as `save_pretrained` writes them for the sliced model, with
    the family's expert-count fixups."""
    from transformers import GenerationConfig

    model, n_keep = job.model, job.n_keep
    job.adapter.set_num_experts(model.config, n_keep)
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out_dir)
    path = out_dir / "config.json"
    saved = job.adapter.config_dict_fixups(json.loads(path.read_text()), n_keep)
    if job.quantization_config is not None:
        saved["quantization_config"] = job.quantization_config
    path.write_text(json.dumps(saved, indent=2) + "\n")
    if model.can_generate():
        try:
            generation = GenerationConfig.from_pretrained(job.source_dir, local_files_only=True)
        except OSError:
            generation = GenerationConfig.from_pretrained(job.source_dir, config_file_name="config.json",
                                                          _from_model_config=True, local_files_only=True)
        generation.save_pretrained(out_dir)


def _check_failed(path: Path, what: str) -> SlimWiseError:
    return SlimWiseError(f"export check failed: {what} in {path.name}; the checkpoint was not written")


def _verify(out_dir: Path, entries: list[_Entry], n_keep: int, reader: _Reader) -> None:
    """Read the written checkpoint back: safetensors' own reader agrees on every name, shape and dtype, every
    tensor's bytes equal its source slice (chunk by chunk), and the config has n_keep experts."""
    from safetensors import safe_open

    want = {entry.name: entry for entry in entries}
    written = stored_tensors(weight_files(out_dir))
    if set(written) != set(want):
        raise _check_failed(out_dir, f"{len(set(written) ^ set(want))} tensor names differ from the plan's")
    for path in sorted({s.file for s in written.values()}):
        with safe_open(path, framework="pt") as reference:
            for name in reference.keys():  # noqa: SIM118  (safe_open is not a mapping)
                found = reference.get_slice(name)
                if tuple(found.get_shape()) != want[name].shape or found.get_dtype() != want[name].dtype:
                    raise _check_failed(path, f"{name} has shape {found.get_shape()} {found.get_dtype()}")
    for name, entry in want.items():
        position = written[name].start
        for chunk in _chunks(entry, reader):
            if reader.read(written[name].file, position, len(chunk)) != chunk:
                raise _check_failed(written[name].file, f"{name} differs from {entry.source} of the source")
            position += len(chunk)
    config = load_config(out_dir)
    if get_adapter(config).num_experts(config) != n_keep:
        raise _check_failed(out_dir / "config.json", f"the expert count is not {n_keep}")


# ----- public API -------------------------------------------------------------------------------------------

def stream_pruned(source_dir: str | Path, plan: PrunePlan, out_dir: str | Path, *,
                  dtype: str | torch.dtype = "auto", force: bool = False,
                  max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> StreamedCheckpoint:
    """Write the checkpoint `export_pruned(load_model(source_dir, dtype), plan, out_dir)` writes, without
    loading the model (see the module docstring); shards of at most `max_shard_bytes` (a larger tensor gets
    its own), with model.safetensors.index.json when there are several. Raises `StreamingUnsupported` before
    writing anything when this checkpoint needs the in-memory export."""
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise SlimWiseError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    source = resolve_model_dir(source_dir)
    out_dir = Path(out_dir)
    check_output_dir(out_dir, source, force)
    job = _prepare(source, plan, dtype)
    with atomic_dir(out_dir) as tmp, _Reader() as reader:
        shards = _write_weights(tmp, job.entries, max_shard_bytes, reader)
        _write_config(tmp, job)
        copy_tokenizer_files(source, tmp)
        write_plan_and_manifest(tmp, plan, job.fingerprint, source)
        _verify(tmp, job.entries, job.n_keep, reader)
    return StreamedCheckpoint(out_dir, shards, len(job.entries), sum(e.nbytes for e in job.entries),
                              job.dropped)


def verify_streamed(path: str | Path, source_dir: str | Path, plan: PrunePlan,
                    dtype: str | torch.dtype = "auto") -> None:
    """Check a written pruned checkpoint against its source and plan tensor by tensor, as `stream_pruned`
    checks its output before renaming it into place; a difference is refused in one line."""
    job = _prepare(resolve_model_dir(source_dir), plan, dtype)
    with _Reader() as reader:
        _verify(Path(path), job.entries, job.n_keep, reader)


def export_checkpoint(source_dir: str | Path, plan: PrunePlan, out_dir: str | Path, *,
                      dtype: str | torch.dtype = "auto", force: bool = False, delta=None,
                      max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                      note: Callable[[str], None] = print) -> Path:
    """`slimwise prune`: the pruned checkpoint of the model in `source_dir`, streamed (`stream_pruned`)
    unless this checkpoint needs the in-memory export, which then loads the whole model (`note` gets one line
    saying why). With a distilled `delta` the export is always in memory: the delta changes the loaded
    weights before they are sliced."""
    source = resolve_model_dir(source_dir)
    quantized_as = (quantized.quantization_config(load_config(source)) or {}).get("quant_method")
    if quantized_as is not None and delta is not None:
        raise SlimWiseError(f"a distilled delta cannot be exported into a {quantized_as} checkpoint: folding "
                            "it changes weights that are stored quantized; serve the delta with the plan "
                            "instead")
    if delta is None:
        try:
            done = stream_pruned(source, plan, out_dir, dtype=dtype, force=force,
                                 max_shard_bytes=max_shard_bytes)
        except StreamingUnsupported as exc:
            if quantized_as is not None:  # in memory would write the dequantized weights: another format
                raise SlimWiseError(f"cannot prune this {quantized_as} checkpoint from its files "
                                    f"({exc})") from exc
            note(f"streaming export not possible ({exc}); exporting in memory, which loads the whole model")
        else:
            if done.dropped:
                note(f"not written: {len(done.dropped)} stored tensor(s) the model does not load "
                     f"(e.g. {done.dropped[0]})")
            return done.path
    from slimwise.models import load_model

    return export_pruned(load_model(source, dtype=dtype), plan, out_dir, source_dir=source, force=force,
                         delta=delta)


__all__ = ["CHUNK_BYTES", "DEFAULT_SHARD_BYTES", "StreamedCheckpoint", "StreamingUnsupported",
           "export_checkpoint", "stream_pruned", "verify_streamed"]
