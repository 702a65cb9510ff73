"""Reconcilers: observe, decide with the pure modules, act through savepoint.k8s."""

from __future__ import annotations

import threading
from collections import defaultdict

# kopf runs the create handler, timers and watch-event handlers of one object in
# different threads; one pass at a time per object keeps check-then-act steps (such as
# "append checkpoint.created unless it is there") from racing within this process.
_locks: defaultdict[tuple[str, str, str], threading.Lock] = defaultdict(threading.Lock)
_guard = threading.Lock()


def object_lock(kind: str, namespace: str, name: str) -> threading.Lock:
    with _guard:
        return _locks[(kind, namespace, name)]
