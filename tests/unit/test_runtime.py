"""The operator's runtime plumbing without a cluster: peering decisions, the API client's
timeout and error counting, /healthz, and the event log's metric hooks."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta

import pytest
import urllib3
from kubernetes import client

from savepoint import eventlog, k8s, metrics
from savepoint.config import Settings
from savepoint.peering import blocking_peers, decide

NOW = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


def _memo():
    """kopf's memo as `python -m savepoint` passes it: the process's Runtime."""
    from types import SimpleNamespace

    from savepoint.runtime import Runtime

    return SimpleNamespace(runtime=Runtime(Settings(), admission_workers=0))


def peer(priority: int, seen_ago: float = 0, lifetime: int = 60) -> dict:
    return {"priority": priority, "lifetime": lifetime, "lastseen": (NOW - timedelta(seconds=seen_ago)).isoformat()}


# --- peering ------------------------------------------------------------------------


def test_the_highest_live_priority_is_active_and_the_others_stand_by():
    status = {"a": peer(10), "b": peer(20)}
    assert decide([{"status": status}], "b", 20, NOW)
    assert not decide([{"status": status}], "a", 10, NOW)
    assert blocking_peers(status, "a", 10, NOW) == ["b"]


def test_an_equal_priority_blocks_both_as_kopf_does():
    status = {"a": peer(5), "b": peer(5)}
    assert not decide([{"status": status}], "a", 5, NOW)
    assert not decide([{"status": status}], "b", 5, NOW)


def test_a_dead_peer_does_not_block():
    status = {"a": peer(10), "b": peer(20, seen_ago=61, lifetime=60)}
    assert decide([{"status": status}], "a", 10, NOW)
    status["b"] = peer(20, seen_ago=59, lifetime=60)
    assert not decide([{"status": status}], "a", 10, NOW)


def test_a_record_without_lastseen_or_lifetime_is_read_as_kopf_reads_it():
    # kopf: no lastseen means "now"; no lifetime means 60 s.
    assert blocking_peers({"x": {"priority": 7}}, "me", 1, NOW) == ["x"]
    old = (NOW - timedelta(seconds=61)).isoformat()
    assert blocking_peers({"x": {"priority": 7, "lastseen": old}}, "me", 1, NOW) == []


def test_a_missing_peering_object_or_any_blocked_namespace_means_standby():
    assert decide([{"status": {}}, {}], "me", 1, NOW)
    assert not decide([None], "me", 1, NOW)
    assert not decide([{"status": {}}, {"status": {"x": peer(9)}}], "me", 1, NOW)
    assert decide([], "me", 1, NOW)


def test_priority_is_random_per_process_but_stable_within_it(monkeypatch):
    monkeypatch.delenv("SAVEPOINT_PEERING_PRIORITY", raising=False)
    assert Settings().peering_priority == Settings().peering_priority > 0
    monkeypatch.setenv("SAVEPOINT_PEERING_PRIORITY", "42")
    monkeypatch.setenv("SAVEPOINT_PEERING_LIFETIME", "7")
    assert (Settings().peering_priority, Settings().peering_lifetime_seconds) == (42, 7)


# --- the API client -------------------------------------------------------------------


def test_default_timeout_only_where_the_call_set_none():
    assert k8s.with_timeout((), {}, 30) == {"_request_timeout": 30}
    assert k8s.with_timeout((), {"_request_timeout": None}, 30) == {"_request_timeout": 30}
    assert k8s.with_timeout((), {"_request_timeout": 5}, 30) == {"_request_timeout": 5}
    assert k8s.with_timeout(({}, None, None, 5), {}, 30) == {}
    assert k8s.with_timeout((), {}, 0) == {}


def _client(port: int, timeout: float) -> client.CoreV1Api:
    conf = client.Configuration(host=f"http://127.0.0.1:{port}")
    conf.retries = 0
    api = client.ApiClient(conf)
    k8s._instrument(api, k8s.RateLimiter(0, 1), timeout)
    return client.CoreV1Api(api)


def _errors() -> float:
    return metrics.api_requests.labels("GET", "error")._value.get()


def test_a_refused_connection_is_counted_as_an_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    before = _errors()
    with pytest.raises(urllib3.exceptions.HTTPError):
        _client(port, 5).read_namespace("default")
    assert _errors() == before + 1


def test_a_hung_server_times_out_instead_of_holding_the_thread():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()  # accepts (in the kernel) and never answers
        before, started = _errors(), time.monotonic()
        with pytest.raises(urllib3.exceptions.HTTPError):
            _client(server.getsockname()[1], 0.5).read_namespace("default")
        assert time.monotonic() - started < 5
    assert _errors() == before + 1


# --- /healthz -------------------------------------------------------------------------


@pytest.fixture
def health(monkeypatch):
    monkeypatch.setattr(metrics, "_beats", {})
    monkeypatch.setattr(metrics, "_loop", None)
    monkeypatch.setattr(metrics, "LOOP_TIMEOUT", 0.5)
    server = metrics.serve(_free_port(), "127.0.0.1")
    assert server is not None
    yield f"http://127.0.0.1:{server.server_address[1]}/healthz"
    server.shutdown()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_healthz_follows_the_event_loop(health):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    metrics.watch_loop(loop)
    assert _get(health) == (200, "ok\n")
    release = threading.Event()
    loop.call_soon_threadsafe(release.wait)  # a handler that blocks the loop
    code, body = _get(health)
    assert code == 503 and "event loop" in body
    release.set()
    assert _get(health) == (200, "ok\n")
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()
    assert _get(health)[0] == 503


def test_healthz_fails_on_an_overdue_heartbeat(health):
    metrics.beat("expiry loop", 60)
    assert _get(health) == (200, "ok\n")
    metrics._beats["expiry loop"] = (time.monotonic() - 61, 60)
    code, body = _get(health)
    assert code == 503 and "expiry loop" in body


# --- event log hooks ----------------------------------------------------------------


class _Response:
    def __init__(self, body: dict) -> None:
        self.data = json.dumps(body).encode()


class _OneChunk:
    """A CoreV1Api stand-in holding one log chunk; the first patch loses a race (409)."""

    def __init__(self) -> None:
        self.version, self.data, self.raced = 1, {}, False

    def _body(self) -> dict:
        meta = {"name": "s-log-000001", "resourceVersion": str(self.version),
                "annotations": {eventlog.FIRST_SEQ_ANNOTATION: "1"}}  # fmt: skip
        return {"metadata": meta, "data": dict(self.data)}

    def list_namespaced_config_map(self, *args, **kwargs) -> _Response:
        return _Response({"metadata": {}, "items": [self._body()]})

    def read_namespaced_config_map(self, *args, **kwargs) -> _Response:
        return _Response(self._body())

    def patch_namespaced_config_map(self, name, namespace, body, **kwargs) -> _Response:
        if not self.raced:
            self.raced = True
            self.version += 1  # another writer got there first
            raise client.ApiException(status=409)
        self.version += 1
        self.data.update(body["data"])
        return _Response(self._body())


def test_the_operator_counts_event_log_appends_and_conflicts(monkeypatch):
    monkeypatch.setattr(eventlog, "on_append", None)
    monkeypatch.setattr(eventlog, "on_conflict", None)
    metrics.observe_eventlog()
    appended = metrics.log_appends.labels("unit.test")._value.get()
    conflicts = metrics.log_conflicts._value.get()
    log = eventlog.EventLog(_OneChunk(), "ns", "s")
    log.append_many([("unit.test", {}), ("unit.test", {"n": 2})])
    assert metrics.log_appends.labels("unit.test")._value.get() == appended + 2
    assert metrics.log_conflicts._value.get() == conflicts + 1


# Allocates from 16 threads at once, then prints glibc's malloc_info (one <heap> per arena).
_ARENA_PROBE = """
import ctypes, sys, threading
from savepoint import memory
if sys.argv[1] == "capped":
    assert memory.limit_arenas()
