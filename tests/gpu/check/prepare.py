"""What `make gpu-check` brings to a GPU machine that reaches no package registry, into
.gpu-check/ (at most 64 MiB, what one device call carries):

- wheels/: cp312 wheels of what kvmesh and the GPU suite need beyond what such a machine has
  (torch, CuPy, transformers and their dependencies): nvmath-python and cuda-bindings, gguf,
  llguidance, redis, OpenTelemetry, the gRPC family at our pinned version, jsonschema,
  aiohttp, pytest-asyncio...
- llama.cpp.tar.xz: llama.cpp's sources from the llama-cpp-python sdist our CPU peers use,
  less what a CUDA build of its benchmarks never reads (docs, models, tests, other backends).
- skeleton.gguf: the default model's metadata and tensor list (model_skeleton.py).
- redis/: redis-server and the libraries it links that a bare machine lacks, unpacked from
  this machine's Debian packages with dpkg -x.

Run: make gpu-check-prepare  (needs the registries; a minute or two)
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from loadtest.llama_cpp import LLAMA_CPP_PYTHON
from shared.model_paths import default_model_path
from tests.gpu.check.model_skeleton import write_skeleton

ROOT = Path(__file__).resolve().parents[3]
BUNDLE = ROOT / ".gpu-check"
LIMIT_BYTES = 64 << 20
PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# Resolved with their dependencies, for cp312.
REQUIREMENTS = (
    "nvmath-python>=1.0",
    "cuda-bindings>=13,<14",
    "gguf>=0.10",
    "llguidance>=1.0",
    "redis>=5.2",
    "anyio>=4.4",
    "grpcio==1.85.1",
    "grpcio-health-checking==1.85.1",
    "grpcio-reflection==1.85.1",
    "grpcio-status==1.85.1",
    "protobuf>=7.34,<8",
    "googleapis-common-protos>=1.70",
    "opentelemetry-proto>=1.30",
    "opentelemetry-sdk>=1.30",
    "opentelemetry-exporter-otlp-proto-common>=1.30",
    "prometheus-client>=0.20",
    "jsonschema>=4.20",
    "aiohttp>=3.9",
    "pytest-asyncio>=1.0",
    "psutil>=5.9",
)
# The machine's own, which ours must not shadow: torch's, transformers' and pytest's worlds.
MACHINE_HAS = re.compile(
    r"^(numpy|torch|triton|nvidia_.*|cupy.*|sympy|mpmath|networkx|filelock|fsspec|jinja2|"
    r"markupsafe|typing_extensions|packaging|pyyaml|tqdm|requests|urllib3|idna|certifi|"
    r"charset_normalizer|huggingface_hub|hf_xet|tokenizers|safetensors|regex|transformers|"
    r"setuptools|pytest|pluggy|iniconfig|pygments|six|fastrlock)-",
    re.IGNORECASE,
)
# Never read by a CUDA build of llama-batched-bench and llama-quantize.
LLAMA_CPP_UNUSED = (
    "models", "docs", "tests", "examples", "pocs", "benches", "media", "scripts", "ci", "app",
    "tools/ui", "gguf-py", "conversion", "requirements", "skills", "grammars", ".github",
    *(f"ggml/src/ggml-{backend}" for backend in (
        "vulkan", "opencl", "sycl", "hexagon", "metal", "et", "webgpu", "openvino", "cann",
        "virtgpu",
    )),
)  # fmt: skip
REDIS_PACKAGES = ("redis-tools", "liblzf1", "libjemalloc2")


def download_wheels(target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version",
         PYTHON, *platforms, "-d", str(target), *REQUIREMENTS],
        check=True,
    )  # fmt: skip
    for wheel in target.iterdir():
        if MACHINE_HAS.match(wheel.name):
            wheel.unlink()


def pack_llama_cpp(target: Path) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", scratch],
            check=True,
        )  # fmt: skip
        (sdist,) = Path(scratch).glob("llama_cpp_python-*.tar.gz")
        prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        unused = tuple(prefix + path for path in LLAMA_CPP_UNUSED)
        with tarfile.open(sdist) as source, tarfile.open(target, "w:xz") as packed:
            for member in source.getmembers():
                if not member.name.startswith(prefix) or member.name.startswith(unused):
                    continue
                name = member.name[len(prefix) :]
                if not name:
                    continue
                data = source.extractfile(member) if member.isfile() else None
                member.name = name
                # A long name travels in a pax header, which would override the new one.
                member.pax_headers = {
                    key: value for key, value in member.pax_headers.items() if key != "path"
                }
                packed.addfile(member, data)


def unpack_redis(target: Path) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(["apt-get", "download", *REDIS_PACKAGES], cwd=scratch, check=True)
        for package in Path(scratch).glob("*.deb"):
            subprocess.run(["dpkg", "-x", str(package), str(target)], check=True)
    for unused in ("usr/share", "etc", "lib/systemd"):
        shutil.rmtree(target / unused, ignore_errors=True)
    binaries = target / "usr" / "bin"
    for unused in ("redis-benchmark", "redis-check-aof", "redis-cli", "redis-server"):
        (binaries / unused).unlink(missing_ok=True)
    (binaries / "redis-check-rdb").rename(binaries / "redis-server")  # its own name: a server
    for link in [path for path in target.rglob("*") if path.is_symlink()]:
        resolved = link.resolve()  # links may not travel with a device call: copies do
        link.unlink()
        shutil.copy2(resolved, link)


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    shutil.rmtree(BUNDLE, ignore_errors=True)
    BUNDLE.mkdir()
    download_wheels(BUNDLE / "wheels")
    pack_llama_cpp(BUNDLE / "llama.cpp.tar.xz")
    write_skeleton(default_model_path(), str(BUNDLE / "skeleton.gguf"))
    unpack_redis(BUNDLE / "redis")
    total = size_of(BUNDLE)
    for part in sorted(BUNDLE.iterdir()):
        size = size_of(part) if part.is_dir() else part.stat().st_size
        print(f"{part.name:<20} {size / 2**20:6.1f} MiB")
    print(f"{'total':<20} {total / 2**20:6.1f} MiB (a device call carries {LIMIT_BYTES >> 20})")
    if total > LIMIT_BYTES:
        raise SystemExit("the bundle is over what one call carries")


if __name__ == "__main__":
    main()
