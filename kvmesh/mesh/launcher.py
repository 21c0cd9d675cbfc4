"""Start the whole mesh as local processes on loopback, and stop every one of them.

Order: redis-server (unless a URL is given), trace-collector, tokenizer, engine-worker(s),
scheduler(s), gateway; each must report SERVING on grpc.health.v1 before the mesh counts as
up; with `supervise`, one that exits is restarted (supervisor.py). Stopping goes the other way:
the gateway drains first so no new work reaches the rest."""

from __future__ import annotations

import os
import sys
import tempfile
import time

from kvmesh.mesh import gateways
from kvmesh.mesh.config import MeshConfig, ModelPair
from kvmesh.mesh.local_redis import redis_command, wait_for_redis
from kvmesh.mesh.mesh_secrets import MeshSecrets
from kvmesh.mesh.service_process import ServiceProcess, free_port
from kvmesh.mesh.settings import serving_args
from kvmesh.mesh.supervisor import Supervisor
from shared.model_entry import ModelEntry
from shared.model_paths import default_embedding_model_path, is_encoder
from shared.model_repository import ModelRepository
from shared.runtime.service import LIVENESS
from shared.runtime.settings import SCHEDULER, WORKER
from shared.runtime.tls import tls_config

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"  # the name clients use for the default embedding model


