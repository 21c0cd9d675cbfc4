"""The engine-worker's settings, each declared once (shared/runtime/settings.py), and the
configs built from them: the model and its KV pool, the KV tiers below the pool, the breaker."""

from __future__ import annotations

import argparse
from typing import Any

from services.engine_worker.kv_tiers.config import KV_TIER_SETTINGS, kv_tier_config
from shared.config import (
    KV_CACHE_DTYPES,
    PREPARED_MODES,
    SLIDING_WINDOW_KV,
    WEIGHT_FORMATS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SimConfig,
    format_bytes,
    parse_bytes,
)
from shared.runtime.service import service_parser
from shared.runtime.settings import (
    UP,
    WORKER,
    Setting,
    decimal,
    size,
    whole,
)
from shared.step_limits import STEP_LIMIT_SETTINGS, step_limit_config

DEFAULT_PORT = 50061
_DESCRIPTION = "load, validate and warm the model, then serve steps"


class BreakerDefaults:
    max_failures = 8
    window_s = 60.0
    cooldown_s = 30.0


_MODEL = "model"
_PER_PAIR: dict[str, Any] = dict(group=_MODEL, takers=(WORKER,), per_model=True)

MODEL_SETTINGS = (
    Setting(
        "model",
        None,
        "GGUF file or HF model directory (default: SmolLM2-135M-Instruct)",
        group=_MODEL,
        takers=(UP,),  # the launcher gives each pair its own
    ),
    Setting(
        "backend",
        "auto",
        "compute backend; auto: cupy when CuPy sees a GPU, else torch; sim: no model "
        "computed, tokens drawn per seed at --sim-step-ms a step (to measure the serving path)",
        choices=("auto", "torch", "cupy", "sim"),
        **_PER_PAIR,
    ),
    Setting(
        "sim-step-ms",
        SimConfig.step_ms,
        "--backend sim: the wall time of every step, whatever its batch",
        decimal(0.0),
        **_PER_PAIR,
    ),
    Setting(
        "sim-prefill-ms-per-1k-tokens",
        SimConfig.prefill_ms_per_1k_tokens,
        "--backend sim: more wall time per 1,000 prompt tokens a step computes",
        decimal(0.0),
        **_PER_PAIR,
    ),
    Setting(
        "dtype",
        EngineConfig.dtype,
        None,
        choices=("float32", "bfloat16", "float16"),
        **_PER_PAIR,
    ),
    Setting(
        "weights",
        EngineConfig.weights,
        "torch backend weight format; packed: a Q4 file's own 4-bit groups on AVX-512 CPUs, "
        "int8 rows through fbgemm otherwise; auto: packed for a quantized file or with "
        "--quantize, else float32",
        choices=("auto", *WEIGHT_FORMATS),
        **_PER_PAIR,
    ),
    Setting(
        "quantize",
        None,
        "quantize a float checkpoint's projections at load (packed weights): int8 rows, or "
        "4-bit groups of 32 (llama.cpp's Q4_1 recipe; int8 rows on CPUs without AVX-512)",
        choices=("int8", "int4"),
        **_PER_PAIR,
    ),
    Setting(
        "compile",
        "auto",
        "auto: a packed model on the CPU runs each step as one TorchInductor graph "
        "(compiled at warm-up: 35-165 s the first time, seconds from the disk cache); off: eager",
        choices=("auto", "off"),
        group=_MODEL,
        takers=(WORKER,),
    ),
    Setting(
        "prepared",
        "auto",
        "auto: load a prepared artifact (packed weights, compiled step) made for this "
        "model, machine and runtime, else prepare one and store it for the next start, a served "
        "worker answering on the eager step while its compiled step compiles; wait: the same, "
        "ready only once prepared; off: prepare in memory only",
        choices=PREPARED_MODES,
        group=_MODEL,
        takers=(WORKER,),
    ),
    Setting(
        "prepared-dir",
        None,
        "a folder of prepared artifacts searched first and written to (`kvmesh prepare "
        "--out`); default: the repository version's prepared/, then $KVMESH_CACHE_DIR/prepared",
        group=_MODEL,
        takers=(WORKER,),
    ),
    Setting(
        "kv-memory",
        format_bytes(CacheConfig.kv_memory_bytes),
        "KV cache budget, e.g. 512MiB",
        size,
        **_PER_PAIR,
    ),
    Setting(
        "kv-cache-dtype",
        CacheConfig.dtype,
        "KV cache element type; auto: float16 where the step compiles (a packed model on "
        "the CPU: half the bytes per token, as llama.cpp keeps it), else the activation dtype",
        choices=KV_CACHE_DTYPES,
        **_PER_PAIR,
    ),
    Setting("block-size", CacheConfig.block_size, "tokens per KV block", whole(1), **_PER_PAIR),
    Setting(
        "sliding-window-kv",
        CacheConfig.sliding_window_kv,
        "sliding layers' K/V (Gemma 2 and 3); window: only each request's window is kept, in "
        "a pool of its own (no prefix caching, forks or KV tiers for such a model); full: the "
        "whole context, as every other layer",
        choices=SLIDING_WINDOW_KV,
        **_PER_PAIR,
    ),
    Setting(
        "max-model-len",
        None,
        "context length cap (default: the model's)",
        whole(2),
        **_PER_PAIR,
    ),
    Setting(
        "threads",
        None,
        "torch CPU threads (default: torch's choice; under `kvmesh up`, the cores shared "
        "among the workers)",
        whole(1),
        group=_MODEL,
        takers=(UP,),  # the launcher gives each worker its share
    ),
)

