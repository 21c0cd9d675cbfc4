"""The gateway's flags (routing, admission, tenants, the HTTP front's bounds), each defaulting
to KVMESH_<FLAG> when set, and the same parsed back as arguments for `kvmesh up` to forward."""

from __future__ import annotations

import argparse

from shared.flag_env import env_default, env_float, env_int

# Gateway routing policies (services/gateway/router.py implements them).
ROUTING_POLICIES = ("cache-aware", "round-robin", "least-loaded")


def add_gateway_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("routing, admission and tenants")
    group.add_argument(
        "--routing",
        default=env_default("routing", "cache-aware"),
        choices=ROUTING_POLICIES,
        help="cache-aware: longest cached prefix weighed against load (needs --redis)",
    )
    group.add_argument(
        "--max-queue-ms",
        type=float,
        default=float(env_default("max-queue-ms", "10000") or 0),
        help="refuse with OVERLOADED when every scheduler's estimated queue time is past "
        "this (0: no limit)",
    )
    group.add_argument(
        "--max-queue-tokens",
        type=int,
        default=env_int("max-queue-tokens", 0),
        help="... or its queued prompt tokens are past this (0: no limit)",
    )
    group.add_argument(
        "--max-in-flight",
        type=int,
        default=env_int("max-in-flight", 4096),
        help="streams this gateway holds at once; beyond: OVERLOADED",
    )
    group.add_argument(
        "--max-streams-per-tenant",
        type=int,
        default=env_int("max-streams-per-tenant", 0),
        help="open streams per tenant across every gateway, for tenants without their own "
        "max_concurrent (and the anonymous one); beyond: RATE_LIMITED (0: no limit)",
    )
    group.add_argument(
        "--max-request-bytes",
        type=int,
        default=env_int("max-request-bytes", 4 << 20),
        help="largest request message (gRPC) or body (HTTP); beyond: REQUEST_TOO_LARGE",
    )
    group.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=env_int("max-prompt-tokens", 0),
        help="longest prompt; beyond: PROMPT_TOO_LONG (0: the model's context length)",
    )
    group.add_argument(
        "--max-total-tokens",
        type=int,
        default=env_int("max-total-tokens", 0),
        help="prompt + max_tokens per request; beyond: PROMPT_TOO_LONG (0: no limit; the "
        "context length ends the output)",
    )
    group.add_argument(
        "--tenant-failures-per-minute",
        type=int,
        default=env_int("tenant-failures-per-minute", 8),
        help="a tenant's requests that may fail in the engine (EXECUTION_FAILED, OUT_OF_MEMORY, "
        "their sampling parameters or format) within a minute; past it, RATE_LIMITED (0: off)",
    )
    group.add_argument(
        "--stall-timeout-s",
        type=float,
        default=float(env_default("stall-timeout-s", "30") or 0),
        help="cancel a request whose client has not taken an event for this long (flow "
        "control holds the rest back; 0: never)",
    )
    group.add_argument(
        "--max-http-requests-per-client",
        type=int,
        default=env_int("max-http-requests-per-client", 256),
        help="HTTP requests one client address may have open at once, reading a body "
        "included; beyond: 429 RATE_LIMITED (0: no limit; behind a proxy every client is its)",
    )
    group.add_argument(
        "--body-timeout-s",
        type=float,
        default=env_float("body-timeout-s", 30.0),
        help="an HTTP request's headers or body not arrived within this: the connection is "
        "closed (a body: 408 first); also how long an idle kept-alive connection stays open",
    )
    group.add_argument(
        "--handover-min-tokens",
        type=int,
        default=env_int("handover-min-tokens", 256),
        help="with prefill and decode pairs: a prompt with fewer tokens to compute (past the "
        "decode pair's cached prefix) skips the prefill pair",
    )
    group.add_argument(
        "--api-keys-file",
        default=env_default("api-keys-file", None),
        help="TOML file of tenants, their API keys and limits (or KVMESH_API_KEYS=tenant=key,...)",
    )
    parser.add_argument(
        "--trace-content",
        action="store_true",
        default=env_default("trace-content", "") == "1",
        help="record prompt and completion text in spans (off: telemetry never holds them)",
    )


def gateway_flag_args(args: argparse.Namespace) -> list[str]:
    forwarded = ["--routing", args.routing, "--max-queue-ms", str(args.max_queue_ms)]
    forwarded += ["--max-queue-tokens", str(args.max_queue_tokens)]
    forwarded += ["--max-in-flight", str(args.max_in_flight)]
    forwarded += ["--max-streams-per-tenant", str(args.max_streams_per_tenant)]
    forwarded += ["--max-request-bytes", str(args.max_request_bytes)]
    forwarded += ["--max-prompt-tokens", str(args.max_prompt_tokens)]
    forwarded += ["--max-total-tokens", str(args.max_total_tokens)]
    forwarded += ["--tenant-failures-per-minute", str(args.tenant_failures_per_minute)]
    forwarded += ["--stall-timeout-s", str(args.stall_timeout_s)]
    forwarded += ["--body-timeout-s", str(args.body_timeout_s)]
    forwarded += ["--max-http-requests-per-client", str(args.max_http_requests_per_client)]
    forwarded += ["--handover-min-tokens", str(args.handover_min_tokens)]
    forwarded += ["--trace-content"] if args.trace_content else []
    return forwarded + (["--api-keys-file", args.api_keys_file] if args.api_keys_file else [])
