"""Engine configuration: one frozen dataclass per component, validated at construction."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from shared.errors import KvmeshError, Reason

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GIB": 1 << 30,
}


def parse_bytes(text: str) -> int:
    """'512MiB', '2G', '1048576' -> bytes."""
    stripped = text.strip().upper()
    number = stripped.rstrip("KMGIB")
    unit = stripped[len(number) :]
    try:
        return int(float(number) * _UNITS[unit])
    except (KeyError, ValueError):
        raise KvmeshError(Reason.INVALID_ARGUMENT, f"cannot parse a size from {text!r}") from None


def format_bytes(count: int) -> str:
    """4 << 30 -> '4GiB': a default size as a flag shows it (parse_bytes reads it back)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale and count % scale == 0:
            return f"{count // scale}{unit}"
    return str(count)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise KvmeshError(Reason.INVALID_ARGUMENT, message)


KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


SLIDING_WINDOW_KV = ("window", "full")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: the pool is sized from a memory budget, not from the context length."""

    block_size: int = 16
    kv_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    # auto: float16 where the step compiles (a packed model on the CPU), else the activation
    # dtype; a dtype other than the activations' needs the compiled step (kv_cache.py).
    dtype: str = "auto"
    # window: a sliding layer's K/V behind its window goes back to a pool of its own
    # (shared/sliding_window.py); full: every layer keeps the whole context, so prefix caching,
    # forks and KV tiers work on sliding-window models too.
    sliding_window_kv: str = "window"

    def __post_init__(self) -> None:
        _require(
            self.sliding_window_kv in SLIDING_WINDOW_KV,
            f"sliding window kv must be window or full, got {self.sliding_window_kv!r}",
        )
        _require(
            self.dtype in KV_CACHE_DTYPES,
            f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.dtype!r}",
        )
        _require(
            self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
            f"block_size must be a power of two, got {self.block_size}",
        )
        _require(self.kv_memory_bytes > 0, "kv_memory_bytes must be positive")


SPECULATIVE_METHODS = ("off", "ngram", "suffix")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Draft tokens proposed from text already seen (services/scheduler/speculation.py) and
    verified in the same step as the request's next token."""

    method: str = "off"  # off | ngram (prompt lookup) | suffix (suffix trie, shared outputs)
    # Longest proposal; each request adapts below it. 3: torch's int4 CPU kernel runs rows in
    # tiles of 4, so a lone request's step with 3 drafts costs 1.6x its plain step, with 5
    # drafts 2.7x (measured, default model, packed weights).
    max_draft_tokens: int = 3
    ngram_min: int = 2  # shortest and longest context n-gram the lookup matches
    ngram_max: int = 4
    # What one draft row adds to a one-request decode step, as a share of it: measured on a
    # 2-core CPU with the default model (a 4-row step took 1.6x a 1-row one). A GPU's rows
    # are nearly free until large batches: ~0.02 there.
    draft_row_cost: float = 0.2

    def __post_init__(self) -> None:
        _require(
            self.method in SPECULATIVE_METHODS,
            f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}",
        )
        _require(1 <= self.max_draft_tokens <= 64, "max_draft_tokens must be in 1..64")
        _require(0.0 <= self.draft_row_cost < 1.0, "draft_row_cost must be in [0, 1)")
        _require(
            1 <= self.ngram_min <= self.ngram_max, "ngram sizes need 1 <= ngram_min <= ngram_max"
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Token budget per step; prefill_chunk_size None turns chunked prefill off."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    prefill_chunk_size: int | None = 512
    # A tenant below its fair share gets its prefill in a step without the others' decodes.
    fair_prefill_first: bool = True
    # Plan step N+1 while the worker computes step N (services/scheduler/step_pipeline.py):
    # on, off, or auto (on for a worker on a GPU).
    plan_ahead: str = "auto"
    # A request's tokens go to its caller every this many (the first and the last at once):
    # each delivery is a message through scheduler, gateway and tokenizer.
    stream_interval: int = 1
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    @property
    def max_sampled_rows(self) -> int:
        """Rows whose logits one step may sample: a speculating request samples one per draft
        token and one more."""
        drafts = 0 if self.speculative.method == "off" else self.speculative.max_draft_tokens
        return min(self.max_num_batched_tokens, self.max_num_seqs * (1 + drafts))

    def __post_init__(self) -> None:
        _require(self.max_num_batched_tokens > 0, "max_num_batched_tokens must be positive")
        _require(self.max_num_seqs > 0, "max_num_seqs must be positive")
        _require(
            self.plan_ahead in ("auto", "on", "off"),
            f"plan_ahead must be auto, on or off, got {self.plan_ahead!r}",
        )
        _require(self.stream_interval > 0, "stream_interval must be positive")
        _require(
            self.prefill_chunk_size is None or self.prefill_chunk_size > 0,
            "prefill_chunk_size must be positive or None",
        )


PREPARED_MODES = ("auto", "wait", "off")
KV_TIERS = ("host", "disk", "redis")
REDIS_SCHEMES = ("redis", "rediss", "unix")


def is_redis_url(url: str) -> bool:
    """A URL redis-py can connect with: its scheme, and a host or a socket path."""
    parts = urlsplit(url)
    return parts.scheme in REDIS_SCHEMES and bool(parts.netloc or parts.path)


KV_WRITE_POLICIES = ("through", "back")


@dataclass(frozen=True)
class KVTierConfig:
    """The block store under a worker's pool (services/engine_worker/kv_tiers/): which tiers,
    their budgets, when blocks go down to them and how long a hit must be to be loaded."""

    tiers: tuple[str, ...] = ()  # of KV_TIERS, searched in that order; () is none
    host_bytes: int = 4 << 30
    disk_dir: str = ""  # "" is $KVMESH_CACHE_DIR/kv-blocks
    disk_bytes: int = 20 << 30
    redis_url: str = ""  # the mesh's Redis unless set
    redis_bytes: int = 2 << 30
    # through: a prefix block goes down as soon as it is full (what another worker or a
    # restart can find); back: only when the pool evicts it.
    write: str = "through"
    write_queue_blocks: int = 256  # a full queue drops the write (counted), never waits
    # A shorter tier hit is recomputed. On a 2-core CPU a 256-token load halves TTFT and below
    # 64 tokens it gains nothing (make bench-kv-tiers); a GPU prefills a short prefix faster
    # than Redis returns it, so the line sits at SGLang's 256 for both.
    load_min_tokens: int = 256

    def __post_init__(self) -> None:
        unknown = [tier for tier in self.tiers if tier not in KV_TIERS]
        _require(not unknown, f"kv tiers must be among {', '.join(KV_TIERS)}, got {unknown}")
        _require(
            self.write in KV_WRITE_POLICIES,
            f"kv write policy must be through or back, got {self.write!r}",
        )
        _require(
            "redis" not in self.tiers or bool(self.redis_url),
            "the redis kv tier needs a Redis URL (--kv-redis, or the mesh's --redis)",
        )
        _require(
            not self.redis_url or is_redis_url(self.redis_url),
            f"--kv-redis must be a redis://, rediss:// or unix:// URL, got {self.redis_url!r}",
        )
        _require(self.write_queue_blocks > 0, "the kv write queue needs room for a block")
        _require(self.load_min_tokens >= 0, "kv load min tokens must be >= 0")

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)


