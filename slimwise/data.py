"""Calibration and evaluation prompts from local files: JSONL (one object per line) or a directory of them.

A record's prompt is its `prompt` field (else `text`, else `question`); `.txt` files give one prompt per
non-empty line. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from slimwise.errors import SlimWiseError

PROMPT_KEYS = ("prompt", "text", "question")


def _text_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file; binary or otherwise encoded files are refused in one line."""
    try:
        return path.read_text(encoding="utf-8").split("\n")  # not splitlines: JSON strings may hold U+2028
    except UnicodeDecodeError as exc:
        raise SlimWiseError(
            f"{path} is not UTF-8 text (byte {exc.start}); pass .jsonl with one JSON object per line "
            "or .txt with one prompt per line"
        ) from exc
    except IsADirectoryError as exc:
        raise SlimWiseError(
            f"{path} is a directory inside the data directory; pass .jsonl or .txt files"
        ) from exc


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    records = []
    for n, line in enumerate(_text_lines(path), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SlimWiseError(f"{path}:{n} is not valid JSON ({exc.msg}); fix or remove that line") from exc
        if not isinstance(obj, dict):
            raise SlimWiseError(f"{path}:{n} is not a JSON object; write one object per line")
        records.append(obj)
    return records


def _prompt(record: dict, where: str) -> str:
    for key in PROMPT_KEYS:
        if isinstance(record.get(key), str) and record[key]:
            return record[key]
    raise SlimWiseError(f"{where} has none of the fields {PROMPT_KEYS}; give every record a prompt")


def load_records(path: str | Path) -> list[dict]:
    """Records from a .jsonl file, a .txt file, or a directory of those (sorted by name)."""
    path = Path(path)
    if not path.exists():
        raise SlimWiseError(f"data path {path} does not exist; pass a .jsonl file or a directory of them")
    files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".txt")) if path.is_dir() else [path]
    records: list[dict] = []
    for f in files:
        if f.suffix == ".txt":
            records += [{"prompt": line.rstrip("\r")} for line in _text_lines(f) if line.strip()]
        else:
            records += read_jsonl(f)
    if not records:
        raise SlimWiseError(f"no records found in {path}; it needs .jsonl lines with a 'prompt' field")
    return records


def load_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    records = load_records(path)[:limit] if limit else load_records(path)
    return [_prompt(r, f"record {i} of {path}") for i, r in enumerate(records)]
