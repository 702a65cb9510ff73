"""A Session's event log as its passes need it: the digest of every event (logdigest.py),
kept from pass to pass, and the newest chunk's events.

A pass folds only what is newer than the last digest: the newest chunk as the chunk
watch showed it (controllers/cache.py), which costs no request; or, when that chunk does
not reach back to the digest's end, the events after it, read from the log. The whole log
is read again only for a Session seen the first time in this process, after a rollback
(it rewrites the effective history) unless the rollback read the events through its
target beforehand (Target, rolled_back), after an erase or a retention deletion (they
change events already folded), and in the resync, which reads everything fresh.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from savepoint.controllers import cache
from savepoint.eventlog import SEALED_ANNOTATION, Event, EventLog
from savepoint.logdigest import Digest, History, history_through
from savepoint.sandbox import chunk_index


@dataclass(frozen=True)
class LogView:
    uid: str
    digest: Digest
    chunks: int  # chunks in the log (status.eventLog.chunks)
    newest: int  # the newest chunk's index, 0 for none
    tail: tuple[Event, ...] = ()  # the log's newest events, from tail_from to its end
    tail_from: int = 1

    def since(self, elog: EventLog, seq: int) -> list[Event]:
        """The events after `seq`: from the tail when it holds them all, else read."""
        if seq + 1 >= self.tail_from:
            return [e for e in self.tail if e.seq > seq]
        return elog.read(from_seq=seq + 1, partial=True)


def observe(body: dict, elog: EventLog, fresh_after: float | None = None, fresh_version: int = 0) -> LogView:
    """The Session's log (EventLogError when it cannot be read); the newest chunk it used
    is seeded into `elog`, so an append that follows writes without a read.

    Without `fresh_after`, as the chunk watch last showed it: a pass that a newer event
    would start again may read a moment-old copy. With it (a monotonic time), at least as
    new as a read started then: checkpoint admission cuts the log and checks it for an
    open run, and must see every event appended before the Checkpoint was made. One read
    serves all the checkpoints of the session that arrived before it started, and so does
    one of our own writes of the chunk (cache.Chunks.written): a checkpoint.created sent
    after a checkpoint arrived spares that checkpoint's admission its read. So does a copy
    of the newest chunk, unsealed, whose resourceVersion is at least `fresh_version` (the
    Checkpoint's): it was written after the Checkpoint was made, and no newer chunk can
    exist before this one is sealed. So does the chunk watch, once it has delivered any
    event at least that new: it delivers in order, so the store already holds every
    append made before the Checkpoint.
    """
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
    changed = cache.chunks.take_changed(namespace, name)
    held: LogView | None = cache.log_views.get(namespace, name) if cache.in_use() and not changed else None
    if fresh_after is not None and fresh_version and _fresh_in_store(namespace, name, fresh_version):
        fresh_after = None
    view = _fold(held, elog, namespace, name, fresh_after) if held is not None and held.uid == uid else None
    if view is None:
        events = elog.read(partial=True)
        newest = chunk_index(elog.listed[-1]) if elog.listed else 0
        start = elog.newest_first_seq or 1
        tail = tuple(e for e in events if e.seq >= start)
        view = LogView(uid, Digest.of(events), len(elog.listed), newest, tail, start)
    latest = cache.log_views.get(namespace, name)
    if latest is None or latest.uid != uid or latest.digest.through <= view.digest.through:
        cache.log_views.put(namespace, name, dataclasses.replace(view, tail=()))  # the digest alone: small
    return view


@dataclass(frozen=True)
class Target:
    """The history of a Session's log through a rollback's toSequence, and the chunk
    store's stamp when its read started (None: a change was waiting, so it serves nothing)."""

    stamp: int | None
    history: History


def read_target(body: dict, elog: EventLog, through: int) -> Target:
    """Read the Session's events through `through` (a rollback's target) for rolled_back."""
    meta = body["metadata"]
    stamp = cache.chunks.stamp(meta["namespace"], meta["name"])
    return Target(stamp, history_through(elog.read(1, through, partial=True) if through else [], through))


def rolled_back(body: dict, elog: EventLog, event: Event, target: Target) -> bool:
    """Keep the Session's view as the session.rollback `event`, just written by `elog`,
    leaves it: the kept digest with the rollback folded onto `target`. The pass that
    starts the Pod then reads no whole log. Only when the kept digest ends right before
    `event` and nothing it folded changed since `target` was read; whether it was kept."""
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
    held = cache.log_views.get(namespace, name)
    newest = elog.newest_index
    if held is None or held.uid != uid or newest is None or target.stamp is None:
        return False
    if cache.chunks.stamp(namespace, name) != target.stamp:
        return False
    digest = held.digest.roll_back(event, target.history)
    if digest is None:
        return False
    chunks = held.chunks + newest - held.newest
    cache.log_views.put(namespace, name, LogView(uid, digest, chunks, newest, (), elog.newest_first_seq or 1))
    return True


def _fresh_in_store(namespace: str, session: str, version: int) -> bool:
    """Whether the chunk store shows the session's log at least as it stood at `version`:
    the namespace's chunk watch has delivered an event that new (under a burst, another
    session's append soon is), or the newest chunk held is unsealed and written at or after
    `version` (no newer chunk can exist before it is sealed)."""
    if cache.chunks.delivered_through(namespace) >= version:
        return True
    chunk = cache.chunks.newest(namespace, session)
    if chunk is None or cache.version(chunk) < version:
        return False
    return (chunk["metadata"].get("annotations") or {}).get(SEALED_ANNOTATION) != "true"


def remember_written(body: dict, elog: EventLog, events: list[Event]) -> None:
    """The Session's log is `events`, every one of them just written by `elog` into a log
    that had no chunk (EventLog.start_from): the pass's view folds from them, reading
    nothing, where a Session seen the first time would read its whole log."""
    meta = body["metadata"]
    newest = elog.newest_index
    if not events or newest is None:
        return
    view = LogView(meta.get("uid", ""), Digest.of(events), newest, newest, (), elog.newest_first_seq or 1)
    cache.log_views.put(meta["namespace"], meta["name"], view)


def _fold(held: LogView, elog: EventLog, namespace: str, name: str, fresh_after: float | None) -> LogView | None:
    through = held.digest.through
    read_at = cache.chunks.read_since(namespace, name)
    if fresh_after is not None and (read_at is None or read_at < fresh_after):
        started = time.monotonic()
        seeded = elog.load_newest(held.newest)  # on_chunk keeps it in the store
        cache.chunks.mark_read(namespace, name, started)
    else:
        seeded = elog.seed(cache.chunks.newest(namespace, name))
    if (
        seeded is not None
        and not seeded.sealed
        and seeded.index >= held.newest
        and seeded.first_seq <= through + 1
        and (not seeded.events or seeded.events[-1].seq >= through)
    ):
        digest = held.digest.fold(seeded.events)
        if digest is None:
            return None  # a rollback: the whole log again
        chunks = held.chunks + seeded.index - held.newest
        return LogView(held.uid, digest, chunks, seeded.index, tuple(seeded.events), seeded.first_seq)
    newer = elog.read(from_seq=through + 1, partial=True)
    digest = held.digest.fold(newer)
    if digest is None or not elog.listed:
        return None
    return LogView(held.uid, digest, len(elog.listed), chunk_index(elog.listed[-1]), tuple(newer), through + 1)
