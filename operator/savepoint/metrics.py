"""Prometheus metrics, served with /healthz on SAVEPOINT_METRICS_PORT.

/healthz is the liveness probe. It answers 200 `ok` unless (503, saying which):
- kopf's event loop did not run a no-op within LOOP_TIMEOUT seconds (blocked or gone), or
- a heartbeat is overdue: the expiry loop's thread beats before every pass, standing by
  or not, and is overdue after max(10 passes, 30 minutes), which no healthy sweep needs.
A standby replica (kopf peering) is healthy: it has its event loop and its expiry loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

checkpoint_seconds = Histogram("savepoint_checkpoint_duration_seconds", "Checkpoint creation to Ready", buckets=BUCKETS)
restore_seconds = Histogram(
    "savepoint_restore_duration_seconds", "Fork or rollback start to target Ready", ["mode"], buckets=BUCKETS
)
checkpoint_transitions = Counter(
    "savepoint_checkpoint_transitions_total", "Checkpoints reaching a phase", ["phase", "reason"]
)
hook_seconds = Histogram(
    "savepoint_checkpoint_hook_duration_seconds",
    "Checkpoint hooks run in sandboxes, by hook and result",
    ["hook", "result"],
    buckets=BUCKETS,
)
fork_transitions = Counter("savepoint_fork_transitions_total", "Forks reaching a phase", ["phase", "reason"])
expiries = Counter("savepoint_checkpoint_expiries_total", "Checkpoints expired by the TTL controller")
log_appends = Counter("savepoint_eventlog_appends_total", "Events the operator appended to session logs", ["type"])
log_conflicts = Counter("savepoint_eventlog_conflicts_total", "Lost optimistic-concurrency races on log chunks")
retention_chunks = Counter(
    "savepoint_eventlog_retention_chunks_deleted_total",
    "Log chunks deleted by log retention (savepoint.dev/log-retention)",
)
retention_bytes = Counter(
    "savepoint_eventlog_retention_bytes_freed_total",
    "Bytes of event data (keys and values) in the chunks retention deleted",
)
_api_requests = Counter(
    "savepoint_api_requests_total",
    "Requests the operator sent to the API server, by client: its own (operator) and kopf's (kopf)",
    ["client", "verb", "code"],
)


class ClientRequests:
    """One client's series of savepoint_api_requests_total: `.labels(verb, code)`."""

    def __init__(self, client: str) -> None:
        self.client = client

    def labels(self, verb: str, code: str) -> Counter:
        return _api_requests.labels(self.client, verb, code)


api_requests = ClientRequests("operator")  # savepoint.k8s: our kubernetes client
kopf_requests = ClientRequests("kopf")  # kopf's own aiohttp client: watches, lists, patches, events
api_throttle_seconds = Counter(
    "savepoint_api_throttle_seconds_total", "Time requests waited for the client-side rate limiter"
)
idle_pauses = Counter("savepoint_session_idle_pauses_total", "Sessions the operator paused for idleness (spec.idle)")
wakes = Counter(
    "savepoint_session_wakes_total",
    "Idle pauses ended: by an event of the log (trigger=event) or by a change to the spec (trigger=spec)",
    ["trigger"],
)
wake_seconds = Histogram(
    "savepoint_session_wake_seconds", "Time from the event that woke an idle-paused Session to Ready", buckets=BUCKETS
)
reconcile_errors = Counter("savepoint_reconcile_errors_total", "Reconcile passes that raised", ["kind"])
reconciles = Counter("savepoint_reconciles_total", "Reconcile passes started", ["kind"])
reconciles_in_flight = Gauge("savepoint_reconciles_in_flight", "Reconcile passes running now", ["kind"])
peering_active = Gauge("savepoint_peering_active", "1 on the active replica, 0 on a standby (kopf peering)")
admissions_waiting = Gauge(
    "savepoint_checkpoint_admissions_waiting", "New or resumed Checkpoints waiting in the admission queue"
)
snapshot_watches_open = Gauge(
    "savepoint_snapshot_watches_open",
    "VolumeSnapshot watches open now: one per served namespace while a checkpoint is unsettled",
)


