"""What the watches last showed, so a pass reads memory instead of the API.

kopf already watches Sessions, Checkpoints and the Sessions' Pods and claims; its event
handlers put each body here (handlers/, runtime.py), and our own writes put what the API
server answered, so a pass that follows its own write does not read an older copy. A read
that finds nothing asks the API server (an object not seen yet, or gone): a hit may be a
moment old, which level-based passes allow, since the watch event that brings the newer
copy also brings another pass. The Session pass still reads the Session itself fresh
(another controller may have just written it), and the resync reads everything fresh.

Measured on the local control plane, a checkpoint cost 22 operator requests, 9 of them
reads these stores now answer (docs/performance.md).
"""

from __future__ import annotations

import copy
import itertools
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from savepoint import k8s
from savepoint.models import FINISHED_FORK_PHASES, SETTLED_CHECKPOINT_PHASES

Key = tuple[str, str]


def version(body: dict) -> int:
    """A body's resourceVersion as a number, to order two bodies of one object."""
    try:
        return int(body["metadata"].get("resourceVersion") or 0)
    except ValueError:  # opaque to clients in principle; etcd's are integers
        return 0


def newest(*bodies: dict | None) -> dict | None:
    """The body with the highest resourceVersion among those given (None for none)."""
    present = [b for b in bodies if b]
    return max(present, key=version) if present else None


# Bodies kept per kind, the least recently written dropped first: a pass that misses reads
# the API server. About 14 KiB of heap per Pod body: 2,000 Sessions with their Pods and
# claims would otherwise add about 60 MiB to an operator that rests at 250 MiB.
STORE_LIMIT = 1000


class Store:
    """Bodies of one kind by (namespace, name), the newest resourceVersion kept."""

    def __init__(self, keep: Callable[[dict], bool] = lambda body: True, limit: int = STORE_LIMIT) -> None:
        self._keep = keep
        self._limit = limit
        self._bodies: OrderedDict[Key, dict] = OrderedDict()
        # Names whose DELETED event came last: known to be gone, not merely not kept.
        self._gone: OrderedDict[Key, None] = OrderedDict()
        self._lock = threading.Lock()

    def observe(self, event_type: str | None, body: dict) -> None:
        """A watch event: keep the body (unless `keep` says no), or drop it when DELETED."""
        key = (body["metadata"].get("namespace", ""), body["metadata"]["name"])
        if event_type == "DELETED" or not self._keep(body):
            with self._lock:
                self._bodies.pop(key, None)
                if event_type == "DELETED":
                    self._gone[key] = None
                    self._gone.move_to_end(key)
                    while len(self._gone) > self._limit:
                        self._gone.popitem(last=False)
            return
        self.put(body)

    def put(self, body: dict | None) -> None:
        """Our own write's answer, or a watch event's body: kept unless a newer one is
        (without managedFields, the largest part of a body, which no pass reads)."""
        if not body or not body.get("metadata", {}).get("name"):
            return
        body = _slim(body)
        key = (body["metadata"].get("namespace", ""), body["metadata"]["name"])
        with self._lock:
            self._gone.pop(key, None)
            old = self._bodies.get(key)
            if old is not None and version(body) < version(old):
                return
            if not self._keep(body):
                self._bodies.pop(key, None)
                return
            self._bodies[key] = body
            self._bodies.move_to_end(key)
            while len(self._bodies) > self._limit:
                self._bodies.popitem(last=False)

    def get(self, namespace: str, name: str) -> dict | None:
        """A copy of the newest body seen, or None."""
        with self._lock:
            body = self._bodies.get((namespace, name))
        return copy.deepcopy(body) if body is not None else None

    def has(self, namespace: str, name: str) -> bool:
        with self._lock:
            return (namespace, name) in self._bodies

    def matches(self, namespace: str, name: str, test: Callable[[dict], bool]) -> bool:
        """Whether the newest body seen is there and `test` holds for it (no copy made)."""
        with self._lock:
            body = self._bodies.get((namespace, name))
            return body is not None and test(body)

    def gone(self, namespace: str, name: str) -> bool:
        """Whether the last the watch said of this name was its deletion (nothing made since)."""
        with self._lock:
            return (namespace, name) in self._gone

    def names(self, namespace: str, where: Callable[[dict], bool]) -> list[str]:
        """The names of the bodies kept in a namespace for which `where` is true."""
        with self._lock:
            return sorted(name for (ns, name), body in self._bodies.items() if ns == namespace and where(body))

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._bodies.pop((namespace, name), None)
            self._gone.pop((namespace, name), None)

    def clear(self) -> None:
        with self._lock:
            self._bodies.clear()
            self._gone.clear()

    def __len__(self) -> int:
        return len(self._bodies)


