"""Checkpoint handlers: a Session some checkpoints wait for moves them on.

The Checkpoints themselves and their VolumeSnapshots are the runtime's own watches
(savepoint.watches): kopf writes nothing on a Checkpoint, and reads none of their events."""

from __future__ import annotations

import kopf

from savepoint.controllers import cache
from savepoint.models import GROUP, VERSION


def _awaited_session(namespace: str, name: str, status: kopf.Status, memo: kopf.Memo, **_: object) -> bool:
    # A filter: the events of the sessions no checkpoint waits for cost no worker thread.
    return status.get("phase") not in (None, "Provisioning") and bool(memo.runtime.waiting_for(namespace, name))


@kopf.on.event(GROUP, VERSION, "sessions", id="checkpoint_session_event", when=_awaited_session)
async def checkpoint_session_event(
    type: str | None, body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, **_: object
) -> None:
    """A Session some checkpoints wait for is no longer Provisioning: admit them now (in
    the event loop, not a worker thread: it only files keys for the admission threads)."""
    cache.sessions.observe(type, dict(body))  # the passes read it: this event's copy, not an older one
    for waiting in memo.runtime.waiting_for(namespace, name):
        memo.runtime.admit_checkpoint((namespace, waiting))
