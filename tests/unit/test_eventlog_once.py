"""EventLog.append_once against the in-memory API: a retried writer's event is written once."""

from __future__ import annotations

from savepoint.eventlog import EventLog
from tests.unit.fake_api import FakeAPI


def test_an_event_already_after_the_cut_is_not_appended_again():
    api = FakeAPI()
    log = EventLog(api.core(), "ns", "s")
    log.append("user.message", {"text": "hi"})
    cut = log.cursor().seq

    def mine(event) -> bool:
        return event.type == "checkpoint.created" and event.data.get("uid") == "u1"

    first = log.append_once("checkpoint.created", {"uid": "u1"}, after=cut, same=mine)
    assert first is not None and first.seq == cut + 1
    again = EventLog(api.core(), "ns", "s")  # a retried pass, in a new process
    assert again.append_once("checkpoint.created", {"uid": "u1"}, after=cut, same=mine, newest_hint=1) is None
    assert [e.type for e in again.read()].count("checkpoint.created") == 1
    # Another checkpoint's event does not count as this one's.
    assert again.append_once("checkpoint.created", {"uid": "u2"}, after=cut, same=mine) is None
    other = again.append_once("checkpoint.created", {"uid": "u2"}, after=cut, same=lambda e: e.data.get("uid") == "u2")
    assert other is not None and other.seq == cut + 2


def test_the_check_reads_older_chunks_when_the_cut_is_before_the_newest():
    """Events after the cut spread over several chunks: found in an older one, not appended."""
    api = FakeAPI()
    log = EventLog(api.core(), "ns", "s", max_chunk_bytes=1024)
    log.append("user.message", {"text": "start"})
    log.append("checkpoint.created", {"uid": "u1"})
    for i in range(12):
        log.append("agent.message", {"text": "x" * 120, "i": i})
    assert len(log.chunk_names()) > 1
    fresh = EventLog(api.core(), "ns", "s", max_chunk_bytes=1024)
    assert (
        fresh.append_once("checkpoint.created", {"uid": "u1"}, after=1, same=lambda e: e.data.get("uid") == "u1")
        is None
    )
    written = fresh.append_once("checkpoint.created", {"uid": "u3"}, after=1, same=lambda e: e.data.get("uid") == "u3")
    assert written is not None and written.seq == 15


def mine(uid: str):
    return lambda event: event.type == "checkpoint.created" and event.data.get("uid") == uid


def test_a_seeded_append_writes_without_reading():
    api = FakeAPI()
    EventLog(api.core(), "ns", "s").append("user.message", {"text": "hi"})
    chunk = api.get("configmaps", "ns", "s-log-000001")
    log = EventLog(api.core(), "ns", "s")
    assert [e.seq for e in log.seed(chunk).events] == [1]
    api.requests.clear()
    assert log.append_once("checkpoint.created", {"uid": "u1"}, after=1, same=mine("u1")).seq == 2
    assert [r.verb for r in api.requests] == ["patch"]


def test_a_stale_seed_neither_loses_nor_repeats_the_event():
    """The watch's copy is older than the log: our event already landed after it (a retried
    pass), or another writer's did. The conditional write fails and a fresh read decides."""
    api = FakeAPI()
    writer = EventLog(api.core(), "ns", "s")
    writer.append("user.message", {"text": "hi"})
    stale = api.get("configmaps", "ns", "s-log-000001")
    writer.append("checkpoint.created", {"uid": "u1"})
    retried = EventLog(api.core(), "ns", "s")
    retried.seed(stale)
    assert retried.append_once("checkpoint.created", {"uid": "u1"}, after=1, same=mine("u1")) is None
    other = EventLog(api.core(), "ns", "s")
    other.seed(stale)
    written = other.append_once("checkpoint.created", {"uid": "u2"}, after=1, same=mine("u2"))
    assert written is not None and written.seq == 3
    assert [e.data.get("uid") for e in writer.read()] == [None, "u1", "u2"]


def test_a_seed_of_another_log_or_a_broken_chunk_is_refused():
    api = FakeAPI()
    EventLog(api.core(), "ns", "other").append("user.message", {})
    log = EventLog(api.core(), "ns", "s")
    assert log.seed(api.get("configmaps", "ns", "other-log-000001")) is None
    assert log.seed(None) is None
    assert log.newest_first_seq is None
