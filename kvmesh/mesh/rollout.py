"""Rollouts on a running mesh: deploy a model version, canary it, roll back; no stream dropped.

Deploy, in order: pin the model's current split (a new version gets nothing by arriving);
start the version's engine-worker + scheduler pairs and wait for readiness (digests verified,
warmed, warm-up fixtures matched); add them to the gateway and send a fixture prompt through it
pinned to the version; shift traffic (all, or a canary share); then for each version left with
no traffic, remove it from the gateway (which returns once its streams there ended) and stop its
pairs (SIGTERM: each scheduler finishes whatever it still holds). A failure before the shift
stops the new pairs and leaves traffic where it was.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field

import grpc

from kvmesh.mesh.every_gateway import EveryGateway, every_gateway
from kvmesh.mesh.launcher import Mesh, ModelPair
from shared import grpc_errors
from shared.errors import KvmeshError, Reason
from shared.model_entry import ModelEntry
from shared.model_paths import is_encoder
from shared.pb.kvmesh.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    model_admin_pb2,
    model_admin_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from shared.runtime.tls import sync_channel

READY_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 120.0


@dataclass
class RolloutStep:
    message: str
    traffic: dict[str, float] = field(default_factory=dict)
    done: bool = False


class RolloutController:
    """Serializes rollouts on one mesh; remembers each model's versions for rollback."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self._lock = threading.Lock()
        self._history: dict[str, list[str]] = {}  # model -> versions deployed, current last
        self._traffic: dict[str, dict[str, float]] = {}
        # With API keys on, the gateway takes ModelAdmin calls from an admin tenant only.
        key = os.environ.get("KVMESH_ADMIN_API_KEY", "")
        self._metadata = (("authorization", f"Bearer {key}"),) if key else ()

    def deploy(
        self, name: str, version: str, canary_percent: float | None = None
    ) -> Iterator[RolloutStep]:
        with self._lock:
            yield from self._deploy(name, version, canary_percent)
            history = self._history.setdefault(name, [])
            if version in history:
                history.remove(version)
            history.append(version)

    def rollback(self, name: str) -> Iterator[RolloutStep]:
        with self._lock:
            history = self._history.get(name) or self._running_versions(name)
            if len(history) < 2:
                raise KvmeshError(
                    Reason.INVALID_ARGUMENT, f"{name} has no earlier version to roll back to"
                )
            previous = history[-2]
            yield from self._deploy(name, previous, None)
            self._history[name] = history[:-1]

    def _deploy(
        self, name: str, version: str, canary_percent: float | None
    ) -> Iterator[RolloutStep]:
        if canary_percent is not None and not 0 < canary_percent < 100:
            raise KvmeshError(Reason.INVALID_ARGUMENT, "a canary takes a percent in (0, 100)")
        entry = self.mesh.repository.entry(name, version)  # MODEL_NOT_FOUND before anything
        if is_encoder(entry.artifact_path):
            raise KvmeshError(
                Reason.INVALID_ARGUMENT, "rollouts move generation models; embedding models not yet"
            )
        self._require_tokenizer(name)
        self._history.setdefault(name, self._running_versions(name))
        traffic = self._traffic.setdefault(name, self._even_split(name))
        own_addresses = [g.grpc_address for g in self.mesh.gateways]
        stubs = model_admin_pb2_grpc.ModelAdminStub, inference_pb2_grpc.InferenceStub
        with every_gateway(own_addresses, *stubs) as (admin, gateways):
            if traffic:
                self._set_traffic(admin, name, traffic)
            pairs = self._pairs(name, version)
            if not pairs:
                pairs = yield from self._start(entry, admin, gateways)
            split = self._new_split(traffic, version, canary_percent)
            self._set_traffic(admin, name, split)
            self._traffic[name] = split
            yield RolloutStep(f"traffic for {name}: {_describe(split)}", dict(split))
            for old in sorted({p.version for p in self._pairs(name)} - set(split)):
                yield from self._retire(admin, name, old)
            self.mesh.remember_schedulers()
        yield RolloutStep(f"{entry.label} deployed", dict(split), done=True)

    def _require_tokenizer(self, name: str) -> None:
        """Text requests need the model's tokenizer: the mesh's tokenizer service loads one
        per model at start, so a model it was not started with cannot be rolled out here."""
        with sync_channel(
            self.mesh.tokenizer_address, token=self.mesh.secrets.mesh_token
        ) as channel:
            try:
                tokenizer_pb2_grpc.TokenizerStub(channel).GetInfo(
                    tokenizer_pb2.TokenizerInfoRequest(model=name), timeout=10
                )
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.NOT_FOUND:
                    raise grpc_errors.from_rpc_error(error) from None
                raise KvmeshError(
                    Reason.MODEL_NOT_FOUND,
                    f"{name} was not among `kvmesh up --models`: the mesh's tokenizer holds "
                    "none for it; restart the mesh with it",
                ) from None

    def _start(
        self,
        entry: ModelEntry,
        admin: EveryGateway,
        gateways: EveryGateway,
    ) -> Generator[RolloutStep, None, list[ModelPair]]:
        replicas = max(
            [len(self._pairs(entry.name, v)) for v in self._running_versions(entry.name)] or [1]
        )
        pairs = [self.mesh.start_pair(entry) for _ in range(replicas)]
        try:
            self.mesh.wait_ready([s for p in pairs for s in (p.worker, p.scheduler)])
            yield RolloutStep(
                f"{entry.label}: {replicas} pair(s) ready (digests verified, warmed, "
                f"{len(entry.fixtures)} warm-up fixture(s) matched)"
            )
            for pair in pairs:
                admin.AddBackend(
                    model_admin_pb2.AddBackendRequest(
                        address=pair.scheduler.address, model=entry.name, version=entry.version
                    ),
                    timeout=10,
                    metadata=self._metadata,
                )
            self._wait_gateway_ready(gateways, entry, replicas)
            self._answer_fixture(entry)
            yield RolloutStep(f"{entry.label}: answered its fixture prompt through the gateway")
        except BaseException:
            for pair in pairs:
                if pair.scheduler.address is not None:
                    self._remove_backend(admin, pair.scheduler.address, 1.0)
                self.mesh.stop_pair(pair, timeout_s=5)
            raise
        return pairs

    def _retire(self, admin: EveryGateway, name: str, version: str) -> Iterator[RolloutStep]:
        for pair in self._pairs(name, version):
            address = pair.scheduler.grpc_address
            left = self._remove_backend(admin, address, DRAIN_TIMEOUT_S)
            self.mesh.stop_pair(pair, timeout_s=DRAIN_TIMEOUT_S)
            yield RolloutStep(
                f"{name}@{version}: drained ({left} stream(s) left at the timeout) and stopped "
                f"{pair.scheduler.name}"
            )

    def _remove_backend(self, admin: EveryGateway, address: str, timeout_s: float) -> int:
        replies = admin.RemoveBackend(
            model_admin_pb2.RemoveBackendRequest(address=address, drain_timeout_s=timeout_s),
            timeout=timeout_s + 10,
            metadata=self._metadata,
        )
        return sum(int(reply.streams_left) for reply in replies)

    def _set_traffic(self, admin: EveryGateway, name: str, split: dict[str, float]) -> None:
        admin.SetTraffic(
            model_admin_pb2.SetTrafficRequest(model=name, percent=split),
            timeout=10,
            metadata=self._metadata,
        )

    def _wait_gateway_ready(self, gateways: EveryGateway, entry: ModelEntry, replicas: int) -> None:
        """Until every gateway sees the version's replicas ready."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            every_listed = gateways.ListModels(
                inference_pb2.ListModelsRequest(), timeout=10, metadata=self._metadata
            )
            if all(
                any(
                    (status.name, status.version) == (entry.name, entry.version)
                    and status.ready_replicas >= replicas
                    for status in listed.versions
                )
                for listed in every_listed
            ):
                return
            if time.monotonic() > deadline:
                raise KvmeshError(
                    Reason.MODEL_NOT_READY, f"the gateway never saw {entry.label} ready"
                )
            time.sleep(0.05)

    def _answer_fixture(self, entry: ModelEntry) -> None:
        """One greedy request pinned to the new version, through the gateway (the public
        port): the whole path works, and the output is the fixture's (when it has one)."""
        fixture = entry.fixtures[0] if entry.fixtures else None
        prompt = list(fixture.prompt_ids) if fixture else [1, 2, 3, 4]
        max_tokens = len(fixture.expected_ids) if fixture else 4
        request = inference_pb2.GenerateRequest(
            model=entry.label,
            token_ids=common_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True
            ),
        )
        output: list[int] = []
        try:
            with sync_channel(self.mesh.gateway_address) as channel:
                gateway = inference_pb2_grpc.InferenceStub(channel)
                events = list(gateway.Generate(request, timeout=60, metadata=self._metadata))
            for event in events:
                if event.HasField("delta"):
                    output.extend(event.delta.token_ids)
                elif event.HasField("failed"):
                    raise KvmeshError(
                        Reason.MODEL_NOT_READY,
                        f"{entry.label} failed its fixture prompt: {event.failed.error.message}",
                    )
        except grpc.RpcError as error:
            raise grpc_errors.from_rpc_error(error) from None
        if fixture is not None and tuple(output) != fixture.expected_ids:
            raise KvmeshError(
                Reason.MODEL_NOT_READY,
                f"{entry.label} answered its fixture prompt with {output}, "
                f"expected {list(fixture.expected_ids)}",
            )

    def _pairs(self, name: str, version: str | None = None) -> list[ModelPair]:
        return [p for p in self.mesh.pairs if p.name == name and version in (None, p.version)]

    def _running_versions(self, name: str) -> list[str]:
        running = {p.version for p in self._pairs(name)}
        return [v for v in self.mesh.repository.versions(name) if v in running]

    def _even_split(self, name: str) -> dict[str, float]:
        versions = self._running_versions(name)
        return {v: 100.0 / len(versions) for v in versions} if versions else {}

    @staticmethod
    def _new_split(
        current: dict[str, float], version: str, canary_percent: float | None
    ) -> dict[str, float]:
        if canary_percent is None:
            return {version: 100.0}
        rest = {v: share for v, share in current.items() if v != version and share > 0}
        total = sum(rest.values())
        if not total:
            return {version: 100.0}
        scale = (100.0 - canary_percent) / total
        return {**{v: share * scale for v, share in rest.items()}, version: canary_percent}


def _describe(split: dict[str, float]) -> str:
    return ", ".join(f"{version} {share:g}%" for version, share in sorted(split.items()))
