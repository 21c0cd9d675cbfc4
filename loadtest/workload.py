"""Workloads as files: prompt and output length distributions, sampling, cancellations and
deadlines, turned into the same list of requests for every target from a seed.

A workload is a TOML file (`loadtest/workloads/*.toml`, or any path). Prompts are random token
ids (as costly to compute as text, and the same for every server); with `prefix_tokens` and
`prefix_groups`, each prompt starts with one of that many shared prefixes.

    [prompt]  kind = "lognormal", median, sigma, low, high  |  kind = "uniform", low, high
              kind = "choice", values = [...]  (cycled in order: a fixed grid)
              kind = "fixed", value
    [output]  the same kinds, in tokens to generate
    [sampling] temperature, top_p, top_k, ignore_eos, seed
    cancel_rate: share of requests the client cancels after a random part of its answer
    deadline_rate, deadline_ms: share of requests sent with that deadline
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

WORKLOAD_DIR = Path(__file__).resolve().parent / "workloads"
FIRST_ID = 100  # random prompt ids start above the special tokens


@dataclass(frozen=True)
class Lengths:
    kind: str
    params: dict[str, Any]

    def sampler(self, rng: random.Random) -> Callable[[int], int]:
        p, kind = self.params, self.kind
        if kind == "fixed":
            return lambda index: int(p["value"])
        if kind == "choice":
            values = [int(v) for v in p["values"]]
            return lambda index: values[index % len(values)]
        if kind == "uniform":
            return lambda index: rng.randint(int(p["low"]), int(p["high"]))
        if kind == "lognormal":
            mu, sigma = math.log(float(p["median"])), float(p["sigma"])
            low, high = int(p.get("low", 1)), int(p.get("high", 1 << 30))
            return lambda index: min(high, max(low, round(rng.lognormvariate(mu, sigma))))
        raise ValueError(f"unknown length distribution {kind!r}")


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt: list[int]
    max_tokens: int
    sampling: dict[str, Any]
    cancel_after_tokens: int | None = None  # the client cancels after this many tokens
    deadline_ms: int = 0  # 0: none


@dataclass(frozen=True)
class Workload:
    name: str
    requests: int
    seed: int
    prompt: Lengths
    output: Lengths
    sampling: dict[str, Any] = field(default_factory=dict)
    prefix_tokens: int = 0
    prefix_groups: int = 0
    cancel_rate: float = 0.0
    deadline_rate: float = 0.0
    deadline_ms: int = 0

    @staticmethod
    def load(name_or_path: str) -> Workload:
        path = Path(name_or_path)
        if not path.exists():
            path = WORKLOAD_DIR / f"{name_or_path}.toml"
        if not path.exists():
            known = ", ".join(sorted(p.stem for p in WORKLOAD_DIR.glob("*.toml")))
            raise ValueError(f"no workload {name_or_path!r}: a TOML path, or one of {known}")
        with open(path, "rb") as handle:
            raw = tomllib.load(handle)

        def lengths(table: dict[str, Any]) -> Lengths:
            params = dict(table)
            return Lengths(params.pop("kind"), params)

        return Workload(
            name=raw.get("name", path.stem),
            requests=int(raw.get("requests", 100)),
            seed=int(raw.get("seed", 0)),
            prompt=lengths(raw["prompt"]),
            output=lengths(raw["output"]),
            sampling=dict(raw.get("sampling", {})),
            prefix_tokens=int(raw.get("prefix_tokens", 0)),
            prefix_groups=int(raw.get("prefix_groups", 0)),
            cancel_rate=float(raw.get("cancel_rate", 0.0)),
            deadline_rate=float(raw.get("deadline_rate", 0.0)),
            deadline_ms=int(raw.get("deadline_ms", 0)),
        )

    def build(
        self, vocab_size: int, count: int | None = None, max_context: int | None = None
    ) -> list[RequestSpec]:
        """`count` requests (default: the file's), the same for a seed whatever the target.
        `max_context` caps prompt + output (a server refuses what cannot fit)."""
        rng = random.Random(self.seed)
        prompt_len, output_len = self.prompt.sampler(rng), self.output.sampler(rng)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(FIRST_ID, vocab_size) for _ in range(n)]

        prefixes = [tokens(self.prefix_tokens) for _ in range(self.prefix_groups)]
        specs = []
        for index in range(self.requests if count is None else count):
            prompt = tokens(prompt_len(index))
            if prefixes:
                prompt = prefixes[index % len(prefixes)] + prompt
            max_tokens = output_len(index)
            if max_context is not None:
                prompt = prompt[: max(1, max_context - 8)]
                max_tokens = max(1, min(max_tokens, max_context - len(prompt)))
            cancel = None
            if rng.random() < self.cancel_rate:
                cancel = rng.randint(1, max(1, max_tokens - 1))
            deadline = self.deadline_ms if rng.random() < self.deadline_rate else 0
            specs.append(
                RequestSpec(index, prompt, max_tokens, dict(self.sampling), cancel, deadline)
            )
        return specs
