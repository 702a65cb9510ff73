"""Periodic passes over many objects without a kopf timer per object.

A kopf timer keeps its object's whole latest body in memory for as long as the object
exists (kopf's live body for daemons), whether or not the timer's filter matches: with
a Pending-poll timer on Checkpoints and a resync timer on Sessions, that was every
Checkpoint's and Session's body, the largest part of the operator's memory at thousands
of them. Instead, a watch handler files each object that needs polling here, by key
only, and one loop takes what is due.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class PollQueue:
    """Keys (namespace, name) each due every `interval` seconds, first `interval` after
    they are filed. Filing a key already there keeps its time; dropping forgets it."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._due: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def file(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._due.setdefault(key, self._clock() + self.interval)

    def drop(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._due.pop(key, None)

    def take_due(self, limit: int | None = None) -> list[tuple[str, str]]:
        """Keys due now (the most overdue first, at most `limit`), each due again an interval later."""
        now = self._clock()
        with self._lock:
            due = sorted((at, key) for key, at in self._due.items() if at <= now)
            if limit is not None:
                due = due[:limit]
            for _, key in due:
                self._due[key] = now + self.interval
        return [key for _, key in due]

    def __len__(self) -> int:
        return len(self._due)
