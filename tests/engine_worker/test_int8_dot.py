"""`kvmesh::int8_dot`: int8 rows times int8 activations (AVX512-VNNI), row-exact; packed int8
rows (the head, projections without 4-bit groups) where it runs."""

from __future__ import annotations

import pytest
import torch

from services.engine_worker.torch_backend import weights as torch_weights
from services.engine_worker.torch_backend.dot_kernels import fits
from services.engine_worker.torch_backend.int8_dot import (
    Int8DotLinear,
    int8_dot_is_available,
    pack_rows,
)
from services.engine_worker.torch_backend.linear import Int8Linear, quantize_rows

pytestmark = pytest.mark.skipif(not int8_dot_is_available(), reason="needs AVX512-VNNI")


def test_a_row_is_computed_the_same_whatever_its_batch() -> None:
    torch.manual_seed(0)
    head = Int8DotLinear(*quantize_rows(torch.randn(160, 96) * 0.05))
    rows = torch.randn(37, 96)
    rows[4] *= 1000
    together = head(rows)
    alone = torch.cat([head(rows[i : i + 1]) for i in range(37)])
    assert torch.equal(together, alone)
    for start, count in ((3, 2), (6, 3), (11, 9), (0, 33)):
        assert torch.equal(head(rows[start : start + count]), together[start : start + count])


def test_it_computes_its_int8_rows() -> None:
    """What is left is the int8 rounding of each group of 32 activations (llama.cpp's Q8_0)."""
    torch.manual_seed(1)
    rows, scale = quantize_rows(torch.randn(512, 576) * 0.02)
    x = torch.randn(6, 576)
    out = Int8DotLinear(rows, scale)(x)
    reference = x @ (rows.float() * scale).t()
    assert out.dtype == torch.float32 and out.shape == (6, 512)
    assert ((out - reference).norm() / reference.norm()).item() < 0.01
    # The same int8 rows fbgemm runs, so the two differ by activation rounding alone.
    fbgemm = Int8Linear.from_rows(rows, scale, None)(x)
    assert ((out - fbgemm).norm() / reference.norm()).item() < 0.01


def test_the_layout_puts_four_inputs_of_each_of_16_rows_in_a_zmm() -> None:
    rows = torch.zeros(32, 64, dtype=torch.int8)
    rows[17, 37] = -5  # block 1, row 1 of it; group 1, input 5: chunk 1, position 1
    packed = pack_rows(rows)
    assert packed.shape == (2, 2, 8, 64) and packed.dtype == torch.uint8
    assert int(packed[1, 1, 1, 4 * 1 + 1]) == 128 - 5
    assert int(packed.sum()) == 128 * packed.numel() - 5
    assert fits(32, 64) and not fits(40, 64) and not fits(32, 48)


def test_a_non_finite_activation_makes_its_row_nan_and_no_other() -> None:
    head = Int8DotLinear(*quantize_rows(torch.randn(32, 64)))
    rows = torch.randn(3, 64)
    rows[1, 60] = float("inf")
    out = head(rows)
    assert out[1].isnan().all() and out[0].isfinite().all() and out[2].isfinite().all()


def test_bad_rows_are_refused_with_the_ops_reason() -> None:
    head = Int8DotLinear(*quantize_rows(torch.randn(16, 64)))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.kvmesh.int8_dot(torch.randn(2, 64).double(), head.weights, head.row_scales)
    with pytest.raises(RuntimeError, match="K does not match"):
        torch.ops.kvmesh.int8_dot(torch.randn(2, 96), head.weights, head.row_scales)


def test_packed_int8_rows_run_through_it_where_they_fit() -> None:
    bias = torch.randn(64)
    rows = torch_weights.packed_rows(torch.randn(64, 32), bias)
    assert isinstance(rows, Int8DotLinear)
    x = torch.randn(3, 32)
    assert torch.equal(rows(x), Int8DotLinear.product(x, rows.weights, rows.row_scales) + bias)
    assert isinstance(torch_weights.packed_rows(torch.randn(72, 32)), Int8Linear)  # 72 % 16
