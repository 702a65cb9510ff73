"""controllers/logview.py against the in-memory API: a Session's passes fold the newest
chunk the watch showed into the log's digest, reading the whole log only when they must."""

from __future__ import annotations

import time

import pytest

from savepoint import eventlog
from savepoint.controllers import cache, logview
from savepoint.eventlog import EventLog
from savepoint.logdigest import Digest
from tests.unit.fake_api import FakeAPI

SESSION = {"metadata": {"namespace": "ns", "name": "s", "uid": "u-s"}}


@pytest.fixture
def api(monkeypatch):
    cache.clear()
    monkeypatch.setattr(eventlog, "on_chunk", cache.chunks.put)  # as __main__ sets it
    yield FakeAPI()
    cache.clear()


def watched(api: FakeAPI, *names: str) -> None:
    """The chunk watch delivers the chunks as they are now."""
    for name in names:
        cache.chunks.observe("MODIFIED", api.get("configmaps", "ns", name))


def reads(api: FakeAPI) -> list[str]:
    return [f"{r.verb} {r.name}" for r in api.requests if r.kind == "configmaps"]


def test_the_next_pass_folds_the_watched_chunk_without_a_request(api):
    log = EventLog(api.core(), "ns", "s")
    log.append("run.started", {"runId": "r1"})
    first = logview.observe(SESSION, EventLog(api.core(), "ns", "s"))
    assert first.digest.summary()["run_in_flight"] and first.chunks == 1
    log.append("run.completed", {"runId": "r1"})
    watched(api, "s-log-000001")
    api.requests.clear()
    second = logview.observe(SESSION, EventLog(api.core(), "ns", "s"))
    assert reads(api) == []
    assert second.digest == Digest.of(log.read())
    assert second.digest.last_run_completed == 2 and [e.seq for e in second.tail] == [1, 2]


def test_a_chunk_the_watch_has_not_shown_yet_is_read_from_the_digest_on(api):
    log = EventLog(api.core(), "ns", "s", max_chunk_bytes=1024, rollover_bytes=1024)
    log.append("user.message", {"text": "x" * 300})
    logview.observe(SESSION, EventLog(api.core(), "ns", "s"))
    for i in range(6):
        log.append("agent.message", {"text": "y" * 300, "i": i})
    assert len(log.chunk_names()) > 2
    watched(api, log.chunk_names()[-1])  # only the newest: it does not reach back to event 2
    view = logview.observe(SESSION, EventLog(api.core(), "ns", "s"))
    assert view.digest == Digest.of(log.read()) and view.chunks == len(log.chunk_names())
    # The chunks after the digest's end are read, never the first one again.
    assert not any(r.startswith("get") and r.endswith("s-log-000001") for r in reads(api))


def test_a_rollback_an_erase_or_another_session_reads_the_whole_log(api):
    log = EventLog(api.core(), "ns", "s")
    log.append("user.message", {"text": "one"})
    log.append("user.message", {"text": "two"})
    logview.observe(SESSION, EventLog(api.core(), "ns", "s"))
    log.append("session.rollback", {"toSequence": 1})
    watched(api, "s-log-000001")
    view = logview.observe(SESSION, EventLog(api.core(), "ns", "s"))
    assert view.digest == Digest.of(log.read()) and view.digest.through == 3
    # An event rewritten in place (erase) is not something a fold can see: the flag says so.
    chunk = api.get("configmaps", "ns", "s-log-000001")
    chunk["data"]["000000000001"] = chunk["data"]["000000000001"].replace("one", "gone")
    chunk["metadata"]["resourceVersion"] = str(int(chunk["metadata"]["resourceVersion"]) + 100)
    cache.chunks.observe("MODIFIED", chunk)
    api.requests.clear()
    logview.observe(SESSION, EventLog(api.core(), "ns", "s"))
    assert any(r.startswith("list") for r in reads(api))
    api.requests.clear()
    logview.observe(SESSION, EventLog(api.core(), "ns", "s"))
    assert not any(r.startswith("list") for r in reads(api))  # said once
    # A Session of the same name made again (another uid) starts from its own log.
    again = {"metadata": {"namespace": "ns", "name": "s", "uid": "u-new"}}
    api.requests.clear()
    logview.observe(again, EventLog(api.core(), "ns", "s"))
    assert any(r.startswith("list") for r in reads(api))


def test_the_resync_reads_fresh(api):
    EventLog(api.core(), "ns", "s").append("user.message", {})
    logview.observe(SESSION, EventLog(api.core(), "ns", "s"))
    watched(api, "s-log-000001")
    api.requests.clear()
    with cache.reading(False):
        logview.observe(SESSION, EventLog(api.core(), "ns", "s"))
    assert any(r.startswith("list") for r in reads(api))


