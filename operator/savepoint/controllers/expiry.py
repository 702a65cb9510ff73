"""Checkpoint expiry: each checkpoint's clock from the watch (ExpiryQueue), the Expired
step, and the deletion of ended checkpoints after the grace period.

The runtime's expiry loop (savepoint.runtime) sweeps a full listing once when this
replica becomes active, then drains what the queue says is due every few seconds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

from savepoint import k8s, metrics
from savepoint.checkpoint import parse_time
from savepoint.config import Settings
from savepoint.constants import Reason
from savepoint.controllers import cache, object_lock
from savepoint.controllers.checkpoint import ready_condition, write_status
from savepoint.models import CheckpointPhase

log = logging.getLogger(__name__)


def _now() -> datetime:
    return datetime.now(UTC)


def ask_deletion(body: dict) -> None:
    """Ask for the deletion of an overdue checkpoint's snapshot, without waiting for it (the
    snapshot controller finishes it, and the garbage collector takes it if the Checkpoint is
    deleted meanwhile). Gone already is fine."""
    meta, status = body["metadata"], body.get("status") or {}
    if status.get("volumeSnapshotName"):
        k8s.request_volume_snapshot_deletion(meta["namespace"], status["volumeSnapshotName"])


def record_expired(body: dict) -> None:
    """Write Expired once the snapshot's deletion is asked for. No Event: the status says it
    (phase, reason, message, the Ready condition), as for Ready, and an Event was one of each
    expiry's four requests. Counted once written: a write that fails is tried again."""
    status = body.get("status") or {}
    message = f"expired at {status.get('expiresAt')}; its VolumeSnapshot is deleted"
    write_status(
        body,
        {
            "phase": CheckpointPhase.EXPIRED.value,
            "reason": Reason.TTL_EXPIRED.value,
            "message": message,
            "resume": {"kind": "event_log"},
            "conditions": ready_condition(body, False, Reason.TTL_EXPIRED, message),
        },
    )
    metrics.expiries.inc()


# Phases whose checkpoint is deleted at expiresAt + the grace period.
ENDED = (CheckpointPhase.EXPIRED, CheckpointPhase.FAILED)


def _small_copy(body: dict) -> dict:
    """What an expiry reads of a checkpoint: its name, versions, clock, snapshot and conditions."""
    meta, status = body["metadata"], body.get("status") or {}
    return {
        "metadata": {k: meta[k] for k in ("namespace", "name", "resourceVersion", "generation") if k in meta},
        "status": {k: status[k] for k in ("phase", "expiresAt", "volumeSnapshotName", "conditions") if k in status},
    }


