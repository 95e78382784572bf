"""The shared KV directory of the disaggregated proxy: where a prompt's KV is stored and when its folder may
go.

Invariants: a folder is deleted only when nobody holds it and every prefill request sent before the deletion
was asked for has answered (a prefill instance writes a folder only while such a request runs, so a folder
never goes from under a writer); deleting renames first, so a folder is either whole or gone; new prefills are
refused (`Full`) while the directory is over its cap. The proxy's event loop is the only caller: no locking.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch

KV_DIR_MAX_BYTES = 4 << 30  # default cap of the shared KV directory (slimwise serve --kv-dir-max-gb)
KV_STALE_S = 1800.0  # an unreferenced folder this old belongs to no request the proxy still waits on
KV_GRACE_S = 30.0  # after an abnormal end: time for the decode instance to drop the aborted request
KV_SCAN_S = 1.0  # the directory's size is measured at most this often


class Full(Exception):
    """The shared KV directory is over its cap: 503 with Retry-After."""


def kv_folder(kv_dir: str | Path, token_ids: list[int]) -> Path:
    """Where ExampleConnector-style storage keeps a prompt's KV (same hash as the connector)."""
    from vllm.utils.hashing import safe_hash

    data = torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes()
    return Path(kv_dir) / safe_hash(data, usedforsecurity=False).hexdigest()


class KVFolders:
    """Lifetime of the per-prompt folders in the shared-directory connector's storage.

    A folder is keyed by the prompt's token ids, so concurrent requests with the same prompt share it: it is
    reference-counted from the moment its prefill answered until its decode request ended, and deleted when
    the last holder lets go: soon after a normal end or a decode rejection (the decode instance no longer
    needs it), KV_GRACE_S later when the decode request was abandoned (timeout, client gone: the instance may
    still be about to load it). "Soon" is once every prefill request sent before the deletion was asked for
    has answered: a prefill instance writes a folder only while such a request runs, so a folder never goes
    from under a writer. Deleting renames the folder first (atomic); a prefill that found the folder just
    before it went stored nothing, which `acquire` detects (the folder is missing) and the proxy answers by
    prefilling again. Folders nobody holds that are older than KV_STALE_S (a prefill answer that never
    arrived, a crashed proxy) are swept, and new requests get 503 while the directory is over `max_bytes`."""

    def __init__(self, kv_dir: str | Path, max_bytes: int = KV_DIR_MAX_BYTES,
                 stale_s: float = KV_STALE_S) -> None:
        self.dir, self.max_bytes, self.stale_s = Path(kv_dir), max_bytes, stale_s
        self.refs: Counter[Path] = Counter()
        self.sent = 0  # prefill requests sent so far (their sequence numbers)
        self.prefilling: set[int] = set()  # sequence numbers of prefill requests not yet answered
        self.pending: dict[Path, tuple[int, float]] = {}  # folder -> (prefills sent when asked, not before)
        self.usage, self.measured = 0, -math.inf

    def prefill_sent(self) -> int:
        self.sent += 1
        self.prefilling.add(self.sent)
        return self.sent

    def prefill_answered(self, seq: int) -> None:
        self.prefilling.discard(seq)
        self.run_pending()

    @contextlib.contextmanager
    def prefill_window(self) -> Iterator[None]:
        """Around one prefill request, once it holds its instance slot: Full when the directory is over its
        cap (checked after the wait: the folders waiting for decode count), else the request counts as a
        possible writer until it answered, however it ends."""
        if full := self.over_cap():
            raise Full(full)
        seq = self.prefill_sent()  # a prefill writes KV only now: deletions wait for it from here on
        try:
            yield
        finally:
            self.prefill_answered(seq)

    def acquire(self, token_ids: list[int]) -> bool:
        """Hold the prompt's folder; True when it holds the stored KV."""
        folder = kv_folder(self.dir, token_ids)
        self.refs[folder] += 1
        self.pending.pop(folder, None)
        with contextlib.suppress(OSError):
            return any(name.endswith(".safetensors") for name in os.listdir(folder))
        return False

    def release(self, token_ids: list[int], now: bool = True) -> None:
        """Let go of the folder; the last holder deletes it (`now` False: after KV_GRACE_S)."""
        folder = kv_folder(self.dir, token_ids)
        self.refs[folder] -= 1
        if self.refs[folder] <= 0:
            del self.refs[folder]
            self._pend(folder, 0.0 if now else KV_GRACE_S)

    def discard(self, token_ids: list[int]) -> None:
        """A prompt that never reaches the decode instance (finished at t1): delete its folder unless held."""
        folder = kv_folder(self.dir, token_ids)
        if not self.refs[folder]:  # a Counter lookup adds no key
            self._pend(folder, 0.0)

    def _pend(self, folder: Path, delay: float) -> None:
        """Delete when the prefills sent so far have answered. Only a folder that exists: a prefill sent later
        may be writing one that does not (after a missing folder, the proxy prefills again)."""
        if folder.is_dir():
            self.pending[folder] = (self.sent, time.monotonic() + delay)
            self.run_pending()

    def run_pending(self) -> None:
        oldest = min(self.prefilling, default=math.inf)
        now = time.monotonic()
        for folder, (sent, when) in list(self.pending.items()):
            if sent < oldest and when <= now:
                del self.pending[folder]
                if not self.refs[folder]:
                    self._delete(folder)

    def _delete(self, folder: Path) -> None:
        doomed = folder.with_name(f".deleting-{folder.name}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(folder, doomed)
        except OSError:
            return  # already gone
        shutil.rmtree(doomed, ignore_errors=True)

    def over_cap(self) -> str | None:
        """A message when the directory is over its cap (measured at most every KV_SCAN_S, sweeping as it
        goes)."""
        now = time.monotonic()
        if now - self.measured >= KV_SCAN_S:
            self.measured, self.usage = now, self.sweep()
        if self.usage > self.max_bytes:
            return (f"the shared KV directory {self.dir} holds {self.usage / 2**20:.0f} MiB, over its cap of "
                    f"{self.max_bytes / 2**20:.0f} MiB (slimwise serve --kv-dir-max-gb); retry shortly")
        return None

    def sweep(self) -> int:
        """Delete pending folders that may go and stale unheld folders; the bytes that remain."""
        self.run_pending()
        wall = time.time()
        total = 0
        with contextlib.suppress(OSError), os.scandir(self.dir) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    if not entry.is_dir(follow_symlinks=False):
                        continue
                    folder = Path(entry.path)
                    if entry.name.startswith(".deleting-"):  # renamed by a delete that did not finish
                        shutil.rmtree(folder, ignore_errors=True)
                        continue
                    if not self.refs[folder] and folder not in self.pending and \
                            wall - entry.stat().st_mtime > self.stale_s:
                        self._delete(folder)
                        continue
                    with os.scandir(folder) as files:
                        total += sum(f.stat().st_size for f in files if f.is_file(follow_symlinks=False))
        return total
