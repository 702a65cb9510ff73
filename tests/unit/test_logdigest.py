"""The log digest folds a log event by event into what the whole-log functions derive from
all of it: random logs split at random points, then a few conversations by name. No cluster."""

from __future__ import annotations

import random
from typing import Any

import pytest

from savepoint.eventlog import TOMBSTONE_KEY, Event, effective_history, summarize
from savepoint.logdigest import Digest, history_through
from savepoint.models import SessionPhase
from savepoint.session import activity
from savepoint.usage import derive_usage

BASE = "2030-01-01T00:{:02d}:{:02d}.{:06d}Z"


# The whole-log reference the digest is checked against (its read-out replaced it in the
# Session controller).
def latest_checkpoint(events: list) -> str | None:
    """The checkpoint named by the log's newest checkpoint.created of this session.

    The whole log, not the effective history: a checkpoint cut on a branch a rollback
    closed was still the newest one taken. A fork's log starts with its parent's prefix,
    whose checkpoints are the parent's: those end at session.forked.
    """
    for event in reversed(events):
        if event.type == "session.forked":
            return None
        if event.type == "checkpoint.created":
            return event.data.get("checkpoint")
    return None


def at(ms: int) -> str:
    seconds, micro = divmod(ms * 1000, 1_000_000)
    return BASE.format(seconds // 60, seconds % 60, micro)


def ev(seq: int, type: str, ms: int = 0, **data: Any) -> Event:
    return Event(seq, f"{seq:012d}-abc", type, at(ms), data)


# ---------------------------------------------------------------- random logs


def _ident(rng: random.Random) -> Any:
    # Few ids, so they repeat; an int is an id too, a bool is none.
    return rng.choice([None, None, "a", "b", "c", 1, True])


def _with(data: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    return data if value is None else {**data, key: value}


def _data(rng: random.Random, kind: str, seq: int) -> dict[str, Any]:
    if kind in ("run.started", "run.completed"):
        return _with({}, "runId", _ident(rng))
    if kind == "agent.approval_request":
        return _with({}, "requestId", _ident(rng))
    if kind == "user.approval":
        data = _with({}, "requestId", _ident(rng))
        return _with(data, "approved", rng.choice([True, False, None, "yes", 1]))
    if kind == "checkpoint.created":
        return _with({}, "checkpoint", rng.choice([None, "cp-a", "cp-b", f"cp-{seq}"]))
    if kind == "session.rollback":
        target = rng.choice(["valid", "valid", seq, seq + 3, -1, True, "2", None])
        return _with({}, "toSequence", rng.randrange(seq) if target == "valid" else target)
    if kind == "agent.message" and rng.random() < 0.7:
        spent: dict[str, Any] = {}
        for key in ("inputTokens", "outputTokens", "llmCalls"):
            value = rng.choice([None, 0, 3, 250, -4, True, "7", 2**70])
            spent = _with(spent, key, value)
        return {"usage": spent}
    return {}


KINDS = [
    "run.started",
    "run.completed",
    "agent.approval_request",
    "user.approval",
    "user.interrupt",
    "agent.message",
    "checkpoint.created",
    "session.forked",
    "session.rollback",
    "user.message",
]
WEIGHTS = [6, 5, 3, 3, 1, 5, 2, 1, 1, 3]


def random_log(rng: random.Random) -> list[Event]:
    events = []
    ms = 0
    for seq in range(1, rng.randrange(0, 60) + 1):
        kind = rng.choices(KINDS, WEIGHTS)[0]
        ms += rng.randrange(-200, 5000)  # writers' clocks disagree now and then
        data = _data(rng, kind, seq)
        if rng.random() < 0.05:
            data = {TOMBSTONE_KEY: True}  # erased: its type stays
        time = at(max(ms, 0)) if rng.random() > 0.02 else "not a time"
        events.append(Event(seq, f"{seq:012d}-{rng.randrange(16**4):04x}", kind, time, data))
    return events


def has_valid_rollback(events: list[Event]) -> bool:
    for e in events:
        target = e.data.get("toSequence")
        if e.type == "session.rollback" and type(target) is int and 0 <= target < e.seq:
            return True
    return False


def reference(events: list[Event]) -> dict[str, Any]:
    """What a Session pass derived from the whole log before the digest."""
    history = effective_history(events)
    completed = [e.seq for e in history if e.type == "run.completed"]
    return {
        "summary": summarize(history),
        "activity": activity(events),
        "usage": derive_usage(events),
        "latest_checkpoint": latest_checkpoint(events),
        "last_run_completed": completed[-1] if completed else 0,
        "cursor": (events[-1].seq, events[-1].id) if events else (0, ""),
        "last_time": events[-1].time if events else None,
    }


def read_out(digest: Digest) -> dict[str, Any]:
    return {
        "summary": digest.summary(),
        "activity": digest.activity(),
        "usage": digest.usage(),
        "latest_checkpoint": digest.latest_checkpoint,
        "last_run_completed": digest.last_run_completed,
        "cursor": digest.cursor,
        "last_time": digest.last_time,
    }


LOGS = [random_log(random.Random(seed)) for seed in range(400)]


@pytest.mark.parametrize("seed", range(len(LOGS)))
def test_a_random_log_folded_from_any_split_reads_out_as_the_whole_log(seed):
    rng = random.Random(10_000 + seed)
    events = LOGS[seed]
    whole = Digest.of(events)
    assert read_out(whole) == reference(events)
    for split in {0, len(events), *(rng.randrange(len(events) + 1) for _ in range(4))}:
        head, rest = events[:split], events[split:]
        before = Digest.of(head)
        folded = before.fold(rest)
        assert before == Digest.of(head)  # fold changed nothing of the digest it started from
        if has_valid_rollback(rest):
            assert folded is None
            continue
        assert folded == whole
        assert read_out(folded) == read_out(whole)
        # A chunk read again holds events folded already: they are skipped.
        again = events[rng.randrange(split + 1) :]
        assert before.fold(again) == whole


@pytest.mark.parametrize("seed", range(0, len(LOGS), 4))
def test_a_rollback_folded_onto_the_history_through_its_target_reads_out_as_the_whole_log(seed):
    """A rollback's hand-back keeps the Session's digest without reading the log again: the
    history through the target (read while the claim restored) and the digest kept before
    the rollback event give the same read-out as the whole log with the rollback in it."""
    rng = random.Random(20_000 + seed)
    events = LOGS[seed]
    before = Digest.of(events)
    for target in {0, len(events) // 2, *(rng.randrange(len(events) + 1) for _ in range(3))}:
        rollback = ev(len(events) + 1, "session.rollback", ms=99_000, toSequence=target)
        rolled = before.roll_back(rollback, history_through(events, target))
        assert rolled is not None
        assert read_out(rolled) == reference([*events, rollback]) == read_out(Digest.of([*events, rollback]))
        after = ev(len(events) + 2, "run.started", runId="z")
        folded = rolled.fold([after])
        assert folded is not None
        assert read_out(folded) == reference([*events, rollback, after])


def test_roll_back_takes_only_the_next_event_and_a_rollback_that_rewrites_the_history():
    events = [ev(1, "run.started", runId="r1"), ev(2, "run.completed", runId="r1")]
    digest, target = Digest.of(events), history_through(events, 1)
    assert digest.roll_back(ev(4, "session.rollback", toSequence=1), target) is None  # not the next one
    assert digest.roll_back(ev(3, "session.rollback", toSequence=3), target) is None  # no valid target
    assert digest.roll_back(ev(3, "user.message"), target) is None
    rolled = digest.roll_back(ev(3, "session.rollback", toSequence=1), target)
    assert rolled is not None and rolled.summary()["run_in_flight"] and rolled.usage()["runs"] == 1


@pytest.mark.parametrize("seed", range(0, len(LOGS), 10))
def test_pass_after_pass_a_fold_or_a_rebuild_keeps_up_with_the_log(seed):
    """The controller's use: each pass folds what the log gained, rebuilding after a rollback."""
    rng = random.Random(20_000 + seed)
    events = LOGS[seed]
    digest = Digest()
    read = 0
    while read < len(events):
        read = min(len(events), read + rng.randrange(1, 8))
        digest = digest.fold(events[max(0, read - 10) : read]) or Digest.of(events[:read])
        assert read_out(digest) == reference(events[:read])


def test_the_random_logs_cover_the_cases_that_matter():
    folded = rebuilt = 0
    kinds: set[str] = set()
    for events in LOGS:
        kinds.update(e.type for e in events)
        rest = events[len(events) // 2 :]
        if has_valid_rollback(rest):
            rebuilt += 1
        elif has_valid_rollback(events):
            folded += 1  # a rollback before the split: the fold extends a rewritten history
    assert kinds == set(KINDS)
    assert folded > 20 and rebuilt > 20


# ---------------------------------------------------------------- named cases


def test_a_run_open_across_the_split_is_timed_when_it_completes():
    digest = Digest.of([ev(1, "user.message"), ev(2, "run.started", 1000, runId="r1")])
    assert digest.activity() == SessionPhase.RUNNING
    assert digest.summary() == {"run_in_flight": True, "approval_pending": False, "runs": 0}
    folded = digest.fold([ev(3, "agent.message", 2000), ev(4, "run.completed", 4500, runId="r1")])
    assert folded is not None
    assert folded.activity() == SessionPhase.READY
    assert folded.summary() == {"run_in_flight": False, "approval_pending": False, "runs": 1}
    assert folded.usage()["runDurationMs"] == {"p50": 3500, "max": 3500}
    assert folded.last_run_completed == 4
    assert folded.cursor == (4, "000000000004-abc")
    assert folded.last_time == at(4500)
    assert digest.activity() == SessionPhase.RUNNING  # the old digest is as it was


def test_an_approval_answered_after_the_split_ends_the_wait():
    digest = Digest.of([ev(1, "run.started", 0), ev(2, "agent.approval_request", 1000, requestId="q1")])
    assert digest.activity() == SessionPhase.AWAITING_APPROVAL
    folded = digest.fold([ev(3, "user.approval", 3000, requestId="q1", approved=True)])
    assert folded is not None
    assert folded.activity() == SessionPhase.RUNNING
    assert folded.usage()["approvals"] == {"requested": 1, "approved": 1, "denied": 0, "waitMsTotal": 2000}


def test_a_fork_after_the_split_resets_usage_and_the_latest_checkpoint():
    head = [
        ev(1, "run.started", 0, runId="r1"),
        ev(2, "agent.message", 100, usage={"inputTokens": 10, "outputTokens": 5}),
        ev(3, "checkpoint.created", 200, checkpoint="parent-cp"),
    ]
    digest = Digest.of(head)
    assert digest.latest_checkpoint == "parent-cp"
    assert digest.usage()["tokens"]["total"] == 15
    rest = [ev(4, "session.forked", 300), ev(5, "agent.message", 400, usage={"inputTokens": 1})]
    folded = digest.fold(rest)
    assert folded is not None
    assert folded.latest_checkpoint is None
    assert folded.usage() == derive_usage(head + rest)
    assert folded.usage()["tokens"] == {"input": 1, "output": 0, "total": 1}
    assert folded.usage()["llmCalls"] == 1
    # The conversation is the parent's too: its open run is still in flight.
    assert folded.activity() == SessionPhase.RUNNING
    later = folded.fold([ev(6, "checkpoint.created", 500, checkpoint="own-cp")])
    assert later is not None and later.latest_checkpoint == "own-cp"


def test_an_empty_log():
    empty = Digest.of([])
    assert empty == Digest()
    assert read_out(empty) == reference([])
    assert empty.fold([]) is empty
    events = [ev(1, "run.started"), ev(2, "run.completed")]
    assert Digest().fold(events) == Digest.of(events)


def test_only_a_rollback_the_history_honours_needs_the_whole_log():
    digest = Digest.of([ev(1, "run.started", runId="r1"), ev(2, "run.completed", runId="r1")])
    assert digest.fold([ev(3, "session.rollback", toSequence=1)]) is None
    assert digest.fold([ev(3, "session.rollback", toSequence=0)]) is None
    for invalid in (3, 7, -1, True, "1", None):
        events = [ev(3, "session.rollback", toSequence=invalid)]
        assert digest.fold(events) is not None, invalid


def test_after_a_rollback_the_log_folds_onto_the_rewritten_history():
    events = [
        ev(1, "run.started", runId="r1"),
        ev(2, "run.completed", runId="r1"),
        ev(3, "run.started", runId="r2"),  # a closed branch: in flight nowhere, but it ran
        ev(4, "run.completed", runId="r2"),
        ev(5, "session.rollback", toSequence=2),
    ]
    digest = Digest.of(events)
    assert digest.summary()["runs"] == 1 and digest.usage()["runs"] == 2
    assert digest.last_run_completed == 2
    folded = digest.fold([ev(6, "run.started", runId="r3")])
    assert folded is not None
    assert read_out(folded) == reference([*events, ev(6, "run.started", runId="r3")])
