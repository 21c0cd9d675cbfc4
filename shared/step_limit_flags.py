"""The step limit flags: what bounds one step's size. The scheduler plans within them and the
engine-worker sizes its step buffers for them, so both take them and a launcher forwards them to
both (services/scheduler/step_limits.py checks that they agree)."""

from __future__ import annotations

import argparse

from shared.config import SPECULATIVE_METHODS, SchedulerConfig, SpeculativeConfig
from shared.flag_env import env_default, env_int


def add_step_limit_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("step limits (scheduler and engine-worker)")
    group.add_argument(
        "--max-batched-tokens",
        type=int,
        default=env_int("max-batched-tokens", 2048),
        help="token budget per step",
    )
    group.add_argument(
        "--max-num-seqs",
        type=int,
        default=env_int("max-num-seqs", 128),
        help="most requests running at once",
    )
    group.add_argument(
        "--speculative",
        choices=SPECULATIVE_METHODS,
        default=env_default("speculative", "off"),
        help="draft tokens from the request's own text, verified in the same step: ngram "
        "(prompt lookup) or suffix (a suffix trie of the request and recent outputs)",
    )
    group.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=env_int("num-speculative-tokens", SpeculativeConfig.max_draft_tokens),
        help="longest proposal; each request adapts its own length below it",
    )


def step_limit_config(args: argparse.Namespace) -> SchedulerConfig:
    """A SchedulerConfig with the limits set and every other batching value its default."""
    return SchedulerConfig(
        max_num_batched_tokens=args.max_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        speculative=SpeculativeConfig(args.speculative, args.num_speculative_tokens),
    )


def step_limit_flag_args(args: argparse.Namespace) -> list[str]:
    """Parsed step limits back as arguments, for a launcher to forward to both processes."""
    forwarded = ["--max-batched-tokens", str(args.max_batched_tokens)]
    forwarded += ["--max-num-seqs", str(args.max_num_seqs), "--speculative", args.speculative]
    return [*forwarded, "--num-speculative-tokens", str(args.num_speculative_tokens)]


def step_limit_args_of(scheduler_args: list[str]) -> list[str]:
    """The step limits a scheduler's arguments give (defaults where they say nothing), as
    arguments for its engine-worker: a launcher gives both processes of a pair the same."""
    parser = argparse.ArgumentParser(add_help=False)
    add_step_limit_flags(parser)
    known, _ = parser.parse_known_args(scheduler_args)
    return step_limit_flag_args(known)
