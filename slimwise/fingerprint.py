"""Fingerprints that tie a plan, a cache or a delta to the weights it was made for.

Three parts, each a 16-hex-digit sha256 prefix: `config_sha256` (the structural config fields),
`weights_sha256` (a strided sample of every weight in memory, float32 view so dtype upcasts agree) and
`files_sha256` (a window of every decoder-layer tensor in the checkpoint files, read from the safetensors
headers without loading). Two fingerprints match when they agree on every part both carry
(`fingerprints_match`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from slimwise.errors import SlimWiseError
from slimwise.safetensors_files import CODE_DTYPES, FLOAT_CODES, itemsize, read_header

# config keys that fix the weights' shapes, routing and attention: what a plan depends on. A whitelist,
# because loaders normalise other fields differently (vLLM rewrites sliding_window, label maps, architectures,
# ...).
_STRUCTURAL_KEYS = {"model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                    "shared_expert_intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "num_experts", "num_local_experts", "n_routed_experts",
                    "num_experts_per_tok", "norm_topk_prob", "n_group", "topk_group", "routed_scaling_factor",
                    "n_shared_experts", "first_k_dense_replace", "decoder_sparse_step", "mlp_only_layers",
                    "layer_types", "hidden_act", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
                    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                    "swiglu_limit", "full_attention_interval"}


def config_fingerprint(config_dict: dict) -> str:
    """Hash of the structural fields of a model config (nested text_config merged in)."""
    merged = dict(config_dict)
    if isinstance(merged.get("text_config"), dict):
        merged.update(merged["text_config"])
    cfg = {k: v for k, v in merged.items() if k in _STRUCTURAL_KEYS or k.startswith("linear_")}
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]


def checkpoint_fingerprint(model_dir: str | Path, samples_per_tensor: int = 32) -> str | None:
    """Checksum of a checkpoint's decoder-layer weights as stored, read without loading them: every layer
    tensor's name from "layers." on, its shape and a window of values from its middle (float32, so a dtype
    upcast agrees), one small read per tensor from the safetensors header's offsets; the same for the
    multimodal and the text-only layout of the same weights. Lets `slimwise serve` refuse a plan made for
    other weights of the same shape before any engine starts. None when the directory has no safetensors files
    or one cannot be read."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    key = tuple((str(f.resolve()), f.stat().st_mtime_ns, f.stat().st_size) for f in files)
    if key not in _FILES_FINGERPRINTS:
        _FILES_FINGERPRINTS[key] = _read_checkpoint_fingerprint(files, samples_per_tensor)
    return _FILES_FINGERPRINTS[key]


_FILES_FINGERPRINTS: dict[tuple, str | None] = {}


def _layer_name(name: str) -> str | None:
    """The decoder-layer part of a tensor name ("layers.3.mlp.gate.weight"), None for what a plan does not
    depend on and checkpoint layouts disagree about: the published multimodal class prefixes
    "model.language_model.", the text-only class "model.", and only the former carries a vision tower (and
    some an MTP head)."""
    at = name.find("layers.")
    if at < 0 or any(part in name for part in ("visual", "vision", "mtp")):
        return None
    return name[at:]


