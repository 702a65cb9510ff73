"""Session handlers: every signal about a Session funnels into one idempotent reconcile."""

from __future__ import annotations

import copy
import threading
import time

import kopf

from savepoint import k8s, peering
from savepoint.config import load
from savepoint.controllers import forget, heartbeat
from savepoint.controllers import session as reconcile
from savepoint.metrics import count_errors
from savepoint.models import GROUP, VERSION
from savepoint.polling import PollQueue
from savepoint.session import SESSION_LABEL
from savepoint.usage import HeartbeatSeen, heartbeat_session

SESSIONS = (GROUP, VERSION, "sessions")
settings = load()


@kopf.on.resume(*SESSIONS, id="session_resume")
@kopf.on.create(*SESSIONS, id="session_create")
@kopf.on.update(*SESSIONS, id="session_update")
def session_reconcile(namespace: str, name: str, body: kopf.Body, reason: str, **_: object) -> None:
    with count_errors("session"):
        reconcile.reconcile_session(
            namespace, name, seen=copy.deepcopy(dict(body)), resumed=reason == kopf.Reason.RESUME
        )


# The safety re-reconcile of every Session, without a kopf timer per Session (which would
# keep each Session's whole body in memory; see savepoint.polling).
resyncs = PollQueue(settings.resync_seconds)


@kopf.on.event(*SESSIONS, id="session_resync_clock")
async def session_resync_clock(type: str | None, name: str, namespace: str, **_: object) -> None:
    if type == "DELETED":
        resyncs.drop((namespace, name))
        reconcile.idle_timers.drop((namespace, name))
        forget("session", namespace, name)
        heartbeat.forget(namespace, name)
    else:
        resyncs.file((namespace, name))


@kopf.on.startup()
def session_resync_loop(**_: object) -> None:
    """Reconcile the Sessions whose resync is due, a few at a time, on the active replica."""

    def resync(key: tuple[str, str]) -> None:
        try:
            with count_errors("session"):
                reconcile.reconcile_session(*key, retention=True)
        except Exception:  # counted; the next watch event tries again, or this soon
            reconcile.log.exception("resyncing session %s/%s", *key)
            resyncs.hurry(RESYNC_RETRY_SECONDS, keys=[key])

    def loop() -> None:
        while True:
            time.sleep(RESYNC_TICK_SECONDS)
            if not peering.last_known(settings):
                continue
            for key in resyncs.take_due():
                resync(key)

    def idle_loop() -> None:
        # A pass when a Session's idle window ends (spec.idle), to the second, not at its
        # next resync; a standby drops what falls due: the active replica has its own timers.
        while True:
            reconcile.idle_timers.wait(RESYNC_TICK_SECONDS)
            active = peering.last_known(settings)
            for key in reconcile.idle_timers.take_due():
                if active:
                    resync(key)

    threading.Thread(target=loop, name="session-resync", daemon=True).start()
    threading.Thread(target=idle_loop, name="session-idle", daemon=True).start()


RESYNC_TICK_SECONDS = 5.0
# A resync that failed (the API server away) is tried again this soon, not a whole
# resync interval later.
RESYNC_RETRY_SECONDS = 30.0
# At most one early resync of every Session per this many seconds: a re-list sends an
# event for each child, thousands at once.
RELIST_RESYNC_GAP_SECONDS = 60.0
_relist_resync_at = [float("-inf")]


def resync_all_after_relist() -> None:
    """A re-list tells nothing of the children that went meanwhile (relisted): every
    Session gets its resync now, not up to SAVEPOINT_RESYNC_SECONDS later."""
    now = time.monotonic()
    if now - _relist_resync_at[0] >= RELIST_RESYNC_GAP_SECONDS:
        _relist_resync_at[0] = now
        reconcile.log.info("a watch listed again (the API server restarted?): resyncing every Session now")
        resyncs.hurry()


def _is_heartbeat(body: kopf.Body, **_: object) -> bool:
    return heartbeat_session(dict(body)) is not None


@kopf.on.event("", "v1", "configmaps", labels={SESSION_LABEL: kopf.PRESENT}, when=_is_heartbeat)
async def session_heartbeat_event(type: str | None, body: kopf.Body, **_: object) -> None:
    # In memory only: the heartbeat loop below writes the Session's status.
    heartbeat.observe(type, dict(body))


@kopf.on.startup()
def session_heartbeat_loop(**_: object) -> None:
    """Reflect the sandboxes' heartbeats into their Sessions (controllers/heartbeat.py)."""

    def loop() -> None:
        while True:
            time.sleep(heartbeat.tick_seconds())
            if not peering.last_known(settings):
                continue
            passes, patches = heartbeat.due()
            for key in passes:
                try:
                    with count_errors("session"):
                        reconcile.reconcile_session(*key)
                except Exception:  # counted; the next tick tries again
                    reconcile.log.exception("heartbeat pass of session %s/%s", *key)
            for (namespace, name), resources in patches:
                try:
                    k8s.patch_status("sessions", namespace, name, {"resources": resources})
                except Exception:
                    reconcile.log.exception("writing the resources of session %s/%s", namespace, name)
                    continue
                heartbeat.reflected(namespace, name, HeartbeatSeen(resources, False, 0), pass_=False)

    threading.Thread(target=loop, name="session-heartbeat", daemon=True).start()


def _child_changed(type: str | None, body: kopf.Body, resource: kopf.Resource, **_: object) -> bool:
    # A filter (it only remembers what a listing shows): events that change nothing a pass
    # reads cost no worker thread. Each checkpoint's snapshot adds and removes a finalizer
    # on the claim, and the start-up listing of every Pod, claim and chunk is covered by
    # the Sessions' resume passes.
    raw = dict(body)
    if resource.plural == "configmaps" and heartbeat_session(raw) is not None:
        return False  # session_heartbeat_event's
    if reconcile.relisted(resource.plural, type, raw):
        resync_all_after_relist()
    return reconcile.child_changed(resource.plural, type, raw, record=False)


if settings.webhook:

    @kopf.on.validate(*SESSIONS, id="validate-sessions", operations=["CREATE", "UPDATE"])
    def session_admission(namespace: str, name: str, spec: kopf.Spec, old: kopf.Body | None, **_: object) -> None:
        """The Pod Security check of the status path, answered at `kubectl apply` time. An
        update is checked only when it changes the template: a Session admitted before
        can still be paused or resumed."""
        template = dict(spec).get("podTemplate") or {}
        if old is not None and (dict(old).get("spec") or {}).get("podTemplate") == template:
            return
        refusal = reconcile.pod_security_refusal(namespace, name, template)
        if refusal:
            raise kopf.AdmissionError(f"PodTemplateForbidden: {refusal}", code=403)


@kopf.on.event("", "v1", "pods", labels={SESSION_LABEL: kopf.PRESENT}, when=_child_changed)
@kopf.on.event("", "v1", "persistentvolumeclaims", labels={SESSION_LABEL: kopf.PRESENT}, when=_child_changed)
@kopf.on.event("", "v1", "configmaps", labels={SESSION_LABEL: kopf.PRESENT}, when=_child_changed)
def session_child_event(
    namespace: str, labels: dict[str, str], type: str | None, body: kopf.Body, resource: kopf.Resource, **_: object
) -> None:
    if reconcile.child_changed(resource.plural, type, dict(body)):
        with count_errors("session"):
            reconcile.reconcile_session(namespace, labels[SESSION_LABEL])
