"""Compiled programs that are saved once and loaded without tracing: what makes a warm start fast.

`torch.compile` traces its function with Dynamo on the first call of every process, even when
Inductor's cache holds the compiled code: on the default model that tracing was 18 s of a warm
worker's 27 s start on a 2-core machine. `aot_compile` traces once, while a model is prepared,
and what it returns serializes (guards, Dynamo's bytecode and Inductor's code); loading it takes
a fraction of a second. A loaded program keeps its guards: called with inputs it was not traced
for, it raises instead of computing.

Programs are called under `torch.no_grad()`, not inference mode: a serialized guard records a
tensor's dispatch keys without the thread's inference-mode exclusions, so a normal tensor
(the KV pool) fails its own guard in inference mode.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from typing import Any

import torch

Program = Callable[..., Any]


def aot_program(function: Callable[..., Any], args: tuple[Any, ...], **options: Any) -> Program:
    """`function` traced and compiled for `args` (their marked dynamic sizes stay dynamic)."""
    compiled = torch.compile(function, fullgraph=True, dynamic=False, **options)
    with torch.no_grad():
        return compiled.aot_compile((args, {}))  # type: ignore[attr-defined]


def program_bytes(program: Program) -> bytes:
    return type(program).serialize(program).serialized_data  # type: ignore[attr-defined]


def load_program(data: bytes) -> Program:
    return torch.compiler.load_compiled_function(io.BytesIO(data))


class ProgramTable:
    """Programs by name, the ones this process compiled kept as bytes for the prepared
    artifact. `record` on: a program missing when it is first needed is compiled ahead of time
    and kept; off, the caller falls back to its lazily traced function."""

    def __init__(self, check_guards: bool = True) -> None:
        # Off only where the name pins every input's shape and dtype: a serialized guard on an
        # inference tensor's dispatch keys fails inside an op's kernel, where the thread's
        # included keys differ from those of the process that traced it.
        self.check_guards = check_guards
        self.programs: dict[str, Program] = {}
        self.compiled: dict[str, bytes] = {}
        self.record = False
        self.compile_seconds = 0.0  # spent compiling programs ahead of time

    def get(
        self, name: str, function: Callable[..., Any], args: tuple[Any, ...], **options: Any
    ) -> Program | None:
        program = self.programs.get(name)
        if program is None and self.record:
            started = time.perf_counter()
            program = aot_program(function, args, **options)
            self.compile_seconds += time.perf_counter() - started
            self._install(name, program)
            self.compiled[name] = program_bytes(program)
        return program

    def load(self, saved: dict[str, bytes]) -> None:
        for name, data in saved.items():
            self._install(name, load_program(data))

    def _install(self, name: str, program: Program) -> None:
        if not self.check_guards:
            program.disable_guard_check()  # type: ignore[attr-defined]
        self.programs[name] = program
