"""Which blocks of a new request to load from its worker's KV tiers, and what a load that fell
short leaves to compute.

A request arrives knowing how many of its leading full blocks some tier holds (the worker was
asked before it queued). At admission the blocks past the pool's own prefix hit, up to that
count, are loaded instead of computed, when there are enough of them to beat recomputing
(`load_min_tokens`); at least one prompt token is always left to compute, for the logits.
A handed-over request's blocks (pulled from its prefill worker) are always loaded: its prompt
was computed once already, and a decode pair recomputes only what did not arrive, or fails the
request under `--kv-load-failure fail`.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.block_manager import BlockManager, PrefixMatch
from services.scheduler.request import Request
from shared.errors import Reason
from shared.step import FailedRequest, LoadFailure


@dataclass(frozen=True)
class TierPolicy:
    """The worker's KV tiers as its scheduler sees them (WorkerInfo.kv_tiers)."""

    tiers: tuple[str, ...] = ()
    write: str = "through"  # through: as blocks fill; back: as the pool evicts them
    load_min_tokens: int = 256
    fail_handovers: bool = False  # --kv-load-failure fail: a short handover fails its request

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)

    @property
    def write_policy(self) -> str | None:
        return self.write if self.tiers else None


NO_TIERS = TierPolicy()


@dataclass
class TierLoadStats:
    loaded_tokens: int = 0  # prompt tokens planned as loads that did load
    short_loads: int = 0  # loads that stopped short (a miss, a bad block, a tier down)
    recomputed_tokens: int = 0  # what those left to compute


class TierLoads:
    def __init__(self, policy: TierPolicy, block_size: int) -> None:
        self.policy = policy
        self.block_size = block_size
        self.stats = TierLoadStats()

    def plan(self, request: Request, prefix: PrefixMatch) -> tuple[int, ...]:
        """Hashes of the blocks to load after `prefix` (none for a fork: its sibling's)."""
        enabled = self.policy.enabled or request.handed_over
        if not enabled or not prefix.from_cache or prefix.copy_from is not None:
            return ()
        start = len(prefix.block_ids)
        stop = min(request.num_tier_blocks, (request.num_tokens - 1) // self.block_size)
        min_tokens = 1 if request.handed_over else max(1, self.policy.load_min_tokens)
        if (stop - start) * self.block_size < min_tokens:
            return ()
        return tuple(request.full_block_hashes(self.block_size)[start:stop])

    def admitted(self, request: Request, loads: tuple[int, ...]) -> None:
        request.num_loaded_tokens = len(loads) * self.block_size
        request.loading = bool(loads)
        self.stats.loaded_tokens += request.num_loaded_tokens

    def fell_short(
        self, request: Request, failure: LoadFailure | None, block_manager: BlockManager
    ) -> bool:
        """After the step that ran its load (if any): whether the load fell short. Then the
        step computed nothing for it: it goes on from what the pool holds, and is never
        planned a load again (a preempted request recomputes)."""
        request.loading = False
        if failure is None:
            return False
        missing = request.num_computed_tokens - failure.num_computed_tokens
        request.num_loaded_tokens -= missing
        request.num_computed_tokens = failure.num_computed_tokens
        request.num_tier_blocks = 0
        self.stats.loaded_tokens -= missing
        self.stats.short_loads += 1
        self.stats.recomputed_tokens += missing
        block_manager.cache_full_blocks(request)
        return True

    def handover_failure(self, request: Request) -> FailedRequest | None:
        """A handed-over request whose load fell short, under the fail policy."""
        if not (request.handed_over and self.policy.fail_handovers):
            return None
        return FailedRequest(request.request_id, Reason.KV_HANDOVER_FAILED.value, "LoadFailure")
