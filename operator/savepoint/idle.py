"""Pure decisions of spec.idle: when an idle session pauses, and what wakes it.

The operator's idle pause lives in status.idle, never in spec.operatingMode: the spec
stays the user's (and a GitOps tool's), so the operator never writes it and nothing
fights over it. A session is idle-paused while status.idle.paused is true and the spec
has not changed since (status.idle.generation): a user who edits the spec, for example
to pause the session themselves, takes the session back. controllers/session.py reads
the log, asks these functions, and acts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from savepoint.durations import parse_duration
from savepoint.eventlog import Event, parse_time
from savepoint.logdigest import Digest
from savepoint.models import IdlePolicy, SessionPhase

# Reasons of the Idle condition and of the Events the operator posts.
IDLE_PAUSED = "IdlePaused"
ACTIVE = "Active"
WOKEN = "Woken"
SPEC_CHANGED = "SpecChanged"


def is_paused(state: dict[str, Any] | None, generation: int | None) -> bool:
    """Whether the operator's idle pause holds: paused, and the spec unchanged since."""
    state = state or {}
    return bool(state.get("paused")) and state.get("generation") == generation


def pause_deadline(policy: IdlePolicy, log: Digest, active_since: datetime | None) -> datetime | None:
    """When the session has been idle for policy.pauseAfter: pauseAfter after the newer of
    its newest event and `active_since` (when it last became Ready, or was woken). None
    while a run is in flight or an approval is pending: those never pause."""
    if log.activity() != SessionPhase.READY:
        return None
    moments = [m for m in (active_since, parse_time(log.last_time) if log.last_time else None) if m is not None]
    if not moments:
        return None
    return max(moments) + parse_duration(policy.pause_after)


@dataclass(frozen=True)
class Wake:
    """What ends an idle pause: the event (sequence, type, time) that woke it."""

    sequence: int
    type: str
    time: str


def waking_event(policy: IdlePolicy | None, log: Digest, newer: Sequence[Event]) -> Wake | None:
    """The first event after the pause that wakes the session, if any: one of
    policy.wakeOnTypes, when policy.wakeOnEvent. Whatever the policy, a rollback wakes it
    (its Fork waits for the session to come back on the restored disk), and so does a run
    or an approval opened after the pause (its harness needs the sandbox)."""
    if not newer:
        return None
    if policy is not None and policy.wake_on_event:
        for event in newer:
            if event.type in policy.wake_on_types:
                return Wake(event.seq, event.type, event.time)
    for event in newer:
        if event.type == "session.rollback":
            return Wake(event.seq, event.type, event.time)
    if log.activity() != SessionPhase.READY:
        opened = next((e for e in newer if e.type in ("run.started", "agent.approval_request")), newer[-1])
        return Wake(opened.seq, opened.type, opened.time)
    return None


def paused_state(log: Digest, generation: int | None, now: str) -> dict[str, Any]:
    """status.idle as the operator pauses the session now."""
    return {
        "paused": True,
        "pausedAt": now,
        "throughSequence": log.through,
        "generation": generation,
        "wokenBySequence": None,
        "wokenByType": None,
        "wokenAt": None,
    }


def woken_state(state: dict[str, Any], wake: Wake | None) -> dict[str, Any]:
    """status.idle once the pause ends: by an event (timed until Ready) or by the user's spec."""
    return {
        **state,
        "paused": False,
        "wokenBySequence": wake.sequence if wake else None,
        "wokenByType": wake.type if wake else None,
        "wokenAt": wake.time if wake else None,
    }


def wake_duration(state: dict[str, Any], now: datetime) -> timedelta | None:
    """Time from the waking event to now (the session Ready), while a wake is being timed."""
    if not state.get("wokenAt") or state.get("paused"):
        return None
    return max(timedelta(0), now - parse_time(state["wokenAt"]))


def reclaim_name(session: str, state: dict[str, Any]) -> str:
    """The Checkpoint an idle pause keeps the workspace in (idle.checkpoint): one per pause,
    since an idle pause needs a newer event or a newer spec than the one before."""
    return f"{session}-idle-{state.get('generation') or 0}-{state.get('throughSequence') or 0}"
