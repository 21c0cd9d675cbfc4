"""The projections a layer runs, one class per weight format: dense float, packed int4 or int8.

Every projection takes x: (M, in) and returns (M, out) in x's dtype, and reports the bytes its
weights keep resident. Which format runs is the manifest's `weights` field.

`packed` keeps a quantized file's weights as the file holds them wherever this CPU has a fast
kernel for that form (the measurements per CPU: docs/benchmarks/cpu-engine.md):
- 4-bit groups (Q4_0, Q4_1, `--quantize int4`) through torch's `_weight_int4pack_mm_for_cpu`
  on AVX-512 CPUs (where it builds, our own kernel instead: int4_dot.py), as fast as fbgemm's int8
  GEMM at batch 1 from half the bytes. Without AVX-512 that kernel runs 17x slower than an
  fp32 GEMM, so there 4-bit groups fall back to:
- int8 per output row through fbgemm (activations quantized on the fly, integer multiply-adds
  like llama.cpp's Q8 dot products), the form of every other packed weight. torch's traceable
  weight-only int8 kernel took 2x as long at 8 and 32 rows, so fbgemm stays and the compiled
  step calls it through an op of ours.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from services.engine_worker.artifacts.int4_groups import GROUP, Int4Groups


class Projection(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def resident_bytes(self) -> int: ...


class DenseLinear:
    """A float weight (float32 or bfloat16) in HF layout (out, in), plus an optional bias.

    `W @ x^T` with W on the left: MKL's small-M GEMM on a (in, out) right operand repacks the
    whole weight on every call (a batch-8 step took 186 ms that way against 126). A tied head
    shares the embedding table itself.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight.contiguous()  # (out, in)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, dtype = self.weight, x.dtype
        if dtype != weight.dtype:
            x = x.to(weight.dtype)
        if x.shape[0] == 1:
            out = F.linear(x, weight, self.bias)
        else:
            out = torch.mm(weight, x.t()).t()  # (out, M)^T
            if self.bias is not None:
                out = out + self.bias
        return out.to(dtype)

    @property
    def resident_bytes(self) -> int:
        total = self.weight.numel() * self.weight.element_size()
        return total + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())


# fbgemm multiplies uint8 activations by int8 weights in pairs summed into int16 (vpmaddubsw):
# 127-level weights need its `reduce_range` (7-bit activations, 2 * 127 * 127 < 2**15) to never
# saturate. Measured on the default model: 63-level weights with 8-bit activations cost 1.1%
# perplexity from the weights alone, 127-level weights 0.2%; 7-bit activations are made up for
# by a second level (see Int8Linear).
_WEIGHT_LEVELS = 127
# fbgemm's grid for an input whose range is pinned to [-1, 1] (reduce_range: 0..127): scale
# 2/127, zero point 64 (63.5 rounded half to even); values quantize to rne(x * 63.5) in -64..63.
_GRID = 63.5
_GRID_LOW, _GRID_HIGH = -64, 63


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 rows, float32 scale per row (rows, 1)): symmetric, max |w| of a row at 127."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / _WEIGHT_LEVELS
    rows = torch.clamp(torch.round(weight / scale), -_WEIGHT_LEVELS, _WEIGHT_LEVELS)
    return rows.to(torch.int8), scale


# fbgemm's dynamic int8 GEMM, called as the C++ op itself: through its OpOverload, Python first
# scans the arguments for fake script objects (~5 µs of a ~20 µs small call; 121 calls a step).
LINEAR_DYNAMIC = torch.ops.quantized.linear_dynamic.default._op