class ExpiryQueue:
    """Each checkpoint's expiry clock, fed by the Checkpoint watch, so finding what is due
    costs no request: (namespace, name) -> (when it is due, what to do then).

    A Ready or Pending checkpoint is due for expiry at expiresAt; an Expired or Failed one
    for deletion at expiresAt + the grace period. Taking an entry removes it; the watch
    event of what was done (or of anything else that changes it) puts it back as it now is.
    Beside each clock it keeps a small copy of the newest body seen (latest()), so an
    expiry reads memory, not the API server, for the checkpoint as it is now.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], tuple[datetime, str]] = {}
        self._copies: dict[tuple[str, str], dict] = {}
        self._lock = threading.Lock()

    @staticmethod
    def clock(body: dict) -> tuple[datetime, str] | None:
        """(expiresAt, phase) of a checkpoint with an expiry clock running, else None."""
        status = body.get("status") or {}
        phase, expires = status.get("phase"), status.get("expiresAt")
        if body["metadata"].get("deletionTimestamp") or not expires:
            return None
        if phase not in (CheckpointPhase.READY, CheckpointPhase.PENDING, *ENDED):
            return None
        try:
            return parse_time(expires), str(phase)
        except ValueError:
            return None

    def due_action(self, body: dict, now: datetime, grace: timedelta) -> str | None:
        """ "expire", "delete" or None for this checkpoint as it is now."""
        clock = self.clock(body)
        if clock is None:
            return None
        expires, phase = clock
        if phase in ENDED:
            return "delete" if expires + grace <= now else None
        return "expire" if expires <= now else None

    def observe(self, event_type: str | None, body: dict) -> None:
        """A watch event, or our own write's answer (older than the copy kept: ignored)."""
        key = (body["metadata"].get("namespace", ""), body["metadata"]["name"])
        clock = None if event_type == "DELETED" else self.clock(body)
        with self._lock:
            old = self._copies.get(key)
            if event_type != "DELETED" and old is not None and cache.version(body) < cache.version(old):
                return
            if clock is None:
                self._entries.pop(key, None)
                self._copies.pop(key, None)
            else:
                self._entries[key] = clock
                self._copies[key] = _small_copy(body)

    def latest(self, key: tuple[str, str]) -> dict | None:
        """The newest copy seen of a checkpoint with a clock (None once it has none)."""
        with self._lock:
            copy = self._copies.get(key)
        return {"metadata": dict(copy["metadata"]), "status": dict(copy["status"])} if copy else None

    def put_back(self, key: tuple[str, str], clock: tuple[datetime, str]) -> None:
        """Return an entry whose work failed, unless a watch event has filed a newer one."""
        with self._lock:
            self._entries.setdefault(key, clock)

    def take_due(self, now: datetime, grace: timedelta) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """(keys to expire, keys to delete) due at `now`, removed from the queue."""
        expire: list[tuple[str, str]] = []
        delete: list[tuple[str, str]] = []
        with self._lock:
            for key, (expires, phase) in list(self._entries.items()):
                if phase in ENDED:
                    if expires + grace <= now:
                        delete.append(key)
                        del self._entries[key]
                elif expires <= now:
                    expire.append(key)
                    del self._entries[key]
        expire.sort(key=lambda k: k)
        return expire, delete

    def next_due(self, grace: timedelta) -> datetime | None:
        """When the soonest entry falls due (None with none)."""
        with self._lock:
            return min(
                (expires + grace if phase in ENDED else expires for expires, phase in self._entries.values()),
                default=None,
            )

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._copies.clear()


def next_wait(queue: ExpiryQueue, settings: Settings, now: datetime | None = None) -> float:
    """Seconds the expiry loop sleeps: until the queue's soonest entry falls due, at most
    the expiry interval, so a checkpoint expires at its expiresAt, not up to an interval
    later. One due already and still queued (put back after a failure) waits the interval."""
    interval = settings.expiry_interval_seconds
    soonest, now = queue.next_due(settings.expired_grace), now or _now()
    if soonest is None or soonest <= now:
        return interval
    return min(interval, (soonest - now).total_seconds() + 0.01)


# The runtime's queue. The rollback's refresh of a checkpoint's expiresAt writes through
# it (refreshed()), so an expiry that follows that refresh sees it before its watch event.
clocks = ExpiryQueue()


def refreshed(body: dict | None) -> None:
    if body is not None:
        clocks.observe("MODIFIED", body)


Key = tuple[str, str]


BodyNow = Callable[[Key], dict | None]
PutBack = Callable[[Key, dict], None]


def _ask(key: Key, body_now: BodyNow, put_back: PutBack) -> tuple[Key, dict] | None:
    """The first round of one expiry: under the checkpoint's lock, its body as it is now
    (None: not to expire after all), then its snapshot's deletion. The lock stays held
    until _record() has written Expired: never beside a reconcile pass of the same
    checkpoint, which could re-create what this deletes or write Ready over Expired, nor
    beside a rollback's refresh of its expiresAt."""
    lock = object_lock("checkpoint", *key)
    lock.acquire()
    body = None
    try:
        body = body_now(key)
        if body is not None:
            ask_deletion(body)
            return key, body
    except Exception:  # one bad object must not stop the storm
        log.exception("expiring checkpoint %s/%s", *key)
        if body is not None:
            put_back(key, body)
    lock.release()
    return None


def _record(asked: tuple[Key, dict], put_back: PutBack) -> bool:
    """The second round of one expiry: its Expired status, then its lock released."""
    key, body = asked
    try:
        record_expired(body)
        return True
    except Exception:
        log.exception("expiring checkpoint %s/%s", *key)
        put_back(key, body)
        return False
    finally:
        object_lock("checkpoint", *key).release()


