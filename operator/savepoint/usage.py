"""Pure derivations of what a Session reports about its use: `status.usage` from the
event log, `status.resources` from the sandbox's heartbeat object.

The Session pass reads the whole log anyway (its phase is a function of it), so usage
is one more linear walk over the events already parsed: no request of its own.
docs/event-log.md describes the event shapes read here, and the heartbeat object.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from savepoint.constants import HEARTBEAT_KEY, HEARTBEAT_SUFFIX, SESSION_LABEL
from savepoint.eventlog import (
    APPROVAL,
    APPROVAL_REQUEST,
    INTERRUPT,
    RUN_COMPLETED,
    RUN_STARTED,
    Event,
    parse_time,
)

FORKED = "session.forked"
# The largest count or byte figure taken from a harness: what a CRD int64 holds.
MAX_INT = 2**63 - 1
# A heartbeat object's sample larger than this is ignored (a sample is ~150 bytes).
MAX_SAMPLE_BYTES = 4096


def own_events(events: Sequence[Event]) -> Sequence[Event]:
    """The events this session made: after its session.forked, which ends the prefix a
    fork copied from its parent (that part is the parent's usage, reported there)."""
    for i in range(len(events) - 1, -1, -1):
        if events[i].type == FORKED:
            return events[i + 1 :]
    return events


def count(value: Any) -> int | None:
    """A non-negative integer from a harness's event, else None (bools are not counts)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return min(value, MAX_INT)


def _ms_between(start: str, end: str) -> int:
    """Milliseconds from one event's time to another's; 0 when unreadable or negative
    (the two writers' clocks disagree)."""
    try:
        delta = (parse_time(end) - parse_time(start)).total_seconds()
    except ValueError:
        return 0
    return max(0, int(delta * 1000))


def nearest_rank(values: Sequence[int], fraction: float) -> int | None:
    """The nearest-rank percentile (a value that occurred); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


class Opened(NamedTuple):
    """An open run or approval request: what matching it and timing it need."""

    seq: int
    time: str


def _take(open_: dict[str | None, list[Opened]], ident: str | None) -> Opened | None:
    """The opening event an answer closes: same id, else the oldest without an id, else
    (for an answer without an id) the oldest open one: summarize()'s matching."""
    key: str | None
    if ident is not None and open_.get(ident):
        key = ident
    elif open_.get(None):
        key = None
    elif ident is None and open_:
        key = min(open_, key=lambda k: open_[k][0].seq)
    else:
        return None
    queue = open_[key]
    opened = queue.pop(0)
    if not queue:
        del open_[key]  # only open ones stay: the search above is over what is open
    return opened


def _ident(data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    return str(value)


def derive_usage(events: Sequence[Event]) -> dict[str, Any]:
    """status.usage's log-derived fields, over every event this session made (own_events):
    a branch a rollback closed still counts, since its runs ran and its tokens were spent.

    - runs: run.completed events (a repeated runId once); runDurationMs {p50, max} from
      each run.started to its run.completed (matched by data.runId, else by order);
    - interrupts: user.interrupt events;
    - approvals: agent.approval_request events (requested), user.approval answers with
      data.approved true (approved) or false (denied), waitMsTotal from each request to
      its answer (matched by data.requestId, else by order);
    - tokens {input, output, total} and llmCalls: the sums of data.usage.inputTokens,
      outputTokens and llmCalls (1 when a usage object omits it) on any event.
    """
    runs_open: dict[str | None, list[Opened]] = {}
    asks_open: dict[str | None, list[Opened]] = {}
    completed: set[str] = set()
    runs = interrupts = requested = approved = denied = wait_ms = 0
    durations: list[int] = []
    tokens_in = tokens_out = calls = 0
    for event in own_events(events):
        kind, data = event.type, event.data
        if kind == RUN_STARTED:
            runs_open.setdefault(_ident(data, "runId"), []).append(Opened(event.seq, event.time))
        elif kind == RUN_COMPLETED:
            run_id = _ident(data, "runId")
            if run_id is None or run_id not in completed:
                runs += 1
                if run_id is not None:
                    completed.add(run_id)
                started = _take(runs_open, run_id)
                if started is not None:
                    durations.append(_ms_between(started.time, event.time))
        elif kind == INTERRUPT:
            interrupts += 1
        elif kind == APPROVAL_REQUEST:
            requested += 1
            asks_open.setdefault(_ident(data, "requestId"), []).append(Opened(event.seq, event.time))
        elif kind == APPROVAL:
            answer = data.get("approved")
            if answer is True:
                approved += 1
            elif answer is False:
                denied += 1
            asked = _take(asks_open, _ident(data, "requestId"))
            if asked is not None:
                wait_ms += _ms_between(asked.time, event.time)
        spent = data.get("usage")
        if isinstance(spent, dict):
            tokens_in += count(spent.get("inputTokens")) or 0
            tokens_out += count(spent.get("outputTokens")) or 0
            n = count(spent.get("llmCalls"))
            calls += 1 if n is None else n
    duration: dict[str, int] = {}
    if durations:
        duration = {"p50": nearest_rank(durations, 0.5) or 0, "max": max(durations)}
    return {
        "runs": runs,
        "runDurationMs": duration,
        "interrupts": interrupts,
        "approvals": {
            "requested": requested,
            "approved": approved,
            "denied": denied,
            "waitMsTotal": min(wait_ms, MAX_INT),
        },
        "tokens": {
            "input": min(tokens_in, MAX_INT),
            "output": min(tokens_out, MAX_INT),
            "total": min(tokens_in + tokens_out, MAX_INT),
        },
        "llmCalls": min(calls, MAX_INT),
    }


def count_pauses(old_phase: str | None, new_phase: str, pauses: int) -> int:
    """Pauses the operator has seen: one more at each transition into Paused."""
    return pauses + 1 if new_phase == "Paused" and old_phase not in (None, "Paused") else pauses


# ------------------------------------------------------------------ heartbeat


def heartbeat_name(session: str) -> str:
    """The one object a sandbox writes its resource samples to (docs/event-log.md)."""
    return f"{session}{HEARTBEAT_SUFFIX}"


def heartbeat_session(obj: dict[str, Any]) -> str | None:
    """The session whose heartbeat this ConfigMap is, None for any other: its name must be
    `<session>-heartbeat` for the session its savepoint.dev/session label names."""
    meta = obj.get("metadata") or {}
    session = (meta.get("labels") or {}).get(SESSION_LABEL)
    if not session or meta.get("name") != heartbeat_name(session):
        return None
    return session


def parse_sample(data: dict[str, Any] | None) -> dict[str, Any] | None:
    """status.resources from a heartbeat object's data, None when it holds no valid sample.

    The sandbox is not trusted: only the known fields are kept, each checked (bytes are
    non-negative integers, load1 a finite non-negative number, sampledAt RFC 3339), and
    the sample needs sampledAt. memLimitBytes is left out when the sandbox has no limit.
    """
    raw = (data or {}).get(HEARTBEAT_KEY)
    if not isinstance(raw, str) or len(raw) > MAX_SAMPLE_BYTES:
        return None
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    at = obj.get("sampledAt")
    if not isinstance(at, str) or len(at) > 64:
        return None
    try:
        parse_time(at)
    except ValueError:
        return None
    sample: dict[str, Any] = {"sampledAt": at}
    load = obj.get("load1")
    if isinstance(load, int | float) and not isinstance(load, bool) and math.isfinite(load) and load >= 0:
        sample["load1"] = round(float(load), 2)
    for key in ("memBytes", "memLimitBytes", "diskBytes"):
        value = count(obj.get(key))
        if value is not None:
            sample[key] = value
    return sample


def sampled_epoch(sample: dict[str, Any]) -> float:
    return parse_time(sample["sampledAt"]).timestamp()


@dataclass(frozen=True)
class HeartbeatSeen:
    """What a Session pass knows of its sandbox's heartbeat: the newest sample (as
    status.resources) and whether it is older than the threshold."""

    resources: dict[str, Any]
    stale: bool
    threshold_seconds: float

    def message(self, running: bool) -> str:
        # Stable while nothing changes (no age in it): a new message would be a status write.
        if not running:
            return "no sandbox Pod running: no heartbeat expected"
        if self.stale:
            return (
                f"no heartbeat from the sandbox since {self.resources.get('sampledAt')} "
                f"(threshold {self.threshold_seconds:g}s)"
            )
        return f"the sandbox's heartbeat is newer than {self.threshold_seconds:g}s"


def heartbeat_stale(arrived: float, now: float, threshold: float) -> bool:
    """Whether a heartbeat that arrived at `arrived` (the operator's clock, seconds) is older
    than the threshold at `now`."""
    return now - arrived > threshold


def arrival(sample: dict[str, Any], now: float, listed: bool) -> float:
    """When to count a sample as arrived, by the operator's clock. A watch event is now;
    a listing (a restart) shows an object written at some time before: its own sampledAt,
    never later than now, so a sandbox whose heartbeat stopped before the restart is
    found stale without waiting a whole threshold again."""
    if not listed:
        return now
    try:
        return min(now, sampled_epoch(sample))
    except ValueError:
        return now


__all__ = [
    "HeartbeatSeen",
    "Opened",
    "arrival",
    "count_pauses",
    "derive_usage",
    "heartbeat_name",
    "heartbeat_session",
    "heartbeat_stale",
    "nearest_rank",
    "own_events",
    "parse_sample",
]
