"""Sampling parameters of one request, validated once at the edge.

Construction does not validate: the scheduler and the engine-worker decode what the gateway
already checked, and check nothing again. Whoever takes parameters from a user calls
`validate()`: the gateway's admission, the in-process Engine, a model's defaults at load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.errors import KvmeshError, Reason

# A temperature above 0 and below this samples as if it were this (as vLLM does): logits
# divided by 1e-320 are infinite, and the distribution at 0.01 is already all but greedy.
MIN_TEMPERATURE = 0.01
# Dividing or multiplying a logit by a penalty outside this keeps it finite in float32.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


def _invalid(message: str) -> KvmeshError:
    return KvmeshError(Reason.INVALID_SAMPLING_PARAMS, message)


@dataclass(frozen=True)
class ResponseFormat:
    """A constraint on the output: a JSON schema, any JSON object, a regex or a Lark grammar.
    Whether `spec` is valid is the engine-worker's to say (it compiles it: INVALID_SCHEMA)."""

    kind: str  # one of KINDS
    spec: str = ""  # the schema (JSON text), regex or grammar; empty for json_object

    KINDS = ("json_schema", "json_object", "regex", "lark")

    def validate(self) -> ResponseFormat:
        if self.kind not in self.KINDS:
            raise KvmeshError(Reason.INVALID_SCHEMA, f"response format must be one of {self.KINDS}")
        if self.kind != "json_object" and not self.spec:
            raise KvmeshError(Reason.INVALID_SCHEMA, f"a {self.kind} response format needs a spec")
        return self


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Defaults follow vLLM's.

    temperature 0 means greedy; top_k None and top_p 1.0 and min_p 0.0 mean "off".
    logprobs None returns none; N >= 0 returns the sampled token's logprob plus the top N.
    prompt_logprobs likewise for every prompt token after the first (scoring, evaluation).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    response_format: ResponseFormat | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    disable_speculation: bool = False  # no draft tokens for it where the server speculates
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias)))

    def validate(self) -> SamplingParams:
        """Itself, when every field is in range; else INVALID_SAMPLING_PARAMS (or, for the
        response format, INVALID_SCHEMA)."""
        if self.max_tokens < 1:
            raise _invalid(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature < math.inf:
            raise _invalid(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise _invalid(f"top_k must be >= 1 or unset, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise _invalid(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise _invalid(f"min_p must be in [0, 1], got {self.min_p}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise _invalid(
                f"repetition_penalty must be in [{low:g}, {high:g}], got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise _invalid(f"{name} must be in [-2, 2], got {value}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise _invalid(f"logprobs must be in [0, 20] or unset, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise _invalid(
                f"prompt_logprobs must be in [0, 20] or unset, got {self.prompt_logprobs}"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise _invalid("stop_token_ids must be non-negative")
        if any(not -100.0 <= bias <= 100.0 for _, bias in self.logit_bias):
            raise _invalid("logit_bias values must be in [-100, 100]")
        if any(token < 0 for token, _ in self.logit_bias):
            raise _invalid("logit_bias token ids must be non-negative")
        if self.response_format is not None:
            self.response_format.validate()
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
