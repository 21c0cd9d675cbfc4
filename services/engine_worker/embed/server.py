"""The engine-worker's face for an encoder model: `kvmesh.v1.Embedder` (Embed, GetModel).

Loads in a thread after the server starts (ready once loaded and warmed), like the generation
worker; each Embed call's inputs join the shared batcher, every forward pass on one thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time

import grpc
from prometheus_client import Histogram

from services.engine_worker.embed.batcher import EmbedBatcher
from services.engine_worker.embed.encoder import SentenceEncoder
from shared.errors import KvmeshError, Reason
from shared.model_entry import is_entry, read_entry
from shared.pb.kvmesh.v1 import common_pb2, engine_worker_pb2, engine_worker_pb2_grpc
from shared.runtime.service import ServiceRuntime

log = logging.getLogger("kvmesh.engine_worker.embed")
EMBED_BATCH_SIZE = Histogram(
    "kvmesh_embed_batch_size",
    "Inputs in one embedding forward pass",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
MAX_INPUTS_PER_CALL = 2048


class EmbedderService(engine_worker_pb2_grpc.EmbedderServicer):
    def __init__(
        self,
        runtime: ServiceRuntime,
        model_path: str,
        served_name: str | None = None,
        max_batch_tokens: int = 16384,
    ) -> None:
        self.runtime = runtime
        self.model_path = model_path
        self.served_name = served_name
        self.encoder: SentenceEncoder | None = None
        self.info = common_pb2.ModelInfo()
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "torch")
        self.batcher = EmbedBatcher(self._forward, max_batch_tokens)

    async def load(self) -> None:
        started = time.perf_counter()
        path, name, version = self.model_path, "", ""
        digests: dict[str, str] = {}
        aliases: tuple[str, ...] = ()
        if is_entry(path):  # a repository version: digests first
            entry = read_entry(path)
            entry.verify()
            path, name, version, aliases = (
                entry.artifact_path,
                entry.name,
                entry.version,
                entry.aliases,
            )
            digests = {os.path.join(entry.directory, f): d for f, d in entry.sha256.items()}
        loop = asyncio.get_running_loop()
        encoder = await loop.run_in_executor(self._thread, SentenceEncoder, path)
        load_seconds = time.perf_counter() - started
        await loop.run_in_executor(self._thread, encoder.embed, [[0, 1]])  # first-call costs
        self.info = common_pb2.ModelInfo(
            name=self.served_name or name or os.path.basename(path.rstrip("/")),
            version=version or "0",
            artifact_sha256=digests,
            artifact_path=path,
            architecture="BertModel",
            num_parameters=encoder.num_parameters,
            dtype="float32",
            quantization="none",
            backend="torch",
            max_model_len=encoder.config.max_seq_length,
            vocab_size=encoder.config.vocab_size,
            load_seconds=round(load_seconds, 3),
            task="embed",
            embedding_dimensions=encoder.dimensions,
            aliases=aliases,
        )
        self.encoder = encoder
        log.info("ready", extra={"model": self.info.name, "dimensions": encoder.dimensions})
        await self.runtime.set_ready(True)

    def _loaded_encoder(self) -> SentenceEncoder:
        if self.encoder is None:
            raise KvmeshError(
                Reason.MODEL_NOT_READY,
                "the embedding model is loading",
                retryable=True,
                retry_after_ms=1000,
            )
        return self.encoder

    async def _forward(self, batch: list[list[int]]) -> list[list[float]]:
        encoder = self._loaded_encoder()
        EMBED_BATCH_SIZE.observe(len(batch))
        loop = asyncio.get_running_loop()
        vectors = await loop.run_in_executor(self._thread, encoder.embed_sorted, batch)
        return vectors.tolist()

    async def Embed(
        self, request: engine_worker_pb2.EmbedInputs, context: grpc.aio.ServicerContext
    ) -> engine_worker_pb2.EmbedVectors:
        with self.runtime.in_flight():
            inputs = self._token_ids(request)
            vectors = await self.batcher.embed(inputs)
        return engine_worker_pb2.EmbedVectors(
            embeddings=[
                common_pb2.Embedding(values=vector, num_tokens=len(ids))
                for vector, ids in zip(vectors, inputs, strict=True)
            ]
        )

    def _token_ids(self, request: engine_worker_pb2.EmbedInputs) -> list[list[int]]:
        encoder = self._loaded_encoder()
        if not request.inputs or len(request.inputs) > MAX_INPUTS_PER_CALL:
            raise KvmeshError(
                Reason.INVALID_ARGUMENT, f"give 1 to {MAX_INPUTS_PER_CALL} inputs per call"
            )
        texts = [i.text for i in request.inputs if i.WhichOneof("input") == "text"]
        encoded = iter(encoder.encode_texts(texts) if texts else [])
        inputs = []
        for item in request.inputs:
            kind = item.WhichOneof("input")
            ids = next(encoded) if kind == "text" else list(item.token_ids.ids)
            encoder.check_ids(ids)
            inputs.append(ids)
        return inputs

    async def GetModel(
        self, request: engine_worker_pb2.EmbedderModelRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ModelInfo:
        self._loaded_encoder()  # not ready until the encoder is
        return self.info
