"""Session handlers: every signal about a Session funnels into one idempotent pass."""

from __future__ import annotations

import copy

import kopf

from savepoint.controllers import cache, heartbeat
from savepoint.controllers import session as sessions
from savepoint.models import GROUP, VERSION
from savepoint.session import SESSION_LABEL
from savepoint.usage import heartbeat_session

SESSIONS = (GROUP, VERSION, "sessions")
STORES: dict[str, cache.Store | cache.Chunks] = {
    "pods": cache.pods,
    "persistentvolumeclaims": cache.claims,
    "configmaps": cache.chunks,
}


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


def _is_heartbeat(body: kopf.Body, **_: object) -> bool:
    return heartbeat_session(dict(body)) is not None


@kopf.on.event("", "v1", "configmaps", labels={SESSION_LABEL: kopf.PRESENT}, when=_is_heartbeat)
async def session_heartbeat_event(type: str | None, body: kopf.Body, **_: object) -> None:
    # In memory only: the runtime's heartbeat loop writes the Session's status.
    heartbeat.observe(type, dict(body))


def _child_changed(type: str | None, body: kopf.Body, resource: kopf.Resource, memo: kopf.Memo, **_: object) -> bool:
    # A filter (it only remembers what a listing shows): events that change nothing a pass
    # reads cost no worker thread. Each checkpoint's snapshot adds and removes a finalizer
    # on the claim, and the start-up listing of every Pod, claim and chunk is covered by
    # the Sessions' resume passes.
    raw = dict(body)
    if resource.plural == "configmaps" and heartbeat_session(raw) is not None:
        return False  # session_heartbeat_event's
    if resource.plural in STORES:
        STORES[resource.plural].observe(type, raw)  # what the passes read (controllers/cache.py)
    if sessions.relisted(resource.plural, type, raw):
        memo.runtime.resync_all_after_relist()
    return sessions.child_changed(resource.plural, type, raw, record=False)


@kopf.on.event("", "v1", "pods", labels={SESSION_LABEL: kopf.PRESENT}, when=_child_changed)
@kopf.on.event("", "v1", "persistentvolumeclaims", labels={SESSION_LABEL: kopf.PRESENT}, when=_child_changed)
@kopf.on.event("", "v1", "configmaps", labels={SESSION_LABEL: kopf.PRESENT}, when=_child_changed)
def session_child_event(
    namespace: str,
    labels: dict[str, str],
    type: str | None,
    body: kopf.Body,
    resource: kopf.Resource,
    memo: kopf.Memo,
    **_: object,
) -> None:
    if sessions.child_changed(resource.plural, type, dict(body)):
        memo.runtime.session_pass(namespace, labels[SESSION_LABEL])
