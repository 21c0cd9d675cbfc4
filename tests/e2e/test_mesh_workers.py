"""`--workers N`: several engine-worker + scheduler pairs behind one gateway."""

from __future__ import annotations

import asyncio

import grpc

from kvmesh.mesh.launcher import Mesh, MeshConfig
from shared.pb.kvmesh.v1 import inference_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.mesh_helpers import assert_one_terminal, collect, ids_request


async def test_requests_spread_over_every_worker(tiny_llama_dir: str, tmp_path) -> None:
    config = MeshConfig(
        model=tiny_llama_dir,
        workers=2,
        worker_threads=1,
        worker_args=["--kv-memory", "16MiB"],
        log_dir=str(tmp_path),
        drain_seconds=2,
    )
    with Mesh(config) as mesh:
        async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
            inference = inference_pb2_grpc.InferenceStub(channel)
            requests = [ids_request([1, 2, i], max_tokens=200, ignore_eos=True) for i in range(8)]
            streams = await asyncio.gather(*(collect(inference, r) for r in requests))
        outcomes = [(assert_one_terminal(events), events[-1]) for events in streams]
        assert [kind for kind, _ in outcomes] == ["completed"] * 8, [
            str(last) for kind, last in outcomes if kind != "completed"
        ]
        schedulers = {e[-1].completed.execution.scheduler for e in streams}
        assert schedulers == set(mesh.scheduler_addresses)
        for address in mesh.scheduler_addresses:
            async with grpc.aio.insecure_channel(address) as sched:
                load = await scheduler_pb2_grpc.SchedulerStub(sched).GetLoad(
                    scheduler_pb2.LoadRequest()
                )
            assert load.num_steps > 0 and load.num_free_blocks == load.num_blocks
