"""Checkpoint handlers: which watch event calls which runtime step or controller."""

from __future__ import annotations

import kopf

from savepoint.constants import RECLAIM_LABEL
from savepoint.controllers import cache
from savepoint.models import GROUP, VERSION

CHECKPOINTS = (GROUP, VERSION, "checkpoints")


def _awaited_session(namespace: str, name: str, status: kopf.Status, memo: kopf.Memo, **_: object) -> bool:
    # A filter: the events of the sessions no checkpoint waits for cost no worker thread.
    return status.get("phase") not in (None, "Provisioning") and bool(memo.runtime.waiting_for(namespace, name))


@kopf.on.event(GROUP, VERSION, "sessions", id="checkpoint_session_event", when=_awaited_session)
def checkpoint_session_event(
    type: str | None, body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, **_: object
) -> None:
    """A Session some checkpoints wait for is no longer Provisioning: admit them now."""
    cache.sessions.observe(type, dict(body))  # the passes read it: this event's copy, not an older one
    for waiting in memo.runtime.waiting_for(namespace, name):
        memo.runtime.admit_checkpoint((namespace, waiting))


# Only watch events, no create, resume or delete handler: kopf then writes nothing of its
# own on a Checkpoint (no finalizer, no last-handled-configuration, no progress), two to
# four requests each. The garbage collector deletes a Checkpoint's VolumeSnapshot (its
# ownerReference) instead of a finalizer; the passes are level-based, from our status.
@kopf.on.event(*CHECKPOINTS, id="checkpoint_event")
async def checkpoint_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: object) -> None:
    # In the event loop, not a worker thread: it only files keys and times in memory (a
    # new or listed unsettled one for an admission thread, runtime.py).
    memo.runtime.observe_checkpoint(type, dict(body))


def _reclaim_settled(type: str | None, labels: dict[str, str], status: kopf.Status, **_: object) -> bool:
    return (
        type == "MODIFIED"
        and labels.get(RECLAIM_LABEL) == "true"
        and status.get("phase") in ("Ready", "Failed", "Rejected")
    )


@kopf.on.event(*CHECKPOINTS, id="checkpoint_reclaim_event", when=_reclaim_settled)
def checkpoint_reclaim_event(namespace: str, spec: kopf.Spec, memo: kopf.Memo, **_: object) -> None:
    """A paused Session's reclaim checkpoint is settled: its pass deletes (or keeps) the claim
    now. Its checkpoint.created event comes a moment before the Ready status, so the pass
    that event starts may find it still Pending, and nothing else would bring one soon."""
    memo.runtime.session_pass(namespace, spec["sessionName"])
