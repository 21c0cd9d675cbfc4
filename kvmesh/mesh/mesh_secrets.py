"""The credentials one mesh's processes share: the internal ports' mesh token and the password
of its Redis. Taken from the environment the operator set, else made by `kvmesh up` when auth
is on; handed to every child in its environment, never its argv."""

from __future__ import annotations

import os
from dataclasses import dataclass

from shared import redis_auth
from shared.runtime import mesh_token


@dataclass
class MeshSecrets:
    mesh_token: str = ""
    redis_password: str = ""
    redis_user: str = ""  # "": Redis's default user

    @classmethod
    def from_env(cls) -> MeshSecrets:
        return cls(
            mesh_token.mesh_token(),
            os.environ.get(redis_auth.ENV_PASSWORD, ""),
            os.environ.get(redis_auth.ENV_USER, ""),
        )

    def complete(self, auth_on: bool, own_redis: bool) -> None:
        """With auth on, what the operator did not give is made: a mesh token, and for the
        redis-server the mesh starts itself, a password. That server's password (made or
        given) belongs to the ACL user it is started with, whom every child logs in as."""
        if auth_on:
            self.mesh_token = self.mesh_token or mesh_token.new_mesh_token()
            if own_redis and not self.redis_password:
                self.redis_password = redis_auth.new_password()
        if own_redis and self.redis_password:
            self.redis_user = redis_auth.MESH_USER

    def env(self) -> dict[str, str]:
        env = {mesh_token.ENV: self.mesh_token} if self.mesh_token else {}
        if self.redis_password:
            env[redis_auth.ENV_PASSWORD] = self.redis_password
        if self.redis_user:
            env[redis_auth.ENV_USER] = self.redis_user
        return env
