"""4-bit groups times int8 activations, llama.cpp's way: `kvmesh::int4_dot` (csrc/int4_dot.cpp).

torch's 4-bit CPU kernel turns every nibble back into a float and multiplies in float, which
made the 4-bit GEMMs compute-bound on AVX-512 CPUs without AMX. Rounding each group of 32
activations to int8 lets AVX512-VNNI multiply 64 nibble-byte pairs an instruction and sum them
exactly: the default model's projections ran 1.5x (1 row) to 2.7x (32 rows) faster on a Zen 4
EPYC (docs/design/cpu-engine.md). Without VNNI (Skylake-class Xeons) two AVX512-BW instructions
do the same sums, exactly, so the bits are the same. The kernel is C++ of ours, built on a
machine's first use (~15 s on 2 cores, then cached by torch's extension builder) and reached
through the dispatcher (dot_kernels.py), so the compiled step's loaded programs call it.

The weights keep the file's values: w = scale * q + min per group, scale and min in float16
(what Q4_0 and Q4_1 blocks hold, so exact there; a Q4_K group's product of its super-block's
float16 and a 6-bit scale is rounded to float16, 2**-11 relative). Used wherever the CPU has
AVX-512 or AVX2: built for AVX2, the same layout runs 8 rows to a register with the AVX-512
build's bits, where torch's 4-bit kernel is not vectorized and packed meant int8 rows.
"""

from __future__ import annotations

import torch

from services.engine_worker.artifacts.int4_groups import GROUP, Int4Groups
from services.engine_worker.torch_backend import dot_kernels
from services.engine_worker.torch_backend.dot_kernels import (
    ROWS_PER_BLOCK,
    dot_kernels_are_available,
    load_dot_kernels,
)


def int4_dot_is_available() -> bool:
    """Whether this CPU has AVX-512 (BW, VL, DQ) or AVX2 and the kernel built (or builds now)."""
    return dot_kernels_are_available()


def prefill_rows_dense() -> bool:
    """Whether prefill rows beat the kernel as bfloat16 GEMMs over the weight unpacked for the
    step (graph_ops.int4_dot_rows): with AMX only. Without it bfloat16 GEMMs lost even before
    the unpacking (Zen 4, AVX512_BF16: 4.5 ms against the kernel's 3.3 for 512 rows of a
    3072x576 projection)."""
    return torch.cpu._is_amx_tile_supported()


def fits(groups: Int4Groups) -> bool:
    return dot_kernels.fits(*groups.shape)


class Int4DotLinear:
    """A 4-bit projection through `kvmesh::int4_dot`; takes and returns float32 rows."""

    def __init__(self, groups: Int4Groups, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = groups.shape
        self.nibbles = pack_nibbles(groups.q)
        self.scales, self.mins = pack_pairs(groups.d), pack_pairs(groups.m)
        self.bias = None if bias is None else bias.float()

    @classmethod
    def from_parts(
        cls,
        nibbles: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> Int4DotLinear:
        """From the tensors a prepared model saved."""
        if not load_dot_kernels():
            raise RuntimeError("these weights need kvmesh::int4_dot, which did not build here")
        linear = cls.__new__(cls)
        linear.nibbles, linear.scales, linear.mins, linear.bias = nibbles, scales, mins, bias
        linear.out_features = nibbles.shape[0] * ROWS_PER_BLOCK
        linear.in_features = nibbles.shape[1] * GROUP
        return linear

    @staticmethod
    def dequantized(groups: Int4Groups) -> torch.Tensor:
        """The float (out, in) weight this format computes with (scales and mins in float16)."""
        rows, cols = groups.shape
        d, m = (t.half().float().unsqueeze(-1) for t in (groups.d, groups.m))
        return (groups.q.view(rows, cols // GROUP, GROUP).float() * d + m).view(rows, cols)

    @staticmethod
    def product(
        x: torch.Tensor, nibbles: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
    ) -> torch.Tensor:
        """x (M, in) times the weight, in x's dtype (eager, and in the compiled step)."""
        return torch.ops.kvmesh.int4_dot(x.float(), nibbles, scales, mins).to(x.dtype)

    @staticmethod
    def dense_weight(
        nibbles: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
    ) -> torch.Tensor:
        """The (in, out) weight in bfloat16, unpacked from the kernel's layout: what prefill
        rows multiply where the CPU has bfloat16 GEMMs (graph_ops.int4_rows)."""
        blocks, groups = nibbles.shape[:2]
        # (blocks, groups, 4 chunks, 16 rows, 4 inputs, low/high) -> (groups, 4, 2, 4, blocks, 16)
        pairs = nibbles.view(blocks, groups, 4, ROWS_PER_BLOCK, 4, 1)
        q = torch.cat((pairs & 15, pairs >> 4), dim=-1).permute(1, 2, 5, 4, 0, 3).float()
        d = scales.float().permute(1, 0, 2).reshape(groups, 1, 1, 1, blocks, ROWS_PER_BLOCK)
        m = mins.float().permute(1, 0, 2).reshape(groups, 1, 1, 1, blocks, ROWS_PER_BLOCK)
        weight = q * d + m
        return weight.reshape(groups * GROUP, blocks * ROWS_PER_BLOCK).to(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x, self.nibbles, self.scales, self.mins)
        return out if self.bias is None else out + self.bias

    @property
    def resident_bytes(self) -> int:
        total = sum(t.numel() * t.element_size() for t in (self.nibbles, self.scales, self.mins))
        return total + (0 if self.bias is None else self.bias.numel() * 4)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values 0..15 -> (N/16, K/32, 4, 64) uint8, the kernel's layout (csrc/int4_dot.cpp):
    zmm c of a group holds row i's inputs 8c..8c+3 in the low nibbles of bytes 4i..4i+3 and its
    inputs 8c+4..8c+7 in the high nibbles."""
    rows, cols = q.shape
    # (blocks, 16 rows, groups, 4 chunks, low/high, 4 inputs) -> (blocks, groups, 4, 16, 4, 2)
    parts = q.to(torch.uint8).view(rows // ROWS_PER_BLOCK, ROWS_PER_BLOCK, cols // GROUP, 4, 2, 4)
    parts = parts.permute(0, 2, 3, 1, 5, 4)
    packed = parts[..., 0] | (parts[..., 1] << 4)
    return packed.reshape(rows // ROWS_PER_BLOCK, cols // GROUP, 4, 64).contiguous()


def pack_pairs(values: torch.Tensor) -> torch.Tensor:
    """(N, K/32) a group's scale or min -> (N/16, K/32, 16) float16."""
    rows, groups = values.shape
    blocks = values.half().view(rows // ROWS_PER_BLOCK, ROWS_PER_BLOCK, groups)
    return blocks.permute(0, 2, 1).contiguous()