SERVING_ROLES = ("mixed", "prefill", "decode")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class HandoverConfig:
    """A scheduler/engine-worker pair's part in the prefill/decode split (docs/guides/
    prefill-decode.md): its role, and how a handover's blocks are held and pulled."""

    role: str = "mixed"  # of SERVING_ROLES
    # The address other workers dial to pull this pair's leased blocks ("" is --worker).
    worker_advertise: str = ""
    # A prefilled request's blocks wait this long for its decode pair (vLLM's NIXL lease: 30 s).
    lease_s: float = 30.0
    # A pull past this gives what arrived; the policy says what becomes of the rest.
    pull_timeout_s: float = 10.0
    load_failure: str = "recompute"  # of KV_LOAD_FAILURE_POLICIES

    def __post_init__(self) -> None:
        _require(self.role in SERVING_ROLES, f"role must be one of {SERVING_ROLES}")
        _require(
            self.load_failure in KV_LOAD_FAILURE_POLICIES,
            f"kv load failure policy must be one of {KV_LOAD_FAILURE_POLICIES}",
        )
        _require(self.lease_s > 0 and self.pull_timeout_s > 0, "handover times must be > 0")


# How projection weights are held: int8 through fbgemm (CPU), or a float dtype. On a GPU the
# weights run in the activation dtype, which is how float16 comes to be one of them.
WEIGHT_FORMATS = ("packed", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class SimConfig:
    """The simulated backend's step time (services/engine_worker/sim_backend/)."""

    step_ms: float = 2.0  # every step, whatever its batch (the flags refuse a negative)
    prefill_ms_per_1k_tokens: float = 0.0  # more per prompt token the step computes


@dataclass(frozen=True)
class EngineConfig:
    """The root: model artifact, backend, and the component configs."""

    model: str | None = None  # GGUF file or HF directory; None = the default model
    backend: str = "torch"
    dtype: str = "float32"  # activations (and the KV cache, unless cache.dtype says otherwise)
    weights: str = "auto"  # auto or one of WEIGHT_FORMATS (linear.py)
    quantize: str | None = None  # int8 | int4: quantize a float checkpoint's projections at load
    max_model_len: int | None = None  # None = the model's own context length
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's choice
    # auto: a packed model on the CPU runs as one compiled graph (compiled_model.py);
    # off: eager. KVMESH_COMPILE sets the default (the test suite's is off, see conftest.py).
    compile: str = field(default_factory=lambda: os.environ.get("KVMESH_COMPILE", "auto"))
    # auto: load a prepared artifact matching this worker, else prepare one and store it (a
    # served worker answers on the eager step meanwhile); wait: the same, ready once prepared;
    # off: prepare in memory only. KVMESH_PREPARED sets the default (the test suite's is off,
    # see conftest.py).
    prepared: str = field(default_factory=lambda: os.environ.get("KVMESH_PREPARED", "auto"))
    prepared_dir: str | None = None  # searched first and written to; else the cache folder
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_tiers: KVTierConfig = field(default_factory=KVTierConfig)
    sim: SimConfig = field(default_factory=SimConfig)  # read by --backend sim alone

    def __post_init__(self) -> None:
        _require(
            self.dtype in ("float32", "float16", "bfloat16"),
            f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}",
        )
        _require(
            self.weights in ("auto", *WEIGHT_FORMATS),
            f"weights must be auto or one of {', '.join(WEIGHT_FORMATS)}, got {self.weights!r}",
        )
        _require(
            self.quantize in (None, "int8", "int4"),
            f"quantize must be int8 or int4, got {self.quantize!r}",
        )
        _require(
            self.quantize is None or self.weights in ("auto", "packed"),
            f"--quantize {self.quantize} needs --weights packed or auto",
        )
        _require(self.max_model_len is None or self.max_model_len > 1, "max_model_len must be > 1")
        _require(
            self.compile in ("auto", "off"), f"compile must be auto or off, got {self.compile!r}"
        )
        _require(
            self.prepared in PREPARED_MODES,
            f"prepared must be one of {', '.join(PREPARED_MODES)}, got {self.prepared!r}",
        )
