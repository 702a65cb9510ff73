"""Session handlers: every signal about a Session funnels into one idempotent reconcile."""

from __future__ import annotations

import kopf

from savepoint.config import load
from savepoint.controllers import session as reconcile
from savepoint.metrics import count_errors
from savepoint.models import GROUP, VERSION
from savepoint.session import SESSION_LABEL

SESSIONS = (GROUP, VERSION, "sessions")
settings = load()


@kopf.on.resume(*SESSIONS, id="session_resume")
@kopf.on.create(*SESSIONS, id="session_create")
@kopf.on.update(*SESSIONS, id="session_update")
def session_reconcile(namespace: str, name: str, **_: object) -> None:
    with count_errors("session"):
        reconcile.reconcile_session(namespace, name)


@kopf.timer(*SESSIONS, interval=settings.resync_seconds, idle=settings.resync_seconds, id="session_resync")
def session_resync(namespace: str, name: str, **_: object) -> None:
    with count_errors("session"):
        reconcile.reconcile_session(namespace, name)


@kopf.on.event("", "v1", "pods", labels={SESSION_LABEL: kopf.PRESENT})
@kopf.on.event("", "v1", "persistentvolumeclaims", labels={SESSION_LABEL: kopf.PRESENT})
def session_workload_event(
    namespace: str, labels: dict[str, str], type: str | None, body: kopf.Body, resource: kopf.Resource, **_: object
) -> None:
    # Each checkpoint's snapshot adds and removes a finalizer on the claim: skip such events,
    # and the start-up listing, which the Sessions' own resume passes cover.
    if reconcile.child_changed(resource.plural, type, dict(body)):
        with count_errors("session"):
            reconcile.reconcile_session(namespace, labels[SESSION_LABEL])


@kopf.on.event("", "v1", "configmaps", labels={SESSION_LABEL: kopf.PRESENT})
def session_log_event(namespace: str, labels: dict[str, str], type: str | None, body: kopf.Body, **_: object) -> None:
    if reconcile.child_changed("configmaps", type, dict(body)):
        with count_errors("session"):
            reconcile.reconcile_session(namespace, labels[SESSION_LABEL])