start = threading.Barrier(16)
def churn():
    start.wait()
    for _ in range(50):
        keep = [bytearray(4096) for _ in range(64)]
        del keep
threads = [threading.Thread(target=churn) for _ in range(16)]
for t in threads: t.start()
for t in threads: t.join()
libc = ctypes.CDLL(None)
libc.fdopen.restype = ctypes.c_void_p
out = ctypes.c_void_p(libc.fdopen(1, b"w"))
libc.malloc_info(0, out)
libc.fflush(out)
"""


def test_the_operator_caps_malloc_arenas():
    import subprocess
    import sys
    from pathlib import Path

    operator = str(Path(__file__).resolve().parents[2] / "operator")

    def heaps(mode: str) -> int:
        done = subprocess.run(
            [sys.executable, "-c", _ARENA_PROBE, mode],
            capture_output=True,
            text=True,
            env={"PYTHONPATH": operator},
            check=True,
        )
        return done.stdout.count("<heap nr=")

    assert heaps("capped") <= 2
    assert heaps("default") > 2  # what the cap is there for: an arena per busy thread


_FREEZE_PROBE = """
import gc
from savepoint import memory
import savepoint.runtime  # the operator's modules, as __main__ has them before it starts
scanned = len(gc.get_objects())  # what every full collection walks
memory.freeze_startup()
print(scanned > 10_000, len(gc.get_objects()) < scanned / 10, gc.get_freeze_count() >= scanned * 0.9)
"""


def test_the_start_up_heap_is_kept_out_of_garbage_collections():
    import subprocess
    import sys
    from pathlib import Path

    operator = str(Path(__file__).resolve().parents[2] / "operator")
    done = subprocess.run(
        [sys.executable, "-c", _FREEZE_PROBE], capture_output=True, text=True, env={"PYTHONPATH": operator}, check=True
    )
    assert done.stdout.split() == ["True", "True", "True"]


# --- what kopf watches ----------------------------------------------------------------


def test_kopf_watches_only_sessions_and_forks_and_our_watches_select_children_by_label():
    """Every event of a Checkpoint, a VolumeSnapshot or a Session's child went through
    kopf's handler machinery, most of the operator's CPU under a burst of checkpoints:
    those kinds are the runtime's own watches. The children are selected by label on the
    server, or every Pod, claim and ConfigMap in a namespace would be listed and watched."""
    import kopf

    from savepoint import handlers  # noqa: F401  (registers the handlers)
    from savepoint.checkpoint import CHECKPOINT_LABEL
    from savepoint.session import SESSION_LABEL

    registry = kopf.get_default_registry()
    kinds = {
        h.selector.any_name
        for reg in (registry._watching, registry._changing, registry._spawning, registry._indexing)
        for h in reg.get_all_handlers()
    }
    assert kinds == {"sessions", "forks"}
    runtime = _memo().runtime
    selectors = {kind.plural: selector for kind, selector, _ in runtime.watched()}
    selectors |= {w.kind.plural: w.selector for w in runtime.snapshot_watches.values()}
    assert selectors == {
        "checkpoints": "",
        "volumesnapshots": CHECKPOINT_LABEL,
        "pods": SESSION_LABEL,
        "persistentvolumeclaims": SESSION_LABEL,
        "configmaps": SESSION_LABEL,
    }


def test_kopf_lists_a_page_at_a_time():
    """Cluster-wide, one unpaged listing is every Checkpoint in one response, parsed whole:
    at 10,000 it took the resident size from about 160 to over 300 MiB (docs/performance.md)."""
    import kopf

    from savepoint import handlers, k8s

    settings = kopf.OperatorSettings()
    handlers.operator.operator_configure(settings=settings, memo=_memo())
    assert settings.watching.chunk_size == k8s.LIST_PAGE
    assert 0 < k8s.LIST_PAGE <= 1000


def test_kopf_logs_no_line_per_watch_event_but_keeps_the_rest():
    """Watch-event handlers run on every event of every object (one line per listed object
    at a restart); their success lines are dropped, through kopf's own loggers."""
    import logging

    import kopf
    from kopf._cogs.structs.bodies import Body
    from kopf._core.actions.loggers import LocalObjectLogger, ObjectLogger

    from savepoint import handlers

    settings = kopf.OperatorSettings()
    handlers.operator.operator_configure(settings=settings, memo=_memo())
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    collect = Collect()
    kopf_objects = logging.getLogger("kopf.objects")
    kopf_objects.addHandler(collect)
    try:
        body = Body({"apiVersion": "savepoint.dev/v1alpha1", "kind": "Checkpoint", "metadata": {"name": "c"}})
        watch_logger = LocalObjectLogger(body=body, settings=settings)
        change_logger = ObjectLogger(body=body, settings=settings)
        watch_logger.info("Handler 'checkpoint_clocks' succeeded.")
        watch_logger.error("Handler 'checkpoint_clocks' failed with an exception. Will ignore.")
        change_logger.info("Handler 'checkpoint_create' succeeded.")
    finally:
        kopf_objects.removeHandler(collect)
    assert seen == [
        "Handler 'checkpoint_clocks' failed with an exception. Will ignore.",
        "Handler 'checkpoint_create' succeeded.",
    ]


