"""Tokenize and CountTokens, on gRPC and HTTP: a prompt's token ids without a generation. The
tokenizer's time is the caller's: its tokens are charged to its tokens per minute, as a refused
prompt's are, and a tenant with none left is refused before tokenizing."""

from __future__ import annotations

from services.gateway.mesh.tokenizer_link import TokenizerLink
from services.gateway.policy.policy import GatewayPolicy
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2
from shared.tenants import Tenant


async def charged_token_ids(
    policy: GatewayPolicy,
    tokenizer: TokenizerLink,
    tenant: Tenant,
    request: inference_pb2.TokenizeRequest,
    model: common_pb2.ModelInfo,
    remaining: float | None,
) -> list[int]:
    policy.limits.check_size(request.ByteSize())
    await policy.rate_limiter.require_tokens_left(tenant)
    limit = policy.limits.prompt_limit(model)  # no longer than a prompt could be
    try:
        ids = await tokenizer.prompt_token_ids(request, model, remaining, max_tokens=limit)
    except KvmeshError as error:
        if error.reason is Reason.PROMPT_TOO_LONG:  # counted to the limit at most
            await policy.rate_limiter.charge(tenant, limit)
        raise
    await policy.rate_limiter.charge(tenant, len(ids))
    return ids
