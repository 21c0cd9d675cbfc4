"""What `kvmesh up` starts (MeshConfig) and one started model version's pair of processes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvmesh.mesh.service_process import ServiceProcess
from shared.runtime.restarts import BackOff
from shared.step_limits import step_limit_args_of


@dataclass
class MeshConfig:
    model: str | None = None
    workers: int = 1  # engine-worker + scheduler pairs (per model, with `models`)
    # The prefill/decode split: these pairs instead of `workers` mixed ones, when either is set.
    prefill_workers: int = 0
    decode_workers: int = 0
    # CPU lists (taskset -c) for engine-worker i, by start order; empty: not pinned.
    worker_cpus: list[str] = field(default_factory=list)
    # Repository models to serve (NAME or NAME@VERSION), each with its entry's serving config;
    # the first is the default. Empty: `model` (a path, or the default model) alone.
    models: list[str] = field(default_factory=list)
    model_repo: str = "models"
    # An embedding model beside the rest: "default" (all-MiniLM-L6-v2, from its package) or
    # a path; repository entries in `models` that are encoders are embedders too.
    embedder: str | None = None
    embedder_args: list[str] = field(default_factory=list)  # e.g. ["--max-embed-batch-tokens", "1"]
    redis_url: str | None = None  # None: start our own redis-server
    host: str = "127.0.0.1"
    gateway_port: int = 0  # 0: any free port
    gateways: int = 1  # gateway processes sharing the gRPC and HTTP ports (gateways.py)
    tokenizers: int = 1  # tokenizer processes; gateway i uses tokenizer i mod this
    http_port: int | None = 0  # the gateway's OpenAI HTTP front; 0: any free port; None: off
    worker_threads: int | None = None  # torch threads per engine-worker; None: cores / workers
    worker_args: list[str] = field(default_factory=list)  # e.g. ["--kv-memory", "256MiB"]
    scheduler_args: list[str] = field(default_factory=list)  # e.g. ["--max-num-seqs", "8"]
    gateway_args: list[str] = field(default_factory=list)
    log_dir: str | None = None  # None: a temporary directory
    # A cold start prepares the model: 137 s on a 2-core Xeon, over 300 s on a 2-core EPYC.
    ready_timeout_s: float = 1200.0
    drain_seconds: float = 10.0
    tracing: bool = True  # every service sends spans to the mesh's trace-collector
    # Restart a service that exits (kvmesh/mesh/supervisor.py); `kvmesh up` does, tests that kill
    # services on purpose do not.
    supervise: bool = False
    back_off: BackOff = field(default_factory=BackOff)

    @property
    def pair_worker_args(self) -> list[str]:
        """worker_args, then the step limits scheduler_args give: each engine-worker's buffers
        hold the steps its scheduler plans (a larger plan would be refused at its start)."""
        return [*self.worker_args, *step_limit_args_of(self.scheduler_args)]

    @property
    def collector_args(self) -> list[str]:
        """The gateway's API keys file, if any: with auth on, only an admin reads traces."""
        if "--api-keys-file" not in self.gateway_args:
            return []
        return self.gateway_args[self.gateway_args.index("--api-keys-file") :][:2]

    @property
    def auth_on(self) -> bool:
        """API keys given to the gateways: then the internal ports want the mesh token too."""
        return "--api-keys-file" in self.gateway_args or bool(os.environ.get("KVMESH_API_KEYS"))

    @property
    def roles(self) -> list[str]:
        """Each pair's role, in start order (per model, with `models`)."""
        if self.prefill_workers or self.decode_workers:
            return ["prefill"] * self.prefill_workers + ["decode"] * self.decode_workers
        return ["mixed"] * self.workers


@dataclass
class ModelPair:
    """One engine-worker and the scheduler that drives it, serving one model version."""

    name: str
    version: str
    worker: ServiceProcess
    scheduler: ServiceProcess

    @property
    def gateway_spec(self) -> str:
        return f"{self.name}@{self.version}={self.scheduler.grpc_address}"
