"""Launcher of sample_tokens.cu, and each sampled row's parameters as the kernel reads them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy

from services.engine_worker.cupy_backend.kernels.library import kernel

THREADS = 1024
MAX_TOP = 20  # top-N logprobs a row may ask for (SamplingParams.logprobs <= 20)
# One token's penalties and bias, as the kernel's struct Adjustment: int32 token (its bits in
# column 0), float32 divisor of a positive logit, scale of a negative one, and an addition.
ADJUSTMENT_WIDTH = 4

# name, dtype, the value of a row the kernel only takes the argmax of
ROW_FIELDS = (
    ("temperatures", numpy.float32, 0.0),
    ("top_ks", numpy.int32, 0),
    ("top_ps", numpy.float32, 1.0),
    ("min_ps", numpy.float32, 0.0),
    ("keys", numpy.uint64, 0),
    ("indices", numpy.uint64, 0),
    ("top_ns", numpy.int32, 0),
    ("adjust_ends", numpy.int32, 0),  # where each row's adjustments end (a running count)
)


@dataclass(frozen=True)
class SamplingRows:
    """Per sampled row: temperature (0: argmax), top-k (0: off), top-p (1: off), min-p (0:
    off), the draw's counter key and index, how many top logprobs it wants, and where its
    adjustments end in `adjustments` (float32 (E, 4)). Device arrays of S rows each."""

    temperatures: Any
    top_ks: Any
    top_ps: Any
    min_ps: Any
    keys: Any
    indices: Any
    top_ns: Any
    adjust_ends: Any
    adjustments: Any


def sample_tokens(
    logits: Any, rows: SamplingRows, tokens: Any, logprobs: Any, top_ids: Any, top_logprobs: Any
) -> None:
    """Per row of float32 logits (S, vocab), adjusted in place by its penalties and bias: its
    token into tokens (int32) and the token's log probability under the raw logits into
    logprobs (float32); its top_ns[r] best tokens and their logprobs into the first entries
    of top_ids (S, MAX_TOP) and top_logprobs."""
    count, vocab = logits.shape
    if count:
        kernel("sample_tokens", "sample_tokens")(
            (count,),
            (THREADS,),
            (
                logits,
                numpy.int32(vocab),
                rows.temperatures,
                rows.top_ks,
                rows.top_ps,
                rows.min_ps,
                rows.keys,
                rows.indices,
                rows.top_ns,
                rows.adjust_ends,
                rows.adjustments,
                numpy.int32(top_ids.shape[1]),
                tokens,
                logprobs,
                top_ids,
                top_logprobs,
            ),
        )
