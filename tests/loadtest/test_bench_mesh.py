"""The load generator against a real mesh (tiny random model): closed and open loop, gRPC and
OpenAI HTTP targets, cancels and deadlines, result files and plots, and `kvmesh bench`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.mesh.launcher import Mesh
from loadtest.bench import BenchPlan, run, write_report
from loadtest.driver import LoadShape
from loadtest.report import Slo
from loadtest.workload import Workload
from tests.e2e.mesh_helpers import settled_load, tiny_mesh_config

SMALL = """
name = "small"
requests = 12
seed = 1
cancel_rate = {cancel}
deadline_rate = {deadline}
deadline_ms = 1

[prompt]
kind = "uniform"
low = 8
high = 24

[output]
kind = "fixed"
value = 8

[sampling]
temperature = 0.0
ignore_eos = true
"""


@pytest.fixture(scope="module")
def mesh(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = tiny_mesh_config(tiny_llama_dir, str(tmp_path_factory.mktemp("bench-mesh-logs")))
    with Mesh(config) as running:
        yield running


def workload(tmp_path: Path, cancel: float = 0.0, deadline: float = 0.0) -> Workload:
    path = tmp_path / "small.toml"
    path.write_text(SMALL.format(cancel=cancel, deadline=deadline))
    return Workload.load(str(path))


def test_closed_loop_over_grpc_records_every_request(mesh: Mesh, tmp_path: Path) -> None:
    plan = BenchPlan(
        target=f"grpc://{mesh.gateway_address}",
        workload=workload(tmp_path),
        loads=[LoadShape(concurrency=4)],
        slo=Slo(ttft_s=30.0),
        out_dir=tmp_path / "out",
        progress=False,
    )
    result = run(plan)
    (summary,) = result.summaries
    assert summary["outcomes"] == {"completed": 12} and summary["goodput_share"] == 1.0
    records = next(iter(result.runs.values())).records
    for record in records:
        assert record.output_tokens == 8 and record.reason == "length"
        assert 0 < record.ttft_s <= record.e2e_s
        assert len(record.itl_s) <= 7 and record.queue_s is not None
    lines = (tmp_path / "out" / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 12 and json.loads(lines[0])["label"] == "kvmesh"
    report = write_report(tmp_path / "out", result, "small")
    text = report.read_text()
    assert "| kvmesh | concurrency 4 | 12/12 |" in text and "TTFT: to the first" in text
    assert (tmp_path / "out" / "latency_distributions.png").read_bytes()[:4] == b"\x89PNG"


def test_open_loop_rate_sweep_over_openai_http(mesh: Mesh, tmp_path: Path) -> None:
    plan = BenchPlan(
        target=mesh.http_url,
        workload=workload(tmp_path),
        loads=[LoadShape(rate=4.0, seed=1), LoadShape(rate=8.0, seed=1)],
        label="kvmesh-http",
        vocab_size=256,
        progress=False,
    )
    result = run(plan)
    assert [s["rate"] for s in result.summaries] == [4.0, 8.0]
    for summary in result.summaries:
        assert summary["outcomes"] == {"completed": 12}
        assert summary["output_throughput"] > 0 and summary["ttft_p99_ms"] is not None
    records = next(iter(result.runs.values())).records
    assert all(r.output_tokens == 8 for r in records)  # exact, from the usage chunk
    sends = [r.sent_at for r in records]
    assert 1.0 < max(sends) < 6.0  # 12 Poisson arrivals at 4/s: about 2.75 s
    write_report(tmp_path / "out", result, "sweep")
    assert (tmp_path / "out" / "latency_vs_rate.png").exists()


def test_cancels_and_deadlines_are_counted_and_leak_nothing(mesh: Mesh, tmp_path: Path) -> None:
    plan = BenchPlan(
        target=mesh.gateway_address,
        workload=workload(tmp_path, cancel=0.4, deadline=0.3),
        loads=[LoadShape(concurrency=6)],
        requests=30,
        progress=False,
    )
    (summary,) = run(plan).summaries
    outcomes = summary["outcomes"]
    assert outcomes.get("cancelled", 0) > 0
    assert outcomes.get("refused", 0) + outcomes.get("failed", 0) > 0  # 1 ms deadlines
    assert all(reason.endswith(("client", "DEADLINE_EXCEEDED")) for reason in summary["reasons"])
    assert summary["goodput_share"] < 1.0
    for address in mesh.scheduler_addresses:
        load = await_settled(address)
        assert load.num_free_blocks == load.num_blocks


def await_settled(address: str):  # type: ignore[no-untyped-def]
    import asyncio

    return asyncio.run(settled_load(address))


def test_kvmesh_bench_command(mesh: Mesh, tmp_path: Path) -> None:
    path = tmp_path / "small.toml"
    path.write_text(SMALL.format(cancel=0.0, deadline=0.0))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh",
            "bench",
            f"grpc://{mesh.gateway_address}",
            "--workload",
            str(path),
            "--concurrency",
            "1,4",
            "--requests",
            "6",
            "--slo-ttft-ms",
            "30000",
            "--out",
            str(tmp_path / "cli"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "| kvmesh | concurrency 1 | 6/6 |" in done.stdout
    assert "| kvmesh | concurrency 4 | 6/6 |" in done.stdout
    assert (tmp_path / "cli" / "throughput_vs_concurrency.png").exists()
    assert len((tmp_path / "cli" / "summary.jsonl").read_text().splitlines()) == 2
