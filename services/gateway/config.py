"""The gateway's settings, each declared once (shared/runtime/settings.py): where the mesh is,
and its routing, admission, tenant and HTTP bounds (the ones `kvmesh up` takes and forwards)."""

from __future__ import annotations

import argparse
from typing import Any

from shared.runtime.service import service_parser
from shared.runtime.settings import (
    GATEWAY,
    Setting,
    decimal,
    readable_file,
    redis_url,
    whole,
)

DEFAULT_PORT = 50051
SHARING_PORTS = "serving the shared ports"  # logged once --shared-port is open: launchers wait
_DESCRIPTION = "the public API: auth, admission, routing, and the OpenAI-compatible HTTP front"

# services/gateway/mesh/router.py implements them.
ROUTING_POLICIES = ("cache-aware", "round-robin", "least-loaded")

MESH_SETTINGS = (
    Setting("tokenizer", "127.0.0.1:50081", "tokenizer address"),
    Setting(
        "scheduler",
        "127.0.0.1:50071",
        "scheduler addresses, comma-separated; NAME[@VERSION]=HOST:PORT for one known to "
        "serve that model (requests for it are then MODEL_NOT_READY, not NOT_FOUND, until "
        "ready); dns:///HOST:PORT for every address HOST resolves to (a headless Service)",
    ),
    Setting(
        "embedder",
        "",
        "engine-workers serving embedding models (Embed, /v1/embeddings), comma-separated, "
        "each HOST:PORT or NAME[@VERSION]=HOST:PORT",
    ),
    Setting(
        "default-model",
        "",
        "the model of requests that name none (default: the first scheduler's)",
    ),
    Setting(
        "redis",
        None,
        "shared load, prefix-cache and rate-limit state, e.g. redis://host:6379/0",
        redis_url,
    ),
    Setting(
        "http-port",
        8000,
        "OpenAI-compatible HTTP front (/v1/chat/completions, ...); 0: off",
        whole(0),
    ),
    Setting(
        "shared-port",
        0,
        "a gRPC port this gateway serves beside --port, as the host's other gateways do "
        "(SO_REUSEPORT: the kernel spreads connections among them), its HTTP port then shared "
        "the same way; --port stays its own (health checks, one gateway's metrics); 0: none",
        whole(0),
    ),
    Setting(
        "processes",
        1,
        "gateway processes to run (a container's count): they share --port and --http-port, "
        "each also on --port + 1 + i of its own and on --metrics-port + i",
        whole(1),
    ),
    Setting(
        "peers",
        "",
        "the mesh's other gateways at their own ports (HOST:PORT, comma-separated, or "
        "dns:///HOST:PORT for a headless Service): an Abort for a request this gateway does "
        "not hold is asked of them",
    ),
)

_POLICY: dict[str, Any] = dict(group="routing, admission and tenants", takers=(GATEWAY,))

POLICY_SETTINGS = (
    Setting(
        "routing",
        "cache-aware",
        "cache-aware: longest cached prefix weighed against load (needs --redis)",
        choices=ROUTING_POLICIES,
        **_POLICY,
    ),
    Setting(
        "max-queue-ms",
        10000.0,
        "refuse with OVERLOADED when every scheduler's estimated queue time is past "
        "this (0: no limit)",
        decimal(0.0),
        **_POLICY,
    ),
    Setting(
        "max-queue-tokens",
        0,
        "... or its queued prompt tokens are past this (0: no limit)",
        whole(0),
        **_POLICY,
    ),
    Setting(
        "max-in-flight",
        4096,
        "streams this gateway holds at once; beyond: OVERLOADED",
        whole(1),
        **_POLICY,
    ),
    Setting(
        "max-streams-per-tenant",
        0,
        "sequences in flight per tenant across every gateway (n each), for tenants without "
        "their own max_concurrent (and the anonymous one); beyond: RATE_LIMITED (0: no limit)",
        whole(0),
        **_POLICY,
    ),
    Setting(
        "max-request-bytes",
        4 << 20,
        "largest request message (gRPC) or body (HTTP); beyond: REQUEST_TOO_LARGE",
        whole(1),
        **_POLICY,
    ),
    Setting(
        "max-prompt-tokens",
        0,
        "longest prompt; beyond: PROMPT_TOO_LONG (0: the model's context length)",
        whole(0),
        **_POLICY,
    ),
    Setting(
        "max-total-tokens",
        0,
        "prompt + max_tokens per request; beyond: PROMPT_TOO_LONG (0: no limit; the "
        "context length ends the output)",
        whole(0),
        **_POLICY,
    ),
    Setting(
        "tenant-failures-per-minute",
        8,
        "a tenant's requests that may fail in the engine (EXECUTION_FAILED, OUT_OF_MEMORY, "
        "their sampling parameters or format) within a minute; past it, RATE_LIMITED (0: off)",
        whole(0),
        **_POLICY,
    ),
    Setting(
        "stall-timeout-s",
        30.0,
        "cancel a request whose client has not taken an event for this long (flow "
        "control holds the rest back; 0: never)",
        decimal(0.0),
        **_POLICY,
    ),
    Setting(
        "max-http-requests-per-client",
        256,
        "HTTP requests one client address may have open at once, reading a body "
        "included; beyond: 429 RATE_LIMITED (0: no limit; behind a proxy every client is its)",
        whole(0),
        **_POLICY,
    ),
    Setting(
        "body-timeout-s",
        30.0,
        "an HTTP request's headers or body not arrived within this: the connection is "
        "closed (a body: 408 first); also how long an idle kept-alive connection stays open",
        decimal(0.001),
        **_POLICY,
    ),
    Setting(
        "handover-min-tokens",
        256,
        "with prefill and decode pairs: a prompt with fewer tokens to compute (past the "
        "decode pair's cached prefix) skips the prefill pair",
        whole(0),
        **_POLICY,
    ),
    Setting(
        "api-keys-file",
        None,
        "TOML file of tenants, their API keys and limits (or KVMESH_API_KEYS=tenant=key,...)",
        readable_file,
        **_POLICY,
    ),
    Setting(
        "trace-content",
        False,
        "record prompt and completion text in spans (off: telemetry never holds them)",
        switch=True,
        takers=(GATEWAY,),
    ),
)

SETTINGS = (*MESH_SETTINGS, *POLICY_SETTINGS)


def build_parser() -> argparse.ArgumentParser:
    """Every flag of this service (the configuration reference is generated from it)."""
    return service_parser("services.gateway", _DESCRIPTION, DEFAULT_PORT, SETTINGS)
