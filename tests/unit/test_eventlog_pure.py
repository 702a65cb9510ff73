"""The event log's pure parts: events, effective history, summaries. No cluster."""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys
import threading
import time

import pytest
import urllib3
from kubernetes.client.exceptions import ApiException

from savepoint.errors import EventTooDeep, EventTooLarge, HistoryUnavailable, MalformedChunk
from savepoint.eventlog import (
    MAX_EVENT_DEPTH,
    TOMBSTONE_KEY,
    Event,
    EventLog,
    _parse_chunk,
    effective_history,
    summarize,
)


def ev(seq: int, type: str = "message", **data) -> Event:
    return Event(seq, f"{seq:012d}-abc", type, "2030-01-01T00:00:00.000000Z", data)


def log(*types_and_data) -> list[Event]:
    """log("a", ("session.rollback", {"toSequence": 1})) -> events 1..n."""
    events = []
    for i, item in enumerate(types_and_data, start=1):
        type, data = (item, {}) if isinstance(item, str) else item
        events.append(ev(i, type, **data))
    return events


def seqs(events: list[Event]) -> list[int]:
    return [e.seq for e in events]


# ------------------------------------------------------------------- events


def test_event_json_round_trip():
    event = Event(
        7,
        "000000000007-0a1b2c3d4e5f",
        "user.message",
        "2030-01-02T03:04:05.000006Z",
        {"text": "héllo ✓", "n": [1, 2, {"x": None}]},
        subject="user:42",
    )
    text = event.to_json()
    assert Event.from_json(text) == event
    assert Event.from_json(text.encode()) == event
    assert json.loads(text)["subject"] == "user:42"
    no_subject = Event(1, "x", "t", "2030-01-01T00:00:00Z", {})
    assert "subject" not in json.loads(no_subject.to_json())
    assert Event.from_json(no_subject.to_json()).subject is None


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[]",
        '{"seq":0,"id":"x","type":"t","time":"t","data":{}}',
        '{"seq":true,"id":"x","type":"t","time":"t","data":{}}',
        '{"seq":1,"id":"","type":"t","time":"t","data":{}}',
        '{"seq":1,"id":"x","type":"t","time":"t","data":[]}',
        '{"seq":1,"id":"x","type":"t","time":"t","data":{},"subject":3}',
    ],
)
def test_event_from_json_refuses_what_it_did_not_write(text):
    with pytest.raises(ValueError):
        Event.from_json(text)


def test_erased_event_is_recognised():
    assert Event(1, "x", "t", "z", {TOMBSTONE_KEY: True}).erased
    assert not ev(1, text="hi").erased


def test_importable_without_kopf():
    code = "import sys, savepoint.eventlog; print('kopf' in sys.modules or 'prometheus_client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------- effective history


def test_no_rollback_is_the_whole_log():
    events = log("a", "b", "c")
    assert effective_history(events) == events


def test_one_rollback_closes_a_branch():
    events = log("a", "b", "c", "d", ("session.rollback", {"toSequence": 2}), "e")
    assert seqs(effective_history(events)) == [1, 2, 5, 6]


def test_two_nested_rollbacks():
    # 1 2 3 | rollback to 1 (4) | 5 6 | rollback to 5 (7) | 8
    events = log(
        "a", "b", "c", ("session.rollback", {"toSequence": 1}), "d", "e", ("session.rollback", {"toSequence": 5}), "f"
    )
    assert seqs(effective_history(events)) == [1, 4, 5, 7, 8]


def test_rollback_into_a_closed_branch_restores_that_branch():
    # A checkpoint at 3 is still live after a rollback to 1; rolling back to it brings
    # back the history as it was at 3.
    events = log(
        "a", "b", "c", ("session.rollback", {"toSequence": 1}), "d", ("session.rollback", {"toSequence": 3}), "e"
    )
    assert seqs(effective_history(events)) == [1, 2, 3, 6, 7]


def test_rollback_to_zero_and_invalid_targets():
    events = log("a", ("session.rollback", {"toSequence": 0}), "b")
    assert seqs(effective_history(events)) == [2, 3]
    # Forward, missing or erased targets: an ordinary event.
    for data in ({"toSequence": 5}, {}, {"toSequence": "1"}, {TOMBSTONE_KEY: True}):
        assert seqs(effective_history(log("a", "b", ("session.rollback", data)))) == [1, 2, 3]


