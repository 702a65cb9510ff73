"""Our own watch streams, for the kinds with an event or more in every checkpoint.

kopf runs each watch event through its handler machinery (the handlers' filters, their
keyword arguments, a per-object worker): for the Checkpoints, their VolumeSnapshots and
the Sessions' Pods, claims and log chunks that was most of the operator's CPU under a
burst of checkpoints, for handlers that only file a key or keep a body in memory. One
thread per kind (and per served namespace) reads the stream instead and hands each event
to one function (savepoint.runtime).

A watch starts from a listing, each item delivered as kopf delivers a listed object
(event type None), or, with `listing=False`, from the version of now. It goes on from
the last version seen when its stream ends or fails, and lists again after a 410 Gone
(the API server's watch cache has moved past it: after its restart, say).

An OnDemand watch runs only while something needs it: the VolumeSnapshots matter only
while a checkpoint is unsettled, and an expiry storm of 5,000 Ready checkpoints sent
this watch three or four events of each snapshot it deleted, for nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from savepoint import k8s

log = logging.getLogger(__name__)

# How long a watch waits before it watches again after an error.
RETRY_SECONDS = 1.0
# How long OnDemand.watch() waits for the watch to open before its caller goes on without it.
OPEN_TIMEOUT_SECONDS = 30.0

Deliver = Callable[[str | None, dict], None]
# What an OnDemand watch is opened for: a (namespace, name).
Key = tuple[str, str]


def list_all(kind: k8s.Kind, namespace: str | None, selector: str, deliver: Deliver) -> str:
    """Deliver every selected object (event type None), a page at a time; the listing's version."""
    token = None
    while True:
        page = k8s.list_page(kind, namespace, selector, token)
        for item in page.get("items") or ():
            _deliver(deliver, kind, None, item)
        token = (page.get("metadata") or {}).get("continue")
        if not token:
            return str(page["metadata"]["resourceVersion"])


def follow(
    kind: k8s.Kind,
    namespace: str | None,
    selector: str,
    deliver: Deliver,
    *,
    listing: bool = True,
    expired: Callable[[], None] = lambda: None,
    opened: Callable[[], None] = lambda: None,
    stop: Callable[[], bool] = lambda: False,
    timeout: int = 300,
) -> None:
    """Watch one kind until `stop()`, asked each time a stream ends (at least every
    `timeout` seconds): every event goes to `deliver`, a listing first. `opened()` runs
    each time the watch has the version it starts from: every change after it is
    delivered. After a 410, `expired()` runs before the listing again (without
    `listing`, the watch goes on from now: `expired` is how its user learns that events
    were missed)."""
    version: str | None = None
    while True:
        try:
            if version is None:
                if listing:
                    version = list_all(kind, namespace, selector, deliver)
                else:
                    version = k8s.collection_version(kind, namespace, selector)
                opened()
            for event_type, body in k8s.watch(kind, namespace, version, selector, timeout):
                version = (body.get("metadata") or {}).get("resourceVersion") or version
                if event_type != "BOOKMARK":
                    _deliver(deliver, kind, event_type, body)
        except k8s.Expired:
            version = None
            expired()
        except Exception:  # the API server away: watch again from where it stopped
            log.warning("the %s watch failed; watching again", kind.plural, exc_info=True)
            time.sleep(RETRY_SECONDS)
        if stop():
            return


class OnDemand:
    """A watch from now on, open only while some key is `needed`: `watch(key)` opens it
    (if it is not open) and returns once it has the version it starts from, so every
    change after that call is delivered. When a stream ends (every `window` seconds) and
    no key it was asked for is needed any more, it closes. A 410 reopens it from now,
    `expired()` telling its user what it missed; meanwhile `watch()` waits."""

    def __init__(
        self,
        kind: k8s.Kind,
        namespace: str | None,
        selector: str,
        deliver: Deliver,
        needed: Callable[[Key], bool],
        *,
        expired: Callable[[], None] = lambda: None,
        window: int = 60,
    ) -> None:
        self.kind, self.namespace, self.selector = kind, namespace, selector
        self._deliver, self._needed, self._expired, self._window = deliver, needed, expired, window
        self._wanted: set[Key] = set()
        self._open = False
        self._changed = threading.Condition()

    @property
    def is_open(self) -> bool:
        return self._open

    def watch(self, key: Key, timeout: float = OPEN_TIMEOUT_SECONDS) -> bool:
        """Keep the watch open while `key` is needed (one not needed returns at once);
        False if it did not open within `timeout` (the API server away)."""
        if not self._needed(key):
            return True
        with self._changed:
            self._wanted.add(key)
            self._changed.notify_all()
            return self._changed.wait_for(lambda: self._open, timeout)

    def run(self) -> None:
        """The watch's thread: idle while nothing is wanted, following while something is."""
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._wanted)
            follow(
                self.kind,
                self.namespace,
                self.selector,
                self._deliver,
                listing=False,
                expired=self._lost,
                opened=lambda: self._set_open(True),
                stop=self._unneeded,
                timeout=self._window,
            )

    def _set_open(self, value: bool) -> None:
        with self._changed:
            self._open = value
            self._changed.notify_all()

    def _lost(self) -> None:
        self._set_open(False)  # until watched from now again
        self._expired()

    def _unneeded(self) -> bool:
        with self._changed:
            self._wanted = {key for key in self._wanted if self._needed(key)}
            if self._wanted:
                return False
            self._open = False
            return True


def _deliver(deliver: Deliver, kind: k8s.Kind, event_type: str | None, body: dict) -> None:
    # One event's failure is that event's: the stream goes on (as a kopf event handler's).
    try:
        deliver(event_type, body)
    except Exception:
        meta = body.get("metadata") or {}
        log.exception("handling a %s event of %s/%s", kind.plural, meta.get("namespace"), meta.get("name"))
