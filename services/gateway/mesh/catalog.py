"""The models the gateway serves, as clients name them: aliases, the default model, versions
and their traffic split, and the ListModels answer. Reads the registry; owns no connection."""

from __future__ import annotations

from collections.abc import Sequence

from services.gateway.mesh.connections import EmbedderBackend, ModelBackend, SchedulerBackend
from services.gateway.mesh.registry import BackendRegistry
from services.gateway.mesh.traffic import TrafficSplit
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2


class ModelCatalog:
    def __init__(self, registry: BackendRegistry, default_model: str = "") -> None:
        self.registry = registry
        self.default_model = default_model  # "": the first scheduler's model
        self.traffic = TrafficSplit()

    def _backends(self, task: str) -> Sequence[ModelBackend]:
        return self.registry.embedders if task == "embed" else self.registry.schedulers

    def canonical(self, name: str, task: str = "generate") -> str:
        """An alias to its model's name; "" to the task's default model."""
        if not name:
            if self.default_model and task == "generate":
                return self.default_model
            live = (b.name for b in self._backends(task) if b.name and not b.retired)
            declared = (d.name for d in self.registry.discoveries if task == "generate")
            return next(live, next(declared, ""))
        for backend in self.registry.all():
            if backend.model is not None and name in backend.model.aliases:
                return backend.model.name
        return name

    def schedulers(self, model: str, split: bool = True) -> list[SchedulerBackend]:
        """The ready schedulers for a Generate request's `model`: see `serving`."""
        return [b for b in self.serving(model, split) if isinstance(b, SchedulerBackend)]

    def embedders(self, model: str) -> list[EmbedderBackend]:
        """The ready embedding workers for an Embed request's `model`: see `serving`."""
        serving = self.serving(model, task="embed")
        return [b for b in serving if isinstance(b, EmbedderBackend)]

    def serving(self, model: str, split: bool = True, task: str = "generate") -> list[ModelBackend]:
        """The ready backends for a request's `model` (NAME, NAME@VERSION, an alias, or ""):
        one version's, chosen by the model's traffic split unless pinned (or `split` is off:
        questions about the model take no turn in it); or a clear error."""
        requested_name, _, version = model.partition("@")
        name = self.canonical(requested_name, task)
        own = self._backends(task)
        if task == "embed" and not own and not requested_name:
            raise KvmeshError(Reason.MODEL_NOT_FOUND, "this mesh serves no embedding model")
        other = self._backends("generate" if task == "embed" else "embed")
        if not any(b.name == name for b in own) and any(b.name == name for b in other):
            use = "Embed (/v1/embeddings)" if task == "generate" else "Generate"
            other_task = "embed" if task == "generate" else "generate"
            raise KvmeshError(
                Reason.INVALID_ARGUMENT, f"model {name!r} is for {other_task}: use {use}"
            )
        live = [b for b in own if not b.retired]
        known = [b for b in live if b.name == name and (not version or b.version == version)]
        ready = [b for b in known if b.ready]
        if not ready:
            # A backend not ready yet (or not yet resolved from DNS) may turn out to serve it:
            # not ready rather than unknown.
            discovering = any(d.name in ("", name) for d in self.registry.discoveries)
            what = f"model {model!r}" if model else "the default model"
            served = {b.last_served for b in live if not b.ready and b.last_served}
            if any(n == (name or n) and v == (version or v) for n, v in served):
                raise KvmeshError(
                    Reason.WORKER_UNAVAILABLE,
                    f"{what} has no ready replica: its engine-workers are down, restarting or "
                    "draining",
                    retryable=True,
                    retry_after_ms=1000,
                )
            if known or not name or discovering or any(not b.name for b in live):
                raise KvmeshError(
                    Reason.MODEL_NOT_READY,
                    f"{what} is loading: no scheduler serving it is ready yet",
                    retryable=True,
                    retry_after_ms=1000,
                )
            raise KvmeshError(
                Reason.MODEL_NOT_FOUND,
                f"no model named {model!r}; ListModels shows what is served",
            )
        if split and not version:
            chosen = self.traffic.choose(name, {b.version for b in ready})
            if chosen is not None:
                ready = [b for b in ready if b.version == chosen]
        return ready

    def pick(self, model_name: str) -> ModelBackend:
        """A backend serving the model, for questions about the model (not requests): of the
        version with the largest traffic share. Embedding models count too."""
        name = self.canonical(model_name.partition("@")[0])
        task = "embed" if any(b.name == name for b in self.registry.embedders) else "generate"
        ready = self.serving(model_name, split=False, task=task)
        shares = self.traffic.percent(ready[0].name)
        return max(ready, key=lambda backend: shares.get(backend.version, 0.0))

    def models(self) -> list[common_pb2.ModelInfo]:
        """One per ready model version, the default model first."""
        seen: dict[tuple[str, str], common_pb2.ModelInfo] = {}
        for backend in self.registry.all():
            if backend.ready and backend.model is not None:
                seen.setdefault((backend.name, backend.version), backend.model)
        default = self.canonical("")
        return sorted(seen.values(), key=lambda m: m.name != default)

    def versions(self) -> list[inference_pb2.ModelVersionStatus]:
        statuses: dict[tuple[str, str], inference_pb2.ModelVersionStatus] = {}
        for backend in self.registry.all():
            if not backend.name:
                continue
            key = (backend.name, backend.version)
            status = statuses.setdefault(
                key, inference_pb2.ModelVersionStatus(name=key[0], version=key[1])
            )
            if not backend.retired:
                status.replicas += 1
                status.ready_replicas += backend.ready
        for (name, version), status in statuses.items():
            if not status.replicas:
                status.state = "draining"
            else:
                status.state = "ready" if status.ready_replicas else "loading"
            split = self.traffic.percent(name)
            if split:
                status.traffic_percent = split.get(version, 0.0)
            elif status.ready_replicas:
                ready_for_name = sum(
                    s.ready_replicas for (n, _), s in statuses.items() if n == name
                )
                status.traffic_percent = 100.0 * status.ready_replicas / ready_for_name
        return list(statuses.values())
