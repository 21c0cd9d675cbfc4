"""The KV block store's tiers on their own: budgets, restarts, checksums, namespaces, a Redis
that dies, and tenants that never see each other's blocks."""

from __future__ import annotations

import pytest

from services.engine_worker.kv_tiers.block_record import TierNamespace, pack, unpack
from services.engine_worker.kv_tiers.local_tiers import HostTier
from services.engine_worker.kv_tiers.store import KVBlockStore
from services.engine_worker.kv_tiers.transfer import BlockTransfer
from shared.block_hash import hash_full_blocks
from shared.config import KVTierConfig

NAMESPACE = TierNamespace("ab" * 32, "float16", 4)
TOKENS = list(range(1, 17))  # 4 blocks of 4
PAYLOAD = 64  # bytes of K/V a block holds here


def payload(index: int) -> bytes:
    return bytes([index]) * PAYLOAD


def blocks(salt: bytes = b"") -> list[tuple[int, list[int]]]:
    hashes = hash_full_blocks(TOKENS, 4, salt)
    return [(h, TOKENS[4 * i : 4 * i + 4]) for i, h in enumerate(hashes)]


def filled(config: KVTierConfig, salt: bytes = b"") -> KVBlockStore:
    store = KVBlockStore(config, NAMESPACE)
    for index, (block_hash, tokens) in enumerate(blocks(salt)):
        assert store.offer(block_hash, tokens, payload(index))
    store.flush()
    return store


def load_all(store: KVBlockStore, salt: bytes = b"") -> tuple[list[bytes], str | None]:
    pairs = blocks(salt)
    found, reason = store.load([h for h, _ in pairs], [t for _, t in pairs], PAYLOAD)
    return [bytes(p) for p in found], reason


def test_a_record_is_checked_for_its_checksum_its_tokens_and_its_layout() -> None:
    record = pack([1, 2, 3, 4], payload(7))
    assert bytes(unpack(record, [1, 2, 3, 4], PAYLOAD)) == payload(7)
    flipped = bytearray(record)
    flipped[-1] ^= 1
    for value, tokens, size, reason in [
        (bytes(flipped), [1, 2, 3, 4], PAYLOAD, "checksum"),
        (record, [1, 2, 3, 5], PAYLOAD, "tokens"),
        (record, [1, 2, 3, 4], PAYLOAD * 2, "layout"),
        (record[:10], [1, 2, 3, 4], PAYLOAD, "truncated"),
    ]:
        with pytest.raises(Exception, match=reason):
            unpack(value, tokens, size)


def test_host_tier_keeps_the_most_recently_used_within_its_budget() -> None:
    tier = HostTier(budget_bytes=3 * 100)
    for key in "abc":
        tier.put(key, b"x" * 100)
    assert tier.get("a") is not None  # a is now the most recently used
    tier.put("d", b"x" * 100)
    assert [tier.contains(k) for k in "abcd"] == [True, False, True, True]


def test_disk_tier_outlives_its_process_and_keeps_its_budget(tmp_path) -> None:
    config = KVTierConfig(tiers=("disk",), disk_dir=str(tmp_path), disk_bytes=1 << 20)
    filled(config)
    restarted = KVBlockStore(config, NAMESPACE)  # a new process: the index rebuilt from files
    assert restarted.leading([h for h, _ in blocks()]) == 4
    assert load_all(restarted) == ([payload(i) for i in range(4)], None)
    assert restarted.stats.hits["disk"] == 4
    record_bytes = len(pack(TOKENS[:4], payload(0)))
    small = KVTierConfig(
        tiers=("disk",), disk_dir=str(tmp_path / "small"), disk_bytes=2 * record_bytes
    )
    store = filled(small)  # a full budget: the oldest blocks leave for the new ones
    assert len(list((tmp_path / "small").glob("*.kvb"))) == 2
    assert store.leading([h for h, _ in blocks()]) == 0  # the first block is gone
    assert load_all(store) == ([], "missing")


def test_a_flipped_byte_on_disk_is_a_failed_load_counted_by_reason(tmp_path) -> None:
    config = KVTierConfig(tiers=("disk",), disk_dir=str(tmp_path))
    filled(config)
    files = tmp_path.glob("*.kvb")
    target = next(p for p in files if p.name.endswith(f"{blocks()[1][0]:016x}.kvb"))
    data = bytearray(target.read_bytes())
    data[-3] ^= 0x40
    target.write_bytes(bytes(data))
    restarted = KVBlockStore(config, NAMESPACE)
    assert load_all(restarted) == ([payload(0)], "checksum")  # the first block still loads
    assert restarted.stats.failed_loads == {"disk:checksum": 1}


