"""Reconcilers: observe, decide with the pure modules, act through savepoint.k8s."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter

from savepoint import k8s

# kopf runs the create handler, timers and watch-event handlers of one object in
# different threads; one pass at a time per object keeps check-then-act steps (such as
# "append checkpoint.created unless it is there") from racing within this process.
_locks: defaultdict[tuple[str, str, str], threading.Lock] = defaultdict(threading.Lock)
_guard = threading.Lock()


def object_lock(kind: str, namespace: str, name: str) -> threading.Lock:
    with _guard:
        return _locks[(kind, namespace, name)]


# When each object's last successful pass started (monotonic seconds).
_done: dict[tuple[str, str, str], float] = {}


def one_pass(kind: str, namespace: str, name: str, reconcile: Callable[[], float | None]) -> None:
    """Run reconcile under the object's lock, unless a pass that started after we were
    asked has already succeeded: it observed everything we would (a work queue's dedupe).
    A reconcile that worked from something read before it started returns when that was
    read (monotonic): a pass asked for after that moment is not skipped.

    At start-up kopf asks for a Session's reconcile once for the Session and once per
    Pod, claim and log chunk it owns; under load a checkpoint's snapshot sends several
    watch events in a row. Coalescing these keeps the same outcome with fewer requests.
    """
    asked = time.monotonic()
    key = (kind, namespace, name)
    with object_lock(kind, namespace, name):
        if _done.get(key, float("-inf")) > asked:
            return
        started = time.monotonic()
        observed = reconcile()
        _done[key] = started if observed is None else min(started, observed)


def has_run(kind: str, namespace: str, name: str) -> bool:
    """Whether a pass of this object has succeeded in this process."""
    return (kind, namespace, name) in _done


def forget(kind: str, namespace: str, name: str) -> None:
    """Drop what one_pass and object_lock keep for an object that is gone (its DELETED
    event), so an operator that sees thousands of objects come and go does not keep them.
    A lock a pass still holds stays: the pass ends, and a re-created object reuses it."""
    key = (kind, namespace, name)
    with _guard:
        lock = _locks.get(key)
        if lock is not None and not lock.locked():
            del _locks[key]
        _done.pop(key, None)


def write_status(
    plural: str,
    body: dict,
    status: dict[str, Any],
    transitions: Counter,
    event: tuple[str, str] | None = None,
    warn: bool = False,
) -> dict | None:
    """Patch a Checkpoint's or Fork's status (with observedGeneration), count a phase change
    in `transitions` by phase and reason, keep `body` in step, then post `event` (reason,
    message). Returns the object as written (None if it is gone)."""
    meta = body["metadata"]
    status = {**status, "observedGeneration": meta.get("generation")}
    written = k8s.patch_status(plural, meta["namespace"], meta["name"], status)
    if "phase" in status and status["phase"] != (body.get("status") or {}).get("phase"):
        transitions.labels(status["phase"], status.get("reason") or "").inc()
    body["status"] = {**(body.get("status") or {}), **status}
    if event:
        k8s.post_event(body, event[0], event[1], warning=warn)
    return written
