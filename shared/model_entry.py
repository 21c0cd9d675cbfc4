"""One model repository entry: `<repo>/<name>/<version>/kvmesh.toml` beside its artifact.

An entry says what to serve and how (backend, dtype, context, KV budget, batching, default
sampling, aliases), which bytes are the model (the sha256 of every artifact file), and which
warm-up fixtures its output must match before it may serve. Loading verifies the digests: a
corrupt or swapped file never serves; reading checks its default sampling, so a bad default is
refused when the model loads, not when a request first meets it.

Shared because the CLI writes entries, the launcher reads their serving config, and the
engine-worker verifies them at load.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import tomllib

from shared.codec import default_sampling_to_pb, sampling_from_pb
from shared.errors import KvmeshError, ModelValidationError, Reason

ENTRY_FILE = "kvmesh.toml"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ARTIFACT_SUFFIXES = (".gguf", ".safetensors", ".json", ".txt", ".model")


def sha256_file(path: str, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def check_name(kind: str, value: str) -> str:
    """Names and versions become directory names and routing keys: keep them plain."""
    if not _NAME.match(value):
        raise KvmeshError(
            Reason.INVALID_ARGUMENT,
            f"{kind} {value!r}: use letters, digits, '.', '_' or '-' (at most 128)",
        )
    return value


class ServingConfig(Mapping[str, Any]):
    """An entry's [serving] table: setting (as its flag, with underscores: kv_memory) -> value,
    for this model's pairs alone; an unset one is the mesh's. Which settings a model may set,
    and their values, are checked where the settings are known: `kvmesh up` and `kvmesh models
    add` (kvmesh/mesh/settings.py)."""

    def __init__(self, values: Mapping[str, Any] | None = None, **more: Any) -> None:
        merged = {**(values or {}), **more}
        self._values = {key: value for key, value in merged.items() if value is not None}

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"ServingConfig({self._values!r})"


@dataclass(frozen=True)
class WarmupFixture:
    """A prompt whose greedy output must be exactly `expected_ids` before the model serves."""

    prompt_ids: tuple[int, ...]
    expected_ids: tuple[int, ...]


@dataclass(frozen=True)
class ModelEntry:
    name: str
    version: str
    directory: str  # <repo>/<name>/<version>
    artifact: str  # relative to the directory: a GGUF file or an HF directory
    sha256: Mapping[str, str]  # artifact file (relative) -> digest
    serving: ServingConfig = field(default_factory=ServingConfig)
    default_sampling: Mapping[str, Any] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    fixtures: tuple[WarmupFixture, ...] = ()
    prepared: str = ""  # the prepared artifact `kvmesh models add` made, in ./prepared/<id>

    def __post_init__(self) -> None:
        try:  # checked once, here: a request merging these defaults meets valid ones
            check_default_sampling(self.default_sampling)
        except KvmeshError as error:
            path = os.path.join(self.directory, ENTRY_FILE)
            raise ModelValidationError(path, f"{self.label}: [sampling]: {error.message}") from None

    @property
    def artifact_path(self) -> str:
        return os.path.join(self.directory, self.artifact)

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version}"

    def verify(self) -> None:
        """Every listed file present with its digest, and no artifact file unlisted."""
        on_disk = set(artifact_files(self.directory, self.artifact))
        for relative, expected in sorted(self.sha256.items()):
            path = os.path.join(self.directory, relative)
            if relative not in on_disk:
                raise ModelValidationError(path, f"{self.label}: artifact file missing")
            found = sha256_file(path)
            if found != expected:
                raise ModelValidationError(
                    path,
                    f"{self.label}: sha256 does not match the repository entry "
                    "(corrupt or replaced file)",
                    expected=expected,
                    found=found,
                )
        unlisted = sorted(on_disk - set(self.sha256))
        if unlisted:
            raise ModelValidationError(
                os.path.join(self.directory, unlisted[0]),
                f"{self.label}: artifact file not in the entry's digests",
            )

    def to_toml(self) -> str:
        lines = [
            "# kvmesh model repository entry (`kvmesh models add` wrote it)",
            "[model]",
            f"name = {_toml(self.name)}",
            f"version = {_toml(self.version)}",
            f"artifact = {_toml(self.artifact)}",
            f"aliases = {_toml(list(self.aliases))}",
            f"prepared = {_toml(self.prepared)}",
            "",
            "[serving]",
        ]
        lines += [f"{key} = {_toml(value)}" for key, value in self.serving.items()]
        lines += ["", "[sampling]"]
        lines += [f"{key} = {_toml(value)}" for key, value in self.default_sampling.items()]
        lines += ["", "[sha256]"]
        lines += [
            f"{_toml(path)} = {_toml(digest)}" for path, digest in sorted(self.sha256.items())
        ]
        for fixture in self.fixtures:
            lines += [
                "",
                "[[warmup]]",
                f"prompt_ids = {_toml(list(fixture.prompt_ids))}",
                f"expected_ids = {_toml(list(fixture.expected_ids))}",
            ]
        return "\n".join(lines) + "\n"


def check_default_sampling(table: Mapping[str, Any]) -> None:
    """INVALID_SAMPLING_PARAMS unless the table is sampling fields of the right types and ranges."""
    sampling_from_pb(default_sampling_to_pb(table)).validate()


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def artifact_files(directory: str, artifact: str) -> list[str]:
    """The artifact's files, relative to the entry's directory, in path order."""
    root = os.path.join(directory, artifact)
    if os.path.isfile(root):
        return [artifact]
    found = []
    for parent, _, names in os.walk(root):
        for name in names:
            if name.endswith(_ARTIFACT_SUFFIXES):
                found.append(os.path.relpath(os.path.join(parent, name), directory))
    return sorted(found)


def is_entry(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ENTRY_FILE))


def verified_source(path: str) -> tuple[ModelEntry | None, str]:
    """The artifact's path (and its entry, for a repository version), the entry's digests
    checked before any of it is read."""
    if not is_entry(path):
        return None, path
    entry = read_entry(path)
    entry.verify()
    return entry, entry.artifact_path


def artifact_location(path: str) -> str:
    """A repository version's artifact; any other path as it is."""
    return read_entry(path).artifact_path if is_entry(path) else path


def read_entry(directory: str) -> ModelEntry:
    path = os.path.join(directory, ENTRY_FILE)
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
        model = data["model"]
        serving = ServingConfig(data.get("serving", {}))
        fixtures = tuple(
            WarmupFixture(tuple(f["prompt_ids"]), tuple(f["expected_ids"]))
            for f in data.get("warmup", [])
        )
        return ModelEntry(
            name=check_name("model name", model["name"]),
            version=check_name("version", str(model["version"])),
            directory=os.path.abspath(directory),
            artifact=model["artifact"],
            sha256=dict(data["sha256"]),
            serving=serving,
            default_sampling=dict(data.get("sampling", {})),
            aliases=tuple(model.get("aliases", ())),
            fixtures=fixtures,
            prepared=str(model.get("prepared", "")),
        )
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as error:
        raise ModelValidationError(path, f"not a valid repository entry: {error!r}") from None


def write_entry(entry: ModelEntry) -> None:
    """Written to a temporary name and renamed: a reader never sees half an entry."""
    path = os.path.join(entry.directory, ENTRY_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        handle.write(entry.to_toml())
    os.replace(path + ".tmp", path)
