"""`edgehaul metrics serve`: the fleet view as OpenMetrics text for Prometheus (GET /metrics).

Serves what the last `fleet_report` run stored (`reports/fleet/latest.json` in the ops bucket), so
Prometheus, the Prefect artifact and the JSON show the same figures; `edgehaul_fleet_report_age_seconds`
says how old they are. The stored view is re-read at most every `cache_s` seconds.

    edgehaul metrics serve --store-block lifecycle --port 9464     # infra/monitoring/prometheus.yml
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from edgehaul.blocks import ObjectStore
from edgehaul.ops import fleet

log = logging.getLogger(__name__)

CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"


class ViewCache:
    """The stored view, re-read from the ops bucket at most every `cache_s` seconds."""

    def __init__(self, load: Callable[[], fleet.FleetView | None], cache_s: float = 15.0) -> None:
        self._load = load
        self.cache_s = cache_s
        self._lock = threading.Lock()
        self._view: fleet.FleetView | None = None
        self._at = float("-inf")

    def get(self) -> fleet.FleetView | None:
        with self._lock:
            if time.monotonic() - self._at >= self.cache_s:
                self._view = self._load()
                self._at = time.monotonic()
            return self._view


def make_server(store: ObjectStore, host: str = "127.0.0.1", port: int = 9464, cache_s: float = 15.0
                ) -> ThreadingHTTPServer:
    """An HTTP server answering GET /metrics (OpenMetrics) and /healthz; not yet serving."""
    cache = ViewCache(lambda: fleet.read_view(store), cache_s)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                return self._send(200, b"ok\n", "text/plain")
            if path != "/metrics":
                return self._send(404, b"GET /metrics\n", "text/plain")
            try:
                view = cache.get()
            except Exception as e:  # the store is down: Prometheus records the scrape as failed
                log.warning("fleet view unreadable: %s", e)
                return self._send(503, f"fleet view unreadable: {type(e).__name__}: {e}\n".encode(), "text/plain")
            if view is None:
                return self._send(503, b"no fleet view stored yet: run the fleet_report flow\n", "text/plain")
            self._send(200, fleet.openmetrics(view), CONTENT_TYPE)

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    return ThreadingHTTPServer((host, port), Handler)


def main(argv: list[str] | None = None) -> int:
    from edgehaul.platform.block_loading import load_block
    from edgehaul.platform.roles import StoreBlock

    ap = argparse.ArgumentParser(prog="edgehaul metrics", description="serve the fleet view for Prometheus")
    ap.add_argument("verb", choices=["serve"])
    ap.add_argument("--store-block", default=str(StoreBlock.LIFECYCLE), help="ObjectStore block (reads ops)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9464)
    ap.add_argument("--cache-s", type=float, default=15.0, help="re-read the stored view at most this often")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    server = make_server(load_block(ObjectStore, args.store_block), args.host, args.port, args.cache_s)
    print(f"serving OpenMetrics on http://{args.host}:{server.server_address[1]}/metrics", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
