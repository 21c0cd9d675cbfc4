"""Paged KV block table: ref-counted blocks, chained-hash prefix cache, O(1) LRU free list.

A block with ref_count 0 sits in the free list. If it holds a full, hashed block it stays
findable by hash until it is handed out again (that is the eviction), so freed prefixes can be
reused. Free blocks without content are kept at the front, so they are reused before any cached
block is evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from services.scheduler.cache_events import CacheEventLog
from services.scheduler.request import Request
from services.scheduler.window_budget import WindowBudget
from shared.step import BlockWrite


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    salt: bytes = b""  # the tenant salt inside block_hash, to publish it under the right key
    token_ids: tuple[int, ...] = ()  # content of a hashed block, re-checked on every hit


@dataclass(frozen=True)
class PrefixMatch:
    """Computed blocks that cover a prompt's leading tokens: cached ones, or a sibling's (a
    fork of a request with n > 1), whose partial last block is copied, not shared, since the
    sibling goes on writing into it."""

    block_ids: tuple[int, ...] = ()  # shared as they are
    block_size: int = 0
    copy_from: int | None = None  # a sibling's partial block: the request's next one is a copy
    num_copied_tokens: int = 0
    from_cache: bool = True  # a prefix-cache hit (counted in the stats), not a fork

    @property
    def num_tokens(self) -> int:
        return len(self.block_ids) * self.block_size + self.num_copied_tokens


def fork_of(sibling: Request, num_tokens: int, block_size: int) -> PrefixMatch:
    """The first `num_tokens` of a sibling's computed K/V: full blocks shared, the partial
    one (if any) to be copied."""
    num_full, num_rest = divmod(num_tokens, block_size)
    return PrefixMatch(
        tuple(sibling.block_ids[:num_full]),
        block_size,
        sibling.block_ids[num_full] if num_rest else None,
        num_rest,
        from_cache=False,
    )


@dataclass
class CacheStats:
    queries: int = 0  # prompt tokens of admitted requests
    hits: int = 0  # of those, tokens served from the cache
    evictions: int = 0
    collisions: int = 0  # hash hits whose tokens differed
    forked: int = 0  # tokens a request with n > 1 took from a sibling instead of computing


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    # Hashed blocks copied down to the worker's KV tiers: as they fill (through), as they are
    # evicted (back), or never (None); the next plan carries them (take_writes).
    write_policy: str | None = None
    # A sliding-window model's window blocks, counted beside the pool's (None: no such model).
    window: WindowBudget | None = None
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self) -> None:
        self.blocks = [KVBlock(i) for i in range(self.num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))
        self._by_hash: dict[int, int] = {}
        # What became findable or was evicted, for Redis (bounded: a few times the pool).
        self.events = CacheEventLog(limit=4 * self.num_blocks)
        self._writes: list[BlockWrite] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, request: Request) -> PrefixMatch:
        """Longest run of cached full blocks; at least one prompt token is always left to compute
        so the step that finishes the prompt produces logits."""
        matched, collided = self._leading_cached_blocks(request)
        self.stats.collisions += collided
        return PrefixMatch(tuple(matched), self.block_size)

    def cached_prefix_tokens(self, request: Request) -> int:
        """Leading prompt tokens the cache holds now (an estimate of work a request skips)."""
        return len(self._leading_cached_blocks(request)[0]) * self.block_size

    def _leading_cached_blocks(self, request: Request) -> tuple[list[int], bool]:
        """Block ids of the cached prefix, and whether a hash hit had different tokens."""
        if not self.enable_prefix_caching:
            return [], False
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.full_block_hashes(self.block_size)[:max_blocks]
        matched: list[int] = []
        for index, block_hash in enumerate(hashes):
            block_id = self._by_hash.get(block_hash)
            if block_id is None:
                break
            start = index * self.block_size
            if self.blocks[block_id].token_ids != tuple(
                request.token_ids[start : start + self.block_size]
            ):
                return matched, True
            matched.append(block_id)
        return matched, False

    def allocate(
        self, request: Request, num_new_tokens: int, prefix: PrefixMatch | None = None
    ) -> bool:
        """Give `request` blocks for its computed tokens plus `num_new_tokens`; all or nothing.
        With a fork, the first fresh block is the copy of `prefix.copy_from`."""
        prefix_ids = prefix.block_ids if prefix else ()
        total = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        num_fresh = total - len(request.block_ids) - len(prefix_ids)
        # Touching a cached block that is free takes it out of the free list too.
        num_revived = sum(1 for b in prefix_ids if self.blocks[b].ref_count == 0)
        if max(num_fresh, 0) + num_revived > len(self._free):
            return False
        window_span = self.window.span(request, num_new_tokens) if self.window else 0
        if self.window and not self.window.fits(request, window_span):
            return False
        if prefix is not None and prefix.from_cache:  # counted once, when admitted
            self.stats.queries += request.num_tokens
            self.stats.hits += prefix.num_tokens
        elif prefix is not None:
            self.stats.forked += prefix.num_tokens
        for block_id in prefix_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            request.block_ids.append(block_id)
        for _ in range(num_fresh):
            request.block_ids.append(self._take_free_block())
        if self.window:
            self.window.hold(request, window_span)
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.write_policy == "back":  # read out before the step that reuses it
                self._writes.append(BlockWrite(block_id, block.block_hash, block.token_ids))
            self._uncache(block)
            self.stats.evictions += 1
        block.ref_count = 1
        return block_id

    def cache_full_blocks(self, request: Request) -> None:
        """Make every fully computed block of `request` findable by its chained hash."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_confirmed_tokens // self.block_size
        if num_full <= request.num_hashed_blocks:
            return
        hashes = request.full_block_hashes(self.block_size)
        first, request.num_hashed_blocks = request.num_hashed_blocks, num_full
        for index in range(first, num_full):
            block = self.blocks[request.block_ids[index]]
            if block.block_hash is not None:
                continue
            start = index * self.block_size
            block.block_hash = hashes[index]
            block.salt = request.cache_salt
            block.token_ids = tuple(request.token_ids[start : start + self.block_size])
            # A block with the same content may already be cached; the first one stays findable.
            if self._by_hash.setdefault(block.block_hash, block.block_id) == block.block_id:
                self.events.stored(block.salt, block.block_hash)
                # A block the tiers held when the request arrived is not written again.
                if self.write_policy == "through" and index >= request.num_tier_blocks:
                    self._writes.append(BlockWrite(block.block_id, hashes[index], block.token_ids))

    @property
    def has_writes(self) -> bool:
        return bool(self._writes)

    def take_writes(self) -> tuple[BlockWrite, ...]:
        writes, self._writes = tuple(self._writes), []
        return writes

    def cached_hashes(self) -> dict[bytes, list[int]]:
        """Every findable block hash by salt: the full state a resync publishes."""
        by_salt: dict[bytes, list[int]] = {}
        for block_hash, block_id in self._by_hash.items():
            by_salt.setdefault(self.blocks[block_id].salt, []).append(block_hash)
        return by_salt

    def free(self, request: Request, drop_cached: bool = False) -> None:
        """Release the request's blocks. Tail blocks are freed first so they are evicted first.
        drop_cached: blocks nobody else holds leave the prefix cache too (a failed request's
        K/V is not trusted)."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if drop_cached and block.block_hash is not None:
                    self._uncache(block)
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)
        request.block_ids.clear()
        request.num_hashed_blocks = 0
        if self.window:
            self.window.release(request)

    def trim(self, request: Request) -> None:
        """Frees the request's blocks past its computed tokens: what a step reserved for draft
        tokens it rejected (never cached: only blocks of computed tokens are)."""
        keep = self.blocks_needed(request.num_computed_tokens)
        for block_id in reversed(request.block_ids[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)
        del request.block_ids[keep:]

    def _uncache(self, block: KVBlock) -> None:
        block_hash = block.block_hash
        if block_hash is not None and self._by_hash.get(block_hash) == block.block_id:
            del self._by_hash[block_hash]
            self.events.evicted(block.salt, block_hash)
        block.block_hash = None
        block.token_ids = ()

    def check_invariants(self, holders: list[Request]) -> None:
        """Ref counts equal the number of holders; free list holds exactly the unreferenced.
        Raises AssertionError (under `python -O` too) naming the first broken block."""
        counts = [0] * self.num_blocks
        for request in holders:
            for block_id in request.block_ids:
                counts[block_id] += 1
        for block in self.blocks:
            if block.ref_count != counts[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id}: ref_count {block.ref_count}, "
                    f"holders {counts[block.block_id]}"
                )
            if (block.ref_count == 0) != (block.block_id in self._free):
                raise AssertionError(
                    f"block {block.block_id}: ref_count {block.ref_count}, in free list "
                    f"{block.block_id in self._free}"
                )
        for block_hash, block_id in self._by_hash.items():
            if self.blocks[block_id].block_hash != block_hash:
                raise AssertionError(f"stale hash entry {block_id}")
        if self.window:
            self.window.check(holders)
