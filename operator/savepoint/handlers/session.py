"""Session handlers: every signal about a Session funnels into one idempotent pass.

The Sessions' Pods, claims and log chunks are the runtime's own watches
(savepoint.watches); their events ask for the same pass (Runtime.observe_child)."""

from __future__ import annotations

import copy

import kopf

from savepoint.models import GROUP, VERSION

SESSIONS = (GROUP, VERSION, "sessions")


@kopf.on.resume(*SESSIONS, id="session_resume")
@kopf.on.create(*SESSIONS, id="session_create")
@kopf.on.update(*SESSIONS, id="session_update")
def session_reconcile(namespace: str, name: str, body: kopf.Body, reason: str, memo: kopf.Memo, **_: object) -> None:
    memo.runtime.session_pass(namespace, name, seen=copy.deepcopy(dict(body)), resumed=reason == kopf.Reason.RESUME)


@kopf.on.event(*SESSIONS, id="session_resync_clock")
async def session_resync_clock(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: object) -> None:
    # Its body for the passes (controllers/cache.py), and the safety resync of every
    # Session without a kopf timer per Session (savepoint.polling).
    memo.runtime.observe_session(type, dict(body))