def _read_checkpoint_fingerprint(files: list[Path], samples: int) -> str | None:
    entries = []  # (name, shape, sample bytes), sorted by name so resharding does not change the checksum
    try:
        for f in files:
            data_start, header = read_header(f)
            with open(f, "rb") as fh:
                for name, info in header.items():
                    name = _layer_name(name)
                    if name is None:
                        continue
                    dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
                    size = itemsize(dtype)
                    count = (end - begin) // size
                    first = max(0, count // 2 - samples // 2)
                    take = min(samples, count - first)
                    fh.seek(data_start + begin + first * size)
                    raw = fh.read(take * size)
                    if dtype in FLOAT_CODES and raw:
                        values = torch.frombuffer(bytearray(raw), dtype=CODE_DTYPES[dtype])
                        raw = values.float().numpy().tobytes()
                    entries.append((name, tuple(shape), raw))
    except (SlimWiseError, OSError, ValueError, KeyError, TypeError):
        return None  # unreadable: the loader says what is wrong with the file
    h = hashlib.sha256()
    for name, shape, raw in sorted(entries):
        h.update(name.encode())
        h.update(str(shape).encode())
        h.update(raw)
    return h.hexdigest()[:16]


def fingerprints_match(a: dict | None, b: dict | None) -> bool:
    """Two fingerprints agree on every part both carry. Parts: config_sha256 (structure), weights_sha256 (the
    weights in memory) and files_sha256 (the checkpoint files; only for models loaded from a directory, and in
    plans made since it was added), so a plan from before a part existed still matches on the others. Where
    both carry the weights' checksum it decides, not the files': the same weights saved by another class
    (multimodal vs text-only Qwen3.5) are other files."""
    if not a or not b:
        return a == b
    keys = a.keys() & b.keys()
    if "weights_sha256" in keys:
        keys -= {"files_sha256"}
    return all(a[k] == b[k] for k in keys)


def memory_fingerprint(fingerprint: dict) -> dict:
    """The parts of a fingerprint that describe the weights in memory (no files checksum): cache keys use it,
    so caches written before the files checksum existed stay valid."""
    return {k: v for k, v in fingerprint.items() if k != "files_sha256"}


def _sample(tensor: torch.Tensor, samples_per_tensor: int) -> bytes:
    flat = tensor.detach().reshape(-1)
    step = max(1, flat.numel() // samples_per_tensor)
    return flat[::step][:samples_per_tensor].to(torch.float32).cpu().numpy().tobytes()


def _samples(model: nn.Module, samples_per_tensor: int) -> list[tuple[str, tuple, bytes]]:
    """(name, shape, strided sample) of every state-dict tensor. A model accelerate offloads (parts on disk
    or in host memory between forwards) is read module by module while each is on its execution device, so
    its fingerprint is the same as the same weights held in memory."""
    from slimwise.devices import is_offloaded, onloaded

    if not any(is_offloaded(m) for m in model.modules()):
        return [(name, tuple(t.shape), _sample(t, samples_per_tensor))
                for name, t in model.state_dict().items()]
    out = []
    for prefix, module in model.named_modules():
        with onloaded(module):
            tensors = [(n, t) for n, t in module._parameters.items() if t is not None]
            tensors += [(n, t) for n, t in module._buffers.items()
                        if t is not None and n not in module._non_persistent_buffers_set]
            out += [(f"{prefix}.{n}" if prefix else n, tuple(t.shape), _sample(t, samples_per_tensor))
                    for n, t in tensors]
    return out


def model_fingerprint(model: nn.Module, samples_per_tensor: int = 32) -> dict[str, str]:
    """Config hash + a checksum over a strided sample of every weight (float32 view, so dtype upcasts agree),
    and for a model `load_model` read from a directory, that checkpoint's `checkpoint_fingerprint`."""
    config_hash = config_fingerprint(model.config.to_dict())
    h = hashlib.sha256()
    for name, shape, sample in sorted(_samples(model, samples_per_tensor)):
        h.update(name.encode())
        h.update(str(shape).encode())
        h.update(sample)
    fingerprint = {"config_sha256": config_hash, "weights_sha256": h.hexdigest()[:16]}
    source = getattr(model, "slimwise_source_dir", None)
    files = checkpoint_fingerprint(source) if source else None
    if files is not None:
        fingerprint["files_sha256"] = files
    return fingerprint


# ----- content hashes: caches keyed by what a path holds, never by the path ------------------------------


def file_sha256(path: str | Path) -> str:
    """sha256 (hex) of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def content_sha256(path: str | Path) -> str | None:
    """sha256 (hex) of what `path` holds: a file's bytes, or a directory's regular files (each one's name
    relative to it and its bytes' sha256, in name order; hidden entries such as `atomic_dir` temporaries left
    out). None when nothing is there. What keys a cache by content rather than by path: a file rewritten at
    the same path gets another key, the same files at another path the same one (a delta named by one of its
    files: hash `slimwise.delta.delta_dir` of it)."""
    path = Path(path)
    if path.is_file():
        return file_sha256(path)
    if not path.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        rel = f.relative_to(path)
        if f.is_file() and not any(part.startswith(".") for part in rel.parts):
            h.update(f"{rel.as_posix()}\0{file_sha256(f)}\n".encode())
    return h.hexdigest()
