"""Seconds from start to ready and to the first token: `kvmesh up` cold as before prepared
models (`--prepared off`, an empty cache folder: the step traced and compiled lazily), cold and
ready only once prepared (`--prepared wait`), cold (an empty cache folder: the worker answers on
the eager step while it prepares the model, then switches to the compiled step, a third
figure, and stores it), warm (the prepared
artifact is there), one engine-worker restarted alone on the warm folder, and `kvmesh up
--workers 2` on an empty folder (one prepares, the other waits and loads: their logs are
counted); beside llama.cpp's `llama-server` on the same GGUF, from its start to its health
check answering. Then the 16 parity questions' greedy tokens and logprobs from a fresh
preparation against the prepared artifact it stored, which must be bit-identical.

Each run is a fresh process tree on this machine, one after another; the default model. The two
warm rows are the median of three runs each.
Run: make bench-startup   (llama-server is built once if missing; --no-llama-cpp skips it)
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.client import MeshClient, generate_request
from kvmesh.mesh.service_process import free_port
from services.engine_worker.preparation_underway import COMPILED_SERVING
from shared.model_paths import default_model_path

PROMPT = "Say hello."
KVMESH = str(Path(sys.executable).with_name("kvmesh"))
QUESTIONS = Path(__file__).with_name("texts") / "parity_questions.txt"
# A worker in its own process: the 16 parity questions' greedy tokens and their logprobs.
PARITY = """
import json, sys
from services.engine_worker.worker import Worker
from shared.config import EngineConfig, CacheConfig
from shared.text_tokenizer import load_tokenizer
worker = Worker(EngineConfig(prepared="auto", cache=CacheConfig(kv_memory_bytes=64 << 20)))
tokenizer = load_tokenizer(worker.model_path)
outputs = []
for question in open(sys.argv[1]).read().splitlines():
    prompt = tokenizer.encode(question)
    tokens = worker.greedy(prompt, 16)
    scores = worker.prompt_log_softmax(prompt + tokens)[len(prompt) - 1 :]
    outputs.append([tokens, scores.gather(1, scores.new_tensor(tokens).long()[:, None]).tolist()])
