"""`kvmesh models`: add entries to a model repository, list them, deploy and roll back versions."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from kvmesh.mesh.settings import PER_MODEL, add_serving_flags, serving_of
from services.engine_worker import config as worker_config
from shared.errors import KvmeshError, Reason
from shared.model_entry import ModelEntry, WarmupFixture, write_entry
from shared.model_repository import ModelRepository
from shared.runtime.settings import env_default


def add_models_parser(commands: argparse._SubParsersAction) -> None:
    models = commands.add_parser("models", help="the model repository: add, list, deploy")
    models.add_argument(
        "--repo",
        default=env_default("model-repo", "models"),
        help="repository folder (default: ./models, or KVMESH_MODEL_REPO)",
    )
    actions = models.add_subparsers(dest="models_command", required=True)
    add = actions.add_parser("add", help="add an artifact as a new version, with its digests")
    add.add_argument("name", help="the model's name: what requests ask for")
    add.add_argument("path", help="a GGUF file or an HF model directory")
    add.add_argument("--version", help="version name (default: the next number)")
    add.add_argument("--alias", action="append", default=[], help="another name (repeatable)")
    add_serving_flags(add)
    sampling = add.add_argument_group("default sampling (a request's own values win)")
    sampling.add_argument("--temperature", type=float)
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--max-tokens", type=int)
    fixtures = add.add_argument_group("warm-up fixtures")
    fixtures.add_argument(
        "--fixture",
        action="append",
        default=[],
        help="a prompt whose greedy output, recorded now, must come out the same before the "
        "model serves (repeatable)",
    )
    fixtures.add_argument("--fixture-tokens", type=int, default=8, help="tokens each records")
    add.add_argument(
        "--no-prepare",
        action="store_true",
        help="do not prepare the version now (pack its weights, compile its step and store "
        "them in its prepared/ folder); its first worker then prepares it",
    )
    listing = actions.add_parser("list", help="entries, and where each is loaded")
    listing.add_argument("--addr", help="a gateway HOST:PORT: also show what it serves")
    deploy = actions.add_parser("deploy", help="roll a version out on a running mesh")
    deploy.add_argument("name")
    deploy.add_argument("version")
    deploy.add_argument(
        "--canary", type=float, help="percent of traffic for the new version; the rest stays"
    )
    rollback = actions.add_parser("rollback", help="return to the previous version")
    rollback.add_argument("name")
    for parser in (deploy, rollback):
        parser.add_argument(
            "--control",
            default=env_default("control", "127.0.0.1:50050"),
            help="the mesh's control address (`kvmesh up --control-port`)",
        )


def run_models(args: argparse.Namespace) -> int:
    repository = ModelRepository(args.repo)
    if args.models_command == "add":
        entry = add_entry(repository, args)
        print(f"added {entry.label} at {entry.directory}")
        if entry.prepared:
            print(f"  prepared artifact {entry.prepared} in {entry.directory}/prepared")
        for path, digest in sorted(entry.sha256.items()):
            print(f"  {digest}  {path}")
        return 0
    if args.models_command == "list":
        return list_entries(repository, args.addr)
    from kvmesh.control_client import run_control_command

    return run_control_command(args)


def add_entry(repository: ModelRepository, args: argparse.Namespace) -> ModelEntry:
    serving = serving_of(args)
    sampling = {
        key: value
        for key, value in (
            ("temperature", args.temperature),
            ("top_p", args.top_p),
            ("max_tokens", args.max_tokens),
        )
        if value is not None
    }
    entry = repository.add(
        args.name,
        args.path,
        version=args.version,
        serving=serving,
        default_sampling=sampling,
        aliases=tuple(args.alias),
    )
    prepare = not args.no_prepare and os.environ.get("KVMESH_PREPARED", "auto") != "off"
    if args.fixture or prepare:
        entry = record_fixtures(entry, args.fixture, args.fixture_tokens)
    return entry


def record_fixtures(entry: ModelEntry, prompts: list[str], num_tokens: int) -> ModelEntry:
    """Load the entry as a worker would, which prepares it (stored in its prepared/ folder)
    unless KVMESH_PREPARED is off; record each prompt's greedy output; save both."""
    from services.engine_worker.worker import Worker
    from shared.text_tokenizer import load_tokenizer

    tokenizer = load_tokenizer(entry.artifact_path)
    if tokenizer is None and prompts:
        raise KvmeshError(Reason.TOKENIZER_UNAVAILABLE, "fixtures need the model's tokenizer")
    # The formats the entry will serve in: a fixture's tokens are exact for those only. Its
    # KV tiers and step limits are the mesh's business, not the fixture's.
    model = {s.dest for s in worker_config.MODEL_SETTINGS}
    serving = [
        part
        for key, value in entry.serving.items()
        if key in model
        for part in PER_MODEL[key].as_args(value)
    ]
    argv = ["--model", entry.directory, "--kv-memory", "256MiB", *serving]
    worker = Worker(worker_config.engine_config(worker_config.build_parser().parse_args(argv)))
    prepared = (worker.manifest.preparation or {}).get("id", "")
    fixtures = []
    for prompt in prompts:
        prompt_ids = tokenizer.encode(prompt)  # type: ignore[union-attr]
        expected = worker.greedy(prompt_ids, num_tokens)
        fixtures.append(WarmupFixture(tuple(prompt_ids), tuple(expected)))
    recorded = dataclasses.replace(entry, fixtures=tuple(fixtures), prepared=prepared)
    write_entry(recorded)
    return recorded


def list_entries(repository: ModelRepository, gateway: str | None) -> int:
    where: dict[tuple[str, str], str] = {}
    if gateway:
        from kvmesh.client import MeshClient
        from shared.pb.kvmesh.v1 import inference_pb2

        with MeshClient(gateway) as client:
            listed = client.stub.ListModels(inference_pb2.ListModelsRequest(), timeout=10)
            for status in listed.versions:
                where[(status.name, status.version)] = (
                    f"{status.state} on {status.ready_replicas}/{status.replicas} worker(s), "
                    f"{status.traffic_percent:g}% of traffic"
                )
    entries = list(repository.entries())
    if not entries:
        print(f"no models in {repository.root}; add one with `kvmesh models add NAME PATH`")
    for entry in entries:
        size = sum(os.path.getsize(os.path.join(entry.directory, f)) for f in entry.sha256)
        aliases = f" (aliases: {', '.join(entry.aliases)})" if entry.aliases else ""
        loaded = where.pop((entry.name, entry.version), "not loaded" if gateway else "")
        print(
            f"{entry.label:30} {entry.artifact:40} {size / 2**20:8.1f} MiB"
            f"  {len(entry.fixtures)} fixture(s){aliases}  {loaded}".rstrip()
        )
    for (name, version), state in sorted(where.items()):
        print(f"{name}@{version:30} (not in this repository)  {state}", file=sys.stdout)
    return 0
