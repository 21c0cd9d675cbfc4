"""The worker's own tiers: host memory (beside a GPU pool) and a local disk folder that outlives
the process. Both are LRU under a byte budget, and safe to use from several threads."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

STALE_WRITE_S = 60.0  # a block's write takes milliseconds


class HostTier:
    name = "host"

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._values: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def contains(self, key: str) -> bool:
        return key in self._values

    def get(self, key: str) -> bytes | None:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def pop(self, key: str) -> bytes | None:
        with self._lock:
            value = self._values.pop(key, None)
            if value is not None:
                self._bytes -= len(value)
            return value

    def put(self, key: str, value: bytes) -> None:
        with self._lock:
            if key in self._values or len(value) > self.budget_bytes:
                return
            self._values[key] = value
            self._bytes += len(value)
            while self._bytes > self.budget_bytes:
                _, dropped = self._values.popitem(last=False)
                self._bytes -= len(dropped)


class DiskTier:
    """One file per block in `folder`; the index (key -> size, least recently used first) is
    rebuilt from the folder at start, oldest modification first, so a restarted worker finds
    what it wrote before, and a file another worker on this host wrote is adopted when asked
    for. A write goes to a temporary name of its process and is renamed into place: a crash
    leaves a whole block or none."""

    name = "disk"
    SUFFIX = ".kvb"

    def __init__(self, folder: str | Path, budget_bytes: int) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        files = sorted(self.folder.glob(f"*{self.SUFFIX}"), key=lambda p: p.stat().st_mtime)
        self._index: OrderedDict[str, int] = OrderedDict(
            (path.name.removesuffix(self.SUFFIX), path.stat().st_size) for path in files
        )
        self._bytes = sum(self._index.values())
        for stale in self.folder.glob("*.tmp"):  # a write a crash cut short, not a live one
            with contextlib.suppress(FileNotFoundError):  # renamed into place meanwhile
                if time.time() - stale.stat().st_mtime > STALE_WRITE_S:
                    stale.unlink()

    def _path(self, key: str) -> Path:
        return self.folder / (key.replace(":", "_") + self.SUFFIX)

    def contains(self, key: str) -> bool:
        """In the index, or written since by another worker sharing the folder (adopted)."""
        name = key.replace(":", "_")
        if name in self._index:
            return True
        try:
            size = self._path(key).stat().st_size
        except FileNotFoundError:
            return False
        with self._lock:
            if name not in self._index:
                self._index[name] = size
                self._bytes += size
        return True

    def get(self, key: str) -> bytes | None:
        name = key.replace(":", "_")
        if not self.contains(key):
            return None
        with self._lock:
            if name in self._index:  # (a write on another thread may just have evicted it)
                self._index.move_to_end(name)
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:  # removed behind our back: a miss
            with self._lock:
                self._bytes -= self._index.pop(name, 0)
            return None

    def put(self, key: str, value: bytes) -> None:
        """Raises OSError when the disk refuses (full, read-only): the caller counts it."""
        name = key.replace(":", "_")
        if name in self._index or len(value) > self.budget_bytes:
            return
        path = self._path(key)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_bytes(value)
        os.replace(temporary, path)
        with self._lock:
            self._index[name] = len(value)
            self._bytes += len(value)
            evicted = []
            while self._bytes > self.budget_bytes:
                oldest, size = self._index.popitem(last=False)
                self._bytes -= size
                evicted.append(oldest)
        for oldest in evicted:
            (self.folder / (oldest + self.SUFFIX)).unlink(missing_ok=True)
