"""Compile every kernel ahead of time with nvcc for a GPU architecture, without a GPU.

`python -m services.engine_worker.cupy_backend.kernels.compile_check [--arch sm_90]` prints each
file's ptxas report (registers, shared memory, spills per kernel) and exits non-zero on an error,
a register spill, a kernel over its register budget, or a log without ptxas's report (then "0
spills" would be read from nothing); the test suite runs the same check. `--nvrtc` compiles the
way CuPy does at run time instead, with ptxas's report asked for the same way.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from services.engine_worker.cupy_backend.kernels.library import KERNEL_DIR, sources

SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
REGISTERS = re.compile(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", re.DOTALL)
# Registers per thread each kernel may use. Decode attention keeps a running output per query
# head of its GQA group (up to 8) in registers: 168 still fits three 128-thread CTAs an SM.
# Every other kernel is a row-wise pass that wants full occupancy.
REGISTER_BUDGETS = {"paged_decode_attention": 168, "paged_prefill_attention": 96}
DEFAULT_REGISTER_BUDGET = 64
PTXAS_VERBOSE = "--ptxas-options=-v"  # nvcc's -Xptxas -v, spelled as NVRTC takes it too


@dataclass
class CompileReport:
    source: Path
    returncode: int
    output: str  # nvcc and ptxas -v messages

    @property
    def spilled_bytes(self) -> int:
        return sum(int(a) + int(b) for a, b in SPILLS.findall(self.output))

    @property
    def registers(self) -> dict[str, int]:
        """Each kernel's registers per thread, from ptxas's report."""
        return {name: int(count) for name, count in REGISTERS.findall(self.output)}

    @property
    def budget(self) -> int:
        return REGISTER_BUDGETS.get(self.source.stem, DEFAULT_REGISTER_BUDGET)

    @property
    def problem(self) -> str | None:
        """Why the kernel fails the check, or None when it passes."""
        if self.returncode != 0:
            return "did not compile"
        if not SPILLS.search(self.output) or not self.registers:
            return "no ptxas report in the log (was -v passed?)"
        if self.spilled_bytes:
            return f"spills {self.spilled_bytes} bytes of registers"
        over = {name: n for name, n in self.registers.items() if n > self.budget}
        if over:
            return f"over its budget of {self.budget} registers: {over}"
        return None


def nvcc() -> str | None:
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None
    )


def compile_cubin(
    source: Path, arch: str = "sm_90", compiler: str | None = None, defines: tuple[str, ...] = ()
) -> CompileReport:
    compiler = compiler or nvcc()
    if compiler is None:
        raise FileNotFoundError("nvcc is not installed")
    with tempfile.TemporaryDirectory() as scratch:
        command = [
            compiler,
            "-cubin",
            f"-arch={arch}",
            "-std=c++17",
            f"-I{KERNEL_DIR}",
            *(f"-D{define}" for define in defines),
            PTXAS_VERBOSE,
            "-split-compile=0",  # every core: decode attention alone instantiates 27 kernels
            "-o",
            str(Path(scratch) / f"{source.stem}.cubin"),
            str(source),
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    return CompileReport(source, done.returncode, done.stdout + done.stderr)


def compile_nvrtc(source: Path, arch: str = "sm_90") -> CompileReport:
    """The run-time path: NVRTC through CuPy's bindings (needs CuPy and libnvrtc, no GPU)."""
    from cupy_backends.cuda.libs import nvrtc

    include = [f"-I{KERNEL_DIR}", "-I/usr/local/cuda/include"]
    program = nvrtc.createProgram(source.read_text(), source.name, [], [])
    try:
        options = ["-std=c++17", f"-arch={arch}", PTXAS_VERBOSE, *include]
        nvrtc.compileProgram(program, options)
    except nvrtc.NVRTCError:
        return CompileReport(source, 1, nvrtc.getProgramLog(program))
    return CompileReport(source, 0, nvrtc.getProgramLog(program))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--nvrtc", action="store_true", help="compile with NVRTC, as CuPy does")
    args = parser.parse_args()
    failed = 0
    for source in sources():
        compile_one = compile_nvrtc if args.nvrtc else compile_cubin
        report = compile_one(source, args.arch)
        problem = report.problem
        most = max(report.registers.values(), default=0)
        print(
            f"{source.name}: {problem or 'ok'}, spilled {report.spilled_bytes} bytes, "
            f"at most {most} of {report.budget} registers"
        )
        if problem is not None:
            failed += 1
            print(report.output, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