def _in_pool(work: Callable[[Any], Any], items: list, workers: int) -> list:
    """work over items: one inline, more on `workers` threads, while the client's rate limiter
    (SAVEPOINT_API_QPS) caps the request rate."""
    if len(items) <= 1 or workers <= 1:
        return list(map(work, items))
    with ThreadPoolExecutor(min(workers, len(items)), thread_name_prefix="checkpoint-expiry") as pool:
        return list(pool.map(work, items))


def expire_all(keys: list[Key], body_now: BodyNow, put_back: PutBack, workers: int) -> int:
    """Expire checkpoints that fell due together, in two rounds: every snapshot's deletion,
    then every Expired status write; how many were expired.

    Deletions first, because a storm's end is the CSI stack's: it deletes the snapshots at
    its own pace once they are asked for, and a status write costs the API server a
    fraction of what one deletion costs it (docs/performance.md). An expiry that sent its
    two requests in turn, under the client's rate limit, handed the CSI stack its last
    deletions only as the last status writes went: the stack then trailed by a backlog.
    `body_now(key)` gives a checkpoint as it is now under its lock (None: leave it);
    `put_back(key, body)` returns a failed one to its queue.
    """
    unique = list(dict.fromkeys(keys))  # a lock held across the rounds must be taken once
    asked = _in_pool(lambda key: _ask(key, body_now, put_back), unique, workers)
    held = [a for a in asked if a is not None]
    return sum(_in_pool(lambda a: _record(a, put_back), held, workers))


def _key(body: dict) -> Key:
    return body["metadata"]["namespace"], body["metadata"]["name"]


def sweep(settings: Settings, queue: ExpiryQueue, now: datetime | None = None) -> dict[str, int]:
    """One pass over every checkpoint, listed: expire the overdue, delete Expired and Failed past the
    grace. Run once at start-up; afterwards drain() works from the watch-fed queue."""
    now = now or _now()
    counts = {"expired": 0, "deleted": 0}
    due: list[dict] = []
    namespaces = settings.namespaces or (None,)
    for namespace in namespaces:
        for body in k8s.iter_custom("checkpoints", namespace):  # a page at a time: only the due are kept
            action = queue.due_action(body, now, settings.expired_grace)
            if action == "expire":
                due.append(body)
            elif action == "delete":
                k8s.delete_custom("checkpoints", body["metadata"]["namespace"], body["metadata"]["name"])
                counts["deleted"] += 1
    listed = {_key(body): body for body in due}
    counts["expired"] += expire_all(list(listed), listed.get, lambda key, body: None, settings.expiry_workers)
    return counts


def drain(settings: Settings, queue: ExpiryQueue, now: datetime | None = None) -> dict[str, int]:
    """Expire and delete what the queue says is due: no listing, no read."""
    now = now or _now()
    to_expire, to_delete = queue.take_due(now, settings.expired_grace)
    counts = {"expired": 0, "deleted": 0}
    for namespace, name in to_delete:
        k8s.delete_custom("checkpoints", namespace, name)
        counts["deleted"] += 1
    counts["expired"] += expire_due(to_expire, settings, queue)
    return counts


def expire_due(keys: list[Key], settings: Settings, queue: ExpiryQueue) -> int:
    """Expire checkpoints the queue said are due, each as its newest copy is now."""
    return expire_all(
        keys,
        lambda key: _due_now(key, settings, queue),
        lambda key, body: _put_back(queue, key, body),
        settings.expiry_workers,
    )


def _due_now(key: Key, settings: Settings, queue: ExpiryQueue) -> dict | None:
    """The newest copy of a checkpoint the queue said is due, if it is due still: a storm's
    entry may wait minutes for a worker, and a rollback can move expiresAt meanwhile (it
    does so under the same lock, writing through the queue)."""
    body = queue.latest(key)
    if body is None or queue.due_action(body, _now(), settings.expired_grace) != "expire":
        return None  # deleted, moved on, or given a later expiresAt meanwhile
    return body


def _put_back(queue: ExpiryQueue, key: Key, body: dict) -> None:
    """A failed expiry goes back in the queue, for the next pass."""
    clock = queue.clock(body)
    if clock is not None:
        queue.put_back(key, clock)
