"""llama.cpp's own C++ binaries as peers: built once from the sources vendored in the
`llama-cpp-python` sdist, then `llama-batched-bench` (engine level) and `llama-server
--parallel N` (serving level, continuous batching) run from the cache.

The build is cmake's, native to the machine (-DGGML_NATIVE=ON), into $KVMESH_PEERS_CACHE
(default ~/.cache/kvmesh/llama.cpp-VERSION, `-cuda` appended for the CUDA build); CPU only about
15 minutes on 2 cores, once; with CUDA (`--cuda-arch 90`) about 4.5 minutes on 16 cores. A
machine without a package registry gives the sources as an archive instead
(KVMESH_LLAMA_CPP_SOURCES, a .tar.xz of the sdist's vendor/llama.cpp: tests/gpu/check).
Run alone: python -m loadtest.llama_cpp [--cuda-arch 90]  (prints the binaries' folder).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvmesh.mesh.service_process import free_port

LLAMA_CPP_PYTHON = "0.3.36"
TARGETS = ("llama-batched-bench", "llama-server", "llama-quantize", "llama-perplexity")
CUDA_TARGETS = ("llama-batched-bench", "llama-quantize")  # the GPU bench's peers
SOURCES_ARCHIVE = "KVMESH_LLAMA_CPP_SOURCES"


def cache_dir(cuda: bool = False) -> Path:
    default = Path.home() / ".cache" / "kvmesh" / f"llama.cpp-{LLAMA_CPP_PYTHON}"
    root = Path(os.environ.get("KVMESH_PEERS_CACHE", default))
    return root.with_name(root.name + "-cuda") if cuda else root


def fetch_sources(source: Path, log=sys.stderr) -> None:
    """llama.cpp's sources as vendored in the llama-cpp-python sdist, into `source`."""
    given = os.environ.get(SOURCES_ARCHIVE)
    if given:
        with tarfile.open(given) as tar:
            tar.extractall(source, filter="data")
        return
    with tempfile.TemporaryDirectory() as download:
        print(f"llama.cpp: fetching the llama-cpp-python {LLAMA_CPP_PYTHON} sdist", file=log)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                "-d",
                download,
            ],
            check=True,
        )
        (archive,) = Path(download).glob("llama_cpp_python-*.tar.gz")
        prefix = f"{archive.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for member in members:
                member.name = member.name[len(prefix) :]
            tar.extractall(source, members=[m for m in members if m.name], filter="data")


def build(log=sys.stderr, cuda_arch: str | None = None) -> Path:
    """The folder holding the built binaries; builds them first if missing. cuda_arch (e.g.
    "90"): the CUDA build, for that architecture only."""
    root = cache_dir(cuda=cuda_arch is not None)
    targets = CUDA_TARGETS if cuda_arch else TARGETS
    bin_dir = root / "build" / "bin"
    if all((bin_dir / t).exists() for t in targets):
        return bin_dir
    root.mkdir(parents=True, exist_ok=True)
    source = root / "src"
    if not (source / "CMakeLists.txt").exists():
        fetch_sources(source, log)
    build_dir = root / "build"
    print(f"llama.cpp: building {', '.join(targets)} in {build_dir} (once)", file=log)
    options = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
    ]
    if cuda_arch:
        options += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}"]
        options += ["-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF"]
    subprocess.run(
        ["cmake", "-S", str(source), "-B", str(build_dir), *options],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    subprocess.run(
        ["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 2), "--target", *targets],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return bin_dir


def run_repacked(command: list[str], log=sys.stderr) -> subprocess.CompletedProcess[str]:
    """A llama.cpp binary run with its CPU repacking of quantized weights on (its default);
    where the repacked kernels die by a signal, once more with `--no-repack`, said on `log`.
    Its AMX kernels do on a 2-vCPU Sapphire Rapids-class VM (SIGILL at a `tilezero`) while a
    plain AMX program runs there; whether the result was repacked: "--no-repack" not in .args."""
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode < 0:
        print(
            f"llama.cpp: {Path(command[0]).name} died by signal {-result.returncode} with "
            "repacked weights on this CPU; running it again with --no-repack",
            file=log,
        )
        result = subprocess.run([*command, "--no-repack"], capture_output=True, text=True)
    if result.returncode != 0:
        raise subprocess.CalledProcessError(
            result.returncode, result.args, result.stdout, result.stderr
        )
    return result


@dataclass(frozen=True)
class BatchedBenchRow:
    prompt_tokens: int
    generated_tokens: int
    batch: int
    prefill_tok_s: float
    decode_tok_s: float  # all sequences' generated tokens over the decode time


def batched_bench(
    bin_dir: Path,
    model: str,
    batches: list[int],
    prompt: int,
    generated: int,
    threads: int,
    gpu_layers: int = 0,
    repack: bool = False,
) -> list[BatchedBenchRow]:
    """`llama-batched-bench`: each batch size prefills `prompt` tokens per sequence, then
    decodes `generated` tokens for all of them together; gpu_layers: layers offloaded to a
    CUDA build's GPU (99: all); repack: llama.cpp's CPU repacking of quantized weights (its
    default) left on, where it runs (`run_repacked`)."""
    context = max(batches) * (prompt + generated) + 64
    command = [
        str(bin_dir / "llama-batched-bench"),
        "-m",
        model,
        "-c",
        str(context),
        "-b",
        "2048",
        "-ub",
        "512",
        "-npp",
        str(prompt),
        "-ntg",
        str(generated),
        "-npl",
        ",".join(map(str, batches)),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-fa",
        "on",
        "-ngl",
        str(gpu_layers),
    ]
    if repack:
        result = run_repacked(command)
    else:
        result = subprocess.run(
            [*command, "--no-repack"], check=True, capture_output=True, text=True
        )
    rows = []
    # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s | ...
    for line in result.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and re.fullmatch(r"\d+", cells[0]):
            rows.append(
                BatchedBenchRow(
                    int(cells[0]), int(cells[1]), int(cells[2]), float(cells[5]), float(cells[7])
                )
            )
    return rows


@contextlib.contextmanager
def server(
    bin_dir: Path, model: str, parallel: int, context: int, threads: int, log_path: Path
) -> Iterator[str]:
    """`llama-server --parallel N` (continuous batching) on loopback; yields its /v1 URL."""
    port = free_port()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                str(bin_dir / "llama-server"),
                "-m",
                model,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--parallel",
                str(parallel),
                "-c",
                str(context),
                "-t",
                str(threads),
                "-tb",
                str(threads),
                "--no-repack",
                "--cont-batching",
                "--no-webui",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 180
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server did not start; see {log_path}")
                time.sleep(0.5)
            yield f"{url}/v1"
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def quantize(bin_dir: Path, source: str, target: str, kind: str) -> str:
    """`llama-quantize SOURCE TARGET KIND` (e.g. F16, Q4_1); returns target."""
    subprocess.run(
        [str(bin_dir / "llama-quantize"), source, target, kind],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return target


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cuda-arch", help="build with CUDA for this architecture, e.g. 90")
    print(build(cuda_arch=parser.parse_args().cuda_arch))


if __name__ == "__main__":
    main()