def _slim(body: dict) -> dict:
    if "managedFields" not in body.get("metadata", {}):
        return body
    return {**body, "metadata": {k: v for k, v in body["metadata"].items() if k != "managedFields"}}


CHUNK_NAME = re.compile(r"(.+)-log-(\d{6})")


_stamp_numbers = itertools.count(1)


class Chunks:
    """The newest chunk of each Session's log, as the chunk watch (or our own read or write
    of it) last showed it, and whether anything a digest already folded has changed since:
    an older chunk rewritten (erase) or deleted (retention), or an event of the newest
    rewritten. A Session pass then folds only the newest chunk's new events into the
    log's digest (controllers/logview.py) instead of reading the whole log."""

    def __init__(self, limit: int = STORE_LIMIT) -> None:
        self._limit = limit
        self._newest: OrderedDict[Key, tuple[int, dict]] = OrderedDict()
        self._changed: set[Key] = set()
        self._stamps: dict[Key, int] = {}  # a number new to each change flagged (stamp())
        self._read_at: dict[Key, float] = {}  # when our last read of the newest chunk started
        # Namespace -> the newest resourceVersion its chunk watch delivered (delivered()).
        self._delivered: dict[str, int] = {}
        self._lock = threading.Lock()

    def observe(self, event_type: str | None, body: dict) -> None:
        """A chunk's watch event (event_type None: from a listing, in no particular order)."""
        meta = body["metadata"]
        found = CHUNK_NAME.fullmatch(meta["name"])
        if found is None:
            return
        key, index = (meta.get("namespace", ""), found.group(1)), int(found.group(2))
        with self._lock:
            held = self._newest.get(key)
            if event_type == "DELETED":
                if held is not None and index <= held[0]:
                    self._flag(key)
                if held is not None and index == held[0]:
                    del self._newest[key]
                return
            if held is not None and index < held[0]:
                if event_type is not None:
                    self._flag(key)  # a sealed chunk rewritten: erase
                return
            self._keep(key, index, held, body)

    def put(self, body: dict, sent: float | None = None) -> None:
        """A chunk this process read, or wrote in a write sent at monotonic `sent`: kept if
        it is the newest. A write's answer is the log's newest chunk as of a moment after
        it was sent, as good as a read started then (mark_read)."""
        meta = body.get("metadata") or {}
        found = CHUNK_NAME.fullmatch(meta.get("name", ""))
        if found is None:
            return
        key, index = (meta.get("namespace", ""), found.group(1)), int(found.group(2))
        with self._lock:
            held = self._newest.get(key)
            if held is None or index >= held[0]:
                self._keep(key, index, held, body)
        if sent is not None:
            self.mark_read(*key, sent)

    def _keep(self, key: Key, index: int, held: tuple[int, dict] | None, body: dict) -> None:
        if held is not None and held[0] == index:
            if version(body) <= version(held[1]):
                return
            old, new = held[1].get("data") or {}, body.get("data") or {}
            if any(new.get(k) != v for k, v in old.items()):
                self._flag(key)  # an event rewritten in place: erase
        self._newest[key] = (index, _slim(body))
        self._newest.move_to_end(key)
        while len(self._newest) > self._limit:
            gone, _ = self._newest.popitem(last=False)
            self._read_at.pop(gone, None)
            self._stamps.pop(gone, None)

    def _flag(self, key: Key) -> None:
        self._changed.add(key)
        self._stamps[key] = next(_stamp_numbers)

    def stamp(self, namespace: str, session: str) -> int | None:
        """A number that stays the same until something a digest folded changes (None
        while such a change waits for take_changed): a read of the log that started
        under one stamp still shows the folded events while the stamp is unchanged."""
        with self._lock:
            key = (namespace, session)
            return None if key in self._changed else self._stamps.get(key, 0)

    def newest(self, namespace: str, session: str) -> dict | None:
        """The newest chunk seen of the session's log (not a copy: never change it)."""
        with self._lock:
            held = self._newest.get((namespace, session))
        return held[1] if held is not None else None

    def mark_read(self, namespace: str, session: str, started: float) -> None:
        """Our own read of the session's newest chunk, started at monotonic `started`, is in."""
        with self._lock:
            key = (namespace, session)
            self._read_at[key] = max(started, self._read_at.get(key, started))

    def read_since(self, namespace: str, session: str) -> float | None:
        """When our newest read of the session's newest chunk started (None: none kept)."""
        with self._lock:
            key = (namespace, session)
            return self._read_at.get(key) if key in self._newest else None

    def delivered(self, body: dict) -> None:
        """The chunk watch delivered (and the store holds) an event of `body`, a ConfigMap
        of a Session, chunk or not. A watch delivers its events in resourceVersion order,
        so every change to the namespace's chunks at an older version is in the store."""
        namespace = body["metadata"].get("namespace", "")
        with self._lock:
            self._delivered[namespace] = max(version(body), self._delivered.get(namespace, 0))

    def delivered_through(self, namespace: str) -> int:
        """The newest version the namespace's chunk watch delivered (0: none yet): the
        store shows every chunk of it as it stood at that version, or newer."""
        with self._lock:
            return self._delivered.get(namespace, 0)

    def take_changed(self, namespace: str, session: str) -> bool:
        """Whether what a digest folded may have changed since the last call."""
        with self._lock:
            if (namespace, session) in self._changed:
                self._changed.discard((namespace, session))
                return True
            return False

    def clear(self) -> None:
        with self._lock:
            self._newest.clear()
            self._changed.clear()
            self._stamps.clear()
            self._read_at.clear()
            self._delivered.clear()

    def __len__(self) -> int:
        return len(self._newest)


