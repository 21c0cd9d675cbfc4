"""Every flag's default from the environment: KVMESH_<FLAG> (dashes as underscores) when set,
which is how containers configure the services."""

from __future__ import annotations

import os


def env_default(flag: str, default: str | None) -> str | None:
    return os.environ.get("KVMESH_" + flag.upper().replace("-", "_"), default)


def env_int(flag: str, default: int | None) -> int | None:
    value = env_default(flag, None if default is None else str(default))
    return None if value is None else int(value)


def env_float(flag: str, default: float) -> float:
    return float(env_default(flag, str(default)) or default)
