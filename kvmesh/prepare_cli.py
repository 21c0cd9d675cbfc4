"""`kvmesh prepare MODEL`: prepare a model once (pack its weights, compile its step, record a
fixture) and store the prepared artifact that workers with the same key load in seconds."""

from __future__ import annotations

import argparse
import dataclasses
import json

from services.engine_worker.config import ENGINE_SETTINGS, engine_config
from shared.runtime.settings import add_settings


def add_prepare_parser(commands: argparse._SubParsersAction) -> None:
    prepare = commands.add_parser(
        "prepare",
        help="pack and compile a model once; workers on machines like this one load the result",
    )
    prepare.add_argument(
        "model_path",
        metavar="MODEL",
        nargs="?",
        help="a GGUF file, HF folder or repository version (default: the default model)",
    )
    prepare.add_argument(
        "--out",
        help="folder of prepared artifacts to write (what workers take as --prepared-dir); "
        "default: the repository version's prepared/, else $KVMESH_CACHE_DIR/prepared",
    )
    add_settings(prepare, ENGINE_SETTINGS)


def run_prepare(args: argparse.Namespace) -> int:
    from services.engine_worker.worker import Worker

    args.model = args.model_path or args.model
    args.prepared_dir = args.out or args.prepared_dir
    config = engine_config(args)
    # The KV pool is not part of a prepared artifact: a small one is enough to warm up.
    cache = dataclasses.replace(config.cache, kv_memory_bytes=64 << 20)
    worker = Worker(dataclasses.replace(config, prepared="auto", cache=cache))
    preparation = worker.manifest.preparation or {}
    if preparation.get("source") == "off":
        print("nothing to prepare: only the torch backend's packed weights are prepared")
        return 0
    print(json.dumps(preparation, indent=2, default=str))
    return 0
