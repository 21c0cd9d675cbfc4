"""Redis blocks fetched into host memory while their request waits to be admitted.

A lookup that finds a prompt's blocks only in Redis starts fetching them at once, on a thread
of its own, so the step that loads them copies from memory instead of waiting on the network
(SGLang's HiCache prefetches alike). What is staged stays until loaded, or until newer blocks
push it out of the staging budget; a load that finds a block not yet staged fetches it itself.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from services.engine_worker.kv_tiers.local_tiers import HostTier
from services.engine_worker.kv_tiers.redis_tier import RedisTier, RedisTierDown

STAGING_BYTES = 256 << 20  # ~11,000 tokens of the default model's float16 K/V


class Prefetcher:
    def __init__(self, remote: RedisTier, budget_bytes: int = STAGING_BYTES) -> None:
        self.remote = remote
        self._staged = HostTier(budget_bytes)
        self._block_seconds = 0.0  # what a block of the latest fetch took
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="kv-prefetch")

    def start(self, keys: list[str]) -> None:
        if keys:
            self._fetcher.submit(self._fetch, keys)

    def wait(self) -> None:
        """Until every fetch started so far is done (tests)."""
        self._fetcher.submit(lambda: None).result()

    def take(self, key: str) -> tuple[bytes, float] | None:
        """A staged block and the seconds its fetch took, once."""
        value = self._staged.pop(key)
        return None if value is None else (value, self._block_seconds)

    def _fetch(self, keys: list[str]) -> None:
        keys = [key for key in keys if not self._staged.contains(key)]
        started = time.perf_counter()
        try:
            values = self.remote.get_many(keys)
        except RedisTierDown:
            return  # the load will find Redis down itself, and recompute
        found = [(key, value) for key, value in zip(keys, values, strict=True) if value]
        self._block_seconds = (time.perf_counter() - started) / max(1, len(found))
        for key, value in found:
            self._staged.put(key, value)
