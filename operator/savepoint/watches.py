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

Deliver = Callable[[str | None, dict], None]


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
    stop: threading.Event | None = None,
    timeout: int = 300,
) -> None:
    """Watch one kind until `stop` is set (forever without one): every event goes to
    `deliver`, a listing first. After a 410, `expired()` runs before the listing again
    (without `listing`, the watch goes on from now: `expired` is how its user learns
    that events were missed)."""
    version: str | None = None
    while stop is None or not stop.is_set():
        try:
            if version is None:
                if listing:
                    version = list_all(kind, namespace, selector, deliver)
                else:
                    version = k8s.collection_version(kind, namespace, selector)
            for event_type, body in k8s.watch(kind, namespace, version, selector, timeout):
                version = (body.get("metadata") or {}).get("resourceVersion") or version
                if event_type != "BOOKMARK":
                    _deliver(deliver, kind, event_type, body)
                if stop is not None and stop.is_set():
                    return
        except k8s.Expired:
            version = None
            expired()
        except Exception:  # the API server away: watch again from where it stopped
            log.warning("the %s watch failed; watching again", kind.plural, exc_info=True)
            time.sleep(RETRY_SECONDS)


def _deliver(deliver: Deliver, kind: k8s.Kind, event_type: str | None, body: dict) -> None:
    # One event's failure is that event's: the stream goes on (as a kopf event handler's).
    try:
        deliver(event_type, body)
    except Exception:
        meta = body.get("metadata") or {}
        log.exception("handling a %s event of %s/%s", kind.plural, meta.get("namespace"), meta.get("name"))
