"""Launcher of greedy_sample.cu."""

from __future__ import annotations

from typing import Any

import numpy

from services.engine_worker.cupy_backend.kernels.library import kernel


def greedy_sample(logits: Any, tokens: Any, logprobs: Any) -> None:
    """Per row of float32 logits (S, vocab): argmax into tokens (int32) and its log
    probability into logprobs (float32)."""
    rows, vocab = logits.shape
    if rows:
        kernel("greedy_sample", "greedy_sample")(
            (rows,), (1024,), (logits, numpy.int32(vocab), tokens, logprobs)
        )