def test_effective_history_is_idempotent_and_tolerates_gaps():
    events = log(
        "a", "b", "c", ("session.rollback", {"toSequence": 1}), "d", ("session.rollback", {"toSequence": 3}), "e"
    )
    once = effective_history(events)
    assert effective_history(once) == once
    # Events 1..2 gone (retention): the rollback to 3 still lands on 3.
    assert seqs(effective_history(events[2:])) == [3, 6, 7]
    # Rolling back to a missing seq lands on the newest event before it.
    gappy = [e for e in events if e.seq != 3]
    assert seqs(effective_history(gappy)) == [1, 2, 6, 7]


# --------------------------------------------------------------- summarize


def test_summarize_runs_by_id_and_by_order():
    assert summarize([]) == {"run_in_flight": False, "approval_pending": False, "runs": 0}
    events = log(("run.started", {"runId": "a"}), ("run.started", {"runId": "b"}), ("run.completed", {"runId": "b"}))
    assert summarize(events) == {"run_in_flight": True, "approval_pending": False, "runs": 1}
    events.append(ev(4, "run.completed", runId="a"))
    assert summarize(events) == {"run_in_flight": False, "approval_pending": False, "runs": 2}
    by_order = log("run.started", "run.completed", "run.started")
    assert summarize(by_order)["run_in_flight"] is True
    assert summarize(by_order)["runs"] == 1
    # A completion for an unknown id does not close another id's run.
    events = log(("run.started", {"runId": "a"}), ("run.completed", {"runId": "zzz"}))
    assert summarize(events)["run_in_flight"] is True


def test_summarize_counts_a_repeated_completion_once():
    events = log(("run.started", {"runId": "a"}), ("run.completed", {"runId": "a"}), ("run.completed", {"runId": "a"}))
    assert summarize(events) == {"run_in_flight": False, "approval_pending": False, "runs": 1}


def test_summarize_approvals():
    events = log(
        ("agent.approval_request", {"requestId": "q1"}),
        ("agent.approval_request", {"requestId": "q2"}),
        ("user.approval", {"requestId": "q1", "approved": True}),
    )
    assert summarize(events)["approval_pending"] is True
    events.append(ev(4, "user.approval", requestId="q2"))
    assert summarize(events)["approval_pending"] is False
    assert summarize(log("agent.approval_request", "user.approval"))["approval_pending"] is False


def test_summarize_uses_the_effective_history():
    # A run started on a branch that a rollback closed is not in flight.
    events = log(
        ("run.started", {"runId": "a"}),
        ("run.completed", {"runId": "a"}),
        ("run.started", {"runId": "b"}),
        ("session.rollback", {"toSequence": 2}),
    )
    assert summarize(events) == {"run_in_flight": False, "approval_pending": False, "runs": 1}


# ------------------------------------------------------------ chunk parsing


def chunk(data: dict[str, str], first: str | None = "1", name: str = "s-log-000001") -> dict:
    annotations = {"savepoint.dev/first-seq": first} if first is not None else {}
    return {"metadata": {"name": name, "resourceVersion": "9", "annotations": annotations}, "data": data}


def test_chunk_parsing_names_the_bad_key():
    good = ev(1).to_json()
    parsed = _parse_chunk(chunk({"000000000001": good}), 1)
    assert (parsed.first_seq, parsed.last_seq, parsed.sealed) == (1, 1, False)
    assert parsed.used == 12 + len(good.encode())
    with pytest.raises(MalformedChunk) as err:
        _parse_chunk(chunk({"000000000001": good, "oops": "{}"}), 1)
    assert (err.value.chunk, err.value.key) == ("s-log-000001", "oops")
    bad_value = _parse_chunk(chunk({"000000000001": "{not json"}), 1)
    with pytest.raises(MalformedChunk) as err:
        bad_value.event(1)
    assert err.value.key == "000000000001" and "s-log-000001" in str(err.value)
    with pytest.raises(MalformedChunk) as err:
        _parse_chunk(chunk({"000000000002": ev(3).to_json()}), 1).event(2)
    assert "seq 3" in str(err.value)
    with pytest.raises(MalformedChunk):
        _parse_chunk(chunk({}, first=None), 1)


def test_error_messages_say_what_and_why():
    assert "events 3..7" in str(HistoryUnavailable("s", 3, 7, "retention"))
    assert "retention" in str(HistoryUnavailable("s", 3, 7, "retention"))
    assert "erased" in str(HistoryUnavailable("s", 4, 4, "erasure"))
    too_large = EventTooLarge("note", 5000, 4096)
    assert "4096" in str(too_large) and "5000" in str(too_large)