print(json.dumps({"source": worker.manifest.preparation["source"], "outputs": outputs}))
"""


def mesh_start(
    cache: Path, workers: int = 1, prepared: str = "auto", until_compiled: bool = False
) -> dict[str, object]:
    """`kvmesh up`: seconds to its `ready` line, to the first token of an answer and, with
    `until_compiled`, to its workers' compiled step serving (a first start answers on the eager
    step meanwhile); how many workers prepared the model and how many loaded it (their logs)."""
    env = {**os.environ, "KVMESH_CACHE_DIR": str(cache), "KVMESH_PREPARED": prepared}
    command = [KVMESH, "up", "--port", "0", "--http-port", "0", "--workers", str(workers)]
    command += ["--control-port", "-1", "--metrics-port", "-1"]
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines: queue.Queue[tuple[float, str]] = queue.Queue()

    def read_stderr() -> None:
        for raw in process.stderr:  # type: ignore[union-attr]
            lines.put((time.perf_counter(), raw.decode(errors="replace")))

    threading.Thread(target=read_stderr, daemon=True).start()
    try:
        address = process.stdout.readline().decode().strip()  # type: ignore[union-attr]
        if not address:
            raise RuntimeError(f"`kvmesh up` exited with {process.wait()} before it was ready")
        request = generate_request(
            messages=[{"role": "user", "content": PROMPT}], max_tokens=16, temperature=0.0
        )
        with MeshClient(address) as client:
            for event in client.stream(request, timeout=300):
                if event.HasField("delta"):
                    break
        first_token = time.perf_counter() - started
        stderr: list[tuple[float, str]] = []
        while not any(line.startswith("kvmesh: ready in") for _, line in stderr):
            stderr.append(lines.get(timeout=60))  # written before the address, maybe not read
        said = [line for _, line in stderr]
        log_dir = next(x.split("logs in ")[1].strip(")\n") for x in said if "logs in " in x)
        ready = next(at for at, line in stderr if line.startswith("kvmesh: ready in")) - started
        compiled = None
        while until_compiled and compiled is None:
            if _worker_logs(log_dir).count(COMPILED_SERVING) >= 1:
                compiled = time.perf_counter() - started
            elif time.perf_counter() - started > 1800:
                raise RuntimeError("the compiled step never served")
            time.sleep(0.5)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    logs = _worker_logs(log_dir)
    return {
        "ready_seconds": round(ready, 2),
        "first_token_seconds": round(first_token, 2),
        "compiled_seconds": round(compiled, 2) if compiled is not None else "",
        "prepared": logs.count("model prepared and stored"),
        "loaded": logs.count("prepared model loaded"),
    }


def _worker_logs(log_dir: str) -> str:
    return "".join(p.read_text() for p in Path(log_dir).glob("engine-worker*.log"))


def worker_start(cache: Path) -> dict[str, object]:
    """An engine-worker alone: seconds from its start to SERVING on gRPC health."""
    port = free_port()
    env = {**os.environ, "KVMESH_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "2"}
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "services.engine_worker", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while process.poll() is None:
                try:
                    answer = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if answer.status == health_pb2.HealthCheckResponse.SERVING:
                        return {"ready_seconds": round(time.perf_counter() - started, 2)}
                except grpc.RpcError:
                    pass
                time.sleep(0.05)
        raise RuntimeError("the engine-worker exited before it was ready")
    finally:
        process.terminate()
        process.wait(timeout=60)


def parity(cache: Path) -> dict[str, Any]:
    """A fresh preparation's greedy tokens and logprobs against the prepared artifact's."""
    env = {**os.environ, "KVMESH_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "2"}
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", PARITY, str(QUESTIONS)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    fresh, loaded = runs
    same = sum(a == b for a, b in zip(fresh["outputs"], loaded["outputs"], strict=True))
    return {"sources": [fresh["source"], loaded["source"]], "identical": same, "prompts": 16}


def median_of(runs: int, start: Callable[[], dict[str, object]]) -> dict[str, object]:
    """The run whose seconds to ready are the median of `runs`, with every run's seconds."""
    figures = [start() for _ in range(runs)]
    figures.sort(key=lambda f: float(f["ready_seconds"]))  # type: ignore[arg-type]
    median = figures[runs // 2]
    return {**median, "runs": [f["ready_seconds"] for f in figures]}


def llama_server_start(model: str, log_dir: Path) -> dict[str, object]:
    from loadtest import llama_cpp

    bin_dir = llama_cpp.build()
    started = time.perf_counter()
    with llama_cpp.server(bin_dir, model, 1, 2048, 2, log_dir / "llama-server.log"):
        return {"ready_seconds": round(time.perf_counter() - started, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama-server")
    parser.add_argument("--json", action="store_true", help="the figures as one JSON object")
    args = parser.parse_args()
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="kvmesh-startup-") as scratch:
        cache = Path(scratch) / "cache"
        # Before prepared models: the step compiled lazily, Inductor's cache empty.
        results["kvmesh up, cold, --prepared off"] = mesh_start(Path(scratch) / "off", 1, "off")
        # Ready only once the compiled step serves.
        results["kvmesh up, cold, --prepared wait"] = mesh_start(Path(scratch) / "wait", 1, "wait")
        # The default: the eager step answers while a child prepares the compiled one.
        results["kvmesh up, cold"] = mesh_start(cache, until_compiled=True)
        # Warm starts take seconds: the median of three, each a fresh process tree.
        results["kvmesh up, warm"] = median_of(3, lambda: mesh_start(cache))
        results["engine-worker restarted, warm"] = median_of(3, lambda: worker_start(cache))
        shutil.rmtree(cache)
        results["kvmesh up --workers 2, cold"] = mesh_start(cache, workers=2)
        checked = parity(Path(scratch) / "parity-cache")
        if not args.no_llama_cpp:
            results["llama-server"] = llama_server_start(default_model_path(), Path(scratch))
    if args.json:
        print(json.dumps({**results, "parity": checked}, indent=1))
        return 0
    print(f"{'start':36} {'ready s':>8} {'first token s':>14} {'compiled s':>11}  worker logs")
    for name, figures in results.items():
        logs = ""
        if "prepared" in figures:
            logs = f"{figures['prepared']} prepared, {figures['loaded']} loaded"
        first = figures.get("first_token_seconds", "")
        compiled = figures.get("compiled_seconds", "")
        runs = f"  (runs: {figures['runs']})" if "runs" in figures else ""
        print(f"{name:36} {figures['ready_seconds']:>8} {first:>14} {compiled:>11}  {logs}{runs}")
    print(
        f"greedy tokens and logprobs, {checked['sources'][0]} then {checked['sources'][1]}: "
        f"{checked['identical']}/{checked['prompts']} parity prompts bit-identical"
    )
    peer = results.get("llama-server", {}).get("ready_seconds")
    if isinstance(peer, float) and peer > 0:
        for name in ("kvmesh up, warm", "engine-worker restarted, warm"):
            ratio = float(results[name]["ready_seconds"]) / peer  # type: ignore[arg-type]
            print(f"{name} ready / llama-server ready: {ratio:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