_FAILURES = "failures"

SERVICE_SETTINGS = (
    Setting(
        "served-model-name",
        None,
        "the name clients use for the model (default: the repository entry's, else the "
        "artifact's file or folder name)",
    ),
    Setting(
        "max-embed-batch-tokens",
        16384,
        "embedding models: padded tokens (inputs x longest) per forward pass; 1: one "
        "input at a time",
        whole(1),
    ),
    Setting(
        "breaker-failures",
        BreakerDefaults.max_failures,
        "failed requests within --breaker-window-seconds that turn this worker not ready "
        "(its scheduler drains it, traffic moves); 0: never",
        whole(0),
        group=_FAILURES,
        takers=(WORKER,),
    ),
    Setting(
        "breaker-window-seconds",
        BreakerDefaults.window_s,
        None,
        decimal(0.0),
        group=_FAILURES,
        takers=(WORKER,),
    ),
    Setting(
        "breaker-cooldown-seconds",
        BreakerDefaults.cooldown_s,
        "how long a tripped worker stays not ready before it serves again",
        decimal(0.0),
        group=_FAILURES,
        takers=(WORKER,),
    ),
    Setting(
        "inject-fault-token",
        None,
        "tests only: TOKEN_ID[:AFTER][:worker],... fails every request whose prompt holds "
        "TOKEN_ID once it has AFTER output tokens (default 1); with :worker, every request from "
        "then on",
        group=_FAILURES,
    ),
)

# What an engine reads (the in-process one of `kvmesh generate` too): model, pool, tiers, limits.
ENGINE_SETTINGS = (*MODEL_SETTINGS, *KV_TIER_SETTINGS, *STEP_LIMIT_SETTINGS)
SETTINGS = (*ENGINE_SETTINGS, *SERVICE_SETTINGS)


def build_parser() -> argparse.ArgumentParser:
    """Every flag of this service (the configuration reference is generated from it)."""
    return service_parser("services.engine_worker", _DESCRIPTION, DEFAULT_PORT, SETTINGS)


def engine_config(
    args: argparse.Namespace, scheduler: SchedulerConfig | None = None
) -> EngineConfig:
    """From the engine settings; `scheduler`: the batching config where the caller has more
    than the step limits (a worker's buffers depend on those alone)."""
    return EngineConfig(
        model=args.model,
        backend=args.backend,
        dtype=args.dtype,
        weights=args.weights,
        quantize=args.quantize,
        compile=args.compile,
        prepared=args.prepared,
        prepared_dir=args.prepared_dir,
        max_model_len=args.max_model_len,
        num_threads=args.threads,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_memory_bytes=parse_bytes(args.kv_memory),
            dtype=args.kv_cache_dtype,
            sliding_window_kv=args.sliding_window_kv,
            enable_prefix_caching=not getattr(args, "no_prefix_caching", False),
        ),
        scheduler=scheduler or step_limit_config(args),
        kv_tiers=kv_tier_config(args),
        sim=SimConfig(args.sim_step_ms, args.sim_prefill_ms_per_1k_tokens),
    )