def observe_eventlog() -> None:
    """Count the event log's appends, lost races and retention (savepoint.eventlog knows no metrics)."""
    from savepoint import eventlog

    def deleted(_name: str, size: int) -> None:
        retention_chunks.inc()
        retention_bytes.inc(size)

    eventlog.on_append = lambda event: log_appends.labels(event.type).inc()
    eventlog.on_conflict = log_conflicts.inc
    eventlog.on_retention = deleted


def count_kopf_requests() -> None:
    """Count every request kopf sends into savepoint_api_requests_total{client="kopf"}.

    A watch is verb WATCH (counted when its stream opens), a list or read GET. A request
    kopf retries counts once, with the answer of its last attempt.
    """
    # kopf is pinned (1.45.2) and its get/post/patch/delete/stream reach this private
    # function through the module global; if kopf moves it, this raises at start-up and
    # tests/unit/test_metrics.py fails, instead of the count silently reading zero.
    import aiohttp
    from kopf._cogs.clients import api, errors

    send = api.request
    if getattr(send, "savepoint_counted", False):
        return

    async def request(method: str, url: str, **kwargs: Any) -> Any:
        verb = "WATCH" if "watch=true" in url else method.upper()
        try:
            response = await send(method, url, **kwargs)
        except errors.APIError as err:
            kopf_requests.labels(verb, str(err.status)).inc()
            raise
        except (aiohttp.ClientError, TimeoutError, errors.APISessionClosed):  # no HTTP answer
            kopf_requests.labels(verb, "error").inc()
            raise
        kopf_requests.labels(verb, str(response.status)).inc()
        return response

    request.savepoint_counted = True  # type: ignore[attr-defined]
    api.request = request  # type: ignore[assignment]


# --- liveness -------------------------------------------------------------------------

LOOP_TIMEOUT = 3.0
_loop: asyncio.AbstractEventLoop | None = None
_beats: dict[str, tuple[float, float]] = {}  # name -> (monotonic time of the last beat, max age)


def watch_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The event loop kopf runs in, which /healthz pings."""
    global _loop
    _loop = loop


def beat(name: str, max_age: float) -> None:
    """`name` is alive now; /healthz fails if it does not beat again within max_age seconds."""
    _beats[name] = (time.monotonic(), max_age)


def loop_responsive(loop: asyncio.AbstractEventLoop, timeout: float) -> bool:
    """Whether `loop` runs a no-op scheduled from this thread within `timeout` seconds."""
    done = threading.Event()
    try:
        loop.call_soon_threadsafe(done.set)
    except RuntimeError:  # closed
        return False
    return done.wait(timeout)


def health_problems(now: float | None = None) -> list[str]:
    """What makes this process unhealthy now; empty when healthy."""
    now = time.monotonic() if now is None else now
    problems = []
    if _loop is not None and not loop_responsive(_loop, LOOP_TIMEOUT):
        problems.append(f"the event loop did not answer within {LOOP_TIMEOUT:g}s")
    for name, (last, max_age) in sorted(_beats.items()):
        if now - last > max_age:
            problems.append(f"{name} last beat {now - last:.0f}s ago (allowed {max_age:.0f}s)")
    return problems


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        code = 200
        if self.path.startswith("/healthz"):
            problems = health_problems()
            code = 503 if problems else 200
            body, ctype = ("; ".join(problems) if problems else "ok").encode() + b"\n", "text/plain"
        elif self.path.startswith("/metrics"):
            body, ctype = generate_latest(), CONTENT_TYPE_LATEST
        else:
            self.send_error(404)
            return
        self.send_response(code)
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

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        reconciles_in_flight.labels(self.kind).dec()
        if exc_type is not None:
            reconcile_errors.labels(self.kind).inc()
        return False