def test_blocks_of_another_model_or_kv_dtype_are_never_found(tmp_path) -> None:
    config = KVTierConfig(tiers=("disk",), disk_dir=str(tmp_path))
    filled(config)
    for other in (TierNamespace("cd" * 32, "float16", 4), TierNamespace("ab" * 32, "bfloat16", 4)):
        store = KVBlockStore(config, other)
        assert store.leading([h for h, _ in blocks()]) == 0


def test_a_tenant_never_finds_another_tenants_blocks(tmp_path, redis_server) -> None:
    config = KVTierConfig(
        tiers=("host", "disk", "redis"), disk_dir=str(tmp_path), redis_url=redis_server.url
    )
    store = filled(config, salt=b"tenant-a")
    assert store.leading([h for h, _ in blocks(b"tenant-a")]) == 4
    assert store.leading([h for h, _ in blocks(b"tenant-b")]) == 0
    assert load_all(store, b"tenant-b") == ([], "missing")


def test_redis_tier_is_shared_and_a_dead_redis_fails_loads_and_writes_alone(redis_server) -> None:
    config = KVTierConfig(tiers=("redis",), redis_url=redis_server.url, redis_bytes=1 << 20)
    filled(config)
    other_worker = KVBlockStore(config, NAMESPACE)
    assert load_all(other_worker) == ([payload(i) for i in range(4)], None)
    assert other_worker.stats.hits["redis"] == 4
    redis_server.stop()
    assert other_worker.leading([h for h, _ in blocks()]) == 0  # no error: nothing to load
    assert load_all(other_worker) == ([], "unavailable")
    assert other_worker.offer(*blocks()[0], payload(0))
    other_worker.flush()
    assert other_worker.stats.failed_writes["redis"] == 1
    assert other_worker.stats.failed_loads["redis:unavailable"] >= 1


def test_redis_tier_keeps_its_own_budget(redis_server) -> None:
    record_bytes = len(pack(TOKENS[:4], payload(0)))
    config = KVTierConfig(
        tiers=("redis",), redis_url=redis_server.url, redis_bytes=2 * record_bytes
    )
    store = filled(config)
    assert store.leading([h for h, _ in blocks()]) == 0  # the least recently used went first
    assert store.remote is not None
    held = store.remote.contains_many([NAMESPACE.key(h) for h, _ in blocks()])
    assert held == [False, False, True, True]


def test_a_full_write_queue_drops_and_counts_instead_of_waiting(tmp_path) -> None:
    config = KVTierConfig(tiers=("disk",), disk_dir=str(tmp_path), write_queue_blocks=1)
    store = KVBlockStore(config, NAMESPACE)
    offered = [store.offer(h, t, payload(0)) for h, t in blocks() * 50]
    store.flush()
    assert store.stats.dropped_writes == offered.count(False) > 0


def test_a_tier_measured_slower_than_the_prefill_is_not_offered(tmp_path) -> None:
    store = filled(KVTierConfig(tiers=("disk",), disk_dir=str(tmp_path)))
    transfer = BlockTransfer(store, pool=None, block_size=4)
    hashes = [h for h, _ in blocks()]
    assert transfer.leading(hashes) == 4  # nothing measured yet: load, and learn
    store.stats.loaded("disk", PAYLOAD, 0.010)  # a block took 10 ms to load
    transfer.observe_step(100, 5.0)  # too short a prefill to measure by
    transfer.observe_step(1000, 1.0)  # 1 ms a token: a 4-token block prefills in 4 ms
    assert transfer.leading(hashes) == 0 and store.stats.slow_skips == 1
    transfer.observe_step(1000, 100.0)  # the prefill slows down: loading pays again
    assert transfer.leading(hashes) == 4


def test_a_lookup_prefetches_redis_blocks_before_the_load(redis_server) -> None:
    config = KVTierConfig(tiers=("redis",), redis_url=redis_server.url)
    filled(config)
    reader = KVBlockStore(config, NAMESPACE)
    assert BlockTransfer(reader, pool=None, block_size=4).leading([h for h, _ in blocks()]) == 4
    assert reader.prefetcher is not None
    reader.prefetcher.wait()
    redis_server.stop()  # the load that follows needs no round trip: all four are staged
    assert load_all(reader) == ([payload(i) for i in range(4)], None)
    assert reader.stats.hits["redis"] == 4 and not reader.stats.failed_loads