class Int8Linear:
    """int8 weights, one scale per output row, run by fbgemm with int8 activations.

    fbgemm quantizes its input per tensor, from the tensor's min and max: left alone, one row's
    quantization would depend on the other rows of its batch, and a request's tokens on its
    neighbours. Each row is therefore scaled to max |x| = 1 and two constant columns, +1 and -1
    (against zero weights), pin every batch's range to exactly [-1, 1]: per-token quantization,
    the same for a row whatever else is batched with it.

    Activations are two-level, ~14 bits: what the 7-bit rounding of each row drops (known in
    advance: the grid is pinned), rescaled to [-1, 1] by its own maximum, rides the same GEMM as
    extra rows, so the weights are read once per call. (A fixed 127x for the residual, its
    bound, saves two ops but loses precision where rows are short: 13/16 greedy parity on the
    tiny test checkpoints against 15/16.) Measured on the default model (mean KL divergence from
    float32 per token of the shipped text, `loadtest.perplexity`): 7-bit rows everywhere cost
    +12% perplexity; with SmoothQuant and two levels on Q/K/V and down only, 0.018 nats; two
    levels everywhere, 0.0066 with SmoothQuant and 0.0049 without it (perplexity within 0.2%),
    so there is no smoothing. With one level anywhere, a 1-ulp change upstream can move a value
    a whole grid step: the shipped text's perplexity moved by 0.5% between two orders of the
    same float operations.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """weight: (out, in) float; quantized here, symmetric, one scale per row."""
        self._prepack(*quantize_rows(weight), bias)

    @classmethod
    def from_rows(
        cls, rows: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> Int8Linear:
        """From `rows_and_scales` as a prepared model saved them."""
        linear = cls.__new__(cls)
        linear._prepack(rows, scale, bias)
        return linear

    def _prepack(self, rows: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        out_features, in_features = rows.shape
        padded = torch.zeros(out_features, in_features + 2, dtype=torch.int8)
        padded[:, :in_features] = rows
        # fbgemm's dynamic linear takes a qint8 tensor: made from the rows as they are, not
        # by quantizing their float values again (the same tensor, 12x faster to load).
        per_row, zeros = scale.double().squeeze(1), torch.zeros(out_features, dtype=torch.long)
        with warnings.catch_warnings():  # qint8 tensors are deprecated; fbgemm's API takes one
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch._make_per_channel_quantized_tensor(padded, per_row, zeros, 0)
            self._packed = torch.ops.quantized.linear_prepack(quantized, None)
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else bias.float()
        # int8 values + a scale per row (what fbgemm keeps, less its column offsets).
        self._bytes = out_features * (in_features + 2) + out_features * 8

    @property
    def rows_and_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, in) int8 rows and (out, 1) float32 scales, read back from fbgemm's packing."""
        quantized, _ = torch.ops.quantized.linear_unpack(self._packed)
        rows = quantized.int_repr()[:, : self.in_features].contiguous()
        return rows, quantized.q_per_channel_scales().float().unsqueeze(1)

    @staticmethod
    def dequantized(weight: torch.Tensor) -> torch.Tensor:
        """The float weight this format computes with: what parity tests compare against."""
        rows, scale = quantize_rows(weight)
        return rows * scale

    @staticmethod
    def product(x: torch.Tensor, gemm: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """x (M, in) times the weight, in x's dtype, where `gemm` is fbgemm's GEMM on this
        weight: eager, `linear_dynamic` on the packed weight; in the compiled step, the same
        behind `kvmesh::int8_rows`, and the ops here, traced, fuse with their neighbours.
        fbgemm gets 2M rows, each level scaled to [-1, 1], plus the two pinning columns."""
        x32 = x.float()
        count = x32.shape[0]
        row_max = x32.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
        scaled = x32 / row_max
        on_grid = (scaled * _GRID).round().clamp(_GRID_LOW, _GRID_HIGH) / _GRID
        residual = scaled - on_grid
        residual_max = residual.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
        pins = torch.tensor([1.0, -1.0], device=x.device).expand(2 * count, 2)
        both = gemm(torch.cat((torch.cat((scaled, residual / residual_max)), pins), dim=1))
        return ((both[:count] + both[count:] * residual_max) * row_max).to(x.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x, lambda rows: LINEAR_DYNAMIC(rows, self._packed, True))
        return out if self.bias is None else out + self.bias

    @property
    def resident_bytes(self) -> int:
        return self._bytes + (0 if self.bias is None else self.bias.numel() * 4)


def int4_kernel_is_fast() -> bool:
    """Whether torch's 4-bit CPU kernel has its vectorized path on this CPU (AVX-512)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def dense_prefill_is_fast() -> bool:
    """Whether prefill rows of 4-bit projections run faster as a bfloat16 GEMM over the weight
    dequantized for the step (`Int4Linear.dense_weight`, graph_ops.int4_rows): where the
    CPU multiplies bfloat16 in hardware (AVX512_BF16, AMX), 512 rows of a 3072x576 projection
    ran ~3x faster than through the 4-bit kernel, which dequantizes the weight every 4 rows."""
    return int4_kernel_is_fast() and torch.cpu._is_avx512_bf16_supported()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(in, out) values 0..15 of a weight in torch's AVX-512 4-bit packing, (out, in / 2)
    bytes: blocks of 64 rows, each (in, 32) bytes whose byte j holds row j (low nibble) and row
    32 + j (high); then a last block of 16, 32 or 48 rows, (in, rows / 2) bytes whose byte j
    holds rows 2j and 2j + 1 (tested against the groups)."""
    rows, cols = packed.shape[0], packed.shape[1] * 2
    full = rows // 64 * 64
    shifts = torch.arange(2, dtype=torch.uint8, device=packed.device) * 4
    blocks = packed[:full].reshape(full // 64, cols, 1, 32).permute(1, 0, 2, 3)
    q = ((blocks >> shifts.view(1, 1, 2, 1)) & 15).reshape(cols, full)
    if full < rows:
        pairs = packed[full:].reshape(cols, (rows - full) // 2, 1)
        q = torch.cat((q, ((pairs >> shifts) & 15).reshape(cols, rows - full)), dim=1)
    return q


class Int4Linear:
    """4-bit groups of 32 inputs, one (scale, zero) pair each, through torch's weight-only
    kernel with bfloat16 activations: w = (q - 8) * scale + zero, so scale = d and
    zero = m + 8d for a group d * q + m. The pairs are held in bfloat16, as the kernel takes
    them: d and m come from the file as fp16, so this rounds them (2**-9 relative) where the
    nibbles stay exact (float16 activations, which would keep d exact, take the kernel's slow
    path: the default model decoded 10x slower). A row's result does not depend on the rest of
    its batch (tested bit for bit at 1 to 64 rows).
    """

    ACTIVATIONS = torch.bfloat16

    # Inference tensors, as the compiled step's first call passes them on: a graph traced
    # lazily guards on the difference (it recompiled).
    @torch.inference_mode()
    def __init__(self, groups: Int4Groups, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = groups.shape
        # inner_k_tiles only matters to the CUDA layout; the CPU packing ignores it.
        self._packed = torch._convert_weight_to_int4pack_for_cpu(groups.q.to(torch.int32), 1)
        scale_zero = torch.stack(self._scale_zero_of(groups), dim=-1)  # (out, in/32, 2)
        self._scale_zero = scale_zero.transpose(0, 1).contiguous()
        # The dequantizing loop of `dense_weight` reads the pairs apart, each contiguous
        # (interleaved, it vectorized 10x worse): a quarter of the nibbles' bytes again.
        self.dense_parts: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.out_features % 16 == 0 and dense_prefill_is_fast():
            scale, zero = self._scale_zero.unbind(-1)
            self.dense_parts = (scale.contiguous(), zero.contiguous())
        self.bias = None if bias is None else bias.float()

    @classmethod
    def from_parts(
        cls,
        packed: torch.Tensor,
        scale_zero: torch.Tensor,
        dense_parts: tuple[torch.Tensor, torch.Tensor] | None,
        bias: torch.Tensor | None,
    ) -> Int4Linear:
        """From the tensors a prepared model saved (inference tensors, as `__init__` makes)."""
        linear = cls.__new__(cls)
        linear._packed, linear._scale_zero, linear.dense_parts = packed, scale_zero, dense_parts
        linear.out_features, linear.in_features = packed.shape[0], packed.shape[1] * 2
        linear.bias = bias
        return linear

    @classmethod
    def _scale_zero_of(cls, groups: Int4Groups) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, in/32) each, in the dtype the kernel takes them in."""
        return groups.d.to(cls.ACTIVATIONS), (groups.m + 8 * groups.d).to(cls.ACTIVATIONS)

    @classmethod
    def dequantized(cls, groups: Int4Groups) -> torch.Tensor:
        """The float (out, in) weight this format computes with: what parity tests compare
        against."""
        rows, cols = groups.shape
        scale, zero = (t.float().unsqueeze(-1) for t in cls._scale_zero_of(groups))
        centred = groups.q.view(rows, cols // GROUP, GROUP).float() - 8
        return (centred * scale + zero).view(rows, cols)

    @classmethod
    def product(
        cls, x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor
    ) -> torch.Tensor:
        """x (M, in) times a packed weight, in x's dtype (eager, and in the compiled step)."""
        out = torch._weight_int4pack_mm_for_cpu(x.to(cls.ACTIVATIONS), packed, GROUP, scale_zero)
        return out.to(x.dtype)

    @classmethod
    def dense_weight(
        cls, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
    ) -> torch.Tensor:
        """The (in, out) weight the 4-bit kernel computes with, rounded to bfloat16, unpacked
        from its packing (torch's AVX-512 layout)."""
        q = _nibbles(packed)
        cols, rows = q.shape
        grouped = q.view(cols // GROUP, GROUP, rows).float() - 8
        weight = grouped * scale.unsqueeze(1).float() + zero.unsqueeze(1).float()
        return weight.view(cols, rows).to(cls.ACTIVATIONS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x, self._packed, self._scale_zero)
        return out if self.bias is None else out + self.bias

    @property
    def resident_bytes(self) -> int:
        total = self._packed.numel() * self._packed.element_size()
        total += self._scale_zero.numel() * self._scale_zero.element_size()
        if self.dense_parts is not None:
            total += sum(t.numel() * t.element_size() for t in self.dense_parts)
        return total + (0 if self.bias is None else self.bias.numel() * 4)
