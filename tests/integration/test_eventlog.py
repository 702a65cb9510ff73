"""The event log against a real API server: storage, concurrency, retention, erasure, copy."""

from __future__ import annotations

import multiprocessing
import os
import time
from datetime import UTC, datetime, timedelta

import pytest
import urllib3
from kubernetes import client, config

from savepoint.errors import (
    EventLogError,
    EventTooLarge,
    HistoryUnavailable,
    MalformedChunk,
    SequenceOutOfRange,
)
from savepoint.eventlog import TOMBSTONE_KEY, Cursor, EventLog

SMALL = 4096  # bytes per chunk: a handful of events, so rollovers happen all the time


def chunks(core: client.CoreV1Api, namespace: str, session: str) -> list[client.V1ConfigMap]:
    items = core.list_namespaced_config_map(namespace, label_selector=f"savepoint.dev/session={session}").items
    return sorted(items, key=lambda cm: cm.metadata.name)


def test_append_read_cursor_and_layout(core, namespace):
    owner_cm = core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}, "data": {}})
    owner = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner_cm.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    log = EventLog(core, namespace, "s1", owner=owner)
    assert log.cursor() == Cursor(0, "")
    assert log.read() == []
    log.ensure()
    log.ensure()
    assert log.chunk_names() == ["s1-log-000001"]
    assert log.cursor() == Cursor(0, "")

    a = log.append("run.started", {"runId": "r1"})
    b = log.append("user.message", {"text": "héllo"}, subject="user:1")
    assert (a.seq, b.seq) == (1, 2) and a.id < b.id
    assert log.read() == [a, b]
    assert log.read(2) == [b] and log.read(1, 1) == [a] and log.read(3) == []
    assert log.cursor() == Cursor(2, b.id)
    with pytest.raises(SequenceOutOfRange):
        log.read(1, 3)

    # Another client, as a harness in the sandbox would be, continues the same log.
    c = EventLog(core, namespace, "s1").append("run.completed", {"runId": "r1"})
    assert c.seq == 3 and log.append("note", {}).seq == 4

    [cm] = chunks(core, namespace, "s1")
    assert cm.metadata.name == "s1-log-000001"
    assert cm.metadata.labels == {"savepoint.dev/session": "s1", "app.kubernetes.io/managed-by": "savepoint"}
    assert cm.metadata.annotations["savepoint.dev/first-seq"] == "1"
    assert cm.metadata.owner_references[0].uid == owner_cm.metadata.uid
    assert cm.data["000000000002"] == b.to_json()
    assert sorted(cm.data) == [f"{i:012d}" for i in range(1, 5)]

    log.delete()
    log.delete()
    assert log.chunk_names() == [] and log.read() == []
    assert core.read_namespaced_config_map("owner", namespace)  # only log chunks go


def test_rollover_keeps_chunks_small_and_the_log_whole(core, namespace):
    log = EventLog(core, namespace, "s1", max_chunk_bytes=SMALL)
    events = [log.append("note", {"i": i, "pad": "x" * 300}) for i in range(30)]
    events += log.append_many(("note", {"i": i, "pad": "x" * 300}) for i in range(30, 60))
    assert [e.seq for e in events] == list(range(1, 61))

    cms = chunks(core, namespace, "s1")
    assert len(cms) >= 5
    expected_first = 1
    for i, cm in enumerate(cms, start=1):
        assert cm.metadata.name == f"s1-log-{i:06d}"
        assert sum(len(k) + len(v.encode()) for k, v in cm.data.items()) <= SMALL
        assert int(cm.metadata.annotations["savepoint.dev/first-seq"]) == expected_first
        expected_first += len(cm.data)
        sealed = (cm.metadata.annotations or {}).get("savepoint.dev/sealed") == "true"
        assert sealed == (i < len(cms))

    assert log.read() == events
    assert EventLog(core, namespace, "s1").read(15, 45) == events[14:45]
    paged = EventLog(core, namespace, "s1")
    paged._page = 2  # several list pages, fetched ahead while parsing
    assert paged.read() == events
    assert log.cursor() == Cursor(60, events[-1].id)


