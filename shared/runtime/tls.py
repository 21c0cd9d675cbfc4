"""TLS for every gRPC hop, configured once per process from the environment.

`KVMESH_TLS_CERT` / `KVMESH_TLS_KEY` (PEM paths) are this process's certificate, `KVMESH_TLS_CA`
the CA that signs every certificate in the mesh. With them set:
- every internal server (tokenizer, scheduler, engine-worker, trace-collector) requires a
  client certificate signed by the CA (mTLS), and every internal channel presents its own and
  checks the server's;
- the gateway's public endpoints (gRPC and HTTP) serve TLS; a client certificate is asked for
  only with `KVMESH_TLS_PUBLIC_CLIENT_AUTH=1` (else API keys authenticate clients).
`KVMESH_TLS_SERVER_NAME` overrides the name checked on servers' certificates (one certificate
for the whole mesh). Unset: plaintext, as on loopback.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from typing import Any

import grpc

from shared.runtime.mesh_token import SyncMeshToken, aio_interceptors, mesh_token


@dataclass(frozen=True)
class TlsConfig:
    cert: bytes
    key: bytes
    ca: bytes
    cert_path: str
    key_path: str
    ca_path: str
    server_name: str = ""
    public_client_auth: bool = False


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def tls_config(environ: dict[str, str] | None = None) -> TlsConfig | None:
    env = os.environ if environ is None else environ
    cert, key, ca = (env.get(f"KVMESH_TLS_{name}", "") for name in ("CERT", "KEY", "CA"))
    if not (cert or key or ca):
        return None
    if not (cert and key and ca):
        raise ValueError("KVMESH_TLS_CERT, KVMESH_TLS_KEY and KVMESH_TLS_CA go together")
    return TlsConfig(
        _read(cert),
        _read(key),
        _read(ca),
        cert,
        key,
        ca,
        env.get("KVMESH_TLS_SERVER_NAME", ""),
        env.get("KVMESH_TLS_PUBLIC_CLIENT_AUTH", "") == "1",
    )


def server_credentials(config: TlsConfig, public: bool) -> grpc.ServerCredentials:
    require = config.public_client_auth if public else True
    return grpc.ssl_server_credentials(
        [(config.key, config.cert)], root_certificates=config.ca, require_client_auth=require
    )


def channel_options(config: TlsConfig | None) -> list[tuple[str, Any]]:
    if config is None or not config.server_name:
        return []
    return [("grpc.ssl_target_name_override", config.server_name)]


def channel_credentials(config: TlsConfig) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=config.ca, private_key=config.key, certificate_chain=config.cert
    )


def _channel_settings(
    options: list[tuple[str, Any]] | None,
) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, Any]]]:
    config = tls_config()
    credentials = None if config is None else channel_credentials(config)
    return credentials, [*(options or []), *channel_options(config)]


def aio_channel(
    address: str, options: list[tuple[str, Any]] | None = None, token: str | None = None
) -> grpc.aio.Channel:
    """A channel to another kvmesh service: mTLS when configured, else plaintext; with the
    mesh token on every call (mesh_token.py): `token`, else this process's, if any ("" for
    a peer outside the mesh, such as an OTLP endpoint)."""
    credentials, options = _channel_settings(options)
    token = mesh_token() if token is None else token
    interceptors = aio_interceptors(token) if token else None
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


def sync_channel(
    address: str, options: list[tuple[str, Any]] | None = None, token: str | None = None
) -> grpc.Channel:
    """The same, for the blocking API (probes, the launcher, the CLI, span export)."""
    credentials, options = _channel_settings(options)
    if credentials is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        channel = grpc.secure_channel(address, credentials, options=options)
    token = mesh_token() if token is None else token
    return grpc.intercept_channel(channel, SyncMeshToken(token)) if token else channel


def http_ssl_context(config: TlsConfig) -> ssl.SSLContext:
    """The HTTP front's server context: the same certificate, the same client rule."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=config.ca_path)
    context.load_cert_chain(config.cert_path, config.key_path)
    context.verify_mode = ssl.CERT_REQUIRED if config.public_client_auth else ssl.CERT_NONE
    return context