def test_event_too_large_is_refused_before_any_request():
    elog = EventLog(core=None, namespace="ns", session="s", max_chunk_bytes=4096)
    with pytest.raises(EventTooLarge) as err:
        elog.append("note", {"text": "x" * 5000})
    assert err.value.limit == 4096 and err.value.size > 5000
    assert elog.chunk_name(1) == "s-log-000001"
    with pytest.raises(ValueError):
        EventLog(core=None, namespace="ns", session="s", max_chunk_bytes=2 * 1024 * 1024)
    with pytest.raises(ValueError):
        elog.append("note", {TOMBSTONE_KEY: True})


def _nested(depth: int) -> dict:
    data: dict = {}
    inner = data
    for _ in range(depth - 1):
        inner["a"] = [{}]
        inner = inner["a"][0]
    return data


def test_an_event_nested_too_deep_is_refused_naming_the_limit():
    elog = EventLog(core=None, namespace="ns", session="s")
    with pytest.raises(EventTooDeep) as err:
        elog.append("note", _nested(2000))  # was a bare RecursionError from the JSON encoder
    assert err.value.limit == MAX_EVENT_DEPTH and f"{MAX_EVENT_DEPTH} levels" in str(err.value)
    assert "'note'" in str(err.value)
    cycle: dict = {}
    cycle["self"] = cycle
    with pytest.raises(EventTooDeep):
        elog.append("note", cycle)


