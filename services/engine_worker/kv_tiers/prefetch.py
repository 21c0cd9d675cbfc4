"""Redis blocks fetched into host memory while their request waits to be admitted.

A lookup that finds a prompt's blocks only in Redis starts fetching them at once, on a thread
of its own, so the step that loads them copies from memory instead of waiting on the network
(SGLang's HiCache prefetches alike). What is staged stays until loaded, or until newer blocks
push it out of the staging budget; a load that finds a block not yet staged fetches it itself.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from services.engine_worker.kv_tiers.redis_tier import RedisTier, RedisTierDown

STAGING_BYTES = 256 << 20  # ~11,000 tokens of the default model's float16 K/V


class Prefetcher:
    def __init__(self, remote: RedisTier, budget_bytes: int = STAGING_BYTES) -> None:
        self.remote = remote
        self.budget_bytes = budget_bytes
        self._staged: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="kv-prefetch")

    def start(self, keys: list[str]) -> None:
        if keys:
            self._fetcher.submit(self._fetch, keys)

    def wait(self) -> None:
        """Until every fetch started so far is done (tests)."""
        self._fetcher.submit(lambda: None).result()

    def take(self, key: str) -> tuple[bytes, float] | None:
        """A staged block and the seconds its fetch took, once."""
        with self._lock:
            staged = self._staged.pop(key, None)
            if staged is not None:
                self._bytes -= len(staged[0])
            return staged

    def _fetch(self, keys: list[str]) -> None:
        with self._lock:
            keys = [key for key in keys if key not in self._staged]
        started = time.perf_counter()
        try:
            values = self.remote.get_many(keys)
        except RedisTierDown:
            return  # the load will find Redis down itself, and recompute
        found = [(key, value) for key, value in zip(keys, values, strict=True) if value]
        seconds = (time.perf_counter() - started) / max(1, len(found))
        with self._lock:
            for key, value in found:
                self._staged[key] = (value, seconds)
                self._bytes += len(value)
            while self._bytes > self.budget_bytes:
                _, (dropped, _) = self._staged.popitem(last=False)
                self._bytes -= len(dropped)
