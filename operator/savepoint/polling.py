"""Periodic passes over many objects without a kopf timer per object.

A kopf timer keeps its object's whole latest body in memory for as long as the object
exists (kopf's live body for daemons), whether or not the timer's filter matches: with
a Pending-poll timer on Checkpoints and a resync timer on Sessions, that was every
Checkpoint's and Session's body, the largest part of the operator's memory at thousands
of them. Instead, a watch handler files each object that needs polling here, by key
only, and one loop takes what is due.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class PollQueue:
    """Keys (namespace, name) each due every `interval` seconds, first `interval` after
    they are filed. Filing a key already there keeps its time; dropping forgets it.

    With `spread`, each key's interval is shorter by its own fixed share of up to that
    fraction (from a hash of the key), so keys filed or taken together (Sessions made in
    one go, or every one hurried after a take-over) come apart instead of falling due
    together every interval for as long as they live."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic, spread: float = 0.0) -> None:
        self.interval = interval
        self.spread = spread
        self._clock = clock
        self._due: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def interval_of(self, key: tuple[str, str]) -> float:
        share = zlib.crc32("/".join(key).encode()) / 0xFFFFFFFF
        return self.interval * (1 - self.spread * share)

    def file(self, key: tuple[str, str]) -> None:
        with self._lock:
            if key not in self._due:
                self._due[key] = self._clock() + self.interval_of(key)

    def drop(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._due.pop(key, None)

    def hurry(self, within: float = 0.0, keys: list[tuple[str, str]] | None = None) -> None:
        """Make these keys (all of them by default) due within `within` seconds, unless
        they are due sooner already."""
        at = self._clock() + within
        with self._lock:
            for key in self._due if keys is None else keys:
                if key in self._due:
                    self._due[key] = min(self._due[key], at)

    def take_due(self, limit: int | None = None) -> list[tuple[str, str]]:
        """Keys due now (the most overdue first, at most `limit`), each due again an interval later."""
        now = self._clock()
        with self._lock:
            due = sorted((at, key) for key, at in self._due.items() if at <= now)
            if limit is not None:
                due = due[:limit]
            for _, key in due:
                self._due[key] = now + self.interval_of(key)
        return [key for _, key in due]

    def __len__(self) -> int:
        return len(self._due)


class WorkQueue:
    """Keys waiting for a pass, each with the small payload it was filed with, worked in
    the order filed by a few threads of our own. Filing a key that is still waiting
    replaces its payload and keeps its place; a key being worked may be filed again.

    A kopf handler that files its object here returns at once. kopf keeps a queue of raw
    watch events for each object whose handler has not finished: under a backlog, one
    whole body per object waiting (savepoint.runtime).
    """

    def __init__(self, name: str, workers: int, work: Callable[[tuple[str, str], Any], None]) -> None:
        self.name = name
        self.workers = workers
        self._work = work
        self._waiting: dict[tuple[str, str], Any] = {}
        self._ready = threading.Condition()
        self._started = False

    def file(self, key: tuple[str, str], payload: Any = None) -> None:
        with self._ready:
            self._waiting[key] = payload
            self._ready.notify()

    def take(self, timeout: float | None = None) -> tuple[tuple[str, str], Any] | None:
        """The oldest waiting key and its payload, removed; None after `timeout` with none."""
        with self._ready:
            if not self._ready.wait_for(lambda: self._waiting, timeout):
                return None
            key = next(iter(self._waiting))
            return key, self._waiting.pop(key)

    def start(self) -> None:
        """Start the worker threads (once)."""
        with self._ready:
            if self._started:
                return
            self._started = True
        for i in range(self.workers):
            threading.Thread(target=self._run, name=f"{self.name}-{i}", daemon=True).start()

    def _run(self) -> None:
        while True:
            item = self.take()
            assert item is not None  # no timeout: take() waits for an item
            key, payload = item
            try:
                self._work(key, payload)
            except Exception:  # logged; the thread goes on to the next key
                log.exception("%s: working %s/%s", self.name, *key)

    def __contains__(self, key: tuple[str, str]) -> bool:
        """Whether the key is waiting (not once a thread has taken it)."""
        return key in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)


class DeadlineQueue:
    """Keys each due once, at a time of its own (monotonic seconds): the idle timers of
    Sessions (spec.idle). Scheduling a key again replaces its time; a key taken is gone
    until it is scheduled again."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._due: dict[tuple[str, str], float] = {}
        self._changed = threading.Condition()

    def schedule(self, key: tuple[str, str], at: float) -> None:
        with self._changed:
            self._due[key] = at
            self._changed.notify_all()

    def drop(self, key: tuple[str, str]) -> None:
        with self._changed:
            self._due.pop(key, None)

    def take_due(self) -> list[tuple[str, str]]:
        """Keys due now, the most overdue first, removed."""
        now = self._clock()
        with self._changed:
            due = sorted((at, key) for key, at in self._due.items() if at <= now)
            for _, key in due:
                del self._due[key]
        return [key for _, key in due]

    def wait(self, timeout: float) -> None:
        """Sleep until the earliest key is due, a key is scheduled, or `timeout` passes."""
        with self._changed:
            wait = timeout
            if self._due:
                wait = min(timeout, max(0.0, min(self._due.values()) - self._clock()))
            if wait > 0:
                self._changed.wait(wait)

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._due

    def __len__(self) -> int:
        return len(self._due)


class Spaced:
    """Passes asked for a key at most once per `gap` seconds: the first at once, and all
    those asked within the gap after it as one pass at its end (from `due()`)."""

    def __init__(self, gap: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.gap = gap
        self._clock = clock
        self._last: dict[tuple[str, str], float] = {}
        self.later = DeadlineQueue(clock)
        self._lock = threading.Lock()

    def ask(self, key: tuple[str, str]) -> bool:
        """True: pass now. False: the pass comes from due() at the gap's end."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is None or now - last >= self.gap:
                self._last[key] = now
                if len(self._last) > 1000:  # keep only the keys still within their gap
                    self._last = {k: t for k, t in self._last.items() if now - t < self.gap}
                return True
            if key not in self.later:
                self.later.schedule(key, last + self.gap)
            return False

    def due(self) -> list[tuple[str, str]]:
        """The keys whose deferred pass is due now (each one's gap starts again)."""
        keys = self.later.take_due()
        now = self._clock()
        with self._lock:
            for key in keys:
                self._last[key] = now
        return keys

    def forget(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._last.pop(key, None)
        self.later.drop(key)
