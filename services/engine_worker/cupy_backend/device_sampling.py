"""Which rows the GPU samples, and their parameters as host arrays for sample_tokens.cu.

The GPU draws every row but those under a response format (a grammar's mask is the host's):
temperature, top-k, top-p and min-p, seeded or not, with the chosen token's logprob and up to
20 top logprobs; and a row's penalties and logit bias, as per-token adjustments the host merges
from the request's tokens (what the torch sampler computes, without copying logits back). A
step whose adjustments would pass MAX_ADJUSTMENTS leaves the rest of its penalized rows to the
host, as does a bias on a token past the vocabulary (the torch sampler fails that request).
Both sides draw with the same counter-based generator, so a seeded request's tokens do not
depend on where it sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy
import torch

from services.engine_worker.cupy_backend.kernels.sample_tokens import ADJUSTMENT_WIDTH, ROW_FIELDS
from services.engine_worker.sampler import sample_key
from services.engine_worker.step_inputs import RequestState
from shared.sampling import SamplingParams

MAX_ADJUSTMENTS = 1 << 16  # per step: 1 MiB of pinned and device memory
_INT32_MAX = int(numpy.iinfo(numpy.int32).max)


@dataclass(frozen=True)
class DeviceRows:
    """A step's sampling as the GPU takes it."""

    arrays: dict[str, numpy.ndarray]  # ROW_FIELDS, one entry per sampled row
    adjustments: numpy.ndarray  # float32 (E, ADJUSTMENT_WIDTH), rows' entries in row order
    on_device: list[bool]  # per row: its token comes from the GPU, not the torch sampler


def adjustments_of(state: RequestState) -> numpy.ndarray:
    """float32 (tokens, 4): token (int32 bits), divisor of a positive logit, scale of a
    negative one, addition; as the torch sampler's penalties (repetition over prompt and
    output, presence and frequency over output) and then its logit bias, one entry per token
    touched."""
    params: SamplingParams = state.sampling
    ids = numpy.asarray(state.token_ids, numpy.int64)
    output = ids[state.prompt_len :]
    touched = [numpy.asarray([token for token, _ in params.logit_bias], numpy.int64)]
    if params.repetition_penalty != 1.0:
        touched.append(ids)
    if params.presence_penalty or params.frequency_penalty:
        touched.append(output)
    tokens = numpy.unique(numpy.concatenate(touched))
    entries = numpy.zeros((tokens.shape[0], ADJUSTMENT_WIDTH), numpy.float32)
    entries.view(numpy.int32)[:, 0] = tokens
    entries[:, 1:3] = 1.0
    if params.repetition_penalty != 1.0:
        seen = numpy.isin(tokens, ids)
        entries[seen, 1] = entries[seen, 2] = params.repetition_penalty
    if output.shape[0]:
        ordered = numpy.sort(output)
        counts = numpy.searchsorted(ordered, tokens, "right") - numpy.searchsorted(ordered, tokens)
        entries[:, 3] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    for token, bias in params.logit_bias:
        entries[numpy.searchsorted(tokens, token), 3] += bias
    return entries


def row_parameters(
    states: Sequence[RequestState], rng: torch.Generator, vocab: int, use_device: bool = True
) -> DeviceRows:
    """use_device False (a step whose logits all go to the host): every row on the host.
    Filled as Python lists, made arrays once: numpy scalar stores cost 3x as much (245 against
    87 µs for 128 sampled rows on a 2-vCPU EPYC)."""
    count = len(states)
    columns: dict[str, list] = {name: [value] * count for name, _, value in ROW_FIELDS}
    temperatures, top_ks, top_ps = columns["temperatures"], columns["top_ks"], columns["top_ps"]
    min_ps, keys, indices = columns["min_ps"], columns["keys"], columns["indices"]
    top_ns, adjust_ends = columns["top_ns"], columns["adjust_ends"]
    pieces: list[numpy.ndarray] = []
    on_device = [False] * count
    used = 0
    for row, state in enumerate(states):
        params = state.sampling
        adjust_ends[row] = used
        if not use_device or state.matcher is not None:
            continue
        if params.has_penalties or params.logit_bias:
            if any(token >= vocab for token, _ in params.logit_bias):
                continue
            entries = adjustments_of(state)
            if used + entries.shape[0] > MAX_ADJUSTMENTS:
                continue
            pieces.append(entries)
            used += entries.shape[0]
            adjust_ends[row] = used
        on_device[row] = True
        top_ns[row] = params.logprobs or 0
        if params.greedy:
            continue
        temperatures[row] = params.temperature
        top_ks[row] = min(params.top_k or 0, _INT32_MAX)
        top_ps[row] = params.top_p
        min_ps[row] = params.min_p
        keys[row], indices[row] = sample_key(state, rng)
    arrays = {name: numpy.array(columns[name], dtype) for name, dtype, _ in ROW_FIELDS}
    empty = numpy.zeros((0, ADJUSTMENT_WIDTH), numpy.float32)
    return DeviceRows(arrays, numpy.concatenate([empty, *pieces]), on_device)
