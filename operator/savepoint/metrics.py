"""Prometheus metrics, served with /healthz on SAVEPOINT_METRICS_PORT."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

checkpoint_seconds = Histogram("savepoint_checkpoint_duration_seconds", "Checkpoint creation to Ready", buckets=BUCKETS)
restore_seconds = Histogram(
    "savepoint_restore_duration_seconds", "Fork or rollback start to target Ready", ["mode"], buckets=BUCKETS
)
checkpoint_transitions = Counter(
    "savepoint_checkpoint_transitions_total", "Checkpoints reaching a phase", ["phase", "reason"]
)
fork_transitions = Counter("savepoint_fork_transitions_total", "Forks reaching a phase", ["phase", "reason"])
expiries = Counter("savepoint_checkpoint_expiries_total", "Checkpoints expired by the TTL controller")
log_appends = Counter("savepoint_eventlog_appends_total", "Events the operator appended to session logs", ["type"])
log_conflicts = Counter("savepoint_eventlog_conflicts_total", "Lost optimistic-concurrency races on log chunks")
api_requests = Counter(
    "savepoint_api_requests_total", "Requests the operator's Kubernetes client sent", ["verb", "code"]
)
api_throttle_seconds = Counter(
    "savepoint_api_throttle_seconds_total", "Time requests waited for the client-side rate limiter"
)
reconcile_errors = Counter("savepoint_reconcile_errors_total", "Reconcile passes that raised", ["kind"])
reconciles = Counter("savepoint_reconciles_total", "Reconcile passes started", ["kind"])
reconciles_in_flight = Gauge("savepoint_reconciles_in_flight", "Reconcile passes running now", ["kind"])


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.startswith("/healthz"):
            body, ctype = b"ok\n", "text/plain"
        elif self.path.startswith("/metrics"):
            body, ctype = generate_latest(), CONTENT_TYPE_LATEST
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:  # scrapes every few seconds: keep the log quiet
        pass


def serve(port: int, addr: str = "0.0.0.0") -> ThreadingHTTPServer | None:
    if port <= 0:
        return None
    server = ThreadingHTTPServer((addr, port), _Handler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


class count_errors:  # noqa: N801 (used as a context manager, reads like a function)
    """`with count_errors("session"): ...` counts a reconcile pass (and one that raised, re-raising)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __enter__(self) -> None:
        reconciles.labels(self.kind).inc()
        reconciles_in_flight.labels(self.kind).inc()
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        reconciles_in_flight.labels(self.kind).dec()
        if exc_type is not None:
            reconcile_errors.labels(self.kind).inc()
        return False
