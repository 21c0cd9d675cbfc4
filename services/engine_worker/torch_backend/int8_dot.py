"""int8 rows times int8 activations: `kvmesh::int8_dot` (csrc/int8_dot.cpp), for packed int8
rows (the head; projections without 4-bit groups, such as a K-quant file's Q6_K tensors).

The head of a packed model is int8 rows, one scale per output row (linear.quantize_rows).
Through fbgemm, rounding its activations in eager ops around the GEMM cost about as much as the
GEMM. The kernel rounds each group of 32 activations to int8 itself (as `kvmesh::int4_dot`
does, llama.cpp's Q8_0 x Q8_0 scheme) and reads each weight once per call whatever the batch:
the default model's head took 0.62 ms at batch 1 against fbgemm's 0.80 (AVX-512 Xeon).
fbgemm's two-level (~14-bit) activations stay where the CPU has no AVX512-VNNI.
"""

from __future__ import annotations

import torch

from services.engine_worker.artifacts.int4_groups import GROUP
from services.engine_worker.torch_backend.dot_kernels import (
    ROWS_PER_BLOCK,
    dot_kernels_are_available,
    has_avx512,
    load_dot_kernels,
)


def int8_dot_is_available() -> bool:
    """Whether the kernel runs here: AVX-512 with VNNI, and it built."""
    return has_avx512() and torch.cpu._is_vnni_supported() and dot_kernels_are_available()


class Int8DotLinear:
    """int8 rows through `kvmesh::int8_dot`; takes float32 rows, returns float32."""

    def __init__(
        self, rows: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        """rows: (out, in) int8; scale: (out, 1) float32, as linear.quantize_rows makes them."""
        self.out_features, self.in_features = rows.shape
        self.weights = pack_rows(rows)
        self.row_scales = scale.float().reshape(-1).contiguous()
        self.bias = None if bias is None else bias.float()

    @classmethod
    def from_parts(
        cls, weights: torch.Tensor, row_scales: torch.Tensor, bias: torch.Tensor | None = None
    ) -> Int8DotLinear:
        """From the tensors a prepared model saved."""
        if not load_dot_kernels():
            raise RuntimeError("these weights need kvmesh::int8_dot, which did not build here")
        linear = cls.__new__(cls)
        linear.weights, linear.row_scales, linear.bias = weights, row_scales, bias
        linear.out_features = weights.shape[0] * ROWS_PER_BLOCK
        linear.in_features = weights.shape[1] * GROUP
        return linear

    @staticmethod
    def product(x: torch.Tensor, weights: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor:
        """x (M, in) times the weight, in x's dtype (eager, and in the compiled step)."""
        return torch.ops.kvmesh.int8_dot(x.float(), weights, row_scales).to(x.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x, self.weights, self.row_scales)
        return out if self.bias is None else out + self.bias

    @property
    def resident_bytes(self) -> int:
        total = self.weights.numel() + self.row_scales.numel() * 4
        return total + (0 if self.bias is None else self.bias.numel() * 4)


def pack_rows(rows: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 -> (N/16, K/32, 8, 64) uint8 holding w + 128, the kernel's layout
    (csrc/int8_dot.cpp): zmm c of a group holds row i's inputs 4c..4c+3 in bytes 4i..4i+3."""
    out_features, in_features = rows.shape
    offset = (rows.to(torch.int16) + 128).to(torch.uint8)
    # (blocks, 16 rows, groups, 8 chunks, 4 inputs) -> (blocks, groups, 8, 16, 4)
    parts = offset.view(out_features // ROWS_PER_BLOCK, ROWS_PER_BLOCK, in_features // GROUP, 8, 4)
    packed = parts.permute(0, 2, 3, 1, 4)
    return packed.reshape(out_features // ROWS_PER_BLOCK, in_features // GROUP, 8, 64).contiguous()