def test_an_event_at_the_depth_limit_is_stored():
    # _nested(n) has 2n-1 levels: each step is an object and a list.
    elog = EventLog(FakeCore(), "ns", "s")
    event = elog.append("note", _nested((MAX_EVENT_DEPTH + 1) // 2))
    assert elog.read() == [event]


def test_a_hand_edited_value_below_a_writer_stops_it_until_repaired():
    core = FakeCore()
    elog = EventLog(core, "ns", "s")
    written = [elog.append("note", {"n": n}) for n in (1, 2, 3)]
    chunk = core.objects["s-log-000001"]
    key = f"{written[1].seq:012d}"
    original = chunk["data"][key]
    chunk["data"][key] = '{"seq": "two"'
    chunk["metadata"]["resourceVersion"] = "edited"  # the writer's cached copy is stale now
    for writer in (elog, EventLog(core, "ns", "s")):  # the same writer, and a new one
        with pytest.raises(MalformedChunk) as err:
            writer.append("note", {"n": 4})
        assert err.value.chunk == "s-log-000001" and err.value.key == key
    assert sorted(chunk["data"]) == [f"{n:012d}" for n in (1, 2, 3)]  # nothing written around it
    chunk["data"][key] = original
    after = elog.append("note", {"n": 5})
    assert [e.data["n"] for e in elog.read()] == [1, 2, 3, 5] and after.seq == 4


# ------------------------------------- the write protocol, on an in-memory API server


class _Reply:
    def __init__(self, obj: dict) -> None:
        self.data = json.dumps(obj).encode()


class FakeCore:
    """Just enough of CoreV1Api's ConfigMap calls, with real resourceVersion semantics."""

    def __init__(self) -> None:
        self.objects: dict[str, dict] = {}
        self.version = 0
        self.lock = threading.Lock()

    def _stamp(self, obj: dict) -> _Reply:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        return _Reply(obj)

    def list_namespaced_config_map(self, namespace, label_selector, **_):
        key, value = label_selector.split("=")
        with self.lock:
            items = [
                copy.deepcopy(o) for _, o in sorted(self.objects.items()) if o["metadata"]["labels"].get(key) == value
            ]
        return _Reply({"items": items, "metadata": {}})

    def read_namespaced_config_map(self, name, namespace, **_):
        time.sleep(random.uniform(0, 0.001))  # let other writers in between read and write
        with self.lock:
            if name not in self.objects:
                raise ApiException(status=404)
            return _Reply(self.objects[name])

    def create_namespaced_config_map(self, namespace, body, **_):
        with self.lock:
            if body["metadata"]["name"] in self.objects:
                raise ApiException(status=409, reason="AlreadyExists")
            obj = copy.deepcopy(body)
            self.objects[obj["metadata"]["name"]] = obj
            return self._stamp(obj)

    def patch_namespaced_config_map(self, name, namespace, body, **_):
        with self.lock:
            obj = self.objects.get(name)
            if obj is None:
                raise ApiException(status=404)
            if body["metadata"].get("resourceVersion") != obj["metadata"]["resourceVersion"]:
                raise ApiException(status=409, reason="Conflict")
            obj["metadata"].setdefault("annotations", {}).update(body["metadata"].get("annotations", {}))
            obj.setdefault("data", {}).update(body.get("data", {}))
            return self._stamp(obj)

    def delete_namespaced_config_map(self, name, namespace, **_):
        with self.lock:
            if self.objects.pop(name, None) is None:
                raise ApiException(status=404)


class FlakyCore(FakeCore):
    """Loses replies: some writes are applied and then fail, some fail unapplied."""

    def _flaky(self, call, *args, **kwargs):
        roll = random.random()
        if roll < 0.1:
            raise urllib3.exceptions.ProtocolError("connection reset before the request")
        result = call(*args, **kwargs)
        if roll > 0.9:
            raise urllib3.exceptions.ReadTimeoutError(None, "/", "reply lost")
        return result

    def create_namespaced_config_map(self, *args, **kwargs):
        return self._flaky(super().create_namespaced_config_map, *args, **kwargs)

    def patch_namespaced_config_map(self, *args, **kwargs):
        return self._flaky(super().patch_namespaced_config_map, *args, **kwargs)


def _hammer(core: FakeCore, writers: int, per_writer: int) -> list[Event]:
    def write(w: int) -> None:
        elog = EventLog(core, "ns", "s", max_chunk_bytes=1024)
        for i in range(per_writer):
            elog.append("note", {"writer": w, "i": i, "pad": "p" * 60})

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = EventLog(core, "ns", "s", max_chunk_bytes=1024).read()
    assert [e.seq for e in events] == list(range(1, writers * per_writer + 1))
    pairs = [(e.data["writer"], e.data["i"]) for e in events]
    for w in range(writers):
        assert [i for who, i in pairs if who == w] == list(range(per_writer))
    names = sorted(core.objects)
    for name in names:
        cm = core.objects[name]
        assert sum(len(k) + len(v.encode()) for k, v in cm["data"].items()) <= 1024
        sealed = cm["metadata"]["annotations"].get("savepoint.dev/sealed") == "true"
        assert sealed == (name != names[-1])
    return events


def test_concurrent_appends_with_rollovers_on_a_fake_api():
    events = _hammer(FakeCore(), writers=8, per_writer=60)
    assert len(events) == 480


def test_lost_replies_neither_lose_nor_repeat_events():
    random.seed(7)
    events = _hammer(FlakyCore(), writers=4, per_writer=40)
    assert len({e.id for e in events}) == 160


def test_small_events_roll_over_early_and_a_big_one_gets_a_chunk_of_its_own():
    core = FakeCore()
    elog = EventLog(core, "ns", "s", max_chunk_bytes=8192, rollover_bytes=2048)
    small = [elog.append("note", {"pad": "p" * 200}) for _ in range(20)]
    big = elog.append("note", {"pad": "b" * 6000})
    after = elog.append("note", {"pad": "p" * 200})
    assert elog.read() == [*small, big, after]
    used = {name: sum(len(k) + len(v.encode()) for k, v in cm["data"].items()) for name, cm in core.objects.items()}
    holding = {name: sorted(cm["data"]) for name, cm in core.objects.items()}
    [big_chunk] = [name for name, keys in holding.items() if f"{big.seq:012d}" in keys]
    assert holding[big_chunk] == [f"{big.seq:012d}"] and 6000 < used[big_chunk] <= 8192
    assert all(size <= 2048 for name, size in used.items() if name != big_chunk)
    assert len(core.objects) >= 4


def test_retention_deletes_a_sealed_prefix_counts_it_and_never_the_chunk_being_written(monkeypatch):
    from datetime import UTC, datetime, timedelta

    from savepoint import eventlog

    core = FakeCore()
    elog = EventLog(core, "ns", "s", max_chunk_bytes=1024)
    for i in range(12):
        elog.append("note", {"i": i, "pad": "p" * 300})
    names = sorted(core.objects)
    assert len(names) >= 4
    sizes = {n: sum(len(k) + len(v.encode()) for k, v in core.objects[n]["data"].items()) for n in names}
    seen: list[tuple[str, int]] = []
    monkeypatch.setattr(eventlog, "on_retention", lambda name, size: seen.append((name, size)))
    assert elog.apply_retention(timedelta(hours=1)) == [] and elog.retained_from == 1
    later = datetime.now(UTC) + timedelta(hours=2)  # every event is older than the window now
    deleted = elog.apply_retention(timedelta(hours=1), now=later)
    assert deleted == names[:-1] and sorted(core.objects) == names[-1:]
    assert seen == [(n, sizes[n]) for n in names[:-1]]
    newest = core.objects[names[-1]]
    assert elog.retained_from == int(newest["metadata"]["annotations"]["savepoint.dev/first-seq"])
    with pytest.raises(HistoryUnavailable) as err:
        elog.read()
    assert (err.value.from_seq, err.value.to_seq, err.value.reason) == (1, elog.retained_from - 1, "retention")
    assert elog.append("note", {"i": 12}).seq == 13  # appending goes on
