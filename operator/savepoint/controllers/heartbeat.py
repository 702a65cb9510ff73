"""The sandboxes' heartbeats, kept in memory from the ConfigMap watch and reflected into
their Sessions' status without a Session pass per heartbeat.

A harness writes its resource sample into `<session>-heartbeat` as often as every 10 s;
a Session pass reads the whole log, so a pass per heartbeat would cost a log read each
time. Instead the watch event only records the sample here (no request), and one loop
(savepoint.runtime) writes it:

- status.resources by a merge patch of that field alone (one request), at most once per
  SAVEPOINT_RESOURCES_INTERVAL_SECONDS per Session, and only when the sample changed;
- the HeartbeatStale condition by a Session pass, only when a heartbeat crosses the
  threshold (SAVEPOINT_HEARTBEAT_STALE_SECONDS) one way or the other: rare.

Every Session pass also carries the newest sample (session.build_status), so what a pass
writes and what the loop writes agree.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from savepoint.config import Settings
from savepoint.usage import HeartbeatSeen, arrival, heartbeat_session, heartbeat_stale, parse_sample


@dataclass
class _Beat:
    resources: dict[str, Any]
    arrived: float  # when the sample arrived, the operator's wall clock (usage.arrival)
    reflected: dict[str, Any] | None = None  # the resources last written to the status
    reflected_at: float = float("-inf")  # monotonic time of that write
    stale_seen: bool | None = None  # the stale verdict the last Session pass wrote


# (namespace, session) -> its newest heartbeat.
_beats: dict[tuple[str, str], _Beat] = {}
_guard = threading.Lock()


def observe(event_type: str | None, obj: dict[str, Any]) -> bool:
    """Record a heartbeat object from the watch; False for a ConfigMap that is none."""
    session = heartbeat_session(obj)
    if session is None:
        return False
    key = ((obj.get("metadata") or {}).get("namespace", ""), session)
    if event_type == "DELETED":
        forget(*key)
        return True
    sample = parse_sample(obj.get("data"))
    if sample is None:
        return True  # not (yet) a valid sample: keep the one before
    with _guard:
        beat = _beats.get(key)
        if beat is not None and beat.resources == sample:
            return True  # a re-list, or a write of the same sample
        arrived = arrival(sample, time.time(), listed=event_type is None)
        if beat is None:
            _beats[key] = _Beat(sample, arrived)
        else:
            beat.resources, beat.arrived = sample, arrived
    return True


def seen(namespace: str, session: str, threshold: float) -> HeartbeatSeen | None:
    """The Session pass's view: the newest sample and whether it is stale after
    `threshold` seconds; None for none."""
    with _guard:
        beat = _beats.get((namespace, session))
        if beat is None:
            return None
        return HeartbeatSeen(dict(beat.resources), heartbeat_stale(beat.arrived, time.time(), threshold), threshold)


def reflected(namespace: str, session: str, written: HeartbeatSeen | None, pass_: bool = True) -> None:
    """A Session pass (or the loop's patch, pass_=False) wrote this sample to the status."""
    if written is None:
        return
    with _guard:
        beat = _beats.get((namespace, session))
        if beat is None:
            return
        beat.reflected, beat.reflected_at = dict(written.resources), time.monotonic()
        if pass_:
            beat.stale_seen = written.stale


def forget(namespace: str, session: str) -> None:
    with _guard:
        _beats.pop((namespace, session), None)


def due(settings: Settings) -> tuple[list[tuple[str, str]], list[tuple[tuple[str, str], dict[str, Any]]]]:
    """(Sessions whose heartbeat crossed the threshold since their last pass: each needs a
    pass; Sessions whose newest sample is unwritten and whose last write is an interval
    old, with the sample: each needs a patch of status.resources)."""
    now, mono = time.time(), time.monotonic()
    threshold, interval = settings.heartbeat_stale_seconds, settings.resources_interval_seconds
    passes, patches = [], []
    with _guard:
        for key, beat in _beats.items():
            if heartbeat_stale(beat.arrived, now, threshold) != beat.stale_seen:
                passes.append(key)
            elif beat.resources != beat.reflected and mono - beat.reflected_at >= interval:
                patches.append((key, dict(beat.resources)))
    return passes, patches


def tick_seconds(settings: Settings) -> float:
    """How often the loop looks: often enough for the shortest of the two settings."""
    return max(0.5, min(5.0, settings.resources_interval_seconds / 2, settings.heartbeat_stale_seconds / 4))