def test_kopf_lines_about_an_object_name_it():
    """kopf's own "Handler ... failed" lines say nothing of which object; ours prefix it."""
    import io
    import logging

    import kopf

    from savepoint.__main__ import LOG_FORMAT, ObjectFormatter

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(ObjectFormatter(LOG_FORMAT))
    kopf_objects = logging.getLogger("kopf.objects")
    kopf_objects.addHandler(handler)
    try:
        body = {"kind": "Session", "metadata": {"namespace": "ns", "name": "f9"}}
        kopf.ObjectLogger(body=body, settings=kopf.OperatorSettings()).error("Handler 'session_create' failed")
    finally:
        kopf_objects.removeHandler(handler)
    assert "kopf.objects [ns/f9] Handler 'session_create' failed" in out.getvalue()


# --- settings -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("SAVEPOINT_API_QPS", "fast", "SAVEPOINT_API_QPS='fast': not a number"),
        ("SAVEPOINT_API_BURST", "2.5", "SAVEPOINT_API_BURST='2.5': not a whole number"),
        ("SAVEPOINT_EXPIRY_WORKERS", "-1", "SAVEPOINT_EXPIRY_WORKERS='-1': must not be negative"),
        ("SAVEPOINT_SNAPSHOT_TIMEOUT", "ten", "SAVEPOINT_SNAPSHOT_TIMEOUT: invalid duration 'ten'"),
        ("SAVEPOINT_WEBHOOK", "maybe", "SAVEPOINT_WEBHOOK='maybe': not a boolean"),
        ("SAVEPOINT_LOG_LEVEL", "loud", "SAVEPOINT_LOG_LEVEL='LOUD': not a log level"),
    ],
)
def test_a_bad_setting_is_refused_naming_the_variable(monkeypatch, variable, value, says):
    from savepoint.config import load
    from savepoint.errors import SettingsError

    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as refused:
        load()
    assert str(refused.value).startswith(says)