def test_admission_sees_every_event_appended_before_the_checkpoint_arrived(api):
    """The watch's copy may lag: a run completed a moment ago must not read as still open,
    nor be left out of the cut. A read that started after the checkpoint arrived serves it,
    and every other checkpoint of the session that arrived before that read."""
    log = EventLog(api.core(), "ns", "s")
    log.append("run.started", {"runId": "r1"})
    logview.observe(SESSION, EventLog(api.core(), "ns", "s"))
    watched(api, "s-log-000001")
    hook = eventlog.on_chunk
    eventlog.on_chunk = None  # the harness writes, in its own process
    log.append("run.completed", {"runId": "r1"})  # its watch event not delivered yet
    eventlog.on_chunk = hook
    stale = logview.observe(SESSION, EventLog(api.core(), "ns", "s"))
    assert stale.digest.summary()["run_in_flight"]  # what a Session pass may see for a moment
    arrived = time.monotonic()
    api.requests.clear()
    fresh = logview.observe(SESSION, EventLog(api.core(), "ns", "s"), fresh_after=arrived)
    assert not fresh.digest.summary()["run_in_flight"] and fresh.digest.through == 2
    assert reads(api) == ["get s-log-000001"]
    api.requests.clear()
    again = logview.observe(SESSION, EventLog(api.core(), "ns", "s"), fresh_after=arrived)
    assert again.digest.through == 2 and reads(api) == []


def test_the_chunk_watch_past_the_checkpoint_serves_its_admission(api):
    """The chunk watch delivers in resourceVersion order: once it has delivered any
    Session's chunk at least as new as the Checkpoint, every append made before the
    Checkpoint is in the store, and admission reads nothing. Until then it reads."""

    def made() -> int:  # a Checkpoint made now: its resourceVersion
        return int(api.create("checkpoints", "ns", {"metadata": {"name": f"c{time.monotonic_ns()}"}})
                   ["metadata"]["resourceVersion"])

    def delivered(name: str) -> None:  # the watch delivers the chunk as it is now, as the runtime does
        body = api.get("configmaps", "ns", name)
        cache.chunks.observe("MODIFIED", body)
        cache.chunks.delivered(body)

    log = EventLog(api.core(), "ns", "s")
    log.append("run.started", {"runId": "r1"})
    logview.observe(SESSION, EventLog(api.core(), "ns", "s"))
    hook = eventlog.on_chunk
    eventlog.on_chunk = None  # the harness writes, in its own process
    log.append("run.completed", {"runId": "r1"})
    EventLog(api.core(), "ns", "t").append("message", {"n": 1})
    eventlog.on_chunk = hook
    delivered("s-log-000001")  # older than the Checkpoint made next
    first = made()
    api.requests.clear()
    view = logview.observe(SESSION, EventLog(api.core(), "ns", "s"), time.monotonic(), first)
    assert reads(api) == ["get s-log-000001"] and view.digest.through == 2

    eventlog.on_chunk = None
    log.append("message", {"n": 3})
    eventlog.on_chunk = hook
    delivered("s-log-000001")
    second = made()
    eventlog.on_chunk = None
    EventLog(api.core(), "ns", "t").append("message", {"n": 2})  # another Session's, after it
    eventlog.on_chunk = hook
    delivered("t-log-000001")
    assert cache.chunks.delivered_through("ns") > second
    api.requests.clear()
    view = logview.observe(SESSION, EventLog(api.core(), "ns", "s"), time.monotonic(), second)
    assert reads(api) == [] and view.digest.through == 3
    assert not view.digest.summary()["run_in_flight"]

    third = made()  # after everything the watch delivered
    api.requests.clear()
    logview.observe(SESSION, EventLog(api.core(), "ns", "s"), time.monotonic(), third)
    assert reads(api) == ["get s-log-000001"]
    assert cache.chunks.delivered_through("other") == 0  # per namespace


def test_our_own_append_sent_after_the_checkpoint_arrived_serves_its_admission(api):
    """A write lands only on the newest chunk, and its answer is that chunk as it was after
    the write was sent: the admission of a checkpoint that arrived before then reads nothing.
    One sent before the checkpoint arrived is no such proof."""
    log = EventLog(api.core(), "ns", "s")
    log.append("run.started", {"runId": "r1"})
    logview.observe(SESSION, EventLog(api.core(), "ns", "s"))
    early = time.monotonic()
    hook = eventlog.on_chunk
    eventlog.on_chunk = None  # the harness writes, in its own process
    log.append("run.completed", {"runId": "r1"})  # its watch event not delivered yet
    eventlog.on_chunk = hook
    api.requests.clear()
    late = logview.observe(SESSION, EventLog(api.core(), "ns", "s"), fresh_after=early)
    assert reads(api) == ["get s-log-000001"] and late.digest.through == 2
    # The operator's own append (a checkpoint.created) after a second checkpoint arrived:
    arrived = time.monotonic()
    EventLog(api.core(), "ns", "s").append("checkpoint.created", {"checkpoint": "c1"})
    api.requests.clear()
    served = logview.observe(SESSION, EventLog(api.core(), "ns", "s"), fresh_after=arrived)
    assert reads(api) == [] and served.digest.through == 3
    # A checkpoint that arrived after that append needs a read of its own.
    after = time.monotonic()
    api.requests.clear()
    logview.observe(SESSION, EventLog(api.core(), "ns", "s"), fresh_after=after)
    assert reads(api) == ["get s-log-000001"]
