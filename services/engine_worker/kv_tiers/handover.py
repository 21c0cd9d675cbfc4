"""Prefill/decode handover, worker to worker: a prefilled request's blocks, in the tier format.

Prefill side (`Exports`): a request its scheduler holds under a lease stays among the worker's
requests, blocks and all, until the lease ends (its id in a plan's finished ids). The export
reads those blocks from the pool while steps run: the lock orders each read before any step
that could reuse the block, so a read either sees the leased block whole or finds the lease
gone.

Decode side (`Inbox`): the pull streams the blocks from the prefill worker into memory before
the request queues; the step that admits it copies them into its pool blocks like any tier
load (tokens and CRC-32 checked). A pull that breaks or times out keeps what arrived: the
scheduler's `--kv-load-failure` policy decides what becomes of the rest.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from prometheus_client import Counter, Histogram

from services.engine_worker.kv_tiers.block_record import pack
from services.engine_worker.kv_tiers.local_tiers import HostTier
from services.engine_worker.step_inputs import RequestState
from shared.pb.kvmesh.v1 import engine_worker_pb2, engine_worker_pb2_grpc
from shared.runtime.metrics import TOKEN_SECONDS
from shared.runtime.service import CHANNEL_OPTIONS
from shared.runtime.tls import aio_channel

log = logging.getLogger("kvmesh.kv_handover")
# Pulled blocks wait here for their request's first step: a few long prompts' worth.
INBOX_BYTES = 1 << 30
HANDOVER_BYTES = Counter(
    "kvmesh_kv_handover_bytes",
    "Handover bytes: sent by a prefill worker, received by a decode one",
    ["direction"],
)
HANDOVER_BLOCKS = Counter(
    "kvmesh_kv_handover_blocks",
    "Handover blocks: sent (prefill side), received (decode side)",
    ["direction"],
)
HANDOVER_SECONDS = Histogram(
    "kvmesh_kv_handover_seconds", "One request's pull, decode side", buckets=TOKEN_SECONDS
)
HANDOVER_FAILURES = Counter(
    "kvmesh_kv_handover_failures",
    "Handovers that stopped short: timeout, unreachable, lease_not_found, error "
    "(pull), or a block that failed its checks at load (checksum, tokens, layout)",
    ["reason"],
)


class LeaseEnded(Exception):
    pass


class Exports:
    def __init__(self, requests: dict[str, RequestState], pool: Any, block_size: int) -> None:
        self.requests = requests
        self.pool = pool
        self.block_size = block_size
        self.lock = threading.Lock()

    def forget(self, request_ids: Sequence[str]) -> None:
        """A plan's finished requests, a lease's end among them: their blocks may be reused
        from this step on, so never while a read of theirs is under way."""
        with self.lock:
            for request_id in request_ids:
                self.requests.pop(request_id, None)

    def records(self, lease_id: str, num_blocks: int) -> Iterator[bytes]:
        """The leased request's first `num_blocks` full computed blocks, as tier records;
        LeaseEnded when it holds none (never prefilled here, or its lease ended)."""
        state = self.requests.get(lease_id)
        if state is None:
            raise LeaseEnded(lease_id)
        size = self.block_size
        count = min(num_blocks, state.num_computed_tokens // size)
        for index in range(count):
            with self.lock:
                if self.requests.get(lease_id) is not state:
                    raise LeaseEnded(lease_id)
                payload = self.pool.read_block(state.block_ids[index])
            record = pack(state.token_ids[index * size : (index + 1) * size], payload)
            HANDOVER_BLOCKS.labels("sent").inc()
            HANDOVER_BYTES.labels("sent").inc(len(record))
            yield record


class Inbox:
    """Pulled blocks by chained hash, each taken once by its request's load. One never taken
    (its request refused or cancelled before its first step, or a block the decode pool held
    already) leaves as newer pulls push it out of the budget."""

    def __init__(self, budget_bytes: int = INBOX_BYTES) -> None:
        self._staged = HostTier(budget_bytes)
        self._channels: dict[str, grpc.aio.Channel] = {}

    @staticmethod
    def key(block_hash: int) -> str:
        return f"{block_hash:016x}"

    def take(self, block_hash: int) -> bytes | None:
        return self._staged.pop(self.key(block_hash))

    def _stub(self, address: str) -> engine_worker_pb2_grpc.EngineWorkerStub:
        if address not in self._channels:
            self._channels[address] = aio_channel(address, options=CHANNEL_OPTIONS)
        return engine_worker_pb2_grpc.EngineWorkerStub(self._channels[address])

    async def pull(self, request: engine_worker_pb2.PullRequest) -> engine_worker_pb2.PullResult:
        """The blocks from the prefill worker, first to last, within the request's timeout."""
        hashes = list(request.block_hashes)
        result = engine_worker_pb2.PullResult(outcome="ok")
        started = time.perf_counter()
        export = self._stub(request.source_worker).ExportBlocks(
            engine_worker_pb2.ExportRequest(lease_id=request.lease_id, num_blocks=len(hashes)),
            timeout=request.timeout_s or None,
        )
        try:
            async for block in export:
                if result.num_blocks == len(hashes):
                    break
                self._staged.put(self.key(hashes[result.num_blocks]), block.record)
                result.num_blocks += 1
                result.bytes += len(block.record)
        except grpc.RpcError as error:
            result.outcome = _outcome_of(error)
        except asyncio.CancelledError:
            export.cancel()
            raise
        if result.outcome == "ok" and result.num_blocks < len(hashes):
            result.outcome = "lease_not_found" if result.num_blocks == 0 else "error"
        result.seconds = time.perf_counter() - started
        HANDOVER_SECONDS.observe(result.seconds)
        HANDOVER_BLOCKS.labels("received").inc(result.num_blocks)
        HANDOVER_BYTES.labels("received").inc(result.bytes)
        if result.outcome != "ok":
            HANDOVER_FAILURES.labels(result.outcome).inc()
            log.warning(
                "kv handover stopped short",
                extra={
                    "source": request.source_worker,
                    "lease_id": request.lease_id,
                    "blocks": f"{result.num_blocks}/{len(hashes)}",
                    "outcome": result.outcome,
                },
            )
        return result


def _outcome_of(error: grpc.RpcError) -> str:
    code = error.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timeout"
    if code == grpc.StatusCode.NOT_FOUND:
        return "lease_not_found"
    if code == grpc.StatusCode.UNAVAILABLE:
        return "unreachable"
    return "error"
