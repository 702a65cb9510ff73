"""What a Session pass needs from its event log, folded event by event.

Derived from every event, a pass costs O(log): a 100,000-event log is read and walked
whole each time. A Digest is the state those derivations reach after the events so far,
so the next pass folds only what is newer (the newest chunk) and reads out the same
answers as the whole-log functions:

- summary() and activity(): eventlog.summarize over the effective history, and
  session.activity;
- usage(): usage.derive_usage, over the events after the last session.forked;
- latest_checkpoint: the newest checkpoint.created's data.checkpoint, None after a fork
  (controllers/session.py latest_checkpoint);
- last_run_completed: the seq of the newest run.completed in the effective history;
- cursor and last_time: the newest event's (seq, id) and Event.time.

Appending to the log appends to its effective history, so a fold is exact until a
session.rollback with a valid toSequence: that one rewrites the history, and fold()
returns None for the caller to build the Digest again from the whole log (Digest.of),
or, with the history of the events through the rollback's target read beforehand
(history_through), to fold the rollback in with roll_back().
The state is the open runs and approval requests, the completed runIds (for counting a
repeated one once) and the run durations: never the events.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# The matching of answers to what they answer (by id, else by order) is shared with
# summarize() and derive_usage(), so the digest cannot match differently.
from savepoint.eventlog import (
    APPROVAL,
    APPROVAL_REQUEST,
    INTERRUPT,
    ROLLBACK,
    RUN_COMPLETED,
    RUN_STARTED,
    Event,
    _close,
    _ident,
    _open,
    effective_history,
)
from savepoint.models import SessionPhase
from savepoint.usage import FORKED, MAX_INT, Opened, _ms_between, _take, count, nearest_rank

CHECKPOINT_CREATED = "checkpoint.created"


def rewrites_history(event: Event) -> bool:
    """Whether `event` is a rollback effective_history() honours (a valid toSequence); any
    other event only extends the history."""
    if event.type != ROLLBACK:
        return False
    target = event.data.get("toSequence")
    return isinstance(target, int) and not isinstance(target, bool) and 0 <= target < event.seq


@dataclass
class History:
    """summarize()'s state, and the newest run.completed, over the effective history."""

    runs_open: list[str | None] = field(default_factory=list)
    approvals_open: list[str | None] = field(default_factory=list)
    completed_ids: set[str] = field(default_factory=set)
    runs: int = 0
    last_run_completed: int = 0

    def copy(self) -> History:
        return History(
            list(self.runs_open), list(self.approvals_open), set(self.completed_ids), self.runs, self.last_run_completed
        )

    def add(self, event: Event) -> None:
        kind, data = event.type, event.data
        if kind == RUN_STARTED:
            _open(self.runs_open, _ident(data, "runId"))
        elif kind == RUN_COMPLETED:
            run_id = _ident(data, "runId")
            _close(self.runs_open, run_id)
            if run_id is None or run_id not in self.completed_ids:
                self.runs += 1
                if run_id is not None:
                    self.completed_ids.add(run_id)
            self.last_run_completed = event.seq
        elif kind == APPROVAL_REQUEST:
            _open(self.approvals_open, _ident(data, "requestId"))
        elif kind == APPROVAL:
            _close(self.approvals_open, _ident(data, "requestId"))


@dataclass
class _Own:
    """derive_usage()'s state and the newest checkpoint, over the events since the last
    session.forked (what came before it is the parent's)."""

    runs_open: dict[str | None, list[Opened]] = field(default_factory=dict)
    asks_open: dict[str | None, list[Opened]] = field(default_factory=dict)
    completed: set[str] = field(default_factory=set)
    runs: int = 0
    interrupts: int = 0
    requested: int = 0
    approved: int = 0
    denied: int = 0
    wait_ms: int = 0
    durations: list[int] = field(default_factory=list)  # sorted: a read-out does not sort
    tokens_in: int = 0
    tokens_out: int = 0
    calls: int = 0
    checkpoint: str | None = None

    def copy(self) -> _Own:
        return _Own(
            {k: list(q) for k, q in self.runs_open.items()},
            {k: list(q) for k, q in self.asks_open.items()},
            set(self.completed),
            self.runs,
            self.interrupts,
            self.requested,
            self.approved,
            self.denied,
            self.wait_ms,
            list(self.durations),
            self.tokens_in,
            self.tokens_out,
            self.calls,
            self.checkpoint,
        )

    def add(self, event: Event) -> None:
        kind, data = event.type, event.data
        if kind == RUN_STARTED:
            self.runs_open.setdefault(_ident(data, "runId"), []).append(Opened(event.seq, event.time))
        elif kind == RUN_COMPLETED:
            run_id = _ident(data, "runId")
            if run_id is None or run_id not in self.completed:
                self.runs += 1
                if run_id is not None:
                    self.completed.add(run_id)
                started = _take(self.runs_open, run_id)
                if started is not None:
                    bisect.insort(self.durations, _ms_between(started.time, event.time))
        elif kind == INTERRUPT:
            self.interrupts += 1
        elif kind == APPROVAL_REQUEST:
            self.requested += 1
            self.asks_open.setdefault(_ident(data, "requestId"), []).append(Opened(event.seq, event.time))
        elif kind == APPROVAL:
            answer = data.get("approved")
            if answer is True:
                self.approved += 1
            elif answer is False:
                self.denied += 1
            asked = _take(self.asks_open, _ident(data, "requestId"))
            if asked is not None:
                self.wait_ms += _ms_between(asked.time, event.time)
        elif kind == CHECKPOINT_CREATED:
            self.checkpoint = data.get("checkpoint")
        spent = data.get("usage")
        if isinstance(spent, dict):
            self.tokens_in += count(spent.get("inputTokens")) or 0
            self.tokens_out += count(spent.get("outputTokens")) or 0
            n = count(spent.get("llmCalls"))
            self.calls += 1 if n is None else n

    def report(self) -> dict[str, Any]:
        duration: dict[str, int] = {}
        if self.durations:
            duration = {"p50": nearest_rank(self.durations, 0.5) or 0, "max": self.durations[-1]}
        return {
            "runs": self.runs,
            "runDurationMs": duration,
            "interrupts": self.interrupts,
            "approvals": {
                "requested": self.requested,
                "approved": self.approved,
                "denied": self.denied,
                "waitMsTotal": min(self.wait_ms, MAX_INT),
            },
            "tokens": {
                "input": min(self.tokens_in, MAX_INT),
                "output": min(self.tokens_out, MAX_INT),
                "total": min(self.tokens_in + self.tokens_out, MAX_INT),
            },
            "llmCalls": min(self.calls, MAX_INT),
        }


