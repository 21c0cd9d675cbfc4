"""Which rows the GPU samples, and their parameters as host arrays for sample_tokens.cu.

The GPU draws every row whose distribution is the logits alone: temperature, top-k, top-p and
min-p, seeded or not, with the chosen token's logprob and up to 20 top logprobs. Rows with
penalties, a logit bias or a response format need the request's history or a grammar: their
logits go to the host and the shared torch sampler, which draws with the same counter-based
generator, so a seeded request's tokens do not depend on where it sampled.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy
import torch

from services.engine_worker.cupy_backend.kernels.sample_tokens import ROW_FIELDS
from services.engine_worker.sampler import sample_key
from services.engine_worker.step_inputs import RequestState


def on_gpu_sampler(state: RequestState) -> bool:
    params = state.sampling
    return not params.has_penalties and not params.logit_bias and state.matcher is None


def row_parameters(
    states: Sequence[RequestState], rng: torch.Generator
) -> dict[str, numpy.ndarray]:
    """One entry per sampled row and field of ROW_FIELDS; a row the host samples, or a greedy
    one, keeps the argmax defaults."""
    arrays = {name: numpy.full(len(states), value, dtype) for name, dtype, value in ROW_FIELDS}
    for row, state in enumerate(states):
        params = state.sampling
        if not on_gpu_sampler(state):
            continue
        arrays["top_ns"][row] = params.logprobs or 0
        if params.greedy:
            continue
        arrays["temperatures"][row] = params.temperature
        arrays["top_ks"][row] = min(params.top_k or 0, numpy.iinfo(numpy.int32).max)
        arrays["top_ps"][row] = params.top_p
        arrays["min_ps"][row] = params.min_p
        arrays["keys"][row], arrays["indices"][row] = sample_key(state, rng)
    return arrays
