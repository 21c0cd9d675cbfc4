"""Engine flags shared by the CLI and the services, each defaulting to KVMESH_<FLAG> when set.

The engine-worker owns the model and KV pool flags, the scheduler the batching ones; the
in-process CLI takes both.
"""

from __future__ import annotations

import argparse
import dataclasses

from shared.config import (
    KV_CACHE_DTYPES,
    PREPARED_MODES,
    WEIGHT_FORMATS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    parse_bytes,
)
from shared.flag_env import env_default, env_int
from shared.kv_tier_flags import add_kv_tier_flags, kv_tier_config
from shared.step_limit_flags import add_step_limit_flags, step_limit_config


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model",
        default=env_default("model", None),
        help="GGUF file or HF model directory (default: SmolLM2-135M-Instruct)",
    )
    group.add_argument(
        "--backend",
        default=env_default("backend", "auto"),
        choices=["auto", "torch", "cupy"],
        help="compute backend; auto: cupy when CuPy sees a GPU, else torch",
    )
    group.add_argument(
        "--dtype",
        default=env_default("dtype", "float32"),
        choices=["float32", "bfloat16", "float16"],
    )
    group.add_argument(
        "--weights",
        default=env_default("weights", "auto"),
        choices=["auto", *WEIGHT_FORMATS],
        help="torch backend weight format; packed: a Q4 file's own 4-bit groups on AVX-512 CPUs, "
        "int8 rows through fbgemm otherwise; auto: packed for a quantized file or with "
        "--quantize, else float32",
    )
    group.add_argument(
        "--quantize",
        default=env_default("quantize", None),
        choices=["int8", "int4"],
        help="quantize a float checkpoint's projections at load (packed weights): int8 rows, or "
        "4-bit groups of 32 (llama.cpp's Q4_1 recipe; int8 rows on CPUs without AVX-512)",
    )
    group.add_argument(
        "--compile",
        default=env_default("compile", "auto"),
        choices=["auto", "off"],
        help="auto: a packed model on the CPU runs each step as one TorchInductor graph "
        "(compiled at warm-up: 35-165 s the first time, seconds from the disk cache); off: eager",
    )
    group.add_argument(
        "--prepared",
        default=env_default("prepared", "auto"),
        choices=PREPARED_MODES,
        help="auto: load a prepared artifact (packed weights, compiled step) made for this "
        "model, machine and runtime, else prepare one and store it for the next start, a served "
        "worker answering on the eager step while its compiled step compiles; wait: the same, "
        "ready only once prepared; off: prepare in memory only",
    )
    group.add_argument(
        "--prepared-dir",
        default=env_default("prepared-dir", None),
        help="a folder of prepared artifacts searched first and written to (`kvmesh prepare "
        "--out`); default: the repository version's prepared/, then $KVMESH_CACHE_DIR/prepared",
    )
    group.add_argument(
        "--kv-memory", default=env_default("kv-memory", "1GiB"), help="KV cache budget, e.g. 512MiB"
    )
    group.add_argument(
        "--kv-cache-dtype",
        default=env_default("kv-cache-dtype", "auto"),
        choices=list(KV_CACHE_DTYPES),
        help="KV cache element type; auto: float16 where the step compiles (a packed model on "
        "the CPU: half the bytes per token, as llama.cpp keeps it), else the activation dtype",
    )
    group.add_argument(
        "--block-size", type=int, default=env_int("block-size", 16), help="tokens per KV block"
    )
    group.add_argument(
        "--max-model-len",
        type=int,
        default=env_int("max-model-len", None),
        help="context length cap (default: the model's)",
    )
    add_kv_tier_flags(parser)
    group.add_argument(
        "--threads",
        type=int,
        default=env_int("threads", None),
        help="torch CPU threads (default: torch's choice)",
    )
    add_step_limit_flags(parser)


def add_scheduler_flags(parser: argparse.ArgumentParser, step_limits: bool = True) -> None:
    """step_limits False: a parser that already has them (add_worker_flags adds them too)."""
    if step_limits:
        add_step_limit_flags(parser)
    group = parser.add_argument_group("batching")
    group.add_argument(
        "--chunk-size",
        type=int,
        default=env_int("chunk-size", 512),
        help="prefill chunk size; 0 turns chunked prefill off",
    )
    group.add_argument(
        "--no-prefix-caching",
        action="store_true",
        default=env_default("no-prefix-caching", "") not in ("", "0", "false"),
        help="turn automatic prefix caching off",
    )
    group.add_argument(
        "--no-fair-prefill-first",
        action="store_true",
        default=env_default("no-fair-prefill-first", "") not in ("", "0", "false"),
        help="run a below-share tenant's prefill beside the running decodes, not before them",
    )
    group.add_argument(
        "--plan-ahead",
        default=env_default("plan-ahead", "auto"),
        choices=("auto", "on", "off"),
        help="plan each step while the worker computes the one before (auto: on when the "
        "worker computes on a GPU; lock-step with speculative decoding)",
    )
    group.add_argument(
        "--stream-interval",
        type=int,
        default=env_int("stream-interval", 1),
        help="send a request's tokens to its caller every N tokens (the first and the last at "
        "once): fewer messages through the mesh per token, burstier streams",
    )


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    add_worker_flags(parser)
    add_scheduler_flags(parser, step_limits=False)


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    """From the step limits, plus the batching flags where the parser has them (a worker's
    has only the limits, which is all its buffers depend on)."""
    limits = step_limit_config(args)
    if not hasattr(args, "chunk_size"):
        return limits
    return dataclasses.replace(
        limits,
        prefill_chunk_size=args.chunk_size or None,
        fair_prefill_first=not args.no_fair_prefill_first,
        plan_ahead=args.plan_ahead,
        stream_interval=args.stream_interval,
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """From worker flags, plus scheduler flags where the parser has them."""
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
            enable_prefix_caching=not getattr(args, "no_prefix_caching", False),
        ),
        scheduler=scheduler_config(args),
        kv_tiers=kv_tier_config(args),
    )
