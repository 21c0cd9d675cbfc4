"""The step limits: what bounds one step's size. The scheduler plans within them and the
engine-worker sizes its step buffers for them, so both take them and a launcher forwards them to
both (services/scheduler/step_limits.py checks at connection time that they agree)."""

from __future__ import annotations

import argparse

from shared.config import SPECULATIVE_METHODS, SchedulerConfig, SpeculativeConfig
from shared.runtime.settings import SCHEDULER, WORKER, Setting, add_settings, whole

_GROUP = "step limits (scheduler and engine-worker)"
_BOTH = (WORKER, SCHEDULER)

STEP_LIMIT_SETTINGS = (
    Setting(
        "max-batched-tokens",
        2048,
        "token budget per step",
        whole(1),
        group=_GROUP,
        takers=_BOTH,
        per_model=True,
    ),
    Setting(
        "max-num-seqs", 128, "most requests running at once", whole(1), group=_GROUP, takers=_BOTH
    ),
    Setting(
        "speculative",
        "off",
        "draft tokens from the request's own text, verified in the same step: ngram "
        "(prompt lookup) or suffix (a suffix trie of the request and recent outputs)",
        choices=SPECULATIVE_METHODS,
        group=_GROUP,
        takers=_BOTH,
    ),
    Setting(
        "num-speculative-tokens",
        SpeculativeConfig.max_draft_tokens,
        "longest proposal; each request adapts its own length below it",
        whole(1),
        group=_GROUP,
        takers=_BOTH,
    ),
)


def step_limit_config(args: argparse.Namespace) -> SchedulerConfig:
    """A SchedulerConfig with the limits set and every other batching value its default."""
    return SchedulerConfig(
        max_num_batched_tokens=args.max_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        speculative=SpeculativeConfig(args.speculative, args.num_speculative_tokens),
    )


def step_limit_args_of(scheduler_args: list[str]) -> list[str]:
    """The step limits a scheduler's arguments give (defaults where they say nothing), as
    arguments for its engine-worker: a launcher gives both processes of a pair the same."""
    parser = argparse.ArgumentParser(add_help=False)
    add_settings(parser, STEP_LIMIT_SETTINGS)
    known, _ = parser.parse_known_args(scheduler_args)
    return [part for s in STEP_LIMIT_SETTINGS for part in s.as_args(getattr(known, s.dest))]
