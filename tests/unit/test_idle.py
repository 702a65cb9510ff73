"""Pure decisions of spec.idle and its timer queue: no cluster."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from savepoint import idle
from savepoint.eventlog import Event, format_time
from savepoint.logdigest import Digest
from savepoint.models import IdlePolicy
from savepoint.polling import DeadlineQueue

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def log(*types: str, start: datetime = T0) -> list[Event]:
    return [Event(i, f"e{i}", t, format_time(start + timedelta(seconds=i)), {}) for i, t in enumerate(types, start=1)]


POLICY = IdlePolicy(pause_after="10m", wake_on_event=True)


def deadline(policy: IdlePolicy, events: list[Event], since: datetime | None) -> datetime | None:
    return idle.pause_deadline(policy, Digest.of(events), since)


def waking(policy: IdlePolicy, events: list[Event], through_sequence: int) -> idle.Wake | None:
    return idle.waking_event(policy, Digest.of(events), [e for e in events if e.seq > through_sequence])


def paused(events: list[Event], generation: int, now: str) -> dict:
    return idle.paused_state(Digest.of(events), generation, now)


def test_deadline_counts_from_the_newest_event_or_the_ready_transition():
    events = log("user.message", "run.started", "run.completed")
    assert deadline(POLICY, events, None) == T0 + timedelta(seconds=3, minutes=10)
    later = T0 + timedelta(hours=1)  # resumed by hand long after the last event
    assert deadline(POLICY, events, later) == later + timedelta(minutes=10)
    assert deadline(POLICY, [], None) is None


@pytest.mark.parametrize(
    "types", [("run.started",), ("agent.approval_request",), ("run.started", "run.completed", "run.started")]
)
def test_a_run_or_an_approval_in_flight_never_pauses(types):
    assert deadline(POLICY, log(*types), T0) is None


def test_only_a_newer_event_of_a_waking_type_wakes():
    events = log("user.message", "agent.message", "user.message")
    assert waking(POLICY, events, through_sequence=3) is None
    assert waking(POLICY, events, through_sequence=2) == idle.Wake(3, "user.message", events[2].time)
    assert waking(POLICY, log("user.message", "agent.message"), through_sequence=1) is None
    custom = IdlePolicy(pause_after="1m", wake_on_event=True, wake_on_types=["ticket.opened"])
    assert waking(custom, log("user.message", "ticket.opened"), through_sequence=0).type == "ticket.opened"


def test_without_wake_on_event_only_runs_approvals_and_rollbacks_wake():
    quiet = IdlePolicy(pause_after="1m")
    assert waking(quiet, log("user.message", "user.message"), through_sequence=1) is None
    assert waking(quiet, log("user.message", "run.started"), through_sequence=1).type == "run.started"
    assert waking(quiet, log("x", "session.rollback"), through_sequence=1).type == "session.rollback"


def test_a_change_to_the_spec_ends_the_idle_pause():
    state = paused(log("user.message"), generation=4, now="2026-01-01T12:00:00Z")
    assert state["throughSequence"] == 1
    assert idle.is_paused(state, 4)
    assert not idle.is_paused(state, 5)
    assert not idle.is_paused(idle.woken_state(state, None), 4)


def test_a_wake_is_timed_from_the_waking_event_until_ready():
    state = paused(log("user.message"), generation=1, now="x")
    wake = idle.Wake(2, "user.message", format_time(T0))
    woken = idle.woken_state(state, wake)
    assert idle.wake_duration(state, T0) is None  # still paused
    assert idle.wake_duration(woken, T0 + timedelta(seconds=2.5)) == timedelta(seconds=2.5)


def test_each_idle_pause_keeps_its_workspace_in_a_checkpoint_of_its_own():
    first = paused(log("a"), generation=1, now="x")
    second = paused(log("a", "user.message"), generation=1, now="x")
    assert idle.reclaim_name("s", first) != idle.reclaim_name("s", second)


@pytest.mark.parametrize("bad", ["", "15", "-5m", "1y", "5 m"])
def test_pause_after_must_be_a_duration(bad):
    with pytest.raises(ValidationError, match="pause_after|pauseAfter"):
        IdlePolicy(pause_after=bad)


def test_deadline_queue_hands_out_each_key_once_when_due():
    now = [100.0]
    queue = DeadlineQueue(clock=lambda: now[0])
    queue.schedule(("ns", "a"), 105)
    queue.schedule(("ns", "b"), 102)
    queue.schedule(("ns", "a"), 110)  # rescheduled: the later time wins
    assert queue.take_due() == []
    now[0] = 106
    assert queue.take_due() == [("ns", "b")]
    now[0] = 111
    assert queue.take_due() == [("ns", "a")]
    assert queue.take_due() == [] and len(queue) == 0
