"""Redis credentials, from the environment, never the command line (`ps` shows argv).

`KVMESH_REDIS_PASSWORD` (and `KVMESH_REDIS_USER`, else Redis's `default` user) set, every Redis
client the mesh makes logs in with them; credentials in a `--redis redis://user:pass@...` URL
win over both. `kvmesh up` with auth on starts its redis-server with an ACL user of its own
(`kvmesh`, a generated password, the default user off) and hands both to its children; compose
and the Kubernetes overlays read the password from the environment or a Secret.
"""

from __future__ import annotations

import os
import secrets
from typing import TypedDict

ENV_USER = "KVMESH_REDIS_USER"
ENV_PASSWORD = "KVMESH_REDIS_PASSWORD"
MESH_USER = "kvmesh"  # the ACL user `kvmesh up` makes


class Credentials(TypedDict, total=False):
    """redis-py's keyword arguments for them."""

    username: str
    password: str


def credentials() -> Credentials:
    """This process's credentials as redis-py keyword arguments: none when unset."""
    password = os.environ.get(ENV_PASSWORD, "")
    if not password:
        return {}
    user = os.environ.get(ENV_USER, "")
    return {"password": password, "username": user} if user else {"password": password}


def new_password() -> str:
    return secrets.token_urlsafe(24)
