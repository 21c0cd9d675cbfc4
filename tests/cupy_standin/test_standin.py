"""The stand-in's own rules: what a CUDA graph capture refuses fails and invalidates the
capture, what it may hold is recorded and runs only on replay, and launches with a bad
argument or pointer fail as they would on a GPU (or worse there)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy
import pytest

from tests.cupy_standin import device, installed


@pytest.fixture
def cupy() -> Iterator[Any]:
    with installed():
        import cupy

        yield cupy


@pytest.mark.parametrize(
    "operation",
    [
        lambda cp, a, i: cp.empty(4, numpy.float32),
        lambda cp, a, i: a.get(),
        lambda cp, a, i: a.set(numpy.zeros(4, numpy.float32)),
        lambda cp, a, i: cp.asarray(numpy.zeros(4)),
        lambda cp, a, i: cp.cuda.get_current_stream().synchronize(),
        lambda cp, a, i: a[i],
    ],
    ids=["allocation", "copy to host", "copy from host", "upload", "synchronise", "gather"],
)
def test_a_capture_refuses_what_a_graph_cannot_hold(cupy, operation) -> None:
    array = cupy.zeros(4, numpy.float32)
    index = cupy.asarray(numpy.arange(2))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        with pytest.raises(device.CaptureViolation):
            operation(cupy, array, index)
        with pytest.raises(RuntimeError, match="Invalidated"):
            stream.end_capture()


def test_cupy_cublas_in_a_capture_raises_as_cupy_does(cupy) -> None:
    stream = cupy.cuda.Stream()
    stream.begin_capture()
    with pytest.raises(NotImplementedError, match="during stream capture"):
        cupy.cuda.cublas.setPointerMode(1, 0)
    with pytest.raises(RuntimeError, match="Invalidated"):
        stream.end_capture()


def test_a_captured_kernel_runs_on_replay_only_and_reads_the_buffers_then(cupy) -> None:
    from services.engine_worker.cupy_backend.kernels.bias_add import bias_add
    from services.engine_worker.cupy_backend.kernels.library import DTYPES

    out = cupy.zeros((2, 3), numpy.float32)
    bias = cupy.asarray(numpy.ones(3, numpy.float32))
    stream = cupy.cuda.Stream()
    with stream:
        stream.begin_capture()
        bias_add(out, bias, DTYPES["float32"])
        graph = stream.end_capture()
    assert not out.get().any()  # recorded, not run
    bias.set(numpy.full(3, 2.0, numpy.float32))
    graph.launch(stream)
    graph.launch(stream)
    assert (out.get() == 4.0).all()  # twice, with the bias as it was at replay
    assert graph.node_names == ["bias_add_f32"]


def test_a_gemm_captures_only_on_a_handle_with_its_own_workspace(cupy) -> None:
    from nvmath.bindings import cublas

    from services.engine_worker.cupy_backend.cublas_gemm import CublasGemm
    from services.engine_worker.cupy_backend.kernels.library import DTYPES

    stream = cupy.cuda.Stream()
    gemm = CublasGemm(stream)
    x = cupy.asarray(numpy.arange(6, dtype=numpy.float32).reshape(2, 3))
    weight = cupy.asarray(numpy.eye(3, 4, dtype=numpy.float32))
    out = cupy.zeros((2, 4), numpy.float32)
    with stream:
        stream.begin_capture()
        gemm(x, weight, out, DTYPES["float32"])
        graph = stream.end_capture()
    graph.launch(stream)
    assert out.get().tolist() == [[0, 1, 2, 0], [3, 4, 5, 0]]
    bare = cublas.create()  # no workspace: cuBLAS would allocate one inside the capture
    cublas.set_stream(bare, stream.ptr)
    cublas.set_pointer_mode(bare, 0)
    gemm.handle = bare
    stream.begin_capture()
    with pytest.raises(device.CaptureViolation, match="workspace"):
        gemm(x, weight, out, DTYPES["float32"])
    with pytest.raises(RuntimeError):
        stream.end_capture()


def test_launches_with_a_bad_argument_or_pointer_fail(cupy) -> None:
    from services.engine_worker.cupy_backend.kernels.library import kernel

    wide = cupy.zeros((4, 8), numpy.float32)
    bias = cupy.zeros(4, numpy.float32)
    add = kernel("bias_add", "bias_add_f32")
    with pytest.raises(ValueError, match="C-contiguous"):
        add((4,), (32,), (wide[:, :4], bias, numpy.int32(4)))
    with pytest.raises(TypeError, match="numpy scalar"):
        add((4,), (32,), (wide, bias, 8))  # a Python int: not the kernel's 32-bit int
    with pytest.raises(ValueError, match="no device buffer"):
        device.host_memory(8, 4)
    with pytest.raises(ValueError, match="run past"):
        device.host_memory(bias.data.ptr, bias.nbytes + 4)
