"""4-bit weights in groups of 32 input values, as llama.cpp's Q4_0, Q4_1 and Q4_K blocks hold them.

A group's values are `d * q + m` with q in 0..15 and one (d, m) pair per group (Q4_0 is the
symmetric case m = -8d; a Q4_K super-block of 256 gives each of its eight groups d = d_super *
scale and m = -dmin_super * min, 6-bit scale and min). The nibbles and pairs are read from the
file's blocks as they are, so a GGUF's 4-bit weights are computed with the values llama.cpp
computes with; a float checkpoint (`--quantize int4`) is quantized with llama.cpp's Q4_1 recipe
(a group's minimum and maximum).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32
_LEVELS = 15
# Bytes per 32-value block: fp16 d (and fp16 m for Q4_1), then 16 bytes of nibbles.
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
# A Q4_K super-block: fp16 d and dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles.
_SUPER = 256
_Q4_K_BYTES = 144
INT4_BLOCK_TYPES = (*_BLOCK_BYTES, "Q4_K")


@dataclass(frozen=True)
class Int4Groups:
    q: torch.Tensor  # (out, in) uint8, 0..15
    d: torch.Tensor  # (out, in // GROUP) float32
    m: torch.Tensor  # (out, in // GROUP) float32

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1]

    def dequantized(self) -> torch.Tensor:
        """(out, in) float32, computed as the gguf package's dequantization computes it."""
        rows, cols = self.shape
        grouped = self.q.view(rows, cols // GROUP, GROUP).float()
        return (self.d.unsqueeze(-1) * grouped + self.m.unsqueeze(-1)).view(rows, cols)

    def rows(self, index: torch.Tensor) -> Int4Groups:
        """The groups of rows `index`, in that order (llama.cpp's Q/K row order undone)."""
        return Int4Groups(self.q[index], self.d[index], self.m[index])

    @staticmethod
    def from_blocks(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> Int4Groups:
        """raw: a GGUF tensor's bytes, (out, in / 32 * block bytes); kind: Q4_0, Q4_1 or Q4_K."""
        rows, cols = shape
        if kind == "Q4_K":
            return Int4Groups._from_super_blocks(raw, shape)
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(
            rows, cols // GROUP, _BLOCK_BYTES[kind]
        )
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if kind == "Q4_1":
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        else:
            m = -8.0 * d  # exact: a power-of-two multiple
        nibbles = blocks[..., _BLOCK_BYTES[kind] - GROUP // 2 :]
        # Byte j holds value j in its low nibble and value j + 16 in its high one.
        q = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1).reshape(rows, cols)
        return Int4Groups(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))

    @staticmethod
    def _from_super_blocks(raw: np.ndarray, shape: tuple[int, int]) -> Int4Groups:
        from gguf.quants import Q4_K  # the 6-bit scale unpacking, as llama.cpp lays it out

        rows, cols = shape
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(
            rows, cols // _SUPER, _Q4_K_BYTES
        )
        d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # (rows, supers, 1)
        dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
        scale, low = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
        groups = (rows, cols // GROUP)
        group_d = (d * scale.reshape(rows, -1, 8).astype(np.float32)).reshape(groups)
        group_m = -(dmin * low.reshape(rows, -1, 8).astype(np.float32)).reshape(groups)
        # Each 32 bytes hold two groups: the first in the low nibbles, the next in the high.
        nibbles = blocks[..., 16:].reshape(rows, cols // _SUPER, 4, 1, GROUP)
        q = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-2).reshape(rows, cols)
        return Int4Groups(torch.from_numpy(q), torch.from_numpy(group_d), torch.from_numpy(group_m))

    @staticmethod
    def quantize(weight: torch.Tensor) -> Int4Groups:
        """llama.cpp's Q4_1 recipe for a float (out, in) weight: m = the group's minimum,
        d = its range / 15 (both rounded to fp16, as a Q4_1 file stores them)."""
        rows, cols = weight.shape
        grouped = weight.float().reshape(rows, cols // GROUP, GROUP)
        low, high = grouped.amin(-1), grouped.amax(-1)
        d = ((high - low) / _LEVELS).half().float()
        m = low.half().float()
        inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = torch.round((grouped - m.unsqueeze(-1)) * inverse.unsqueeze(-1)).clamp_(0, _LEVELS)
        return Int4Groups(q.to(torch.uint8).view(rows, cols), d, m)

    @staticmethod
    def cat(parts: list[Int4Groups]) -> Int4Groups:
        """Fused projections (Q/K/V, gate/up) stack their rows."""
        return Int4Groups(
            torch.cat([p.q for p in parts]),
            torch.cat([p.d for p in parts]),
            torch.cat([p.m for p in parts]),
        )
