"""`kvmesh::int4_dot`: 4-bit groups times int8 activations (AVX-512 or AVX2), row-exact, the
same bits from either build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.engine_worker.artifacts.int4_groups import Int4Groups
from services.engine_worker.torch_backend import graph_ops
from services.engine_worker.torch_backend.dot_kernels import has_avx512
from services.engine_worker.torch_backend.int4_dot import (
    Int4DotLinear,
    fits,
    int4_dot_is_available,
    pack_nibbles,
)
from services.engine_worker.torch_backend.linear import dense_prefill_is_fast

pytestmark = pytest.mark.skipif(
    not int4_dot_is_available(), reason="needs AVX-512 or AVX2, and a compiler"
)


def test_a_row_is_computed_the_same_whatever_its_batch() -> None:
    """Every row is one instruction sequence whatever the call's row count (tiles of 4 rows
    and their remainders, two threads)."""
    torch.manual_seed(0)
    projection = Int4DotLinear(Int4Groups.quantize(torch.randn(96, 128) * 0.05), torch.randn(96))
    rows = torch.randn(41, 128)
    rows[3] *= 100
    together = projection(rows)
    alone = torch.cat([projection(rows[i : i + 1]) for i in range(41)])
    assert torch.equal(together, alone)
    for start, count in ((5, 2), (6, 3), (13, 8), (0, 33)):
        assert torch.equal(projection(rows[start : start + count]), together[start : start + count])


AVX2_RUN = """
import sys, torch
from services.engine_worker.artifacts.int4_groups import Int4Groups
from services.engine_worker.torch_backend.int4_dot import Int4DotLinear, int4_dot_is_available
assert torch.backends.cpu.get_cpu_capability() == "AVX2" and int4_dot_is_available()
projection = Int4DotLinear(Int4Groups.quantize(torch.load(sys.argv[1])), None)
torch.save(projection(torch.load(sys.argv[2])), sys.argv[3])
"""


@pytest.mark.skipif(not has_avx512(), reason="compares the AVX2 build with the AVX-512 one")
def test_the_avx2_build_gives_the_avx512_builds_bits(tmp_path: Path) -> None:
    """An AVX2 CPU's build (8 rows to a register, pair sums in int16) against this one's, the
    rows of a prefill and a decode, a NaN among them: the same bits."""
    torch.manual_seed(4)
    weight, rows = torch.randn(3072, 576) * 0.05, torch.randn(67, 576)
    rows[1] *= 1000
    rows[9, 100] = float("nan")
    paths = [tmp_path / name for name in ("weight.pt", "rows.pt", "out.pt")]
    torch.save(weight, paths[0])
    torch.save(rows, paths[1])
    environment = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    command = [sys.executable, "-c", AVX2_RUN, *map(str, paths)]
    subprocess.run(command, env=environment, check=True, timeout=300)
    avx2 = torch.load(paths[2])
    here = Int4DotLinear(Int4Groups.quantize(weight))(rows)
    assert avx2[9].isnan().all() and here[9].isnan().all()
    assert torch.equal(avx2.nan_to_num(), here.nan_to_num())


def test_it_computes_its_dequantized_weight() -> None:
    """What is left is the int8 rounding of each group of 32 activations (llama.cpp's Q8_1)."""
    torch.manual_seed(1)
    groups = Int4Groups.quantize(torch.randn(256, 576) * 0.02)
    x = torch.randn(5, 576)
    out = Int4DotLinear(groups)(x)
    reference = x @ Int4DotLinear.dequantized(groups).t()
    assert ((out - reference).norm() / reference.norm()).item() < 0.01
    assert out.dtype == torch.float32 and out.shape == (5, 256)
    # float16 scales and mins: a Q4_1 file's own values, rounded only from float32 groups.
    assert ((reference - x @ groups.dequantized().t()).norm() / reference.norm()).item() < 1e-3


def test_the_dense_weight_unpacks_the_kernels_layout() -> None:
    torch.manual_seed(2)
    groups = Int4Groups.quantize(torch.randn(48, 96) * 0.02)
    projection = Int4DotLinear(groups)
    dense = Int4DotLinear.dense_weight(projection.nibbles, projection.scales, projection.mins)
    assert dense.dtype == torch.bfloat16 and dense.shape == (96, 48)
    assert torch.equal(dense, Int4DotLinear.dequantized(groups).t().bfloat16())


def test_the_layout_puts_four_inputs_of_each_of_16_rows_in_a_nibble_plane() -> None:
    q = (torch.arange(16 * 32).view(16, 32) % 16).to(torch.uint8)
    q[7, 13] = 3  # row 7, input 13: chunk 1, high half, position 1
    packed = pack_nibbles(q)
    assert packed.shape == (1, 1, 4, 64)
    assert int(packed[0, 0, 1, 4 * 7 + 1]) >> 4 == 3
    assert fits(Int4Groups(q, torch.ones(16, 1), torch.zeros(16, 1)))
    assert not fits(Int4Groups(q[:8], torch.ones(8, 1), torch.zeros(8, 1)))


def test_a_non_finite_activation_makes_its_row_nan_and_no_other() -> None:
    projection = Int4DotLinear(Int4Groups.quantize(torch.randn(32, 64) * 0.05))
    rows = torch.randn(3, 64)
    rows[0, 5], rows[2, 40] = float("nan"), float("inf")
    out = projection(rows)
    assert out[0].isnan().all() and out[2].isnan().all()
    assert out[1].isfinite().all()


def test_bad_rows_are_refused_with_the_ops_reason() -> None:
    projection = Int4DotLinear(Int4Groups.quantize(torch.randn(16, 64)))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.kvmesh.int4_dot(
            torch.randn(2, 64).half(), projection.nibbles, projection.scales, projection.mins
        )
    with pytest.raises(RuntimeError, match="K does not match"):
        torch.ops.kvmesh.int4_dot(
            torch.randn(2, 96), projection.nibbles, projection.scales, projection.mins
        )


@pytest.mark.skipif(not dense_prefill_is_fast(), reason="no bfloat16 GEMMs in hardware")
def test_int4_dot_rows_keep_a_decode_rows_bits_and_run_prefill_rows_dense() -> None:
    torch.manual_seed(3)
    projection = Int4DotLinear(Int4Groups.quantize(torch.randn(576, 1536) * 0.02))
    weights = (projection.nibbles, projection.scales, projection.mins)
    weight = Int4DotLinear.dense_weight(*weights)
    rows = torch.randn(300, 1536)

    def int4_dot_rows(rows: torch.Tensor, decodes: int) -> torch.Tensor:
        return torch.ops.kvmesh.int4_dot_rows(rows, decodes, *weights, weight)

    mixed = int4_dot_rows(rows, 10)
    assert torch.equal(mixed[:10], Int4DotLinear.product(rows[:10], *weights))
    prefill = int4_dot_rows(rows[10:], 0)
    assert torch.equal(mixed[10:], prefill)
    assert torch.equal(int4_dot_rows(rows[40:41], 0), prefill[30:31])  # a piece of its own
    dense = rows[10:].bfloat16().float() @ weight.float()
    assert ((prefill - dense).norm() / dense.norm()).item() < 0.01
    assert graph_ops.PREFILL_PIECE == 256


def test_a_lock_left_by_a_process_killed_while_loading_does_not_stall_the_next() -> None:
    """torch's extension builder takes a lock file on every load; a worker SIGKILLed inside
    the load left it behind, and every later worker on the machine waited on it for ever."""
    from torch.utils import cpp_extension

    from services.engine_worker.torch_backend.dot_kernels import _build

    stale = Path(cpp_extension._get_build_directory(_build()[0], verbose=False)) / "lock"
    stale.touch()
    load = "from services.engine_worker.torch_backend import dot_kernels as d\n"
    load += "assert d.load_dot_kernels()"
    try:
        subprocess.run([sys.executable, "-c", load], check=True, timeout=120)
    finally:
        still_there = stale.exists()
        stale.unlink(missing_ok=True)
    assert not still_there
