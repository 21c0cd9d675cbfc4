"""The stand-in's `cupy`: device arrays kept in host memory, streams, and graph capture.

Outside a capture every operation runs at once on numpy. While a stream captures, kernel
launches and cuBLAS GEMMs on our own handle are recorded into the graph (their arguments are
the buffers themselves, as a real graph holds pointers, so a replay reads what the buffers
hold then), and what a real capture cannot hold fails with CaptureViolation and invalidates
the capture: an allocation, a copy to or from the host, a synchronisation, one of CuPy's own
array kernels, or a call into CuPy's cuBLAS wrapper.
"""

from __future__ import annotations

import bisect
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy

__version__ = "0-cpu-standin"


class CaptureViolation(RuntimeError):
    """What a CUDA stream capture refuses; the capture is invalidated with it."""


@dataclass
class Graph:
    stream: Stream
    nodes: list[tuple[str, Callable[[], None]]] = field(default_factory=list)
    invalidated: str = ""

    def launch(self, stream: Stream | None = None) -> None:
        refuse_in_capture("a graph launch")
        STATE.launches.append("graph")
        for _, run in self.nodes:
            run()

    @property
    def node_names(self) -> list[str]:
        return [name for name, _ in self.nodes]


@dataclass
class DeviceState:
    """What the stand-in saw: allocations, launches, and the capture in progress."""

    free_bytes: int = 80 << 30  # what memGetInfo reports before any allocation
    allocated_bytes: int = 0  # live: an array's bytes come back when it is collected
    pooled_bytes: int = 0  # freed, kept by the memory pool: not in memGetInfo's free
    peak_bytes: int = 0
    launches: list[str] = field(default_factory=list)  # kernels and GEMMs, run or recorded
    allocations: int = 0  # device arrays allocated
    copies_to_device: int = 0
    copies_to_host: int = 0
    synchronizations: int = 0  # a stream's, or a blocking copy's
    capturing: Graph | None = None
    violations: list[str] = field(default_factory=list)
    cupy_cublas_calls: list[str] = field(default_factory=list)

    def reset(self, free_bytes: int = 80 << 30) -> None:
        self.__init__(free_bytes)  # type: ignore[misc]
        _BUFFERS.clear()
        _STARTS.clear()


STATE = DeviceState()


def refuse_in_capture(what: str, error: type[Exception] = CaptureViolation) -> None:
    graph = STATE.capturing
    if graph is not None:
        message = f"{what} while a stream captures a CUDA graph"
        graph.invalidated = graph.invalidated or message
        STATE.violations.append(message)
        raise error(message)


def launch(name: str, run: Callable[[], None]) -> None:
    """A kernel or GEMM: recorded while capturing, else run now."""
    STATE.launches.append(name)
    if STATE.capturing is not None:
        STATE.capturing.nodes.append((name, run))
    else:
        run()


# Device pointers are the host addresses of the arrays' memory; GEMMs called with raw
# pointers find their buffer here, and a pointer outside every live buffer is an error.
_BUFFERS: weakref.WeakValueDictionary[int, numpy.ndarray] = weakref.WeakValueDictionary()
_STARTS: list[int] = []


def _register(root: numpy.ndarray) -> None:
    start = root.__array_interface__["data"][0]
    if start not in _BUFFERS:
        _BUFFERS[start] = root
        bisect.insort(_STARTS, start)


def host_memory(pointer: int, nbytes: int) -> numpy.ndarray:
    """The bytes [pointer, pointer + nbytes) of a live device buffer, as a uint8 view."""
    index = bisect.bisect_right(_STARTS, pointer) - 1
    while index >= 0:
        root = _BUFFERS.get(_STARTS[index])
        if root is not None:
            offset = pointer - _STARTS[index]
            if offset + nbytes > root.nbytes:
                raise ValueError(
                    f"{nbytes} bytes at offset {offset} run past a {root.nbytes}-byte buffer"
                )
            return root.reshape(-1).view(numpy.uint8)[offset : offset + nbytes]
        index -= 1
    raise ValueError(f"pointer {pointer:#x} is in no device buffer")


def _allocate(host: numpy.ndarray) -> ndarray:
    refuse_in_capture("an allocation")
    state = STATE
    state.allocations += 1
    state.allocated_bytes += host.nbytes
    state.peak_bytes = max(state.peak_bytes, state.allocated_bytes)
    weakref.finalize(host, _free, state, host.nbytes)
    return ndarray(host)


