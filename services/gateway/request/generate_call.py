"""One Generate call as its admission and relay read it, and what passed its checks."""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.mesh.connections import SchedulerBackend
from services.gateway.policy.request_ids import Claim
from services.gateway.request.call_context import CallContext
from services.gateway.request.request_telemetry import RequestTelemetry
from services.gateway.request.tools import ToolUse
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2
from shared.sampling import SamplingParams
from shared.tenants import Tenant


@dataclass
class GenerateCall:
    """One Generate call, as every step of its admission reads it."""

    request: inference_pb2.GenerateRequest
    context: CallContext
    request_id: str  # the client's, or one made up for it
    received: float  # time.monotonic() at arrival
    telemetry: RequestTelemetry
    tools: ToolUse | None = None  # the chat's tools and tool choice, once checked
    claim: Claim | None = None  # on the client's own request id, across gateways


@dataclass(frozen=True)
class Checked:
    """A request that passed every check needing no other service."""

    tenant: Tenant
    candidates: list[SchedulerBackend]  # ready schedulers of the model version chosen
    model: common_pb2.ModelInfo
    sampling: SamplingParams
