"""OpenAI's `POST /v1/embeddings`: body -> EmbedRequest, EmbedResponse -> OpenAI's response.

`input` is a string, a list of strings, one token array, or a list of token arrays;
`encoding_format` "float" (default) or "base64" (little-endian float32, as OpenAI sends);
`dimensions`, when given, must be the model's own (these models are not Matryoshka-trained).
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Any

from services.gateway.openai_front.fields import EMBEDDING_FIELDS, ignore_unknown
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2

MAX_TOKEN_ID = (1 << 32) - 1  # the proto's uint32


def _invalid(message: str) -> KvmeshError:
    return KvmeshError(Reason.INVALID_ARGUMENT, message)


def _token_ids(value: list[Any]) -> common_pb2.TokenIds:
    if not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in value):
        raise _invalid("token ids in 'input' must be integers in [0, 2^32)")
    return common_pb2.TokenIds(ids=value)


def _inputs(value: Any) -> list[common_pb2.EmbedInput]:
    if isinstance(value, str):
        return [common_pb2.EmbedInput(text=value)]
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return [common_pb2.EmbedInput(text=item) for item in value]
        if all(type(item) is int for item in value):
            return [common_pb2.EmbedInput(token_ids=_token_ids(value))]
        if all(isinstance(item, list) and item for item in value):
            return [common_pb2.EmbedInput(token_ids=_token_ids(item)) for item in value]
    raise _invalid(
        "'input' must be a string, a list of strings, a token array or a list of token arrays, "
        "none of them empty"
    )


@dataclass
class EmbeddingsRequest:
    embed: inference_pb2.EmbedRequest
    encoding_format: str
    dimensions: int | None

    def response(self, reply: inference_pb2.EmbedResponse) -> dict[str, Any]:
        data = []
        for index, embedding in enumerate(reply.embeddings):
            values = list(embedding.values)
            if self.dimensions is not None and self.dimensions != len(values):
                raise _invalid(
                    f"'dimensions' must be {len(values)} for {reply.model} (its vectors' length)"
                )
            vector: list[float] | str = values
            if self.encoding_format == "base64":
                packed = struct.pack(f"<{len(values)}f", *values)
                vector = base64.b64encode(packed).decode()
            data.append({"object": "embedding", "index": index, "embedding": vector})
        usage = {"prompt_tokens": reply.prompt_tokens, "total_tokens": reply.prompt_tokens}
        return {"object": "list", "data": data, "model": reply.model, "usage": usage}


def parse_embeddings(body: dict[str, Any]) -> EmbeddingsRequest:
    ignore_unknown(body, EMBEDDING_FIELDS, "embeddings")
    model = body.get("model", "")
    if not isinstance(model, str):
        raise _invalid("'model' must be a string")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise _invalid("'encoding_format' must be 'float' or 'base64'")
    dimensions = body.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or dimensions <= 0):
        raise _invalid("'dimensions' must be a positive integer")
    request = inference_pb2.EmbedRequest(model=model, inputs=_inputs(body.get("input")))
    return EmbeddingsRequest(request, encoding, dimensions)
