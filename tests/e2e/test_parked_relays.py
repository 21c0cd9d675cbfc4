"""Plain HTTP streams relayed by the gateway's step pass (parked_relays.py), on the sim mesh:
the same text as the request's own task relays (a gRPC stream never parks), a stop string
matched from the pass ends the stream there, a client that stops reading is cancelled after
the stall timeout, and a lost tokenizer fails the parked streams; each frees its blocks."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator

import openai
import pytest

from kvmesh.client import MeshClient, generate_request
from kvmesh.mesh.launcher import Mesh, MeshConfig
from tests.e2e.mesh_helpers import assert_mesh_idle, metric_value, model_name, settled_load

# Room for 8 completions of 8,000 tokens: the sim's pool is allocated, its pages never touched.
SIM = ["--backend", "sim", "--sim-step-ms", "2", "--kv-memory", "1600MiB"]
PROMPT = "Why is the sky blue?"
PASS_DELTAS = "kvmesh_gateway_step_pass_deltas_total"
STALLED = 'kvmesh_requests_total{outcome="cancelled",reason="client_stalled"}'


@pytest.fixture(scope="module")
def sim_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(
        worker_args=SIM,
        gateway_args=["--stall-timeout-s", "1"],
        log_dir=str(tmp_path_factory.mktemp("parked-mesh-logs")),
        drain_seconds=2,
    )
    with Mesh(config) as running:
        yield running


@pytest.fixture
async def client(sim_mesh: Mesh):
    async with openai.AsyncOpenAI(base_url=sim_mesh.http_url, api_key="unused") as client:
        yield client


def grpc_text(mesh: Mesh, seed: int, max_tokens: int) -> str:
    request = generate_request(PROMPT, max_tokens=max_tokens, seed=seed, ignore_eos=True)
    with MeshClient(mesh.gateway_address) as grpc_client:
        events = list(grpc_client.stream(request, timeout=30))
    assert events[-1].HasField("completed")
    return "".join(e.delta.text for e in events if e.HasField("delta"))


async def http_stream(client, seed: int, max_tokens: int, **extra) -> tuple[str, list[str]]:
    """The streamed text and the finish reasons of a completions stream."""
    stream = await client.completions.create(
        model=await model_name(client),
        prompt=PROMPT,
        max_tokens=max_tokens,
        seed=seed,
        stream=True,
        extra_body={"ignore_eos": True},
        **extra,
    )
    text, finishes = [], []
    async for chunk in stream:
        text.append(chunk.choices[0].text)
        finishes += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    return "".join(text), finishes


async def test_the_step_pass_streams_what_the_requests_task_would(sim_mesh: Mesh, client):
    assert sim_mesh.gateways[0].metrics_url is not None
    before = metric_value(sim_mesh.gateways[0].metrics_url, PASS_DELTAS)
    seeds = list(range(1, 17))
    streamed = await asyncio.gather(*(http_stream(client, seed, 96) for seed in seeds))
    passed = metric_value(sim_mesh.gateways[0].metrics_url, PASS_DELTAS) - before
    for seed, (text, finishes) in zip(seeds, streamed, strict=True):
        assert text == grpc_text(sim_mesh, seed, 96) and finishes == ["length"]
    # All but each stream's first delta could go through the pass; merged deltas are fewer.
    assert len(seeds) * 10 < passed <= len(seeds) * 95
    await assert_mesh_idle(sim_mesh)


async def test_a_stop_string_matched_in_the_pass_ends_the_stream_there(sim_mesh: Mesh, client):
    whole = grpc_text(sim_mesh, 7, 200)
    stop = whole[len(whole) // 2 : len(whole) // 2 + 4]  # well past the first delta
    text, finishes = await http_stream(client, 7, 200, stop=[stop])
    assert text == whole[: whole.index(stop)] and finishes == ["stop"]
    await assert_mesh_idle(sim_mesh)


async def test_an_http_client_that_stops_reading_is_cancelled(sim_mesh: Mesh, client):
    url = urllib.parse.urlsplit(sim_mesh.http_url)
    body = json.dumps(
        {
            "model": await model_name(client),
            "prompt": PROMPT,
            "max_tokens": 8000,
            "n": 8,  # ~14 MB of chunks: more than the socket buffers hold (4 MB on Linux)
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills after a few chunks
    reader.connect((url.hostname, url.port))
    reader.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    try:
        assert reader.recv(64).startswith(b"HTTP/1.1 200")  # then nothing more is read
        deadline = time.monotonic() + 30
        address = sim_mesh.scheduler_addresses[0]
        load = await settled_load(address)
        while load.num_open_streams and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            load = await settled_load(address)
        assert load.num_open_streams == 0 and load.num_blocks_referenced == 0
        assert sim_mesh.gateways[0].metrics_url is not None
        assert metric_value(sim_mesh.gateways[0].metrics_url, STALLED) == 1  # not finished
    finally:
        reader.close()
    await assert_mesh_idle(sim_mesh)


def sse_events(url: urllib.parse.SplitResult, body: dict, started: threading.Event) -> list[dict]:
    """Every `data:` event of a completions stream, read with a plain HTTP client; `started`
    is set once the first two came (the stream is past its first delta)."""
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(body).encode())
    response = connection.getresponse()
    events = []
    for line in response:
        if line.startswith(b"data: {"):
            events.append(json.loads(line[6:]))
            if len(events) == 2:
                started.set()
    connection.close()
    return events


async def test_a_lost_tokenizer_fails_the_parked_streams_and_frees_them(sim_mesh: Mesh, client):
    url = urllib.parse.urlsplit(sim_mesh.http_url)
    body = {"model": await model_name(client), "prompt": PROMPT, "max_tokens": 8000}
    body |= {"stream": True, "ignore_eos": True}
    started = [threading.Event() for _ in range(4)]
    streams = [asyncio.to_thread(sse_events, url, body, flag) for flag in started]
    running = asyncio.gather(*streams)
    for flag in started:
        assert await asyncio.to_thread(flag.wait, 30)
    sim_mesh.service("tokenizer").process.kill()
    for events in await running:
        assert events[-1]["error"]["code"] == "TOKENIZER_LOST", events[-1]
        assert events[-1]["error"]["retryable"] is False  # tokens went out: not resendable
        assert sum(bool(e.get("choices")) for e in events) < 4000  # failed, not finished
    sim_mesh.restart("tokenizer")
    await assert_mesh_idle(sim_mesh)
