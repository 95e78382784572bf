"""Reading a checkpoint's safetensors files without loading them: the one header reader and dtype table.

The streamed export (`slimwise.export_stream`), the checkpoint-file fingerprint (`slimwise.fingerprint`), the
gates file, the footprint estimate and the serving content key all read tensors' names, dtypes, shapes and
byte ranges from here, so a file is judged readable (or truncated) the same way everywhere.

Invariants: a file that is not a safetensors file, a header longer than its file or a header that is not a
JSON object is refused by `read_header`, and an entry without dtype, shape and offsets or a byte range past
the file's end by `stored_tensors`, each in one line (`SlimWiseError`, "copy the checkpoint again") before
any tensor data is read. (`checkpoint_fingerprint` reads such a file as "no fingerprint" and leaves the
refusal to the loader.)
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from slimwise.errors import SlimWiseError

#: safetensors dtype code -> torch dtype, for every code these readers know
CODE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
               "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
               "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
#: torch dtype -> safetensors dtype code
DTYPE_CODES = {dtype: code for code, dtype in CODE_DTYPES.items()}
#: the codes of the floating dtypes a model is loaded in (a checkpoint's load dtype; upcast to float32 alike)
FLOAT_CODES = ("F64", "F32", "F16", "BF16")
#: the single-file checkpoint, and the index of a sharded one
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class StreamingUnsupported(SlimWiseError):
    """This checkpoint cannot be exported by streaming exactly as the in-memory export would write it (the
    message says why); raised before anything is written. `export_checkpoint` falls back to the in-memory
    export on it; refusals of the plan or the output are plain `SlimWiseError`s and are never retried."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor in a safetensors file: its dtype code, shape and absolute byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int


def itemsize(code: str) -> int:
    """Bytes per element of a dtype code; 1 for a code not in `CODE_DTYPES` (read as raw bytes)."""
    return CODE_DTYPES[code].itemsize if code in CODE_DTYPES else 1


def corrupt(path: Path, why: str) -> SlimWiseError:
    """The one-line refusal of a truncated or corrupt weights file."""
    return SlimWiseError(f"the weights in {path.parent} are truncated or corrupt ({path.name}: {why}); "
                         "copy the checkpoint again")


def read_header(path: Path) -> tuple[int, dict]:
    """A safetensors file's header and the offset its data starts at; a file that is not one is refused in
    one line."""
    try:
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            if size > os.fstat(fh.fileno()).st_size:
                raise corrupt(path, "header longer than the file")
            header = json.loads(fh.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise corrupt(path, type(exc).__name__) from exc
    if not isinstance(header, dict):
        raise corrupt(path, "header is not a JSON object")
    return 8 + size, header


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files transformers loads from `model_dir` (model.safetensors, else the index's)."""
    if (model_dir / SINGLE).is_file():
        return [model_dir / SINGLE]
    index = model_dir / INDEX
    if not index.is_file():
        raise StreamingUnsupported(f"{model_dir} has neither {SINGLE} nor {INDEX}")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SlimWiseError(f"{index} is not a readable safetensors index ({type(exc).__name__}); copy the "
                            "checkpoint again") from exc


def stored_tensors(files: list[Path]) -> dict[str, StoredTensor]:
    """Every tensor of `files` by name, from their headers; a byte range past a file's end is refused (a
    truncated copy) before any tensor is read."""
    out: dict[str, StoredTensor] = {}
    for path in files:
        start, header = read_header(path)
        size = path.stat().st_size
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                begin, end = info["data_offsets"]
                stored = StoredTensor(path, info["dtype"], tuple(info["shape"]), start + begin, end - begin)
            except (KeyError, TypeError, ValueError) as exc:
                raise corrupt(path, f"bad entry for {name}") from exc
            if stored.start + stored.nbytes > size:
                raise corrupt(path, f"{name} ends past the end of the file")
            if name in out:
                raise StreamingUnsupported(f"tensor {name} is stored twice")
            out[name] = stored
    return out


__all__ = ["CODE_DTYPES", "DTYPE_CODES", "FLOAT_CODES", "INDEX", "SINGLE", "StoredTensor",
           "StreamingUnsupported", "corrupt", "itemsize", "read_header", "stored_tensors", "weight_files"]
