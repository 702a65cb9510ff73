"""Reconcilers: observe the cluster, ask the pure modules what should be, make it so.

Every function here is idempotent and safe to re-run after a crash at any line: the
objects it creates have names derived from the Session, and each pass starts from
what it observes.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import kopf

from savepoint import idle, k8s, metrics, podsecurity
from savepoint.conditions import ConditionType, set_condition
from savepoint.config import Settings
from savepoint.constants import (
    ANNOTATION_LOG_RETENTION,
    API_VERSION,
    RECLAIM_LABEL,
    THROUGH_SEQUENCE_ANNOTATION,
    Reason,
)
from savepoint.controllers import cache, has_run, heartbeat, logview, object_lock, one_pass, sandbox
from savepoint.controllers import fork as rollbacks
from savepoint.controllers.cache import namespace_meta
from savepoint.controllers.logs import event_log
from savepoint.controllers.logview import LogView
from savepoint.durations import parse_duration
from savepoint.errors import EventLogError
from savepoint.eventlog import EventLog
from savepoint.fork import (
    RESTORING_ANNOTATION,
    ForkReason,
    checkpoint_unusable,
    effective_phase,
    find_event,
    target_claim_name,
)
from savepoint.models import CheckpointPhase, IdlePolicy, OperatingMode, SessionPhase, SessionSpec
from savepoint.polling import DeadlineQueue
from savepoint.session import (
    LIVE_PHASES,
    POD_BOOT_MS,
    POD_CREATED_MS,
    RESTORE_STARTED_MS,
    SESSION_LABEL,
    Observed,
    PodTemplateError,
    build_pod,
    build_pvc,
    build_status,
    child_digest,
    claim_name,
    pod_name,
    pod_phase,
    sandbox_account,
)
from savepoint.timestamps import now_rfc3339, parse_rfc3339

log = logging.getLogger(__name__)


def now_ms() -> int:
    return int(time.time() * 1000)


def _owned_by(obj: dict | None, body: dict) -> bool:
    refs = (obj or {}).get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == body["metadata"]["uid"] for r in refs)


# (kind, namespace, name) of each Pod, claim and log chunk seen -> (child_digest() of it when
# last seen, whether a watch has shown it: not yet for one a pass has just made).
_children: dict[tuple[str, str, str], tuple[tuple, bool]] = {}
_children_guard = threading.Lock()


def _child_key(kind: str, obj: dict[str, Any]) -> tuple[str, str, str]:
    meta = obj.get("metadata") or {}
    return (kind, meta.get("namespace", ""), meta.get("name", ""))


def child_changed(kind: str, event_type: str | None, obj: dict[str, Any], record: bool = True) -> bool:
    """Whether a watch event on a Session's Pod, claim or log chunk changes what a Session
    pass reads. Log chunks change with every append; for Pods and claims, see child_digest.
    With record=False it only answers (a kopf filter); the handler records.

    An object first seen in a listing (event type None) at start-up needs no pass of its
    own: every Session gets its resume pass then, which reads it. It is remembered all
    the same (no handler runs for it), so that a re-list later on (see relisted) starts
    passes only for the objects that changed meanwhile.
    """
    key = _child_key(kind, obj)
    meta = obj.get("metadata") or {}
    with _children_guard:
        if event_type == "DELETED":
            if record:
                _children.pop(key, None)
            return True
        digest = (meta.get("uid"), meta.get("resourceVersion")) if kind == "configmaps" else child_digest(obj)
        known = _children.get(key)
        if record or (known is None and event_type is None):
            _children[key] = (digest, True)
        if known is None:
            return event_type is not None
        return known[0] != digest


def relisted(kind: str, event_type: str | None, obj: dict[str, Any]) -> bool:
    """Whether this event comes from a re-list: a listing (event type None) of a child a
    watch has shown before. kopf lists again when a watch cannot resume (410 Gone: after
    an API server restart its watch cache starts afresh), and a listing says nothing of
    the objects that vanished meanwhile, nor of those made and gone: no event will come
    for them."""
    if event_type is not None:
        return False
    with _children_guard:
        known = _children.get(_child_key(kind, obj))
    return known is not None and known[1]


def made_child(kind: str, obj: dict[str, Any]) -> None:
    """Remember a Pod or claim a pass has just created, as the create answered: its ADDED
    event then shows nothing new and starts no pass (the pass that made it has the rest)."""
    meta = obj.get("metadata") or {}
    if meta.get("uid"):
        with _children_guard:
            _children[_child_key(kind, obj)] = (child_digest(obj), False)


# How long the Pods and claims listed for a namespace's resume passes serve them.
RESUME_LISTING_SECONDS = 60.0
# Namespace -> (monotonic time of the listing, Pods by name, claims by name). Each resume
# pass takes its Session's own out, so the maps empty as the passes run.
_resume_listings: dict[str, tuple[float, dict[str, dict], dict[str, dict]]] = {}
_resume_guard = threading.Lock()


class ResumeChildren:
    """A Session's Pod and claim as of one listing of its namespace's (SESSION_LABEL):
    after a restart, the first resume pass in a namespace lists them once, and the
    thousands of resume passes that follow read none one by one (two GETs each)."""

    def __init__(self, namespace: str, session: str) -> None:
        with object_lock("resume-listing", namespace, ""):
            listed = _resume_listings.get(namespace)
            if listed is None or time.monotonic() - listed[0] > RESUME_LISTING_SECONDS:
                _drop_old_listings()
                at = time.monotonic()
                pods = {p["metadata"]["name"]: p for p in k8s.list_pods(namespace, SESSION_LABEL)}
                claims = {c["metadata"]["name"]: c for c in k8s.list_pvcs(namespace, SESSION_LABEL)}
                listed = _resume_listings[namespace] = (at, pods, claims)
        self.listed_at, self._pods, self._claims = listed
        self._session = session

    def pod(self, name: str) -> dict | None:
        return self._take(self._pods, name)

    def claim(self, name: str) -> dict | None:
        return self._take(self._claims, name)

    def _take(self, objects: dict[str, dict], name: str) -> dict | None:
        # Only a child of this Session: its name, derived from the Session's, could also
        # be another's; what is not taken is dropped with the listing.
        with _resume_guard:
            obj = objects.get(name)
            if obj is None or (obj["metadata"].get("labels") or {}).get(SESSION_LABEL) != self._session:
                return None
            return objects.pop(name)


def _drop_old_listings() -> None:
    """What no resume pass took goes with its listing's time, in every namespace."""
    cutoff = time.monotonic() - RESUME_LISTING_SECONDS
    with _resume_guard:
        for namespace in [ns for ns, listed in _resume_listings.items() if listed[0] < cutoff]:
            del _resume_listings[namespace]