class Memo:
    """Values by (namespace, name), the least recently written dropped first."""

    def __init__(self, limit: int = STORE_LIMIT) -> None:
        self._limit = limit
        self._values: OrderedDict[Key, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, namespace: str, name: str) -> Any:
        with self._lock:
            return self._values.get((namespace, name))

    def put(self, namespace: str, name: str, value: Any) -> None:
        with self._lock:
            self._values[(namespace, name)] = value
            self._values.move_to_end((namespace, name))
            while len(self._values) > self._limit:
                self._values.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._values.clear()


sessions = Store()
# Only unsettled Checkpoints: a settled one's pass has nothing to do, and thousands of
# them would only cost memory.
checkpoints = Store(keep=lambda body: (body.get("status") or {}).get("phase") not in SETTLED_CHECKPOINT_PHASES)
# Only unfinished Forks, for the same reason.
forks = Store(keep=lambda body: (body.get("status") or {}).get("phase") not in FINISHED_FORK_PHASES)
claims = Store()
pods = Store()
chunks = Chunks()
# Each Session's log digest (controllers/logview.py), by the Session's name.
log_views = Memo()


_reads = threading.local()


@contextmanager
def reading(cached: bool) -> Iterator[None]:
    """Within it, on this thread, in_use() says whether a pass may read the stores."""
    before = in_use()
    _reads.cached = cached
    try:
        yield
    finally:
        _reads.cached = before


def in_use() -> bool:
    return getattr(_reads, "cached", True)


def session(namespace: str, name: str) -> dict | None:
    return sessions.get(namespace, name) or k8s.get_custom("sessions", namespace, name)


class Reads:
    """Our newest read of each object: when it started (monotonic) and what it found. A GET
    is a quorum read: one that started after an object arrived shows everything changed
    before that object was made, so it serves every object that arrived before it
    started, as a burst's do."""

    def __init__(self, limit: int = STORE_LIMIT) -> None:
        self._limit = limit
        self._held: dict[Any, tuple[float, Any]] = {}
        self._lock = threading.Lock()

    def since(self, key: Any, seen_at: float | None) -> tuple[bool, Any]:
        """(True, what it found) when a read of `key` started at or after `seen_at`, else
        (False, None); `seen_at` None is never served."""
        with self._lock:
            held = self._held.get(key)
        if seen_at is None or held is None or held[0] < seen_at:
            return False, None
        return True, held[1]

    def note(self, key: Any, started: float, found: Any = None) -> None:
        """A read of `key` that started at `started` found `found`: kept unless a read
        that started later is."""
        with self._lock:
            if key in self._held and self._held[key][0] > started:
                return
            self._held[key] = (started, found)
            while len(self._held) > self._limit:
                del self._held[next(iter(self._held))]

    def clear(self) -> None:
        with self._lock:
            self._held.clear()


