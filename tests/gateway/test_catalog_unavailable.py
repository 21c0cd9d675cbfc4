"""A model whose replicas all went down is WORKER_UNAVAILABLE, never "loading"; a mesh with no
embedding model answers Embed with MODEL_NOT_FOUND, not a retryable "loading"."""

from __future__ import annotations

import pytest

from services.gateway.mesh.catalog import ModelCatalog
from services.gateway.mesh.registry import BackendRegistry
from services.gateway.mesh.tokenizer_link import TokenizerLink
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2


def refusal(catalog: ModelCatalog, model: str, task: str = "generate") -> KvmeshError:
    with pytest.raises(KvmeshError) as refused:
        catalog.serving(model, task=task)
    return refused.value


async def test_a_model_served_before_and_down_now_is_worker_unavailable() -> None:
    backends = BackendRegistry(TokenizerLink("127.0.0.1:1"), ["127.0.0.1:1"])
    catalog = ModelCatalog(backends)
    [scheduler] = backends.schedulers
    assert refusal(catalog, "").reason is Reason.MODEL_NOT_READY  # never served yet: loading
    scheduler.model = common_pb2.ModelInfo(name="smollm2", version="1")
    scheduler.last_served = ("smollm2", "1")
    assert catalog.serving("") == [scheduler]
    scheduler.model = None  # its health turned: down, restarting, its breaker open
    for model in ("", "smollm2", "smollm2@1"):
        error = refusal(catalog, model)
        assert (error.reason, error.retryable) == (Reason.WORKER_UNAVAILABLE, True)
        assert "127.0.0.1" not in error.message
    assert refusal(catalog, "smollm2@9").reason is Reason.MODEL_NOT_READY  # not that version
    error = refusal(catalog, "", task="embed")
    assert (error.reason, error.retryable) == (Reason.MODEL_NOT_FOUND, False)
    await backends.close()