def test_the_operator_stops_at_start_on_a_bad_setting():
    """`python -m savepoint` exits before it registers or starts anything, with the message."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    source = Path(__file__).resolve().parents[2] / "operator"
    env = {**os.environ, "SAVEPOINT_API_QPS": "fast", "PYTHONPATH": str(source)}
    done = subprocess.run([sys.executable, "-m", "savepoint"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "savepoint: SAVEPOINT_API_QPS='fast': not a number" in done.stderr
    assert "Traceback" not in done.stderr


def test_handlers_hold_no_queue_thread_or_settings():
    """The handlers are decorators only: no module state, no thread started at import."""
    import inspect
    import threading as threads

    from savepoint.handlers import checkpoint, fork, operator, session

    for module in (checkpoint, fork, operator, session):
        source = inspect.getsource(module)
        for forbidden in ("threading", "Thread(", "PollQueue", "WorkQueue", "load()", "time.sleep"):
            assert forbidden not in source, f"{module.__name__} has {forbidden}"
    assert not [t for t in threads.enumerate() if t.name.startswith(("checkpoint-", "session-"))]


def test_the_kubeconfig_credential_hook_runs_at_most_once_a_second(monkeypatch):
    """The hook sets every connection setting again (and looks up proxies) before each
    request; spaced, it still runs first, and again once a second has passed."""
    now = [100.0]
    monkeypatch.setattr(k8s.time, "monotonic", lambda: now[0])
    calls: list[float] = []
    conf = client.Configuration()
    conf.api_key = {"BearerToken": "t"}
    conf.refresh_api_key_hook = lambda c: calls.append(now[0])
    k8s._space_credential_refresh(conf)
    for _ in range(5):
        conf.get_api_key_with_prefix("BearerToken")
    assert calls == [100.0]
    now[0] = 101.0
    conf.get_api_key_with_prefix("BearerToken")
    assert calls == [100.0, 101.0]
    bare = client.Configuration()
    k8s._space_credential_refresh(bare)  # no hook (a token given directly): nothing to space
    assert bare.refresh_api_key_hook is None


def test_a_pod_whose_deletion_the_watch_showed_is_not_read_again(monkeypatch):
    from savepoint.controllers import cache

    cache.clear()
    reads: list[str] = []
    monkeypatch.setattr(k8s, "get_pod", lambda ns, name: reads.append(name))
    pod = {"metadata": {"namespace": "ns", "name": "s", "resourceVersion": "5"}}
    assert cache.pod("ns", "s") is None and reads == ["s"]  # never seen: read
    cache.pods.observe("ADDED", pod)
    cache.pods.observe("DELETED", pod)
    assert cache.pod("ns", "s") is None and reads == ["s"]  # its deletion seen: known gone
    cache.pods.put({"metadata": {"namespace": "ns", "name": "s", "resourceVersion": "9"}})  # made again
    assert cache.pod("ns", "s")["metadata"]["resourceVersion"] == "9" and reads == ["s"]
    cache.pods.forget("ns", "s")
    assert cache.pod("ns", "s") is None and reads == ["s", "s"]
    cache.clear()


def test_the_chunk_watch_s_events_mark_how_far_the_store_is_current():
    """Every ConfigMap watch event (a chunk's or a heartbeat's) moves the namespace's mark
    to its version, once the store holds it; a listed object (no event type) and other
    kinds do not: a listing comes in no particular order."""
    from savepoint.controllers import cache
    from savepoint.session import SESSION_LABEL

    cache.clear()
    runtime = _memo().runtime

    def body(name: str, version: int) -> dict:
        return {"metadata": {"namespace": "ns", "name": name, "resourceVersion": str(version),
                             "labels": {SESSION_LABEL: "s"}, "uid": f"u-{name}"}, "data": {}}

    runtime.observe_child("configmaps", None, body("s-log-000001", 7))
    assert cache.chunks.delivered_through("ns") == 0 and cache.chunks.newest("ns", "s") is not None
    runtime.observe_child("configmaps", "MODIFIED", body("s-log-000001", 9))
    assert cache.chunks.delivered_through("ns") == 9
    runtime.observe_child("configmaps", "MODIFIED", body("s-heartbeat", 12))
    assert cache.chunks.delivered_through("ns") == 12
    runtime.observe_child("pods", "MODIFIED", body("s", 20))
    assert cache.chunks.delivered_through("ns") == 12
    cache.clear()


def test_the_heap_is_released_after_work_and_its_tail_not_at_rest():
    from savepoint.memory import Releases

    cpu = [0.0]
    releases = Releases(busy_cpu=1.0, clock=lambda: cpu[0])

    def window(spent: float, release_costs: float = 0.0) -> bool:
        cpu[0] += spent
        due = releases.due()
        if due:
            cpu[0] += release_costs
            releases.released()
        return due

    # Start-up's window counts as worked; then at rest, nothing.
    assert [window(0.1) for _ in range(4)] == [True, False, False, False]
    # A burst: every worked window, and the quiet one after the last (its tail).
    assert [window(s) for s in (3.0, 5.0, 0.2, 0.1, 0.1)] == [True, True, True, False, False]
    # Work spread over windows, each below the bar, is not a burst.
    assert [window(0.9) for _ in range(3)] == [False, False, False]
    # A release's own CPU (a full collection of a large heap) is not the next window's work.
    assert [window(2.0, release_costs=1.5), window(0.1, release_costs=1.5), window(0.1)] == [True, True, False]