def history_through(events: Sequence[Event], seq: int) -> History:
    """The effective history's state over the log's events through `seq`: what a
    session.rollback to `seq` leaves of it (the rollback event itself adds nothing)."""
    history = History()
    for event in effective_history([e for e in events if e.seq <= seq]):
        history.add(event)
    return history


def _own_after(own: _Own, events: Iterable[Event]) -> _Own:
    for event in events:
        if event.type == FORKED:
            own = _Own()  # usage.own_events: a fork's log starts with its parent's events
        else:
            own.add(event)
    return own


@dataclass(frozen=True)
class Digest:
    """What a Session pass needs from its log, folded event by event.

    Never changed once built: fold() builds a new Digest (or returns this one when
    nothing is newer), so a caller keeps the old one until the pass that folded commits.
    """

    through: int = 0  # seq of the newest event folded (0: none)
    last_id: str = ""
    last_time: str | None = None  # Event.time of the newest event folded
    history: History = field(default_factory=History)
    own: _Own = field(default_factory=_Own)

    @classmethod
    def of(cls, events: Sequence[Event]) -> Digest:
        """The digest of a whole log, in seq order (its rollbacks honoured)."""
        if not events:
            return cls()
        history = History()
        for event in effective_history(events):
            history.add(event)
        last = events[-1]
        return cls(last.seq, last.id, last.time, history, _own_after(_Own(), events))

    def fold(self, events: Sequence[Event]) -> Digest | None:
        """This digest with `events` (in seq order) folded in; those not newer than
        `through` are skipped (a chunk read again holds events folded already). None when
        one of them is a rollback that rewrites the history: build it again with of()."""
        newer: list[Event] = []
        through = self.through
        for event in events:
            if event.seq > through:
                newer.append(event)
                through = event.seq
        if not newer:
            return self
        if any(rewrites_history(event) for event in newer):
            return None
        history = self.history.copy()
        for event in newer:
            history.add(event)
        own = _own_after(self.own.copy(), newer)
        last = newer[-1]
        return Digest(last.seq, last.id, last.time, history, own)

    def roll_back(self, event: Event, target: History) -> Digest | None:
        """This digest with the rollback `event`, the next event after `through`, folded in:
        the history becomes `target` (history_through the log and the rollback's
        toSequence), while usage counts every event, the closed branch's too. None when
        `event` is not the next event, or not a rollback that rewrites the history."""
        if event.seq != self.through + 1 or not rewrites_history(event):
            return None
        return Digest(event.seq, event.id, event.time, target.copy(), _own_after(self.own.copy(), [event]))

    def summary(self) -> dict[str, Any]:
        """eventlog.summarize of the log's effective history."""
        return {
            "run_in_flight": bool(self.history.runs_open),
            "approval_pending": bool(self.history.approvals_open),
            "runs": self.history.runs,
        }

    def activity(self) -> SessionPhase:
        """session.activity of the log: AwaitingApproval over Running over Ready."""
        if self.history.approvals_open:
            return SessionPhase.AWAITING_APPROVAL
        if self.history.runs_open:
            return SessionPhase.RUNNING
        return SessionPhase.READY

    def usage(self) -> dict[str, Any]:
        """usage.derive_usage of the log."""
        return self.own.report()

    @property
    def latest_checkpoint(self) -> str | None:
        return self.own.checkpoint

    @property
    def last_run_completed(self) -> int:
        return self.history.last_run_completed

    @property
    def cursor(self) -> tuple[int, str]:
        """The newest event's (seq, id); (0, "") for an empty log."""
        return (self.through, self.last_id)


__all__ = ["Digest", "history_through", "rewrites_history"]
