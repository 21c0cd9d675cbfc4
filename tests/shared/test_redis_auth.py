"""Redis credentials: `kvmesh up`'s ACL user on a real redis-server, and every client logging
in from the environment (a URL's own credentials winning)."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

from kvmesh.mesh.local_redis import redis_command, wait_for_redis
from kvmesh.mesh.mesh_secrets import MeshSecrets
from kvmesh.mesh.service_process import free_port
from shared import redis_auth
from shared.redis_link import RedisLink


async def test_the_acl_user_logs_in_from_the_environment_and_nobody_else_does(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    password, port = redis_auth.new_password(), free_port()
    command = redis_command("127.0.0.1", port, password, str(tmp_path))
    assert password not in " ".join(command)
    assert (tmp_path / "redis.conf").stat().st_mode & 0o777 == 0o600
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    try:
        wait_for_redis("127.0.0.1", port)
        url = f"redis://127.0.0.1:{port}/0"
        outsider = RedisLink(url, degraded="tests")
        assert await outsider.run(lambda client: client.set("kvmesh:x", 1)) is None
        monkeypatch.setenv(redis_auth.ENV_USER, redis_auth.MESH_USER)
        monkeypatch.setenv(redis_auth.ENV_PASSWORD, password)
        own = RedisLink(url, degraded="tests")
        assert await own.run(lambda client: client.set("kvmesh:x", 1)) is True
        assert await own.run(lambda client: client.set("other:x", 1)) is None  # kvmesh:* only
        wrong = RedisLink(f"redis://kvmesh:guess@127.0.0.1:{port}/0", degraded="tests")
        assert await wrong.run(lambda client: client.get("kvmesh:x")) is None  # the URL wins
    finally:
        server.terminate()
        server.wait(10)


def test_secrets_are_made_with_auth_on_and_only_what_was_not_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("KVMESH_MESH_TOKEN", redis_auth.ENV_PASSWORD, redis_auth.ENV_USER):
        monkeypatch.delenv(name, raising=False)
    off = MeshSecrets.from_env()
    off.complete(auth_on=False, own_redis=True)
    assert off.env() == {}
    made = MeshSecrets.from_env()
    made.complete(auth_on=True, own_redis=True)
    assert made.redis_user == redis_auth.MESH_USER and len(made.redis_password) >= 32
    assert set(made.env()) == {"KVMESH_MESH_TOKEN", redis_auth.ENV_PASSWORD, redis_auth.ENV_USER}
    external = MeshSecrets.from_env()
    external.complete(auth_on=True, own_redis=False)  # an operator's Redis: its URL says
    assert external.redis_password == "" and external.mesh_token
    monkeypatch.setenv(redis_auth.ENV_PASSWORD, "given")
    for auth_on in (True, False):  # the server the mesh starts takes it, for its ACL user
        given = MeshSecrets.from_env()
        given.complete(auth_on=auth_on, own_redis=True)
        assert (given.redis_password, given.redis_user) == ("given", redis_auth.MESH_USER)
    theirs = MeshSecrets.from_env()
    theirs.complete(auth_on=True, own_redis=False)  # the operator's server and user
    assert (theirs.redis_password, theirs.redis_user) == ("given", "")