def _free(state: DeviceState, nbytes: int) -> None:
    state.allocated_bytes -= nbytes


class MemoryPointer:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


def _is_view_index(key: Any) -> bool:
    """Basic indexing (ints, slices, Ellipsis): a view, no kernel."""
    keys = key if isinstance(key, tuple) else (key,)
    return all(isinstance(k, (int, numpy.integer, slice)) or k is Ellipsis for k in keys)


def _host_index(key: Any) -> Any:
    if isinstance(key, tuple):
        return tuple(_host_index(k) for k in key)
    return key._host if isinstance(key, ndarray) else key


class ndarray:
    """A device array: its memory is a numpy array that only the stand-in touches."""

    def __init__(self, host: numpy.ndarray) -> None:
        self._host = host

    shape = property(lambda self: self._host.shape)
    dtype = property(lambda self: self._host.dtype)
    ndim = property(lambda self: self._host.ndim)
    size = property(lambda self: self._host.size)
    nbytes = property(lambda self: self._host.nbytes)
    itemsize = property(lambda self: self._host.itemsize)

    @property
    def flags(self) -> Any:
        return self._host.flags

    @property
    def data(self) -> MemoryPointer:
        root = self._host
        while isinstance(root.base, numpy.ndarray):
            root = root.base
        _register(root)
        return MemoryPointer(self._host.__array_interface__["data"][0])

    def __len__(self) -> int:
        return len(self._host)

    def __array__(self, *args: Any, **kwargs: Any) -> numpy.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed: use .get()")

    def __getitem__(self, key: Any) -> ndarray:
        if _is_view_index(key):
            return ndarray(self._host[key])
        refuse_in_capture("CuPy's gather kernel (fancy indexing)")
        STATE.launches.append("cupy:gather")
        return _allocate(self._host[_host_index(key)])

    def __setitem__(self, key: Any, value: Any) -> None:
        refuse_in_capture("CuPy's copy kernel (an assignment)")
        STATE.launches.append("cupy:assign")
        self._host[_host_index(key)] = value._host if isinstance(value, ndarray) else value

    def view(self, dtype: Any) -> ndarray:
        return ndarray(self._host.view(dtype))

    def astype(self, dtype: Any) -> ndarray:
        refuse_in_capture("CuPy's cast kernel")
        return _allocate(self._host.astype(dtype))

    def __mul__(self, other: float) -> ndarray:
        refuse_in_capture("CuPy's multiply kernel")
        return _allocate(self._host * other)

    def __rshift__(self, other: int) -> ndarray:
        refuse_in_capture("CuPy's shift kernel")
        return _allocate(self._host >> other)

    def reshape(self, *shape: Any) -> ndarray:
        reshaped = self._host.reshape(*shape)
        if reshaped.size and not numpy.shares_memory(reshaped, self._host):
            raise ValueError("the stand-in reshapes contiguous arrays only (a copy would launch)")
        return ndarray(reshaped)

    def get(
        self, stream: Any = None, order: str = "C", out: Any = None, blocking: bool = True
    ) -> numpy.ndarray:
        refuse_in_capture("a copy to the host")
        STATE.copies_to_host += 1
        STATE.synchronizations += blocking
        if out is None:
            return self._host.copy()
        if out.shape != self._host.shape or out.dtype != self._host.dtype:
            raise ValueError(f"get: a {self._host.shape} {self.dtype} array into {out.shape}")
        out[...] = self._host
        return out

    def set(self, array: numpy.ndarray, stream: Any = None) -> None:
        refuse_in_capture("a copy from the host")
        STATE.copies_to_device += 1
        if array.shape != self._host.shape or not self._host.flags.c_contiguous:
            raise ValueError(f"set: {array.shape} into a {self._host.shape} array")
        self._host[...] = array


def empty(shape: Any, dtype: Any = numpy.float32) -> ndarray:
    return _allocate(numpy.empty(shape, dtype))


def zeros(shape: Any, dtype: Any = numpy.float32) -> ndarray:
    return _allocate(numpy.zeros(shape, dtype))


def ones(shape: Any, dtype: Any = numpy.float32) -> ndarray:
    return _allocate(numpy.ones(shape, dtype))


def full(shape: Any, fill_value: Any, dtype: Any = None) -> ndarray:
    return _allocate(numpy.full(shape, fill_value, dtype))


