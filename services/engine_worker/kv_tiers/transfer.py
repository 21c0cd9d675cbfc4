"""`BlockTransfer`: blocks between the worker's pool and its KV block store.

A step plan's writes are read out of the pool before the step runs (the step may reuse those
blocks) and offered to the store's queue; a new request's planned load is copied into its pool
blocks before the step computes the rest of its prompt, from the handover inbox first (blocks
pulled from a prefill worker), then the store. A load that stops short says where, so the
scheduler recomputes from there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from services.engine_worker.compile_cache import cache_root
from services.engine_worker.kv_tiers.block_record import BadBlock, TierNamespace, unpack
from services.engine_worker.kv_tiers.handover import HANDOVER_FAILURES, Inbox
from services.engine_worker.kv_tiers.store import KVBlockStore
from shared.config import KVTierConfig
from shared.step import BlockWrite, LoadFailure, NewRequestPlan

log = logging.getLogger("kvmesh.kv_tiers")
MIN_MEASURED_PREFILL = 256


@dataclass(frozen=True)
class LoadRecord:
    """One request's load in the current step, for its trace's span."""

    request_id: str
    started_ns: int
    seconds: float
    loaded_tokens: int
    outcome: str  # ok, or why it stopped short


class BlockTransfer:
    def __init__(self, store: KVBlockStore | None, pool: Any, block_size: int) -> None:
        self.store = store  # None: no tiers, nothing to write or load
        self.pool = pool  # a KVCache or GpuKVCache: read_block, write_block
        self.block_size = block_size
        self.step_loads: list[LoadRecord] = []  # this step's, until the next starts
        self.prefill_s_per_token: float | None = None  # measured on steps, see observe_step
        self.inbox = Inbox()

    @classmethod
    def open(
        cls, config: KVTierConfig, model_digest: str, kv_dtype: torch.dtype, pool: Any
    ) -> BlockTransfer:
        """The disk tier defaults to $KVMESH_CACHE_DIR/kv-blocks."""
        block_size = pool.shape.block_size
        if not config.enabled:
            return cls(None, pool, block_size)
        if "disk" in config.tiers and not config.disk_dir:
            config = replace(config, disk_dir=str(cache_root() / "kv-blocks"))
        dtype = str(kv_dtype).removeprefix("torch.")
        namespace = TierNamespace(model_digest, dtype, block_size)
        return cls(KVBlockStore(config, namespace), pool, block_size)

    def leading(self, block_hashes: list[int]) -> int:
        """How many of a prompt's leading full blocks the tiers can give: 0 without tiers, or
        when loading them from the tiers that hold them has measured slower than prefilling
        them (a slow Redis: never a load that costs more than the prefill it saves)."""
        if self.store is None:
            return 0
        tiers = self.store.leading_tiers(block_hashes)
        if self._slower_than_prefill(tiers):
            self.store.stats.skipped_slow()
            return 0
        # Fetched while the request queues: its step then copies them from memory.
        self.store.prefetch(
            [
                h
                for h, tier in zip(block_hashes[: len(tiers)], tiers, strict=True)
                if tier == "redis"
            ]
        )
        return len(tiers)

    def observe_step(self, prefill_tokens: int, seconds: float) -> None:
        """A step's time per prefill token (steps of at least 256: the step's fixed cost
        would dominate a shorter one), averaged over recent steps."""
        if prefill_tokens < MIN_MEASURED_PREFILL:
            return
        rate = seconds / prefill_tokens
        previous = self.prefill_s_per_token
        self.prefill_s_per_token = rate if previous is None else 0.8 * previous + 0.2 * rate

    def _slower_than_prefill(self, tiers: list[str]) -> bool:
        if not tiers or self.store is None or self.prefill_s_per_token is None:
            return False
        per_block = {tier: self.store.block_load_seconds(tier) for tier in set(tiers)}
        if any(seconds is None for seconds in per_block.values()):
            return False  # not measured yet: load, and learn
        load_s = sum(per_block[tier] or 0.0 for tier in tiers)
        return load_s >= len(tiers) * self.block_size * self.prefill_s_per_token

    def start_step(self, writes: tuple[BlockWrite, ...]) -> None:
        """A step begins: the plan's writes read out before the step may reuse the blocks."""
        self.step_loads = []
        if self.store is None:
            return
        for write in writes:
            try:
                payload = self.pool.read_block(write.block_id)
            except Exception as error:  # a write lost, counted: never a failed step
                self.store.stats.write_failed("pool")
                log.warning("kv block read-out failed", extra={"error": repr(error)})
                continue
            self.store.offer(write.block_hash, write.token_ids, payload)

    def load_into(self, new: NewRequestPlan) -> LoadFailure | None:
        """Its planned blocks into its pool blocks; where it stopped, if it did."""
        if not new.load_hashes:
            return None
        size, count = self.block_size, len(new.load_hashes)
        first = new.num_computed_tokens // size - count
        tokens = [new.token_ids[(first + i) * size : (first + i + 1) * size] for i in range(count)]
        started_ns, started = time.time_ns(), time.perf_counter()
        reason: str | None = None
        written = 0
        try:
            payloads, reason = self._load(new.load_hashes, tokens)
            for payload in payloads:
                self.pool.write_block(new.block_ids[first + written], payload)
                written += 1
        except Exception as error:  # what loaded before it stays; the rest is recomputed
            reason = "error"
            log.warning("kv block load into the pool failed", extra={"error": repr(error)})
        seconds, loaded = time.perf_counter() - started, written * size
        record = LoadRecord(new.request_id, started_ns, seconds, loaded, reason or "ok")
        self.step_loads.append(record)
        if reason is None:
            return None
        return LoadFailure(new.request_id, (first + written) * size, reason)

    def _load(
        self, block_hashes: Sequence[int], token_ids: Sequence[Sequence[int]]
    ) -> tuple[list[memoryview], str | None]:
        """Each block's K/V from the inbox, then the store, up to the first neither has whole."""
        payload_bytes = self.pool.block_payload_bytes
        payloads: list[memoryview] = []
        for block_hash, tokens in zip(block_hashes, token_ids, strict=True):
            record = self.inbox.take(block_hash)
            if record is None:
                break
            try:
                payloads.append(unpack(record, tokens, payload_bytes))
            except BadBlock as bad:
                HANDOVER_FAILURES.labels(bad.reason).inc()
                return payloads, bad.reason
        done = len(payloads)
        if done == len(block_hashes):
            return payloads, None
        if self.store is None:  # blocks neither pulled nor in tiers this worker has
            return payloads, "unavailable"
        rest, reason = self.store.load(block_hashes[done:], token_ids[done:], payload_bytes)
        return payloads + rest, reason
