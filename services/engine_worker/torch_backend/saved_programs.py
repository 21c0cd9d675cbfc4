"""Compiled programs that are saved once and loaded without tracing: what makes a warm start fast.

`torch.compile` traces its function with Dynamo on the first call of every process, even when
Inductor's cache holds the compiled code, and Dynamo's own serialized programs still import
Dynamo and rebuild their guards when loaded (2-3 s of a warm worker's start on a 2-core
machine). A program here is an AOTInductor package instead: the function exported once, while
a model is prepared, and compiled to a shared library with its C++ wrapper; loading one maps
that library (milliseconds) and imports nothing of Dynamo or Inductor. Calling it passes the
argument tensors straight to the library; opaque `kvmesh::` ops are reached through torch's
dispatcher (AOTInductor's proxy executor).

Compiling is mostly single-threaded (Inductor's code generation, then one C++ build after
another), so each program compiles in a process of its own, started as soon as its function is
exported: the default model's two step programs took 180 s one after the other on a 2-core
machine. Meanwhile the table answers with the function itself, run eagerly.

A program has no guards: it computes with whatever tensors it is given, so its name must pin
what it was exported for (the table's caller names one program per graph), and the prepared
artifact's key pins the rest (weights, formats, CPU, torch).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
import torch.utils._pytree as pytree

from shared.runtime.parent_watch import PARENT_PID_ENV, die_with_parent

# AOTInductor's package format: the library, its wrapper source and metadata, in one zip.
PROGRAM_SUFFIX = ".pt2"
_EXPORTED_SUFFIX = ".exported.pt2"


class StepCompileError(RuntimeError):
    """The compiler failed on one of the step's graphs (its message ends with the compiler's
    own last lines)."""

    def under(self, step_limits: dict[str, int]) -> StepCompileError:
        """The same failure as a user starting an engine reads it: its limits, the way out."""
        named = ", ".join(f"{name}={value}" for name, value in step_limits.items())
        return StepCompileError(
            f"the compiled step could not be prepared (step limits {named}); compile='off' "
            f"(--compile off, KVMESH_COMPILE=off) runs the eager step instead. {self}"
        )


class Program:
    """A loaded package, called with the arguments it was exported for.

    Non-tensor arguments were constants of the export. An argument passed as the same object
    as on the previous call (the weights, the KV pool) keeps its flattened tensors: a step
    flattens only its batch (~600 weight tensors flattened anew cost ~0.4 ms a step)."""

    def __init__(self, path: Path) -> None:
        # one runner, on the calling thread: the worker steps one batch at a time
        self._loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", True, 1, -1)
        self._seen: list[tuple[object, list[torch.Tensor]]] = []

    def __call__(self, *args: Any) -> Any:
        if len(self._seen) != len(args):
            self._seen = [(None, [])] * len(args)
        tensors: list[torch.Tensor] = []
        for index, arg in enumerate(args):
            last, flat = self._seen[index]
            if arg is not last:
                flat = [t for t in pytree.tree_leaves(arg) if isinstance(t, torch.Tensor)]
                self._seen[index] = (arg, flat)
            tensors.extend(flat)
        outs = self._loader.boxed_run(tensors)
        return outs[0] if len(outs) == 1 else tuple(outs)


def marked_sizes(args: tuple[Any, ...]) -> list[tuple[int, ...]]:
    """The dimensions marked dynamic (`torch._dynamo.mark_dynamic`) of each tensor in `args`."""
    return [
        tuple(getattr(leaf, "_dynamo_dynamic_indices", ()))
        for leaf in pytree.tree_leaves(args)
        if isinstance(leaf, torch.Tensor)
    ]


def export_program(function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """`function` exported for `args`: the sizes marked dynamic stay dynamic where export can
    keep them (`takes_any_size` tells), every other one and every non-tensor argument is
    fixed."""
    leaves, spec = pytree.tree_flatten(args)
    at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    class Bound(torch.nn.Module):
        def forward(self, *tensors: torch.Tensor) -> Any:
            full = list(leaves)
            for i, tensor in zip(at, tensors, strict=True):
                full[i] = tensor
            return function(*pytree.tree_unflatten(full, spec))

    tensors = tuple(leaves[i] for i in at)
    dynamic = tuple(
        {d: torch.export.Dim.DYNAMIC for d in dims} or None for dims in marked_sizes(args)
    )
    with torch.no_grad():
        return torch.export.export(Bound(), tensors, dynamic_shapes=(dynamic,), strict=False)


def takes_any_size(exported: Any, marked: list[tuple[int, ...]]) -> bool:
    """Whether an exported program computes any size of every dimension that was `marked`
    dynamic, as export proved it: each stayed a symbol (none was fixed to its example's size)
    ranging over 0..inf. Then no step limits are baked into it."""
    from torch.utils._sympy.numbers import int_oo  # sympy: 0.3 s a loading worker never pays

    names = set(exported.graph_signature.user_inputs)
    nodes = exported.graph.nodes
    inputs = [n.meta["val"] for n in nodes if n.op == "placeholder" and n.name in names]
    kept = len(inputs) == len(marked) and all(
        isinstance(value.shape[dim], torch.SymInt)
        for value, dims in zip(inputs, marked, strict=True)
        for dim in dims
    )
    ranges = exported.range_constraints.values()
    return kept and all(r.lower <= 0 and r.upper == int_oo for r in ranges)


def _shrunk(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with its dynamic sizes cut to at most 2."""
    for dim in getattr(tensor, "_dynamo_dynamic_indices", ()):
        tensor = tensor.narrow(dim, 0, min(tensor.shape[dim], 2))
    return tensor.clone()


class _Compiling:
    """One program compiling in a child process."""

    def __init__(
        self, function: Callable[..., Any], args: tuple[Any, ...], package: Path, options: Any
    ) -> None:
        self.package = package
        self.exported = package.with_suffix(_EXPORTED_SUFFIX)
        marked = marked_sizes(args)  # before the export, which consumes the marks
        exported = export_program(function, args)
        self.takes_any_size = takes_any_size(exported, marked)
        # AOTInductor wants example inputs; the KV pool whole was 1.2 GB written and read back
        exported.example_inputs = (tuple(map(_shrunk, exported.example_inputs[0])), {})
        torch.export.save(exported, str(self.exported))
        settings = {
            # The wrapper only calls the kernels: at -O1 its build took 36 s of a program's
            # ~100, at -O0 13 s, for ~3% more time a decode step (still faster than Dynamo's).
            "options": {"aot_inductor.compile_wrapper_opt_level": "O0", **(options or {})},
            "modules": [function.__module__],  # registers the ops the graph calls
            "backed_size_oblivious": bool(fx_config.backed_size_oblivious),
        }
        command = [sys.executable, "-m", __name__, str(self.exported), str(package)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        env[PARENT_PID_ENV] = str(os.getpid())
        self.log = package.with_suffix(".log")  # a file: a full pipe would stall the child
        with open(self.log, "w") as log:
            # A session of its own: a kill reaches the C++ compilers it starts too. It is told
            # when this process dies, and takes them with it (`_compile`).
            self.process = subprocess.Popen(
                [*command, json.dumps(settings)],
                env=env,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )

    def kill(self) -> None:
        """Ends the child and everything it started; its files go."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        for path in (self.exported, self.log, self.package):
            path.unlink(missing_ok=True)

    def wait(self) -> Program:
        self.process.wait()
        errors = self.log.read_text(errors="replace")[-2000:]
        self.exported.unlink(missing_ok=True)
        self.log.unlink(missing_ok=True)
        if self.process.returncode != 0:
            raise StepCompileError(f"compiling {self.package.name} failed: {errors}")
        return Program(self.package)


class ProgramTable:
    """Programs by name, the packages this process compiled kept for the prepared artifact.

    `record_into(folder)`: a program missing when it is first needed is exported and compiled
    there, in another process, and the function runs eagerly until `finish()` loads what was
    compiled. Not recording, the caller falls back to its lazily traced function."""

    def __init__(self) -> None:
        self.programs: dict[str, Program] = {}
        self.compiled: dict[str, Path] = {}  # name -> package this process compiled
        self.takes_any_size: dict[str, bool] = {}  # of those: whether export kept every size
        self.compile_seconds = 0.0  # exporting, and waiting for the compiling processes
        self._folder: Path | None = None
        self._compiling: dict[str, _Compiling] = {}
        # No program yet and none to trace: the function runs eagerly (a worker serving while
        # its programs are prepared elsewhere, or after they failed), never a lazy trace that
        # would stall a live step for minutes.
        self.eager_fallback = False

    def record_into(self, folder: Path | None) -> None:
        self._folder = folder

    def get(
        self, name: str, function: Callable[..., Any], example: tuple[Any, ...], **options: Any
    ) -> Callable[..., Any] | None:
        """The program `name`, else (recording) `function` to run eagerly while the program
        is exported for the arguments `example` and compiled: its sizes are the compiler's
        hints, so they are the caller's choice, not whatever step came first."""
        program = self.programs.get(name)
        if program is not None or self._folder is None:
            return program
        if name not in self._compiling:
            started = time.perf_counter()
            self._folder.mkdir(parents=True, exist_ok=True)
            package = self._folder / f"{name}{PROGRAM_SUFFIX}"
            self._compiling[name] = _Compiling(function, example, package, options.get("options"))
            self.compile_seconds += time.perf_counter() - started
        return function

    def finish(self) -> None:
        """Waits for the programs compiling and loads them."""
        started = time.perf_counter()
        try:
            for name, compiling in self._compiling.items():
                self.programs[name] = compiling.wait()
                self.compiled[name] = compiling.package
                self.takes_any_size[name] = compiling.takes_any_size
        finally:
            self.abandon()  # after a failure, the others are not waited for
            self.compile_seconds += time.perf_counter() - started

    def abandon(self) -> None:
        """Stops what is still compiling (a failure, or the worker stopped while preparing)."""
        for name, compiling in self._compiling.items():
            if name not in self.compiled:
                compiling.kill()
        self._compiling.clear()

    def load(self, saved: dict[str, Path]) -> None:
        for name, path in saved.items():
            self.programs[name] = Program(path)


def _compile(exported: str, package: str, settings: dict[str, Any]) -> None:
    import importlib

    # Sent by the kernel when the worker dies: this process's group (its C++ compilers) with it.
    signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    die_with_parent(signal.SIGTERM)

    for module in settings["modules"]:
        importlib.import_module(module)
    oblivious = settings["backed_size_oblivious"]
    with fx_config.patch(backed_size_oblivious=oblivious):  # type: ignore[attr-defined]
        torch._inductor.aoti_compile_and_package(
            torch.export.load(exported), package_path=package, inductor_configs=settings["options"]
        )


if __name__ == "__main__":
    _compile(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