def arange(*args: Any, dtype: Any = None) -> ndarray:
    return _allocate(numpy.arange(*args, dtype=dtype))


def asarray(array: Any, dtype: Any = None) -> ndarray:
    if isinstance(array, ndarray):
        return array if dtype is None else array.view(dtype)
    refuse_in_capture("a copy from the host")
    STATE.copies_to_device += 1
    return _allocate(numpy.array(array, dtype=dtype, copy=True))


def ascontiguousarray(array: ndarray) -> ndarray:
    if array.flags.c_contiguous:
        return array
    refuse_in_capture("CuPy's copy kernel")
    return _allocate(numpy.ascontiguousarray(array._host))


def asnumpy(
    array: ndarray, stream: Any = None, order: str = "C", out: Any = None, blocking: bool = True
) -> numpy.ndarray:
    return array.get(stream, order, out, blocking)


def empty_like(array: ndarray) -> ndarray:
    return empty(array.shape, array.dtype)


def cos(array: ndarray) -> ndarray:
    return _allocate(numpy.cos(array._host))


def sin(array: ndarray) -> ndarray:
    return _allocate(numpy.sin(array._host))


class _Random:
    """cupy.random's few calls the benchmarks make, seeded: host numpy underneath."""

    def __init__(self) -> None:
        self._rng = numpy.random.default_rng(0)

    def standard_normal(self, shape: Any, dtype: Any = numpy.float64) -> ndarray:
        return _allocate(self._rng.standard_normal(shape).astype(dtype))

    def random(self, shape: Any, dtype: Any = numpy.float64) -> ndarray:
        return _allocate(self._rng.random(shape).astype(dtype))

    def permutation(self, count: int) -> ndarray:
        return _allocate(self._rng.permutation(count))


random = _Random()


class _MemoryPool:
    """CuPy's pool keeps freed blocks for reuse; here a count a test may set (STATE.pooled_bytes)
    that memGetInfo does not report as free, as on a GPU."""

    def free_bytes(self) -> int:
        return STATE.pooled_bytes

    def free_all_blocks(self) -> None:
        STATE.pooled_bytes = 0


def get_default_memory_pool() -> _MemoryPool:
    return _MemoryPool()


def alloc_pinned_memory(nbytes: int) -> bytearray:
    """Page-locked host memory: here plain host memory, counted as no device allocation."""
    return bytearray(nbytes)


class Stream:
    _count = 0

    def __init__(self, null: bool = False, non_blocking: bool = False) -> None:
        Stream._count += 1
        self.ptr = 0x5000 + Stream._count
        self._outer: list[Stream] = []

    def __enter__(self) -> Stream:
        self._outer.append(_current[0])
        _current[0] = self
        return self

    def __exit__(self, *exc: object) -> None:
        _current[0] = self._outer.pop()

    def synchronize(self) -> None:
        refuse_in_capture("a stream synchronisation")
        STATE.synchronizations += 1

    def begin_capture(self, mode: Any = None) -> None:
        if STATE.capturing is not None:
            raise RuntimeError("a capture is already in progress")
        STATE.capturing = Graph(self)

    def end_capture(self) -> Graph:
        graph, STATE.capturing = STATE.capturing, None
        if graph is None or graph.stream is not self:
            raise RuntimeError("end_capture on a stream that is not capturing")
        if graph.invalidated:
            raise RuntimeError(f"cudaErrorStreamCaptureInvalidated: {graph.invalidated}")
        return graph

    def is_capturing(self) -> bool:
        return STATE.capturing is not None and STATE.capturing.stream is self


_current: list[Stream] = [Stream(null=True)]


class Event:
    """A CUDA event: here the host clock when it is recorded (work runs at launch)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.seconds: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        refuse_in_capture("an event record outside a graph's own nodes")
        self.seconds = time.perf_counter()

    def synchronize(self) -> None:
        refuse_in_capture("an event synchronisation")


def get_elapsed_time(start: Event, end: Event) -> float:
    """Milliseconds between two recorded events, as cupy.cuda.get_elapsed_time."""
    if start.seconds is None or end.seconds is None:
        raise RuntimeError("cudaErrorInvalidResourceHandle: an event was never recorded")
    return (end.seconds - start.seconds) * 1e3


def get_current_stream() -> Stream:
    return _current[0]
