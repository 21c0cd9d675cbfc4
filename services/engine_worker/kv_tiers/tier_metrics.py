"""What the KV tiers did, per tier: Prometheus counters for the mesh, and the same figures per
store (`TierStats`) for tests and benchmarks, which may run several stores in one process."""

from __future__ import annotations

from collections import Counter as Tally
from dataclasses import dataclass, field

from prometheus_client import Counter

HITS = Counter("kvmesh_kv_tier_hits", "KV blocks loaded from a tier", ["tier"])
MISSES = Counter("kvmesh_kv_tier_misses", "KV blocks a load looked for and no tier had", ["tier"])
LOAD_BYTES = Counter("kvmesh_kv_tier_load_bytes", "Bytes of KV blocks loaded", ["tier"])
LOAD_SECONDS = Counter("kvmesh_kv_tier_load_seconds", "Seconds spent loading KV blocks", ["tier"])
WRITES = Counter("kvmesh_kv_tier_writes", "KV blocks written to a tier", ["tier"])
WRITE_BYTES = Counter("kvmesh_kv_tier_write_bytes", "Bytes of KV blocks written", ["tier"])
WRITE_SECONDS = Counter("kvmesh_kv_tier_write_seconds", "Seconds spent writing KV blocks", ["tier"])
FAILED_LOADS = Counter(
    "kvmesh_kv_tier_failed_loads",
    "KV block loads that failed (recomputed instead), by reason",
    ["tier", "reason"],
)
FAILED_WRITES = Counter("kvmesh_kv_tier_failed_writes", "KV block writes a tier refused", ["tier"])
SLOW_TIER_SKIPS = Counter(
    "kvmesh_kv_tier_slow_skips",
    "Tier hits not offered for loading: the tier measured slower than the prefill they save",
)
DROPPED_WRITES = Counter(
    "kvmesh_kv_tier_dropped_writes", "KV block writes dropped because the write queue was full"
)


@dataclass
class TierStats:
    hits: Tally[str] = field(default_factory=Tally)
    misses: Tally[str] = field(default_factory=Tally)
    load_bytes: Tally[str] = field(default_factory=Tally)
    load_seconds: dict[str, float] = field(default_factory=dict)
    writes: Tally[str] = field(default_factory=Tally)
    write_bytes: Tally[str] = field(default_factory=Tally)
    write_seconds: dict[str, float] = field(default_factory=dict)
    failed_loads: Tally[str] = field(default_factory=Tally)  # by "tier:reason"
    failed_writes: Tally[str] = field(default_factory=Tally)
    dropped_writes: int = 0
    slow_skips: int = 0

    def loaded(self, tier: str, num_bytes: int, seconds: float) -> None:
        self.hits[tier] += 1
        self.load_bytes[tier] += num_bytes
        self.load_seconds[tier] = self.load_seconds.get(tier, 0.0) + seconds
        HITS.labels(tier).inc()
        LOAD_BYTES.labels(tier).inc(num_bytes)
        LOAD_SECONDS.labels(tier).inc(seconds)

    def missed(self, tier: str) -> None:
        self.misses[tier] += 1
        MISSES.labels(tier).inc()

    def load_failed(self, tier: str, reason: str) -> None:
        self.failed_loads[f"{tier}:{reason}"] += 1
        FAILED_LOADS.labels(tier, reason).inc()

    def wrote(self, tier: str, num_bytes: int, seconds: float) -> None:
        self.writes[tier] += 1
        self.write_bytes[tier] += num_bytes
        self.write_seconds[tier] = self.write_seconds.get(tier, 0.0) + seconds
        WRITES.labels(tier).inc()
        WRITE_BYTES.labels(tier).inc(num_bytes)
        WRITE_SECONDS.labels(tier).inc(seconds)

    def write_failed(self, tier: str) -> None:
        self.failed_writes[tier] += 1
        FAILED_WRITES.labels(tier).inc()

    def skipped_slow(self) -> None:
        self.slow_skips += 1
        SLOW_TIER_SKIPS.inc()

    def dropped(self) -> None:
        self.dropped_writes += 1
        DROPPED_WRITES.inc()
