"""Who may send what, and where it goes: the gateway's admission settings in one object."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.mesh.router import Router
from services.gateway.policy.engine_failures import TenantFailures
from services.gateway.policy.limits import RequestLimits
from services.gateway.policy.rate_limits import RateLimiter
from services.gateway.policy.request_ids import RequestIds
from shared.tenants import ApiKeys


@dataclass
class GatewayPolicy:
    api_keys: ApiKeys = field(default_factory=ApiKeys)
    router: Router = field(default_factory=lambda: Router(None))
    rate_limiter: RateLimiter = field(default_factory=lambda: RateLimiter(None))
    request_ids: RequestIds = field(default_factory=lambda: RequestIds(None))
    max_in_flight: int = 4096  # this gateway's own bound on open streams
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Refuses a tenant whose requests keep failing in the engine (the breaker does not count them).
    tenant_failures: TenantFailures = field(default_factory=TenantFailures)
    stall_timeout_s: float = 30.0  # a client that takes no event this long is cancelled
    body_timeout_s: float = 30.0  # HTTP headers or body not arrived by then: closed (408)
    max_http_per_client: int = 256  # HTTP requests one client address has open; 0: no limit
    trace_content: bool = False  # prompt and completion text in spans (off: never)
    # With prefill and decode pairs: fewer tokens to compute than this skip the prefill pair.
    handover_min_tokens: int = 256