def test_a_crash_between_seal_and_create_is_repaired_by_the_next_writer(core, namespace):
    log = EventLog(core, namespace, "s1")
    log.append("note", {"n": 1})
    core.patch_namespaced_config_map(
        "s1-log-000001", namespace, {"metadata": {"annotations": {"savepoint.dev/sealed": "true"}}}
    )
    fresh = EventLog(core, namespace, "s1")
    assert fresh.append("note", {"n": 2}).seq == 2
    assert fresh.chunk_names() == ["s1-log-000001", "s1-log-000002"]
    assert [e.data["n"] for e in log.read()] == [1, 2]


def test_a_write_that_landed_but_was_not_acknowledged_is_not_repeated(core, namespace):
    log = EventLog(core, namespace, "s1")
    log.append("note", {"n": 0})
    real_patch = log._patch
    calls = []

    def lost_reply(chunk, patch):
        calls.append(1)
        result = real_patch(chunk, patch)
        if len(calls) == 1:
            raise urllib3.exceptions.ReadTimeoutError(None, "/", "read timed out")
        return result

    log._patch = lost_reply
    event = log.append("note", {"n": 1})
    assert event.seq == 2
    assert [e.data["n"] for e in log.read()] == [0, 1]

    calls.clear()

    def no_reply_nothing_done(chunk, patch):
        calls.append(1)
        if len(calls) == 1:
            raise urllib3.exceptions.ProtocolError("connection reset")
        return real_patch(chunk, patch)

    log._patch = no_reply_nothing_done
    assert log.append("note", {"n": 2}).seq == 3
    assert len(calls) == 2
    assert [e.data["n"] for e in log.read()] == [0, 1, 2]


def _writer(kubeconfig, namespace, session, writer, count, start, results):
    api = config.new_client_from_config(config_file=kubeconfig)
    log = EventLog(client.CoreV1Api(api), namespace, session, max_chunk_bytes=SMALL)
    start.wait()
    began = time.monotonic()
    for i in range(count):
        log.append("note", {"writer": writer, "i": i, "pad": "y" * 200})
    results.put((writer, log.conflicts, time.monotonic() - began))


def test_concurrent_writers_in_separate_processes(kubeconfig, core, namespace):
    # The figure: 8 processes x 500 events (SAVEPOINT_LOG_RACE=WxN for a quicker run).
    writers, per_writer = (int(n) for n in os.environ.get("SAVEPOINT_LOG_RACE", "8x500").split("x"))
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_writer, args=(kubeconfig, namespace, "s1", w, per_writer, start, results))
        for w in range(writers)
    ]
    for proc in procs:
        proc.start()
    time.sleep(3)  # let every process import and connect before the race starts
    began = time.monotonic()
    start.set()
    for proc in procs:
        proc.join(timeout=1200)
        assert proc.exitcode == 0, f"writer process exited with {proc.exitcode}"
    elapsed = time.monotonic() - began
    stats = [results.get(timeout=5) for _ in procs]

    log = EventLog(core, namespace, "s1")
    events = log.read()
    total = writers * per_writer
    assert [e.seq for e in events] == list(range(1, total + 1))
    assert len({e.id for e in events}) == total
    pairs = [(e.data["writer"], e.data["i"]) for e in events]
    assert sorted(pairs) == [(w, i) for w in range(writers) for i in range(per_writer)]
    for w in range(writers):
        assert [i for who, i in pairs if who == w] == list(range(per_writer))
    assert len(log.chunk_names()) > 10
    conflicts = sum(s[1] for s in stats)
    print(
        f"\n{total} appends by {writers} processes in {elapsed:.2f}s "
        f"({total / elapsed:.0f}/s), {conflicts} conflicts, {len(log.chunk_names())} chunks"
    )


