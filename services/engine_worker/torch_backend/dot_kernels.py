"""Our C++ CPU kernels (csrc/): `kvmesh::int4_dot` and `kvmesh::int8_dot`, integer dot
products over activations rounded to int8 per group of 32, llama.cpp's scheme.

Built together into one library on a machine's first use (~15 s on 2 cores, then cached by
torch's extension builder) and registered with the dispatcher, so the compiled step's loaded
programs call them like any other op. The op schemas live here, so a program can be loaded (and
a fake tensor traced) before the library is built.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from services.engine_worker.artifacts.int4_groups import GROUP

_log = logging.getLogger(__name__)
_SOURCES = [str(Path(__file__).parent / "csrc" / name) for name in ("int4_dot.cpp", "int8_dot.cpp")]
ROWS_PER_BLOCK = 16  # output rows one zmm register holds

_OPS = torch.library.Library("kvmesh", "FRAGMENT")
_OPS.define("int4_dot(Tensor x, Tensor nibbles, Tensor scales, Tensor mins) -> Tensor")
_OPS.define("int8_dot(Tensor x, Tensor weights, Tensor row_scales) -> Tensor")


@torch.library.register_fake("kvmesh::int4_dot")
def _(x, nibbles, scales, mins):
    return x.new_empty((x.shape[0], nibbles.shape[0] * ROWS_PER_BLOCK))


@torch.library.register_fake("kvmesh::int8_dot")
def _(x, weights, row_scales):
    return x.new_empty((x.shape[0], weights.shape[0] * ROWS_PER_BLOCK))


def fits(out_features: int, in_features: int) -> bool:
    """Whether a weight's shape is whole blocks of output rows and groups of inputs."""
    return out_features % ROWS_PER_BLOCK == 0 and in_features % GROUP == 0


def has_avx512() -> bool:
    """AVX-512 (F, BW, VL, DQ), as torch's own kernels see the CPU (ATEN_CPU_CAPABILITY=avx2
    makes an AVX-512 machine run the AVX2 builds, ours included)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def dot_kernels_are_available() -> bool:
    """Whether this CPU has AVX-512 or AVX2 and the kernels built (or build now)."""
    isa = has_avx512() or torch.backends.cpu.get_cpu_capability() == "AVX2"
    return isa and load_dot_kernels()


def _build() -> tuple[str, list[str]]:
    """The library's name and ISA flags on this CPU: AVX-512 (with VNNI where present), or
    AVX2, where int4_dot runs 8 rows to a register with the same bits and int8_dot is absent."""
    if not has_avx512():
        return "kvmesh_dot_kernels_avx2", ["-mavx2", "-mf16c", "-mfma"]
    flags = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mf16c", "-mfma"]
    if torch.cpu._is_vnni_supported():
        return "kvmesh_dot_kernels_vnni", [*flags, "-mavx512vnni"]
    return "kvmesh_dot_kernels", flags


@contextlib.contextmanager
def _builder_lock(folder: Path) -> Iterator[None]:
    """Held around torch's extension builder in `folder`. The builder's own lock is a file it
    takes on every load: a process killed inside `load` (a worker stopped while it starts)
    leaves it behind, and every later start then waits on it for ever. Ours is an flock, which
    the kernel releases when its holder dies, so a lock file found while holding it is such a
    leftover."""
    with open(folder / "kvmesh.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)  # the name cpp_extension gives its lock
        yield


@functools.cache
def load_dot_kernels() -> bool:
    from torch.utils import cpp_extension

    # pip's ninja lies beside the interpreter, which need not be on PATH (make calls .venv/bin).
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    name, flags = _build()
    _log.info("loading kvmesh's dot-product kernels (built once per machine, ~15 s)")
    try:
        folder = Path(cpp_extension._get_build_directory(name, verbose=False))
        with _builder_lock(folder):
            cpp_extension.load(
                name=name,
                sources=_SOURCES,
                # -fopenmp for ATen's parallel_for; at run time it binds to torch's own libgomp.
                extra_cflags=["-O3", *flags, "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                build_directory=str(folder),
            )
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        _log.warning("kvmesh's dot-product kernels did not build (%s); torch's run instead", error)
        return False
    return True
