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
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from savepoint import k8s

Key = tuple[str, str]


def _version(body: dict) -> int:
    try:
        return int(body["metadata"].get("resourceVersion") or 0)
    except ValueError:  # opaque to clients in principle; etcd's are integers
        return 0


def newest(*bodies: dict | None) -> dict | None:
    """The body with the highest resourceVersion among those given (None for none)."""
    present = [b for b in bodies if b]
    return max(present, key=_version) if present else None


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
        self._lock = threading.Lock()

    def observe(self, event_type: str | None, body: dict) -> None:
        """A watch event: keep the body (unless `keep` says no), or drop it when DELETED."""
        key = (body["metadata"].get("namespace", ""), body["metadata"]["name"])
        if event_type == "DELETED" or not self._keep(body):
            with self._lock:
                self._bodies.pop(key, None)
            return
        self.put(body)

    def put(self, body: dict | None) -> None:
        """Our own write's answer, or a watch event's body: kept unless a newer one is
        (without managedFields, the largest part of a body, which no pass reads)."""
        if not body or not body.get("metadata", {}).get("name"):
            return
        if "managedFields" in body["metadata"]:
            body = {**body, "metadata": {k: v for k, v in body["metadata"].items() if k != "managedFields"}}
        key = (body["metadata"].get("namespace", ""), body["metadata"]["name"])
        with self._lock:
            old = self._bodies.get(key)
            if old is not None and _version(body) < _version(old):
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

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._bodies.pop((namespace, name), None)

    def clear(self) -> None:
        with self._lock:
            self._bodies.clear()

    def __len__(self) -> int:
        return len(self._bodies)


SETTLED_PHASES = ("Ready", "Failed", "Rejected", "Expired")

sessions = Store()
# Only unsettled Checkpoints: a settled one's pass has nothing to do, and thousands of
# them would only cost memory.
checkpoints = Store(keep=lambda body: (body.get("status") or {}).get("phase") not in SETTLED_PHASES)
# Only unfinished Forks, for the same reason.
forks = Store(keep=lambda body: (body.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))
claims = Store()
pods = Store()


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


def checkpoint(namespace: str, name: str) -> dict | None:
    return checkpoints.get(namespace, name) or k8s.get_custom("checkpoints", namespace, name)


def fork(namespace: str, name: str) -> dict | None:
    return forks.get(namespace, name) or k8s.get_custom("forks", namespace, name)


def claim(namespace: str, name: str) -> dict | None:
    return claims.get(namespace, name) or k8s.get_pvc(namespace, name)


def pod(namespace: str, name: str) -> dict | None:
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


def clear() -> None:
    """Forget everything (a test that starts as a fresh process)."""
    for store in (sessions, checkpoints, forks, claims, pods):
        store.clear()
    _namespaces.clear()