def test_retention_deletes_old_chunks_and_reads_over_the_gap_fail(core, namespace):
    log = EventLog(core, namespace, "s1", max_chunk_bytes=SMALL)
    for i in range(25):
        log.append("note", {"i": i, "pad": "x" * 300})
    assert log.apply_retention(timedelta(hours=1)) == []
    time.sleep(1.5)
    fresh_first = log.append("note", {"pad": "x" * 3500})  # fits only an empty chunk: rolls over
    names_before = log.chunk_names()
    assert len(names_before) >= 3
    deleted = log.apply_retention(timedelta(seconds=1))
    assert deleted == names_before[:-1]
    assert log.chunk_names() == names_before[-1:]
    with pytest.raises(HistoryUnavailable) as err:
        log.read()
    assert (err.value.reason, err.value.from_seq, err.value.to_seq) == ("retention", 1, fresh_first.seq - 1)
    assert "retention" in str(err.value) and f"1..{fresh_first.seq - 1}" in str(err.value)
    with pytest.raises(HistoryUnavailable):
        log.read(2, fresh_first.seq)
    assert log.read(fresh_first.seq) == [fresh_first]
    assert log.read(partial=True) == [fresh_first]
    assert log.append("note", {}).seq == fresh_first.seq + 1
    # The newest chunk is never deleted, however old.
    later = datetime.now(UTC) + timedelta(days=30)
    assert log.apply_retention(timedelta(seconds=1), now=later) == []


def test_erase_tombstones_a_subject(core, namespace):
    log = EventLog(core, namespace, "s1", max_chunk_bytes=SMALL)
    for i in range(20):
        log.append(
            "user.message", {"text": f"secret {i}", "pad": "x" * 200}, subject="alice" if i in (3, 4, 15) else "bob"
        )
    assert log.erase("alice") == 3
    assert log.erase("alice") == 0
    with pytest.raises(HistoryUnavailable) as err:
        log.read()
    assert (err.value.reason, err.value.from_seq, err.value.to_seq) == ("erasure", 4, 5)
    assert "erased" in str(err.value)
    with pytest.raises(HistoryUnavailable) as err:
        log.read(6)
    assert (err.value.from_seq, err.value.to_seq) == (16, 16)
    assert len(log.read(6, 15)) == 10
    events = log.read(partial=True)
    assert [e.seq for e in events] == list(range(1, 21))
    erased = [e for e in events if e.erased]
    assert [e.seq for e in erased] == [4, 5, 16]
    assert all(e.data == {TOMBSTONE_KEY: True} and e.type == "user.message" for e in erased)
    assert all("secret" in e.data["text"] for e in events if e.subject == "bob")
    raw = "".join(v for cm in chunks(core, namespace, "s1") for v in cm.data.values())
    assert "secret 3" not in raw and "secret 15" not in raw


def test_event_too_large_names_the_limit(core, namespace):
    log = EventLog(core, namespace, "s1", max_chunk_bytes=SMALL)
    with pytest.raises(EventTooLarge) as err:
        log.append("note", {"blob": "y" * 5000})
    assert str(SMALL) in str(err.value) and err.value.limit == SMALL
    assert log.chunk_names() == []
    log.append("note", {"blob": "y" * 100})
    big = log.append("note", {"blob": "y" * 3800})  # fits only an empty chunk
    assert big.seq == 2 and log.chunk_names() == ["s1-log-000001", "s1-log-000002"]


def test_malformed_chunk_names_chunk_and_key_and_spares_other_sessions(core, namespace):
    bad, good = EventLog(core, namespace, "s1"), EventLog(core, namespace, "s1-log")
    for log in (bad, good):
        log.append("note", {"n": 1})
        log.append("note", {"n": 2})
    core.patch_namespaced_config_map("s1-log-000001", namespace, {"data": {"000000000001": "{not json"}})
    with pytest.raises(MalformedChunk) as err:
        bad.read()
    assert (err.value.chunk, err.value.key) == ("s1-log-000001", "000000000001")
    assert "s1-log-000001" in str(err.value) and "000000000001" in str(err.value)
    assert [e.data["n"] for e in good.read()] == [1, 2]
    assert good.append("note", {"n": 3}).seq == 3

    core.patch_namespaced_config_map("s1-log-log-000001", namespace, {"data": {"hello": "{}"}})
    with pytest.raises(MalformedChunk) as err:
        good.read()
    assert (err.value.chunk, err.value.key) == ("s1-log-log-000001", "hello")
    with pytest.raises(MalformedChunk):
        good.append("note", {})
    assert bad.read(2) == bad.read(2, 2)  # the bad key is outside this range


