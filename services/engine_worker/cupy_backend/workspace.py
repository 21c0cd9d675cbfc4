"""The one workspace of the cupy backend: every intermediate of a forward, allocated once.

Sized for the largest step the scheduler may send (its token budget and sampled rows; decode
attention's splits per row follow from the row count and the SM count, not the context), it
serves every eager step and every captured decode graph: steps run one after another on one
stream, so they never need two. Its size is known before anything is allocated
(`workspace_bytes`), so the memory-fit check counts it with the weights and the KV pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy

from services.engine_worker.artifacts.architecture import ModelArchitecture
from services.engine_worker.cupy_backend.kernels.library import DTypeSpec
from services.engine_worker.cupy_backend.kernels.paged_decode_attention import (
    DecodeScratch,
    grid_splits,
    scratch_rows_by_splits,
)
from services.engine_worker.cupy_backend.kernels.sample_tokens import MAX_TOP


@dataclass(frozen=True)
class StepLimits:
    """The largest step: tokens (every one may be a decode row: a recomputed request's
    tokens past its prompt are) and sampled rows; and the GPU's SM count, which sizes decode
    attention's grid."""

    max_tokens: int
    max_samples: int
    sm_count: int


def sampled_words(samples: int) -> int:
    return samples * (2 + 2 * MAX_TOP)


def _layout(
    arch: ModelArchitecture, spec: DTypeSpec, limits: StepLimits
) -> dict[str, tuple[tuple[int, ...], Any]]:
    tokens, samples = limits.max_tokens, limits.max_samples
    # Decode attention's per-split partials, flat: a step takes the (rows, heads, splits)
    # prefix its row count needs.
    pairs = scratch_rows_by_splits(tokens, arch.num_kv_heads, limits.sm_count)
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
        # Sampled tokens, their logprobs, then each row's top tokens and theirs (float32 bits).
        "sampled": ((sampled_words(samples),), numpy.int32),
        "scratch_out": ((pairs * arch.num_heads * arch.head_dim,), numpy.float32),
        "scratch_stats": ((pairs * arch.num_heads * 2,), numpy.float32),
        "tickets": ((tokens * arch.num_kv_heads,), numpy.int32),
    }


def workspace_bytes(arch: ModelArchitecture, spec: DTypeSpec, limits: StepLimits) -> int:
    return sum(
        int(numpy.prod(shape)) * numpy.dtype(dtype).itemsize
        for shape, dtype in _layout(arch, spec, limits).values()
    )


def sampled_layout(buffer: Any, samples: int, rows: int) -> tuple[Any, Any, Any, Any]:
    """Views of a `sampled` buffer (device or host) sized for `samples` rows."""
    top_at = 2 * samples
    tops = samples * MAX_TOP
    return (
        buffer[:rows],
        buffer[samples : samples + rows].view(numpy.float32),
        buffer[top_at : top_at + rows * MAX_TOP].reshape(rows, MAX_TOP),
        buffer[top_at + tops : top_at + tops + rows * MAX_TOP]
        .view(numpy.float32)
        .reshape(rows, MAX_TOP),
    )


class Workspace:
    def __init__(self, arch: ModelArchitecture, spec: DTypeSpec, limits: StepLimits) -> None:
        import cupy

        self.limits = limits
        buffers = {  # merge tickets start at zero; each merge leaves its ticket at zero
            name: (cupy.zeros if name == "tickets" else cupy.empty)(shape, dtype=dtype)
            for name, (shape, dtype) in _layout(arch, spec, limits).items()
        }
        self.residual, self.normed, self.qkv = (buffers[n] for n in ("residual", "normed", "qkv"))
        self.attn, self.proj = buffers["attn"], buffers["proj"]
        self.gate_up, self.act = buffers["gate_up"], buffers["act"]
        self.final, self.logits = buffers["final"], buffers["logits"]
        self.sampled = buffers["sampled"]
        self._scratch = (buffers["scratch_out"], buffers["scratch_stats"], buffers["tickets"])
        self._heads, self._kv_heads, self._head_dim = (
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
        )
        self.num_bytes = sum(int(buffer.nbytes) for buffer in buffers.values())

    def decode_scratch(self, rows: int) -> DecodeScratch:
        """Views of the partials' buffers for `rows` decode rows and their grid's splits."""
        out, stats, tickets = self._scratch
        rows = max(1, rows)
        shape = (rows, self._heads, grid_splits(rows, self._kv_heads, self.limits.sm_count))
        size = shape[0] * shape[1] * shape[2]
        return DecodeScratch(
            out[: size * self._head_dim].reshape(*shape, self._head_dim),
            stats[: size * 2].reshape(*shape, 2),
            tickets[: rows * self._kv_heads].reshape(rows, self._kv_heads),
        )

    def sampled_views(self, rows: int) -> tuple[Any, Any, Any, Any]:
        """Where sampling writes `rows` tokens (int32), logprobs (float32), top tokens and top
        logprobs (rows, MAX_TOP): one buffer, so one copy brings a step's results back (its
        first 2 x max_samples words when no row wants top logprobs)."""
        return sampled_layout(self.sampled, self.limits.max_samples, rows)

    def check_fits(self, tokens: int, samples: int) -> None:
        """A step larger than the limits the worker stated is a bug upstream: refused, not
        run over the end of a buffer."""
        limits = self.limits
        if tokens > limits.max_tokens or samples > limits.max_samples:
            raise ValueError(
                f"a step of {tokens} tokens and {samples} sampled rows exceeds the "
                f"workspace's limits {limits}"
            )
