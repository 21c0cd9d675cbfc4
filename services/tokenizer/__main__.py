"""`python -m services.tokenizer`: the model's tokenizer and chat template over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import logging

from services.tokenizer.server import LoadedTokenizer, TokenizerService
from shared.errors import KvmeshError, Reason
from shared.model_entry import artifact_location
from shared.model_paths import resolve_model_path
from shared.pb.kvmesh.v1 import tokenizer_pb2_grpc
from shared.runtime.logs import configure_logging
from shared.runtime.service import ServiceRuntime, service_parser, start_observability
from shared.runtime.settings import Setting, parse_args_or_exit
from shared.text_tokenizer import load_tokenizer

SERVICE_NAME = "kvmesh.v1.Tokenizer"


def model_specs(value: str | None) -> list[tuple[str, str | None]]:
    """`PATH` (one tokenizer for every model; none: the default model's) or `NAME=PATH,...`."""
    if not value or "=" not in value:
        return [("", value)]
    specs: list[tuple[str, str | None]] = []
    for item in filter(None, value.split(",")):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise KvmeshError(Reason.INVALID_ARGUMENT, "--model takes PATH or NAME=PATH,...")
        specs.append((name, path))
    return specs


async def serve(args: argparse.Namespace) -> None:
    runtime = ServiceRuntime(SERVICE_NAME, args.host, args.port)
    tokenizers: dict[str, LoadedTokenizer] = {}
    for name, model in model_specs(args.model):
        path = artifact_location(resolve_model_path(model))
        tokenizer = load_tokenizer(path)
        tokenizers[name] = LoadedTokenizer(tokenizer, path)
        logging.getLogger("kvmesh.tokenizer").info(
            "loaded",
            extra={"model": name, "path": path, "has_tokenizer": tokenizer is not None},
        )
    runtime.add_servicer(
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server, TokenizerService(runtime, tokenizers)
    )
    await runtime.start()
    await runtime.set_ready(True)
    await runtime.serve_until_signalled(args.drain_seconds)


SETTINGS = (
    Setting(
        "model",
        None,
        "GGUF file or HF model directory (default: SmolLM2-135M-Instruct), or "
        "NAME=PATH,... for one tokenizer per model of a several-model mesh",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    """Every flag of this service (the configuration reference is generated from it)."""
    return service_parser("services.tokenizer", __doc__ or "", 50081, SETTINGS)


def main() -> None:
    args = parse_args_or_exit(build_parser())
    configure_logging("tokenizer", args.log_level)
    start_observability("tokenizer", args)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