def test_start_from_writes_a_new_log_without_reading_it_and_never_over_one_there(core, namespace):
    src = EventLog(core, namespace, "origin", max_chunk_bytes=SMALL)
    events = [src.append("note", {"i": i, "pad": "z" * 250}, subject=f"s{i % 3}") for i in range(30)]
    new = EventLog(core, namespace, "child", max_chunk_bytes=SMALL)

    def listed(*_: object) -> None:
        raise AssertionError("a new log was listed")

    new._list_meta = listed  # type: ignore[method-assign]
    new._list_chunks = listed  # type: ignore[method-assign]
    written = new.start_from(src, 20, "session.forked", {"from": "origin"})
    assert written is not None and written[:20] == events[:20]
    assert (written[20].seq, written[20].type) == (21, "session.forked")
    assert len(chunks(core, namespace, "child")) > 1  # the prefix spans chunks, each made unread
    assert EventLog(core, namespace, "child").read() == written

    # A log with a chunk already (a restart after the write): nothing is written over it.
    again = EventLog(core, namespace, "child", max_chunk_bytes=SMALL)
    assert again.start_from(src, 20, "session.forked", {"from": "origin"}) is None
    assert again.read() == written
    assert src.copy_to(again, 20) == again.cursor() == Cursor(21, written[20].id)


def test_copy_to_copies_a_prefix_idempotently(core, namespace):
    src = EventLog(core, namespace, "src", max_chunk_bytes=SMALL)
    events = [src.append("note", {"i": i, "pad": "z" * 250}, subject=f"s{i % 3}") for i in range(40)]

    dst = EventLog(core, namespace, "dst", max_chunk_bytes=8192)
    assert src.copy_to(dst, 25) == Cursor(25, events[24].id)
    assert dst.read() == events[:25]
    assert src.copy_to(dst, 25) == Cursor(25, events[24].id)
    assert dst.read() == events[:25]
    forked = dst.append("session.forked", {"from": "src", "throughSequence": 25})
    assert forked.seq == 26
    assert src.copy_to(dst, 25) == Cursor(26, forked.id)  # the target went on: done, at its own end

    # Interrupted midway (a crash after the first write), then resumed.
    part = EventLog(core, namespace, "part", max_chunk_bytes=SMALL)
    real_patch, real_create = part._patch, part._create
    writes = []

    def crash_after_two(real):
        def wrapped(*args):
            writes.append(1)
            if len(writes) > 2:
                raise RuntimeError("operator restarted")
            return real(*args)

        return wrapped

    part._patch, part._create = crash_after_two(real_patch), crash_after_two(real_create)
    with pytest.raises(RuntimeError):
        src.copy_to(part, 40)
    partial = part.read()
    assert 0 < len(partial) < 40 and partial == events[: len(partial)]
    part._patch, part._create = real_patch, real_create
    assert src.copy_to(part, 40) == Cursor(40, events[-1].id)
    assert part.read() == events

    other = EventLog(core, namespace, "other")
    other.append("note", {})
    with pytest.raises(EventLogError, match="different event"):
        src.copy_to(other, 5)
    with pytest.raises(SequenceOutOfRange):
        src.copy_to(EventLog(core, namespace, "x1"), 41)
    src.erase("s1")
    with pytest.raises(HistoryUnavailable):
        src.copy_to(EventLog(core, namespace, "x2"), 10)
    assert src.copy_to(EventLog(core, namespace, "x3"), 0) == Cursor(0, "")
