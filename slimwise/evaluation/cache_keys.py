"""The one key function behind every evaluation cache file name (calibration stats and generation runs).

Invariant: `digest` is the first 16 hex digits of the SHA-256 of the object's JSON with sorted keys and
`default=str`. Changing any of that renames every cache file: every existing stats and run cache would miss.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def digest(obj: Any) -> str:
    """A stable short key of a JSON-able object (non-JSON values count by their str())."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]
