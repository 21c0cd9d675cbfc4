"""Where the mesh `kvmesh up` started can be found: a small JSON file it writes once ready and
removes when it stops, read by `kvmesh chat/generate --addr/trace/bench` given no address.

KVMESH_RUN_FILE names it; else $XDG_RUNTIME_DIR/kvmesh/mesh.json, else
~/.cache/kvmesh/mesh.json. A file whose launcher is no longer alive is ignored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from shared.errors import KvmeshError, Reason


def path() -> Path:
    named = os.environ.get("KVMESH_RUN_FILE")
    if named:
        return Path(named)
    base = os.environ.get("XDG_RUNTIME_DIR") or os.path.expanduser("~/.cache")
    return Path(base) / "kvmesh" / "mesh.json"


def write(addresses: dict[str, object]) -> Path:
    """Records this process's mesh (atomically: a reader never sees half a file)."""
    target = path()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps({"pid": os.getpid(), **addresses}, indent=2) + "\n")
    partial.replace(target)
    return target


def read() -> dict[str, object] | None:
    """The running mesh's record, or None (no file, unreadable, or its launcher is gone)."""
    try:
        record = json.loads(path().read_text())
        os.kill(int(record["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if isinstance(record, dict) else None


def address_of(service: str, fallback: str) -> str:
    record = read()
    value = record.get(service) if record else None
    return value if isinstance(value, str) and value else fallback


def gateway(addr: str | None, fallback: str | None = None) -> str:
    """The gateway a client command talks to: `addr` as given; "up" or none, the recorded
    mesh's; else `fallback`, or a clear error when there is none."""
    if addr and addr != "up":
        return addr
    found = address_of("gateway", fallback or "")
    if not found:
        raise KvmeshError(
            Reason.UNREACHABLE,
            f"no running mesh is recorded in {path()}: start one with `kvmesh up`, or give "
            "--addr HOST:PORT",
        )
    return found


def remove() -> None:
    """Removes the record if it is this process's own (another `kvmesh up` may have written
    a newer one)."""
    try:
        if json.loads(path().read_text()).get("pid") == os.getpid():
            path().unlink()
    except (OSError, ValueError, AttributeError):
        pass
