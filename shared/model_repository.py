"""The model repository: `<repo>/<name>/<version>/` directories, each an entry (model_entry.py).

Versions are listed oldest first; adding a model copies (hard-links where it can) its artifact
in as a new version with the digests of its files.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping
from typing import Any

from shared.errors import KvmeshError, Reason
from shared.model_entry import (
    ModelEntry,
    ServingConfig,
    WarmupFixture,
    artifact_files,
    check_default_sampling,
    check_name,
    is_entry,
    read_entry,
    sha256_file,
    write_entry,
)

DEFAULT_SERVING = ServingConfig()


class ModelRepository:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def names(self) -> list[str]:
        if not os.path.isdir(self.root):
            return []
        return sorted(n for n in os.listdir(self.root) if self.versions(n))

    def versions(self, name: str) -> list[str]:
        """Versions oldest first: numeric ones by number, then the rest by name."""
        directory = os.path.join(self.root, name)
        if not os.path.isdir(directory):
            return []
        found = [v for v in os.listdir(directory) if is_entry(os.path.join(directory, v))]
        return sorted(found, key=lambda v: (not v.isdigit(), int(v) if v.isdigit() else 0, v))

    def entries(self) -> Iterator[ModelEntry]:
        for name in self.names():
            for version in self.versions(name):
                yield self.entry(name, version)

    def entry(self, name: str, version: str | None = None) -> ModelEntry:
        """`version` None: the newest. Unknown names or versions are MODEL_NOT_FOUND."""
        versions = self.versions(name)
        if not versions:
            raise KvmeshError(
                Reason.MODEL_NOT_FOUND, f"no model {name!r} in the repository {self.root}"
            )
        chosen = versions[-1] if version is None else version
        if chosen not in versions:
            raise KvmeshError(
                Reason.MODEL_NOT_FOUND,
                f"model {name!r} has no version {chosen!r}; it has {', '.join(versions)}",
            )
        return read_entry(os.path.join(self.root, name, chosen))

    def resolve(self, spec: str) -> ModelEntry:
        """`NAME` (newest version) or `NAME@VERSION`."""
        name, _, version = spec.partition("@")
        return self.entry(name, version or None)

    def add(
        self,
        name: str,
        source: str,
        *,
        version: str | None = None,
        serving: ServingConfig = DEFAULT_SERVING,
        default_sampling: Mapping[str, Any] | None = None,
        aliases: tuple[str, ...] = (),
        fixtures: tuple[WarmupFixture, ...] = (),
    ) -> ModelEntry:
        """Copy (hard-link where possible) the artifact in as a new version, with digests."""
        check_name("model name", name)
        check_default_sampling(default_sampling or {})  # refused before anything is copied
        if not os.path.exists(source):
            raise KvmeshError(Reason.MODEL_NOT_FOUND, f"no model file or directory at {source}")
        if version is None:
            numeric = [int(v) for v in self.versions(name) if v.isdigit()]
            version = str(max(numeric, default=0) + 1)
        check_name("version", version)
        directory = os.path.join(self.root, name, version)
        if os.path.exists(directory):
            raise KvmeshError(
                Reason.INVALID_ARGUMENT, f"{name}@{version} already exists at {directory}"
            )
        os.makedirs(directory)
        artifact = os.path.basename(os.path.abspath(source).rstrip("/"))
        target = os.path.join(directory, artifact)
        if os.path.isdir(source):
            shutil.copytree(source, target, copy_function=_link_or_copy)
        else:
            _link_or_copy(source, target)
        entry = ModelEntry(
            name=name,
            version=version,
            directory=directory,
            artifact=artifact,
            sha256={
                f: sha256_file(os.path.join(directory, f))
                for f in artifact_files(directory, artifact)
            },
            serving=serving,
            default_sampling=dict(default_sampling or {}),
            aliases=aliases,
            fixtures=fixtures,
        )
        write_entry(entry)
        return entry


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