# Our reads of Sessions for checkpoint admission and a fork's source (the body found is
# kept in `sessions`).
_session_reads = Reads()


def session_as_of(namespace: str, name: str, seen_at: float | None, made_version: int = 0) -> dict | None:
    """The Session as it was at least when a Checkpoint (or a Fork) was made: its spec as
    it stood then applies to that checkpoint (hooks, snapshot class) or fork (the target's
    spec). `seen_at` is when the watch delivered that object (monotonic; None reads the
    Session now) and `made_version` the object's resourceVersion.

    The watch's copy serves when it is newer than the object; otherwise it may lag a
    change made just before it (hooks added, then a checkpoint asked for), so the Session
    is read (Reads: one read serves the checkpoints that arrived before it started).
    """
    key = (namespace, name)
    held = sessions.get(namespace, name)
    if held is not None and made_version and version(held) >= made_version:
        return held
    if held is not None and _session_reads.since(key, seen_at)[0]:
        return held
    started = time.monotonic()
    body = k8s.get_custom("sessions", namespace, name)
    if body is None:
        return None
    sessions.put(body)
    _session_reads.note(key, started)
    return newest(body, sessions.get(namespace, name))


def checkpoint(namespace: str, name: str) -> dict | None:
    return checkpoints.get(namespace, name) or k8s.get_custom("checkpoints", namespace, name)


def fork(namespace: str, name: str) -> dict | None:
    return forks.get(namespace, name) or k8s.get_custom("forks", namespace, name)


def claim(namespace: str, name: str) -> dict | None:
    return claims.get(namespace, name) or k8s.get_pvc(namespace, name)


def pod(namespace: str, name: str) -> dict | None:
    """The Pod as the watch last showed it; read when the watch has not shown it, but not
    when its last word was the Pod's deletion: a paused Session, or one whose Pod a
    rollback deleted, would otherwise read its missing Pod in every pass."""
    if pods.gone(namespace, name):
        return None
    return pods.get(namespace, name) or k8s.get_pod(namespace, name)


# Namespace -> (monotonic time read, its metadata): its labels set a Session's Pod
# Security level and its annotations the log retention (admission reads its checkpoint
# policy fresh: an annotation set a moment ago applies to the next checkpoint); passes
# are many and namespaces are not watched.
_namespaces: dict[str, tuple[float, dict[str, Any]]] = {}
NAMESPACE_CACHE_SECONDS = 5.0


def namespace_meta(namespace: str) -> dict[str, Any]:
    cached = _namespaces.get(namespace)
    if cached is not None and time.monotonic() - cached[0] < NAMESPACE_CACHE_SECONDS:
        return cached[1]
    full = k8s.get_namespace(namespace).get("metadata") or {}
    meta = {"labels": full.get("labels") or {}, "annotations": full.get("annotations") or {}}
    _namespaces[namespace] = (time.monotonic(), meta)
    return meta


# Namespace -> our newest read of its annotations, for checkpoint admission.
_policies = Reads()


def namespace_annotations(namespace: str, seen_at: float | None) -> dict[str, str]:
    """The namespace's annotations as they were at least at monotonic time `seen_at` (when
    the watch delivered the Checkpoint they apply to); None reads them now. Under a burst
    one read admits a whole queue of checkpoints (Reads).
    """
    served, annotations = _policies.since(namespace, seen_at)
    if served:
        return annotations
    started = time.monotonic()
    annotations = (k8s.get_namespace(namespace).get("metadata") or {}).get("annotations") or {}
    _policies.note(namespace, started, annotations)
    return annotations


def clear() -> None:
    """Forget everything (a test that starts as a fresh process)."""
    for store in (sessions, checkpoints, forks, claims, pods, chunks, log_views):
        store.clear()
    _namespaces.clear()
    _policies.clear()
    _session_reads.clear()
