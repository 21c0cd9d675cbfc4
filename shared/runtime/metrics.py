"""Prometheus metrics: the endpoint every service serves, and the bucket layouts they share.

Each service declares its own metrics beside the code that observes them; names follow the
Prometheus conventions (`kvmesh_<what>_<unit>`, counters end in `_total` once exposed).
Histograms take the request's trace id as an exemplar, shown in the OpenMetrics format
(`Accept: application/openmetrics-text`), so a slow bucket leads to a trace.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import make_server

from prometheus_client import make_wsgi_app, start_http_server
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

from shared.runtime.mesh_token import mesh_token

log = logging.getLogger("kvmesh.metrics")
# Request-scale latencies (queue, TTFT, E2E): 5 ms to a minute.
REQUEST_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Token-scale latencies (TPOT, ITL, one step): 1 ms to 2.5 s.
TOKEN_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


def scrape_token() -> str:
    """What every metrics endpoint wants as a Bearer token (Prometheus' `authorization` scrape
    setting): `KVMESH_METRICS_TOKEN`, else, with auth on, the mesh token (so a metrics port is
    never the one door left open; a token of Prometheus' own is better: it opens no gRPC port);
    neither: they answer anyone who reaches them."""
    return os.environ.get("KVMESH_METRICS_TOKEN", "") or mesh_token()


def is_scrape_token(authorization: str) -> bool:
    token = scrape_token()
    return bool(token) and hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode())


def serve_metrics(host: str, port: int) -> None:
    """`GET http://HOST:PORT/metrics` from a daemon thread; with a scrape token, 401 without."""
    if not scrape_token():
        start_http_server(port, addr=host)
    else:
        app = make_wsgi_app()

        def guarded(environ: dict, start_response: Callable) -> Iterable[bytes]:
            if not is_scrape_token(environ.get("HTTP_AUTHORIZATION", "")):
                start_response("401 Unauthorized", [("Content-Type", "text/plain")])
                return [b"a Bearer token is required: KVMESH_METRICS_TOKEN, else the mesh's\n"]
            return app(environ, start_response)

        server = make_server(host, port, guarded, ThreadingWSGIServer, _SilentHandler)
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    log.info("metrics", extra={"address": f"http://{host}:{port}/metrics"})


def exemplar(trace_id: str) -> dict[str, str] | None:
    return {"trace_id": trace_id} if trace_id else None