class Mesh:
    def __init__(self, config: MeshConfig) -> None:
        self.config = config
        self.log_dir = config.log_dir or tempfile.mkdtemp(prefix="kvmesh-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.services: list[ServiceProcess] = []
        self.redis_url = config.redis_url
        self.gateway_address = ""
        self.http_url = ""  # e.g. http://127.0.0.1:8000/v1, an OpenAI client's base_url
        self.scheduler_addresses: list[str] = []
        self.worker_addresses: list[str] = []
        self.tokenizer_addresses: list[str] = []
        self.collector_address = ""
        self.pairs: list[ModelPair] = []  # with `models`: every pair, by model version
        self.repository = ModelRepository(config.model_repo)
        self.supervisor: Supervisor | None = None
        self.secrets = MeshSecrets.from_env()  # what its processes share; made if auth is on

    def __enter__(self) -> Mesh:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        try:
            self._start_all()
        except BaseException:
            self.stop()
            raise
        if self.config.supervise:
            self.supervisor = Supervisor(lambda: self.services, self.config.back_off).started()

    def _start_all(self) -> None:
        config = self.config
        self.secrets.complete(config.auth_on, own_redis=self.redis_url is None)
        if self.redis_url is None:
            self.redis_url = self._start_redis()
        self.collector_address = self.spawn(
            "trace-collector", "services.trace_collector", config.collector_args
        )
        all_entries = [self.repository.resolve(spec) for spec in config.models]
        entries = [e for e in all_entries if not is_encoder(e.artifact_path)]
        if entries:  # a tokenizer per model name (its versions share it)
            first = {e.name: e.directory for e in reversed(entries)}
            specs = [f"{name}={first[name]}" for name in dict.fromkeys(e.name for e in entries)]
            model = ["--model", ",".join(specs)]
        else:
            model = ["--model", config.model] if config.model else []
        self.tokenizer_addresses = [
            self.spawn(name, "services.tokenizer", model)
            for name in gateways.names("tokenizer", config.tokenizers)
        ]
        num_workers = len(config.roles) * max(1, len(entries))
        threads = config.worker_threads or max(1, (os.cpu_count() or 1) // num_workers)
        for entry in entries:
            for role in config.roles:
                self.start_pair(entry, threads, role)
        embedders = [
            self.start_embedder(e.directory, e.label) for e in all_entries if e not in entries
        ]
        if config.embedder == "default":
            embedders.append(self.start_embedder(default_embedding_model_path(), DEFAULT_EMBEDDER))
        elif config.embedder:
            name = os.path.basename(config.embedder.rstrip("/"))
            embedders.append(self.start_embedder(config.embedder, name))
        for index, role in enumerate([] if all_entries else config.roles):
            worker = self.spawn(
                f"engine-worker-{index}",
                "services.engine_worker",
                [*model, "--threads", str(threads), *self._kv_redis, *config.pair_worker_args],
                threads=threads,
                cpus=self._cpus(index),
            )
            self.worker_addresses.append(worker)
            self.scheduler_addresses.append(
                self.spawn(
                    f"scheduler-{index}",
                    "services.scheduler",
                    [
                        *("--worker", worker, "--redis", self.redis_url, "--role", role),
                        *config.scheduler_args,
                    ],
                )
            )
        # Gateways start once every scheduler and tokenizer listens, beside workers still
        # loading: each watches its peers' health from its first connection, ready with them.
        deadline = time.monotonic() + config.ready_timeout_s
        peers = {*self.tokenizer_addresses, *self.scheduler_addresses}
        for service in self.services:
            if service.address in peers:
                service.wait_ready(deadline, LIVENESS)
        schedulers = [pair.gateway_spec for pair in self.pairs] or self.scheduler_addresses
        default = ["--default-model", entries[0].name] if entries else []
        default += ["--embedder", ",".join(embedders)] if embedders else []
        http: list[str] = ["--http-port", "0"]
        if config.http_port is not None:
            http_port = config.http_port or free_port(config.host)
            http = ["--http-port", str(http_port)]
            scheme = "https" if tls_config() is not None else "http"
            self.http_url = f"{scheme}://{config.host}:{http_port}/v1"
        args = ["--scheduler", ",".join(schedulers), "--redis", self.redis_url or "", *default]
        args += [*http, *config.gateway_args]
        self.gateway_address = gateways.start(config, self.spawn, self.tokenizer_addresses, args)
        for service in self.services:
            if service.address is not None:
                service.wait_ready(deadline)
        gateways.wait_sharing(self.gateways, deadline)

    @property
    def gateways(self) -> list[ServiceProcess]:  # one, or gateway-0 ... gateway-{N-1}
        return [s for s in self.services if gateways.stage_of(s.name) == "gateway"]

    @property
    def tokenizer_address(self) -> str:  # the first one's: every tokenizer loads every model
        return self.tokenizer_addresses[0] if self.tokenizer_addresses else ""

    @property
    def _kv_redis(self) -> list[str]:
        """The redis KV tier defaults to the mesh's Redis (a later --kv-redis wins)."""
        return ["--kv-redis", self.redis_url] if self.redis_url else []

    def _cpus(self, worker_index: int) -> str | None:
        cpus = self.config.worker_cpus
        return cpus[worker_index] if worker_index < len(cpus) else None

    def start_pair(
        self, entry: ModelEntry, threads: int | None = None, role: str = "mixed"
    ) -> ModelPair:
        """An engine-worker + scheduler for a repository version, with its serving config
        (after the mesh-wide flags, so the entry's own values win). Not waited for."""
        config = self.config
        threads = threads or config.worker_threads or 1
        index = sum(1 for p in self.pairs if (p.name, p.version) == (entry.name, entry.version))
        suffix = f"{entry.name}-{entry.version}-{index}"
        while any(s.name == f"engine-worker-{suffix}" for s in self.services):
            index += 1
            suffix = f"{entry.name}-{entry.version}-{index}"
        worker_args = [*config.pair_worker_args, *serving_args(entry, WORKER)]
        worker = self.spawn(
            f"engine-worker-{suffix}",
            "services.engine_worker",
            ["--model", entry.directory, "--threads", str(threads), *self._kv_redis, *worker_args],
            threads=threads,
            cpus=self._cpus(len(self.worker_addresses)),
        )
        self.worker_addresses.append(worker)
        worker_process = self.services[-1]
        scheduler_args = [*config.scheduler_args, *serving_args(entry, SCHEDULER)]
        if self.redis_url is None:
            raise RuntimeError("a scheduler needs the mesh's Redis, which is not started yet")
        scheduler = self.spawn(
            f"scheduler-{suffix}",
            "services.scheduler",
            ["--worker", worker, "--redis", self.redis_url, "--role", role, *scheduler_args],
        )
        self.scheduler_addresses.append(scheduler)
        pair = ModelPair(entry.name, entry.version, worker_process, self.services[-1])
        self.pairs.append(pair)
        return pair

    def start_embedder(self, model: str, label: str) -> str:
        """An engine-worker serving an embedding model (`label`: NAME or NAME@VERSION); its
        gateway spec. Not waited for."""
        name = label.partition("@")[0]
        index = sum(1 for s in self.services if s.name.startswith("embedder-"))
        threads = self.config.worker_threads or 1
        address = self.spawn(
            f"embedder-{index}",
            "services.engine_worker",
            [
                *("--model", model, "--threads", str(threads), "--served-model-name", name),
                *self.config.embedder_args,
            ],
            threads=threads,
        )
        return f"{label}={address}"

    def remember_schedulers(self) -> None:
        """After a rollout: the gateway's start command names the pairs there are now, so a
        restarted gateway (`restart("gateway")`) routes to them, not to stopped ones."""
        for gateway in self.gateways if self.pairs else []:
            index = gateway.command.index("--scheduler") + 1
            gateway.command[index] = ",".join(pair.gateway_spec for pair in self.pairs)

    def wait_ready(self, services: list[ServiceProcess]) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        for service in services:
            service.wait_ready(deadline)

    def stop_pair(self, pair: ModelPair, timeout_s: float | None = None) -> None:
        """SIGTERM the scheduler (it finishes its own requests), then the worker."""
        timeout = self.config.drain_seconds + 5 if timeout_s is None else timeout_s
        for service in (pair.scheduler, pair.worker):
            service.terminate(timeout)
            self.services.remove(service)
        self.scheduler_addresses.remove(pair.scheduler.address or "")
        self.worker_addresses.remove(pair.worker.address or "")
        self.pairs.remove(pair)

    def _start_redis(self) -> str:
        host, port = self.config.host, free_port(self.config.host)
        password = self.secrets.redis_password
        self._launch("redis", None, redis_command(host, port, password, self.log_dir), {})
        wait_for_redis(host, port)
        return f"redis://{host}:{port}/0"

    def spawn(
        self,
        name: str,
        module: str,
        args: list[str],
        *,
        threads: int = 1,
        port: int | None = None,
        cpus: str | None = None,
    ) -> str:
        address = f"{self.config.host}:{port or free_port(self.config.host)}"
        host, port_text = address.rsplit(":", 1)
        metrics_port = free_port(self.config.host)
        command = [sys.executable, "-m", module, "--host", host, "--port", port_text]
        command += ["--drain-seconds", str(self.config.drain_seconds)]
        command += ["--metrics-port", str(metrics_port), *args]
        if self.config.tracing and self.collector_address:
            command += ["--otlp-endpoint", self.collector_address]
        if cpus is not None:  # pinned: a benchmark's worker to its own cores
            command = ["taskset", "-c", cpus, *command]
        # One torch/OpenMP pool per core budget: only engine-workers get more than one thread.
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        self._launch(name, address, command, env)
        self.services[-1].metrics_url = f"http://{host}:{metrics_port}/metrics"
        return address

    def _launch(self, name: str, address: str | None, command: list[str], env: dict) -> None:
        log_path = os.path.join(self.log_dir, f"{name}.log")
        env = {**env, **self.secrets.env()}
        self.services.append(ServiceProcess.start(name, address, command, env, log_path))

    def service(self, name: str) -> ServiceProcess:
        return next(s for s in self.services if s.name == name)

    def restart(self, name: str, wait_ready: bool = True) -> ServiceProcess:
        """Start a service again, same command, same port, after it died or was stopped
        (SIGKILL first if it still runs): what an orchestrator does for a crashed container."""
        service = self.service(name)
        service.restart()
        if wait_ready and service.address is not None:
            service.wait_ready(time.monotonic() + self.config.ready_timeout_s)
        return service

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM in reverse start order (gateway first), each given time to drain; SIGKILL."""
        timeout = self.config.drain_seconds + 5 if timeout_s is None else timeout_s
        if self.supervisor is not None:
            self.supervisor.stop()
        for service in reversed(self.services):
            service.terminate(timeout)
        self.services.clear()
        self.pairs.clear()