def reconcile_session(
    namespace: str,
    name: str,
    settings: Settings,
    seen: dict[str, Any] | None = None,
    resumed: bool = False,
    retention: bool = False,
    timers: DeadlineQueue | None = None,
    cached: bool = True,
) -> None:
    """One pass over a Session. `seen` is its body as the watch just delivered it: the
    first pass in this process (the resume pass at start-up, thousands at once) starts
    from it instead of reading it again; later passes read it fresh, since a pass that
    ran in between may have changed its status. A first pass that is a resume (`resumed`)
    also takes its Pod and claim from its namespace's listing (ResumeChildren). With
    `retention` (the resync) the pass then applies the namespace's log retention.
    `timers` gets the Session's next idle deadline (spec.idle), the runtime's wake-up.
    Its Pod and claim come from what the watches last showed (controllers/cache.py),
    unless `cached` is false (the resync: the safety net reads everything afresh)."""

    def reconcile() -> float | None:
        fresh = seen is not None and not has_run("session", namespace, name)
        if fresh:
            # The listed body, unless this process has written or seen a newer one since:
            # a rollback's resume pass may have swapped the claim and deleted the old one
            # meanwhile, and a pass from the older body would make that claim again, empty.
            body = cache.newest(seen, cache.sessions.get(namespace, name)) if cached else seen
        elif cached:
            # The newest of what this event brought and what the watch (or our own last
            # write) showed: every writer of Sessions in this process writes through.
            body = cache.newest(seen, cache.sessions.get(namespace, name)) or k8s.get_custom(
                "sessions", namespace, name
            )
        else:
            body = k8s.get_custom("sessions", namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            heartbeat.forget(namespace, name)  # else the heartbeat loop would ask again
            return None
        children = ResumeChildren(namespace, name) if fresh and resumed else None
        with cache.reading(cached):
            _reconcile(body, settings, timers, children)
        if retention:
            enforce_retention(body)
        # Observed as of the listing: a child event after it still gets its own pass.
        return children.listed_at if children else None

    one_pass("session", namespace, name, reconcile)


def _reconcile(
    body: dict[str, Any], settings: Settings, timers: DeadlineQueue | None, children: ResumeChildren | None = None
) -> None:
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    spec = SessionSpec.model_validate(body.get("spec") or {})
    old_status = body.get("status") or {}
    annotations = meta.get("annotations") or {}

    elog = event_log(body)
    restoring = spec.source is not None and "restore" not in old_status
    if not (old_status.get("eventLog") or {}).get("chunks") and not restoring:
        # Afterwards the log's own reads notice a chunk gone missing. A restore makes the
        # log itself (the prefix, then session.forked), and its claim goes first.
        elog.ensure()

    claim = old_status.get("workspaceClaimName") or claim_name(name)
    if not old_status.get("podName"):
        # Before anything is made for a Pod (a Pod made before this check stays).
        forbidden = pod_security_refusal(namespace, name, spec.pod_template)
        if forbidden:
            _write_failed(body, spec, claim, elog, Reason.POD_TEMPLATE_FORBIDDEN, forbidden)
            return
    extra: dict[str, Any] = {}
    hold: tuple[str, str] | None = None  # (reason, message) while the Pod must stay away
    if restoring:
        try:
            restored = restore_from_source(body, spec, elog, claim)
        except RestoreError as err:
            _write_failed(body, spec, claim, elog, err.reason, str(err))
            return
        extra.update(restored)
    elif "restore" not in old_status:
        extra["restore"] = {"mode": "fresh"}
    # Before the Pod, which runs as this account (after a restore's claim: the snapshot's
    # restore is the longest step, so it starts first). The chunk count is a lower bound
    # of the newest chunk's index; the pass's end widens the Role from the real listing.
    sandbox.ensure_sandbox_access(body, newest=(old_status.get("eventLog") or {}).get("chunks") or 1)
    holder = annotations.get(RESTORING_ANNOTATION)
    if holder and not (claim == target_claim_name(name, holder) and rollbacks.swapped_in(namespace, holder)):
        # A rollback holds the Pod away until it has swapped its restored claim in and
        # recorded session.rollback; from then on the Pod starts on that claim.
        hold = (Reason.ROLLING_BACK, f"rolling back ({holder})")

    # spec.idle: the operator's own pause, kept in status.idle; `spec` stands for the mode
    # in force from here on (the user's spec, paused while the idle pause holds).
    user_spec = spec
    # The log is read before the Pod only when the idle pause needs it: a rollback's
    # hand-back reads its whole log again, and its Pod waits on nothing the log says.
    view: LogView | EventLogError | None = None
    idle_state: dict[str, Any] | None = old_status.get("idle")
    if spec.idle is not None or idle_state:
        view = _view(body, elog)
        idle_state = _idle_step(body, spec, elog, view, hold)
        if idle.is_paused(idle_state, meta.get("generation")):
            spec = spec.model_copy(update={"operating_mode": OperatingMode.PAUSED})

    reclaimed = old_status.get("reclaimedCheckpoint")
    if reclaimed and spec.operating_mode == OperatingMode.RUNNING and hold is None:
        claim, resumed = resume_reclaimed(body, spec, elog, reclaimed)
        extra.update(resumed)

    pvc = children.claim(claim) if children else read_claim(namespace, claim)
    if pvc is None and hold is None and not reclaimed:
        pvc = k8s.ensure_pvc(build_pvc(body, spec, claim))
        made_child("persistentvolumeclaims", pvc)
    elif pvc is not None and not _owned_by(pvc, body):
        # A claim left by an earlier Session of the same name, still being collected.
        raise kopf.TemporaryError(f"PersistentVolumeClaim {claim} belongs to another object", delay=2)

    pod = children.pod(pod_name(name)) if children else read_pod(namespace, pod_name(name))
    if pod is not None and not _owned_by(pod, body):
        raise kopf.TemporaryError(f"Pod {pod_name(name)} belongs to another object", delay=2)
    template_error: tuple[str, str] | None = None
    booted: str | None = None  # the Pod's boot time, seen Running for the first time in this pass
    if spec.operating_mode == OperatingMode.PAUSED or hold is not None:
        if pod is not None and not pod["metadata"].get("deletionTimestamp"):
            k8s.delete_pod(namespace, pod["metadata"]["name"], uid=pod["metadata"]["uid"])
    elif pod is None and (forbidden := pod_security_refusal(namespace, name, spec.pod_template)):
        template_error = (Reason.POD_TEMPLATE_FORBIDDEN, forbidden)
    elif pod is None:
        try:
            pod = k8s.ensure_pod(build_pod(body, spec, claim, now_ms()))
            made_child("pods", pod)
            cache.pods.put(pod)  # the next pass sees it before its ADDED event does
        except PodTemplateError as err:
            template_error = (Reason.INVALID_POD_TEMPLATE, str(err))
        except k8s.Refused as err:
            # The API server refused the Pod the template makes: say why, instead of retrying forever.
            template_error = (
                Reason.INVALID_POD_TEMPLATE,
                f"spec.podTemplate: the API server refused the Pod: {err.message}",
            )
    elif pod_phase(pod) == "Running" and POD_BOOT_MS not in (pod["metadata"].get("annotations") or {}):
        created = int((pod["metadata"].get("annotations") or {}).get(POD_CREATED_MS, now_ms()))
        booted = str(max(0, now_ms() - created))
        pod["metadata"].setdefault("annotations", {})[POD_BOOT_MS] = booted

    paused = spec.operating_mode == OperatingMode.PAUSED and old_status.get("phase") == "Paused"
    idle_paused = spec is not user_spec
    idle_checkpoint = idle_paused and user_spec.idle is not None and user_spec.idle.checkpoint
    reclaim = spec.workspace.reclaim_on_pause or idle_checkpoint
    if paused and reclaim and hold is None and pod is None and pvc and not reclaimed:
        done = reclaim_workspace(body, claim, idle.reclaim_name(name, idle_state or {}) if idle_paused else None)
        if done:
            extra["reclaimedCheckpoint"] = done
            pvc = None

    if view is None:
        view = _view(body, elog)
    beat = heartbeat.seen(namespace, name, settings.heartbeat_stale_seconds)
    # A held Session's Pod is on its way out (this pass or the rollback deletes it): the
    # status says so at once, and the Pod's own deletion then changes nothing to write.
    seen = dataclasses.replace(_observe_log(view, None if hold else pod, pvc), heartbeat=beat)
    warning = _mount_warning(namespace, pod)
    if warning:
        seen = dataclasses.replace(seen, pod_warning=warning)
    if not isinstance(view, EventLogError) and view.newest:
        # Widen the sandbox's Role to the newest chunk this pass saw: no request unless it must grow.
        sandbox.ensure_sandbox_access(body, newest=view.newest)
    status = build_status(body, spec, seen, claim)
    if hold is not None and spec.operating_mode != OperatingMode.PAUSED:
        _override_ready(status, meta, SessionPhase.PROVISIONING, hold[0], hold[1])
    if template_error:
        _override_ready(status, meta, "Failed", *template_error)
    status.update(extra)
    if idle_state is not None or user_spec.idle is not None:
        # {"paused": false} is what the API server stores for an empty status.idle (its default).
        state = idle_state or {"paused": False}
        status["idle"], status["conditions"] = _idle_status(body, user_spec, state, status)
    if spec.source:
        took = restore_ms(meta.get("annotations") or {}, {**old_status, **status})
        if took is not None:
            status["usage"] = {**(status.get("usage") or {}), "restoreMs": took}
    if annotations.get(RESTORING_ANNOTATION):
        # The rollback owns the claim swap: never write back a claim name read before it.
        status.pop("workspaceClaimName", None)
        status.pop("restore", None)
    _commit(body, status)
    if booted is not None and pod is not None:
        # Kept on the Pod, so later passes report the same usage.bootMs: after the status,
        # which is what the Session's users wait for (Ready), not before it.
        # Into the store: a pass brought by an older event of the Pod (the kubelet's, sent
        # before this annotation) would otherwise time the boot again, and write it again.
        cache.pods.put(k8s.annotate_pod(namespace, pod["metadata"]["name"], {POD_BOOT_MS: booted}))
    if user_spec.idle is not None or idle_state is not None:
        _schedule_idle(timers, body, user_spec, status, view, hold is not None)
    heartbeat.reflected(namespace, name, seen.heartbeat)
    policy = spec.checkpoint_policy
    if policy.after_each_run and seen.last_run_completed and not seen.run_in_flight and hold is None:
        # Deferred import: the checkpoint controller builds on this module.
        from savepoint.controllers.checkpoint import ensure_automatic

        ensure_automatic(body, seen.last_run_completed, policy.keep_last, policy.ttl)


def log_retention(namespace: str) -> timedelta | None:
    """The namespace's savepoint.dev/log-retention window; None when unset or unparsable."""
    raw = (namespace_meta(namespace).get("annotations") or {}).get(ANNOTATION_LOG_RETENTION)
    if raw is None:
        return None
    try:
        return parse_duration(raw)
    except ValueError as err:
        log.warning("namespace %s: annotation %s=%r ignored: %s", namespace, ANNOTATION_LOG_RETENTION, raw, err)
        return None


def pod_security_refusal(namespace: str, name: str, template: dict[str, Any]) -> str | None:
    """Why no Pod may be made from this Session's template (podsecurity), or None."""
    level = podsecurity.level_for(namespace_meta(namespace).get("labels"))
    return podsecurity.refusal(template, level, sandbox_account(name))


def enforce_retention(body: dict[str, Any]) -> list[str]:
    """Delete the Session's log chunks older than the namespace's log retention (whole
    chunks, never the one being written), then mark every checkpoint whose log prefix
    lost events: its snapshot stays, a fork from it fails with SessionHistoryUnavailable.
    Returns the names of the chunks deleted."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    window = log_retention(namespace)
    if window is None:
        return []
    elog = event_log(body)
    deleted = elog.apply_retention(window)
    first = elog.retained_from
    if deleted:
        message = f"log retention ({window}) deleted {len(deleted)} chunk(s): events before {first} are gone"
        log.info("session %s/%s: %s (%s)", namespace, name, message, ", ".join(deleted))
        k8s.post_event(body, "LogRetention", message)
    if first is not None and first > 1:
        mark_checkpoints_without_prefix(namespace, name, first)
    return deleted


def mark_checkpoints_without_prefix(namespace: str, session: str, first: int) -> None:
    """Say in each checkpoint's status.resume that its log prefix is incomplete (once)."""
    for ckpt in k8s.list_custom("checkpoints", namespace, f"{SESSION_LABEL}={session}"):
        status = ckpt.get("status") or {}
        through = status.get("throughSequence") or 0
        if through < 1 or (status.get("resume") or {}).get("logPrefixAvailable") is False:
            continue
        gone = f"events 1..{first - 1}" if first - 1 < through else f"events 1..{through}"
        message = (
            f"{gone} of its log prefix (events 1..{through}) were deleted by log retention: a fork from "
            "this checkpoint fails with SessionHistoryUnavailable; its snapshot is kept, and a rollback restores it"
        )
        k8s.patch_status(
            "checkpoints",
            namespace,
            ckpt["metadata"]["name"],
            {
                "resume": {
                    "kind": (status.get("resume") or {}).get("kind") or "snapshot",
                    "logPrefixAvailable": False,
                    "message": message,
                }
            },
        )


def _override_ready(status: dict, meta: dict, phase: str, reason: str, message: str) -> None:
    status["phase"] = phase
    previous: dict = next((c for c in status["conditions"] if c["type"] == "Ready"), {})
    status["conditions"] = [
        *[c for c in status["conditions"] if c["type"] != "Ready"],
        {
            "type": "Ready",
            "status": "False",
            "reason": reason,
            "message": message,
            "lastTransitionTime": previous.get("lastTransitionTime"),
            "observedGeneration": meta.get("generation"),
        },
    ]


def _commit(body: dict, status: dict) -> None:
    meta = body["metadata"]
    old_status = body.get("status") or {}
    if all(old_status.get(key) == value for key, value in status.items()):
        return  # nothing changed: a write would only wake every watcher of Sessions
    cache.sessions.put(k8s.patch_status("sessions", meta["namespace"], meta["name"], status))
    if status["phase"] != old_status.get("phase"):
        ready: dict = next((c for c in status["conditions"] if c["type"] == "Ready"), {})
        message = f"phase {old_status.get('phase') or '-'} -> {status['phase']}: {ready.get('message', '')}"
        k8s.post_event(
            body,
            ready.get("reason", status["phase"]) if status["phase"] == "Failed" else status["phase"],
            message,
            warning=status["phase"] == "Failed",
        )


def _write_failed(body: dict, spec: SessionSpec, claim: str, elog: EventLog, reason: str, message: str) -> None:
    seen = _observe_log(_view(body, elog), None, None)
    status = build_status(body, spec, seen, claim)
    _override_ready(status, body["metadata"], "Failed", reason, message)
    _commit(body, status)


def reclaim_name(session: str, generation: int) -> str:
    return f"{session}-pause-{generation}"


def reclaim_workspace(body: dict, claim: str, name: str | None = None) -> str | None:
    """Checkpoint a paused session's workspace, then delete the claim; the checkpoint's name once done."""
    meta = body["metadata"]
    name = name or reclaim_name(meta["name"], meta.get("generation") or 0)
    ckpt = k8s.get_custom("checkpoints", meta["namespace"], name)
    if ckpt is None:
        k8s.create_custom(
            "checkpoints",
            meta["namespace"],
            {
                "apiVersion": API_VERSION,
                "kind": "Checkpoint",
                "metadata": {"name": name, "labels": {RECLAIM_LABEL: "true"}},
                "spec": {"sessionName": meta["name"], "label": "workspace reclaimed on pause"},
            },
        )
        return None
    phase = (ckpt.get("status") or {}).get("phase")
    if phase != CheckpointPhase.READY:
        if phase in (CheckpointPhase.REJECTED, CheckpointPhase.FAILED):
            log.warning(
                "keeping the workspace of %s/%s: reclaim checkpoint %s is %s",
                meta["namespace"],
                meta["name"],
                name,
                phase,
            )
        return None
    k8s.delete_pvc(meta["namespace"], claim)
    k8s.post_event(body, "WorkspaceReclaimed", f"workspace {claim} deleted; kept in checkpoint {name}")
    return name


def resume_reclaimed(body: dict, spec: SessionSpec, elog: EventLog, checkpoint: str) -> tuple[str, dict]:
    """A resumed session whose disk was reclaimed: restore it, or rebuild from the log if it expired."""
    from savepoint.checkpoint import SNAPSHOT_GROUP

    meta = body["metadata"]
    claim = target_claim_name(meta["name"], checkpoint)
    ckpt = k8s.get_custom("checkpoints", meta["namespace"], checkpoint)
    cstatus = (ckpt or {}).get("status") or {}
    if effective_phase(cstatus) == CheckpointPhase.READY:
        source = {"apiGroup": SNAPSHOT_GROUP, "kind": "VolumeSnapshot", "name": cstatus["volumeSnapshotName"]}
        restore = {"mode": "snapshot", "checkpoint": checkpoint, "throughSequence": cstatus.get("throughSequence")}
    else:
        source = None
        restore = {
            "mode": "event_log_rebuild",
            "reason": "checkpoint_expired",
            "checkpoint": checkpoint,
            "throughSequence": elog.cursor().seq,
        }
    if k8s.get_pvc(meta["namespace"], claim) is None:
        k8s.ensure_pvc(build_pvc(body, spec, claim, source))
        if source is None:
            elog.append("session.rebuilt", {"checkpoint": checkpoint, "reason": "checkpoint_expired"})
        k8s.post_event(body, "WorkspaceRestored", f"workspace {claim} from {restore['mode']} ({checkpoint})")
    return claim, {"restore": restore, "reclaimedCheckpoint": None, "workspaceClaimName": claim}


class RestoreError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# Session uid -> (the status fields of its restore, its claim's data source), from the pass
# that finished copying its log until the claim is Bound: the passes in between (every
# child event of a new fork) then read neither the source checkpoint nor either log.
_log_restored: dict[str, tuple[dict[str, Any], dict | None]] = {}


def forget_restore(uid: str) -> None:
    """A Session deleted before its restored claim was Bound."""
    _log_restored.pop(uid, None)


def restore_from_source(body: dict, spec: SessionSpec, elog: EventLog, claim: str) -> dict:
    """Bring disk and log from spec.source: the status fields once the claim is Bound, {}
    before. The log prefix is in place either way, so the Pod may be made at once: it
    waits for its claim, which the provisioner binds only once the snapshot is restored
    into it (the floor's order, claim Bound then Pod, costs a pass in between)."""
    from savepoint.checkpoint import SNAPSHOT_GROUP
    from savepoint.errors import HistoryUnavailable

    meta = body["metadata"]
    namespace = meta["namespace"]
    source = spec.source
    assert source is not None
    done = _log_restored.get(meta["uid"])
    if done is not None:
        # The prefix and session.forked are in this log (an earlier pass of this process
        # saw them land): only the claim is left to wait for.
        fields, data_source = done
        pvc = read_claim(namespace, claim) or k8s.ensure_pvc(build_pvc(body, spec, claim, data_source))
        if (pvc.get("status") or {}).get("phase") != "Bound":
            return {}
        _log_restored.pop(meta["uid"], None)
        return fields
    through = (meta.get("annotations") or {}).get(THROUGH_SEQUENCE_ANNOTATION)
    data_source = None
    parent = source.session
    if source.checkpoint:
        ckpt = k8s.get_custom("checkpoints", namespace, source.checkpoint)
        refusal = checkpoint_unusable(source.checkpoint, ckpt)
        if refusal is not None:
            # A Session's source does not wait, and to it a missing checkpoint is one not Ready.
            missing = refusal.reason == ForkReason.CHECKPOINT_NOT_FOUND
            raise RestoreError(ForkReason.CHECKPOINT_NOT_READY if missing else refusal.reason, str(refusal))
        assert ckpt is not None
        cstatus = ckpt["status"]
        parent = ckpt["spec"]["sessionName"]
        through = through or str(cstatus.get("throughSequence") or 0)
        data_source = {"apiGroup": SNAPSHOT_GROUP, "kind": "VolumeSnapshot", "name": cstatus["volumeSnapshotName"]}
    parent_body = cache.session(namespace, parent) if parent else None
    if parent_body is None:
        raise RestoreError(ForkReason.SESSION_HISTORY_UNAVAILABLE, f"source session {parent} not found")
    parent_log = event_log(parent_body)
    if through is None:
        if source.at_event:
            match = find_event(parent_log.read(partial=True), source.at_event)
            if match is None:
                raise RestoreError(ForkReason.EVENT_NOT_FOUND, f"session {parent} has no event {source.at_event}")
            through = str(match.seq)
        else:
            through = str(parent_log.cursor().seq)
    through_seq = int(through)

    if RESTORE_STARTED_MS not in (meta.get("annotations") or {}):
        # A Session made with spec.source by hand (a Fork sets this as it creates one).
        started = {RESTORE_STARTED_MS: str(now_ms())}
        cache.sessions.put(
            k8s.patch_custom("sessions", namespace, meta["name"], {"metadata": {"annotations": started}})
        )
        meta["annotations"] = {**(meta.get("annotations") or {}), **started}
    # Disk: a claim restored from the snapshot, or a fresh one for a log-only rebuild. Made
    # without a read first (one the watch has not shown is most likely not there yet: an
    # existing one answers 409, then it is read), since the restore is the longest step.
    seen = cache.claims.get(namespace, claim) if cache.in_use() else None
    pvc = seen or k8s.ensure_pvc(build_pvc(body, spec, claim, data_source))
    # Log: the parent's prefix, then session.forked, exactly once.
    forked = {
        "parentSession": parent,
        "checkpoint": source.checkpoint,
        "throughSequence": through_seq,
        "mode": "snapshot" if data_source else "event_log_rebuild",
    }
    try:
        # No pass has reported this log yet: most likely it has no chunk, and is written
        # without a read first (a chunk there already makes that write refused, unchanged).
        written = (
            None
            if (body.get("status") or {}).get("eventLog")
            else elog.start_from(parent_log, through_seq, "session.forked", forked)
        )
        if written is not None:
            logview.remember_written(body, elog, written)  # the pass's view reads nothing
        else:
            cursor = elog.cursor()
            if cursor.seq < through_seq:
                cursor = parent_log.copy_to(elog, through_seq)
            if cursor.seq == through_seq:
                elog.append("session.forked", forked)
    except HistoryUnavailable as err:
        raise RestoreError(ForkReason.SESSION_HISTORY_UNAVAILABLE, str(err)) from None
    restore: dict[str, Any] = {
        "mode": "snapshot" if data_source else "event_log_rebuild",
        "throughSequence": through_seq,
    }
    if source.checkpoint:
        restore["checkpoint"] = source.checkpoint
    fields = {"restore": restore, "parentSession": parent, "forkedFromCheckpoint": source.checkpoint}
    if (pvc.get("status") or {}).get("phase") != "Bound":
        _log_restored[meta["uid"]] = (fields, data_source)
        return {}
    return fields


def restore_ms(annotations: dict[str, str], status: dict[str, Any]) -> int | None:
    """usage.restoreMs of a restored Session on the pass it is first Ready: from the restore's
    start (RESTORE_STARTED_MS) to now; None when it has one already or is not there yet."""
    started = annotations.get(RESTORE_STARTED_MS)
    usage = status.get("usage") or {}
    ready = status.get("phase") in LIVE_PHASES
    if started is None or not ready or "restore" not in status or usage.get("restoreMs") is not None:
        return None
    return max(0, now_ms() - int(started))


# A Pod Pending this long has its kubelet Events read (one list call per pass until it runs).
MOUNT_WARNING_AFTER = timedelta(seconds=5)


def _mount_warning(namespace: str, pod: dict | None) -> str | None:
    """The kubelet's FailedMount of a Pod stuck Pending; none for a young or running Pod."""
    if pod is None or pod_phase(pod) != "Pending":
        return None
    created = (pod.get("metadata") or {}).get("creationTimestamp")
    if not created or datetime.now(UTC) - parse_rfc3339(created) < MOUNT_WARNING_AFTER:
        return None
    return k8s.pod_warning(namespace, pod, ("FailedMount", "FailedAttachVolume", "FailedMapVolume"))


def _view(body: dict, elog: EventLog) -> LogView | EventLogError:
    """The log as this pass sees it (controllers/logview.py), or why it cannot be read."""
    try:
        return logview.observe(body, elog)
    except EventLogError as err:
        return err


def _observe_log(view: LogView | EventLogError, pod: dict | None, pvc: dict | None) -> Observed:
    if isinstance(view, EventLogError):
        return Observed(
            pod=pod,
            pvc=pvc,
            log_cursor=None,
            log_chunks=0,
            log_error=str(view),
            run_in_flight=False,
            approval_pending=False,
            runs=0,
        )
    digest = view.digest
    summary = digest.summary()
    return Observed(
        pod=pod,
        pvc=pvc,
        log_cursor=digest.cursor,
        log_chunks=view.chunks,
        log_error=None,
        run_in_flight=summary["run_in_flight"],
        approval_pending=summary["approval_pending"],
        runs=summary["runs"],
        last_run_completed=digest.last_run_completed,
        latest_checkpoint=digest.latest_checkpoint,
        usage=digest.usage(),
    )


ACTIVE_PHASES = (SessionPhase.READY, SessionPhase.RUNNING, SessionPhase.AWAITING_APPROVAL)


def _idle_step(
    body: dict, spec: SessionSpec, elog: EventLog, view: LogView | EventLogError, hold: tuple[str, str] | None
) -> dict | None:
    """Pause an idle session, or wake an idle-paused one; status.idle as it is now."""
    meta = body["metadata"]
    old_status = body.get("status") or {}
    state = old_status.get("idle")
    generation = meta.get("generation")
    if isinstance(view, EventLogError):
        return state  # the pass reports the log; nothing to decide from
    if state and state.get("paused"):
        if not idle.is_paused(state, generation):
            metrics.wakes.labels("spec").inc()
            k8s.post_event(body, idle.SPEC_CHANGED, "the spec changed: the idle pause ends, the spec decides")
            return idle.woken_state(state, None)
        try:
            newer = view.since(elog, state.get("throughSequence") or 0)
        except EventLogError:
            return state
        wake = idle.waking_event(spec.idle, view.digest, newer)
        if wake is None:
            return state
        metrics.wakes.labels("event").inc()
        k8s.post_event(body, idle.WOKEN, f"event {wake.sequence} ({wake.type}) woke the session")
        return idle.woken_state(state, wake)
    policy = spec.idle
    if policy is None or spec.operating_mode != OperatingMode.RUNNING or hold is not None:
        return state
    if old_status.get("phase") != SessionPhase.READY or _idle_left(policy, old_status, view) != 0:
        return state
    state = idle.paused_state(view.digest, generation, now_rfc3339())
    # Status before the side effect: whoever reads the Session while its Pod goes sees why.
    cache.sessions.put(k8s.patch_status("sessions", meta["namespace"], meta["name"], {"idle": state}))
    body.setdefault("status", {})["idle"] = state
    metrics.idle_pauses.inc()
    kept = "checkpointing the workspace, then freeing its disk" if policy.checkpoint else "the workspace kept"
    k8s.post_event(body, idle.IDLE_PAUSED, f"no event for {policy.pause_after}: pausing ({kept})")
    return state


def _idle_left(policy: IdlePolicy, status: dict, view: LogView) -> float | None:
    """Seconds until the idle window ends (0 once it has); None while it cannot end (a run
    or an approval open, or the session not Ready)."""
    ready: dict = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
    since = ready.get("lastTransitionTime") if ready.get("status") == "True" else None
    deadline = idle.pause_deadline(policy, view.digest, parse_rfc3339(since) if since else None)
    if deadline is None or status.get("phase") != SessionPhase.READY:
        return None
    return max(0.0, (deadline - datetime.now(UTC)).total_seconds())


def _schedule_idle(
    timers: DeadlineQueue | None, body: dict, spec: SessionSpec, status: dict, view: LogView | EventLogError, held: bool
) -> None:
    """A pass when the idle window of a Ready session ends; none while it cannot end (the
    next change to the log, the Pod or the spec brings a pass)."""
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    left = None
    running = spec.operating_mode == OperatingMode.RUNNING and not held
    asleep = idle.is_paused(status.get("idle"), meta.get("generation"))
    if spec.idle is not None and running and not isinstance(view, EventLogError) and not asleep:
        left = _idle_left(spec.idle, status, view)
    if timers is None:
        return
    if left is None:
        timers.drop(key)
    else:
        # A little after the window: the pass must find it over, not a millisecond short.
        timers.schedule(key, time.monotonic() + left + 0.05)


def _idle_status(body: dict, spec: SessionSpec, state: dict, status: dict) -> tuple[dict, list]:
    """status.idle and the conditions with Idle (and Ready, while idle-paused) saying why."""
    generation = body["metadata"].get("generation")
    conditions = status["conditions"]
    paused = idle.is_paused(state, generation)
    if paused:
        wakes = (
            f"an event of type {', '.join(spec.idle.wake_on_types)} wakes it"
            if spec.idle is not None and spec.idle.wake_on_event
            else "a change to its spec wakes it"
        )
        message = f"paused by the operator: no event since sequence {state.get('throughSequence')}; {wakes}"
        conditions = [
            {**c, "reason": idle.IDLE_PAUSED, "message": message} if c["type"] == ConditionType.READY else c
            for c in conditions
        ]
    else:
        message = (
            f"active: pauses after {spec.idle.pause_after} with no new event and no run or approval open"
            if spec.idle is not None
            else "spec.idle is not set"
        )
    conditions = set_condition(
        conditions, ConditionType.IDLE, paused, idle.IDLE_PAUSED if paused else idle.ACTIVE, message, generation
    )
    took = idle.wake_duration(state, datetime.now(UTC))
    if took is not None and status.get("phase") in LIVE_PHASES:
        metrics.wake_seconds.observe(took.total_seconds())
        state = {
            **state,
            "wokenBySequence": None,
            "wokenByType": None,
            "wokenAt": None,
            "lastWakeMs": int(took.total_seconds() * 1000),
        }
    # A merge patch removes a key written as null: send null only for a key that is there,
    # so a pass that changes nothing finds status.idle equal and writes nothing.
    old = (body.get("status") or {}).get("idle") or {}
    return {k: v for k, v in state.items() if v is not None or k in old}, conditions


def read_claim(namespace: str, name: str) -> dict | None:
    return cache.claim(namespace, name) if cache.in_use() else k8s.get_pvc(namespace, name)


def read_pod(namespace: str, name: str) -> dict | None:
    return cache.pod(namespace, name) if cache.in_use() else k8s.get_pod(namespace, name)
