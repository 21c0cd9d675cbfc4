"""The one workspace of the cupy backend: every intermediate of a forward, allocated once.

Sized for the largest step the scheduler may send (its token budget, its sampled rows, the
longest context's attention splits), it serves every eager step and every captured decode
graph: steps run one after another on one stream, so they never need two. Its size is known
before anything is allocated (`workspace_bytes`), so the memory-fit check counts it with the
weights and the KV pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy

from services.engine_worker.artifacts.architecture import ModelArchitecture
from services.engine_worker.cupy_backend.kernels.library import DTypeSpec
from services.engine_worker.cupy_backend.kernels.paged_decode_attention import (
    DecodeScratch,
    num_splits,
)


@dataclass(frozen=True)
class StepLimits:
    """The largest step: tokens (every one may be a decode row: a recomputed request's
    tokens past its prompt are), sampled rows, and attention splits of the longest context."""

    max_tokens: int
    max_samples: int
    max_splits: int

    @staticmethod
    def of(max_num_batched_tokens: int, max_sampled_rows: int, max_model_len: int) -> StepLimits:
        return StepLimits(max_num_batched_tokens, max_sampled_rows, num_splits(max_model_len))


def _layout(
    arch: ModelArchitecture, spec: DTypeSpec, limits: StepLimits
) -> dict[str, tuple[tuple[int, ...], Any]]:
    tokens, samples = limits.max_tokens, limits.max_samples
    # Decode attention's per-split partials, flat: a step takes the (rows, heads, splits)
    # prefix it needs, so a short context launches one split, not the longest context's.
    scratch = tokens * arch.num_heads * limits.max_splits
    return {
        "residual": ((tokens, arch.hidden_size), spec.storage),
        "normed": ((tokens, arch.hidden_size), spec.storage),
        "qkv": ((tokens, arch.q_size + 2 * arch.kv_size), spec.storage),
        "attn": ((tokens, arch.q_size), spec.storage),
        "proj": ((tokens, arch.hidden_size), spec.storage),
        "gate_up": ((tokens, 2 * arch.intermediate_size), spec.storage),
        "act": ((tokens, arch.intermediate_size), spec.storage),
        "final": ((samples, arch.hidden_size), spec.storage),
        "logits": ((samples, arch.vocab_size), numpy.float32),
        "scratch_out": ((scratch * arch.head_dim,), numpy.float32),
        "scratch_max": ((scratch,), numpy.float32),
        "scratch_sum": ((scratch,), numpy.float32),
    }


def workspace_bytes(arch: ModelArchitecture, spec: DTypeSpec, limits: StepLimits) -> int:
    return sum(
        int(numpy.prod(shape)) * numpy.dtype(dtype).itemsize
        for shape, dtype in _layout(arch, spec, limits).values()
    )


class Workspace:
    def __init__(self, arch: ModelArchitecture, spec: DTypeSpec, limits: StepLimits) -> None:
        import cupy

        self.limits = limits
        buffers = {
            name: cupy.empty(shape, dtype=dtype)
            for name, (shape, dtype) in _layout(arch, spec, limits).items()
        }
        self.residual, self.normed, self.qkv = (buffers[n] for n in ("residual", "normed", "qkv"))
        self.attn, self.proj = buffers["attn"], buffers["proj"]
        self.gate_up, self.act = buffers["gate_up"], buffers["act"]
        self.final, self.logits = buffers["final"], buffers["logits"]
        self._scratch = (buffers["scratch_out"], buffers["scratch_max"], buffers["scratch_sum"])
        self._heads, self._head_dim = arch.num_heads, arch.head_dim
        self.num_bytes = sum(int(buffer.nbytes) for buffer in buffers.values())

    def decode_scratch(self, rows: int, splits: int) -> DecodeScratch:
        """Views of the partials' buffers shaped for `rows` decode rows and `splits` splits."""
        out, maxima, sums = self._scratch
        shape = (max(1, rows), self._heads, splits)
        size = shape[0] * shape[1] * shape[2]
        return DecodeScratch(
            out[: size * self._head_dim].reshape(*shape, self._head_dim),
            maxima[:size].reshape(shape),
            sums[:size].reshape(shape),
        )

    def check_fits(self, tokens: int, samples: int, splits: int) -> None:
        """A step larger than the scheduler's limits is a bug upstream: refused, not run
        over the end of a buffer."""
        limits = self.limits
        if tokens > limits.max_tokens or samples > limits.max_samples or splits > limits.max_splits:
            raise ValueError(
                f"a step of {tokens} tokens, {samples} sampled rows and {splits} attention "
                f"splits exceeds the workspace's limits {limits}"
            )
