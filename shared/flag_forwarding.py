"""Parsed flags back as arguments: what a launcher forwards to the services it starts."""

from __future__ import annotations

import argparse

from shared.kv_tier_flags import kv_tier_flag_args
from shared.step_limit_flags import step_limit_flag_args


def worker_flag_args(args: argparse.Namespace) -> list[str]:
    """Parsed worker flags back as arguments, for a launcher to forward (model and threads are
    the launcher's own)."""
    forwarded = ["--backend", args.backend, "--dtype", args.dtype, "--kv-memory", args.kv_memory]
    forwarded += ["--weights", args.weights] + (
        ["--quantize", args.quantize] if args.quantize else []
    )
    forwarded += ["--block-size", str(args.block_size), "--compile", args.compile]
    forwarded += ["--kv-cache-dtype", args.kv_cache_dtype, "--prepared", args.prepared]
    forwarded += ["--prepared-dir", args.prepared_dir] if args.prepared_dir else []
    if args.max_model_len is not None:
        forwarded += ["--max-model-len", str(args.max_model_len)]
    return forwarded + kv_tier_flag_args(args)


def scheduler_flag_args(args: argparse.Namespace) -> list[str]:
    forwarded = [*step_limit_flag_args(args), "--chunk-size", str(args.chunk_size)]
    forwarded += ["--no-fair-prefill-first"] if args.no_fair_prefill_first else []
    forwarded += ["--plan-ahead", args.plan_ahead] if args.plan_ahead != "auto" else []
    if args.stream_interval != 1:
        forwarded += ["--stream-interval", str(args.stream_interval)]
    return forwarded + (["--no-prefix-caching"] if args.no_prefix_caching else [])
