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
