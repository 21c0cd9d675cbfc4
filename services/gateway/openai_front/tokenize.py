"""vLLM's `POST /tokenize` and `POST /detokenize`, which harnesses and UIs call beside the
OpenAI routes.

/tokenize takes a `prompt` (as /v1/completions encodes it) or `messages` (rendered with the
chat template and the assistant's turn, as /v1/chat/completions does) and answers `count`,
`max_model_len` and `tokens`; /detokenize takes `tokens` and answers `prompt`.
"""

from __future__ import annotations

from typing import Any

from services.gateway.mesh.catalog import ModelCatalog
from services.gateway.openai_front.fields import ignore_unknown
from services.gateway.openai_front.protocol import chat_message
from services.gateway.request.generate import GenerateHandler
from services.gateway.request.tokenize_call import charged_token_ids
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2
from shared.tenants import Tenant

TOKENIZE_FIELDS = {"model", "prompt", "messages"}
DETOKENIZE_FIELDS = {"model", "tokens"}


def _invalid(message: str) -> KvmeshError:
    return KvmeshError(Reason.INVALID_ARGUMENT, message)


def _model(body: dict[str, Any]) -> str:
    model = body.get("model", "")
    if not isinstance(model, str):
        raise _invalid("'model' must be a string")
    return model


def tokenize_request(body: dict[str, Any]) -> inference_pb2.TokenizeRequest:
    ignore_unknown(body, TOKENIZE_FIELDS, "tokenize")
    request = inference_pb2.TokenizeRequest(model=_model(body))
    prompt, messages = body.get("prompt"), body.get("messages")
    if isinstance(prompt, str) and messages is None:
        request.text = prompt
    elif isinstance(messages, list) and messages and prompt is None:
        request.chat.CopyFrom(
            common_pb2.Chat(messages=[chat_message(m, i) for i, m in enumerate(messages)])
        )
    else:
        raise _invalid("give 'prompt' (a string) or 'messages' (a non-empty list), not both")
    return request


async def tokenize(
    catalog: ModelCatalog, generate: GenerateHandler, body: dict[str, Any], tenant: Tenant
) -> dict[str, Any]:
    request = tokenize_request(body)
    model = catalog.pick(request.model).served_model()
    ids = await charged_token_ids(generate.policy, generate.tokenizer, tenant, request, model, None)
    return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}


async def detokenize(
    catalog: ModelCatalog, generate: GenerateHandler, body: dict[str, Any]
) -> dict[str, Any]:
    ignore_unknown(body, DETOKENIZE_FIELDS, "detokenize")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in tokens
    ):
        raise _invalid("'tokens' must be a list of token ids")
    model = catalog.pick(_model(body)).served_model()
    return {"prompt": await generate.tokenizer.text_of(tokens, model, None)}
