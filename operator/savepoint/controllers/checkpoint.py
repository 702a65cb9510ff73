"""The Checkpoint controller: admit, cut, snapshot, ready; expire; clean up.

State machine (status.phase): (none) -> Rejected | Pending -> Ready | Failed;
Ready -> Expired -> (deleted after the grace period). Each step is written before the
next side effect, and every side effect has a name derived from the Checkpoint, so a
restart at any line resumes where it stopped.

The cut an admission decides is written where the snapshot is asked for: on the
VolumeSnapshot itself (CUT_ANNOTATION), then on the Checkpoint with its owner. A snapshot
that is ready before the checkpoint's first Pending poll goes from no phase straight to
Ready, in one status write; a slower one shows Pending (with the cut) from that poll on.
A Session with hooks, a checkpoint that waited for its Session, and a namespace quota
write Pending first, as their steps need it written.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

from savepoint import failpoints, k8s, metrics
from savepoint.checkpoint import (
    AUTOMATIC_LABEL,
    FailReason,
    Patience,
    PolicyError,
    QuotaUse,
    Rejection,
    RejectReason,
    SessionView,
    Wait,
    admit,
    build_volume_snapshot,
    effective_ttl,
    owned_by,
    owned_by_other,
    parse_quantity,
    parse_time,
    pick_snapshot_class,
    policy_from_annotations,
    rfc3339,
    snapshot_name,
    snapshot_state,
)
from savepoint.conditions import set_condition
from savepoint.config import Settings
from savepoint.constants import API_VERSION, CUT_ANNOTATION, RUN_SEQ_LABEL, Reason
from savepoint.controllers import cache, has_run, logview, one_pass
from savepoint.controllers import hooks as checkpoint_hooks
from savepoint.controllers import write_status as write_object_status
from savepoint.controllers.logs import event_log
from savepoint.cut import CUT_FIELDS, cut_annotation, cut_of
from savepoint.errors import EventLogError
from savepoint.eventlog import Cursor
from savepoint.hooks import hooks_of
from savepoint.logdigest import CHECKPOINT_CREATED
from savepoint.models import CheckpointPhase, CheckpointSpec, SessionPhase
from savepoint.session import LIVE_PHASES, SESSION_LABEL, owner_reference

log = logging.getLogger(__name__)
LIVE = (CheckpointPhase.PENDING, CheckpointPhase.READY)
# The finalizer kopf put on Checkpoints while the operator had a delete handler for them.
KOPF_FINALIZER = "kopf.zalando.org/KopfFinalizerMarker"
# A checkpoint whose snapshot is not ready at its first Pending poll (5-30 s after it came:
# runtime.pending_poll_seconds) shows Pending from then on, if its cut is at least this old.
# One ready sooner is never written Pending: under a burst of 200, whose snapshots take
# up to 10-15 s, that write was one of every checkpoint's six requests.
PENDING_SHOWN_AFTER = timedelta(seconds=5)
# In a pass's copy of the status: the Pending status decided but not written yet.
UNWRITTEN = "_pending"


def _now() -> datetime:
    return datetime.now(UTC)


def ready_condition(body: dict, status: bool, reason: str, message: str) -> list[dict]:
    old = (body.get("status") or {}).get("conditions") or []
    return set_condition(old, "Ready", status, reason, message, body["metadata"].get("generation"))


def write_status(body: dict, status: dict[str, Any], event: tuple[str, str] | None = None, warn: bool = False) -> None:
    """Write a Checkpoint's status (controllers.write_status); the Checkpoint as written goes
    to the cache, so the next pass does not read an older copy."""
    written = write_object_status("checkpoints", body, status, metrics.checkpoint_transitions, event, warn)
    cache.checkpoints.put(written)


def reconcile_checkpoint(
    namespace: str,
    name: str,
    settings: Settings,
    seen: dict | None = None,
    snapshot: dict | None = None,
    seen_at: float | None = None,
    listed: bool = False,
) -> None:
    """One pass over a Checkpoint. `seen` is its body as the watch just delivered it (at
    monotonic time `seen_at`; `listed`: from a listing, not a create event): the first
    pass in this process (its create, or its resume at start-up) starts from it, as a
    Session's does, instead of reading it again. `snapshot` is its VolumeSnapshot as a
    watch event just delivered it, read instead of a GET."""
    one_pass(
        "checkpoint", namespace, name, lambda: _reconcile(namespace, name, settings, seen, snapshot, seen_at, listed)
    )


def _reconcile(
    namespace: str,
    name: str,
    settings: Settings,
    seen: dict | None,
    snapshot: dict | None,
    seen_at: float | None,
    listed: bool,
) -> None:
    fresh = seen is not None and not has_run("checkpoint", namespace, name)
    body = copy.deepcopy(seen) if fresh else cache.checkpoint(namespace, name)
    if body is None and snapshot is not None:
        drop_snapshot(namespace, snapshot["metadata"]["name"], owned=snapshot)  # made by a late pass
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    if (body.get("status") or {}).get("phase") is None and not (fresh and not listed):
        # Not this process's first sight of a new one: an earlier pass (or process) may
        # have asked for its snapshot, and the snapshot carries the cut it was made at.
        snapshot = _resume_cut(body, snapshot) or snapshot
    if (body.get("status") or {}).get("phase") is None or waiting(body):  # no snapshot with a cut: admit
        _admit(body, settings, seen_at if fresh else None)
        if waiting(body):
            return  # the Session's events (or the pending poll) bring us back
    if body["status"]["phase"] == CheckpointPhase.PENDING:
        _progress(body, settings, snapshot)


def waiting(body: dict) -> bool:
    """Not admitted yet: new (without a cut on it), or Pending without a cut while its
    Session is not Ready."""
    status = body.get("status") or {}
    phase = status.get("phase")
    if phase is None:
        return cut_of(body) is None
    return phase == CheckpointPhase.PENDING and not status.get("createdAt")


def unshown(body: dict) -> bool:
    """Admitted, its snapshot asked for, and no Pending written yet: a cut on it and no phase."""
    return (body.get("status") or {}).get("phase") is None and cut_of(body) is not None


def _pending_status(body: dict, cut: dict[str, Any], claim: str | None) -> dict[str, Any]:
    """The Pending status of an admitted checkpoint: its cut, and that it is snapshotting."""
    return {
        **cut,
        "phase": CheckpointPhase.PENDING.value,
        "reason": None,
        "message": f"snapshotting {claim or 'the workspace'} through event {cut['throughSequence']}",
        "resume": {"kind": "snapshot"},
        "conditions": ready_condition(body, False, Reason.SNAPSHOTTING, "waiting for the VolumeSnapshot"),
    }


def _resume_cut(body: dict, snapshot: dict | None) -> dict | None:
    """Take up the cut of a checkpoint admitted without a Pending write, from its
    VolumeSnapshot (`snapshot`, or read): the snapshot is asked for with it, so it is
    there whenever a snapshot is. A snapshot of that name made without one (by someone
    else, before the Checkpoint's admission used it) has the cut on the Checkpoint,
    written after the snapshot was asked for. Returns the snapshot found (None: no
    snapshot, or no cut)."""
    meta = body["metadata"]
    vs_name = snapshot_name(meta["name"])
    if snapshot is None or snapshot["metadata"]["name"] != vs_name:
        snapshot = k8s.get_volume_snapshot(meta["namespace"], vs_name)
    if snapshot is None or owned_by_other(snapshot, body):
        return None
    cut = _own_cut(snapshot, body) or cut_of(body)
    if cut is None:
        return None
    claim = ((snapshot.get("spec") or {}).get("source") or {}).get("persistentVolumeClaimName")
    _hold_unwritten(body, _pending_status(body, cut, claim))
    return snapshot


def _own_cut(snapshot: dict, body: dict) -> dict | None:
    """The cut on `snapshot` when it is this checkpoint's (None when it is not, or has none)."""
    return cut_of(snapshot) if owned_by(snapshot, body) else None


def _hold_unwritten(body: dict, pending: dict[str, Any]) -> None:
    """Carry on in this pass as if `pending` were written (it is written with what comes next)."""
    body["status"] = {**(body.get("status") or {}), **pending, UNWRITTEN: pending}


def _unwritten(status: dict) -> dict[str, Any]:
    """The Pending status decided but not written, to write with the next status (taken off)."""
    return status.pop(UNWRITTEN, None) or {}


def poll_pending(namespace: str, name: str, settings: Settings) -> bool:
    """The poll of a Pending checkpoint: read its VolumeSnapshot alone and run a pass only
    when one has something to do (the snapshot is settled, missing, or older than the
    snapshot timeout); True when a pass ran.

    Under a backlog most polls find a snapshot still being made, and a pass would read
    the Checkpoint as well: one GET instead of two. The snapshot is made after the
    Checkpoint's createdAt, so its age never overstates the Checkpoint's; the timeout
    fails it at most that gap (and a poll interval) late.
    """
    snapshot = k8s.get_volume_snapshot(namespace, snapshot_name(name))
    if snapshot is not None:
        state = snapshot_state(snapshot)
        made = snapshot["metadata"].get("creationTimestamp")
        young = made is not None and _now() - parse_time(made) <= settings.snapshot_timeout
        if young and not state.ready and state.error is None and not _shows_pending_now(namespace, name):
            return False
    reconcile_checkpoint(namespace, name, settings, snapshot=snapshot)
    return True


def _shows_pending_now(namespace: str, name: str) -> bool:
    """Whether a checkpoint admitted without a Pending write has waited long enough to show it."""
    body = cache.checkpoints.get(namespace, name)
    cut = cut_of(body) if body is not None and unshown(body) else None
    return cut is not None and _shown_now(cut["createdAt"])


def _shown_now(created_at: str) -> bool:
    """Whether a checkpoint cut at `created_at` and not ready yet shows Pending by now."""
    return _now() - parse_time(created_at) >= PENDING_SHOWN_AFTER


# --- admission ------------------------------------------------------------------------


def _snapshot_class(driver: str | None, wanted: str | None) -> str | None:
    """The class to snapshot with, from a listing up to 30 s old; a miss looks again fresh,
    so a class made a moment ago is found (one deleted since shows as the snapshot's error)."""
    found = pick_snapshot_class(k8s.list_volume_snapshot_classes(max_age=30), driver, wanted)
    return found or pick_snapshot_class(k8s.list_volume_snapshot_classes(), driver, wanted)


# Threads that read a namespace's checkpoint policy beside an admission's log read.
_policy_reads = ThreadPoolExecutor(4, thread_name_prefix="policy-read")


def _policy(namespace: str, seen_at: float | None, settings: Settings):
    return policy_from_annotations(cache.namespace_annotations(namespace, seen_at), settings.default_checkpoint_ttl)


def observe_admission(
    namespace: str,
    spec: CheckpointSpec,
    own_name: str,
    settings: Settings,
    seen_at: float | None = None,
    made_version: int = 0,
):
    """Everything admit() needs, read from the cluster; shared with the webhook. `seen_at`
    is when the watch delivered the Checkpoint (monotonic), None for now, and `made_version`
    the Checkpoint's resourceVersion (0 for one not made yet)."""
    # A policy annotated a moment before the checkpoint was made applies to it, and so do
    # the Session's hooks: the policy is read on another thread while this one reads the
    # Session and its log.
    reading = _policy_reads.submit(_policy, namespace, seen_at, settings)
    session = cache.session_as_of(namespace, spec.session_name, seen_at, made_version)
    view = SessionView(exists=False)
    snapshot_class = None
    if session is not None:
        view_cursor = None
        status = session.get("status") or {}
        phase = "being deleted" if session["metadata"].get("deletionTimestamp") else status.get("phase")
        if phase in LIVE_PHASES:
            try:
                fresh_after = seen_at if seen_at is not None else time.monotonic()
                digest = logview.observe(session, event_log(session), fresh_after, made_version).digest
                # The cut is the log as checked: no second read for the cursor.
                view_cursor = Cursor(*digest.cursor)
                phase = digest.activity()
            except EventLogError:
                phase = SessionPhase.FAILED
        claim = status.get("workspaceClaimName")
        if phase in (None, SessionPhase.PROVISIONING):
            # Admission waits for it: quota and the snapshot class are looked at once it is Ready.
            view = SessionView(exists=True, phase=phase, claim=claim)
            return reading.result(), session, view, QuotaUse(0, 0), None
        pvc = cache.claim(namespace, claim) if claim else None
        driver = k8s.csi_driver_of_claim(pvc) if pvc else None
        wanted = ((session.get("spec") or {}).get("workspace") or {}).get("volumeSnapshotClassName")
        snapshot_class = _snapshot_class(driver, wanted)
        view = SessionView(
            exists=True,
            phase=phase,
            claim=claim,
            cursor=view_cursor,
            hooks=hooks_of(session.get("spec")) is not None,
        )
    policy = reading.result()
    if policy.max_checkpoints is None and policy.max_checkpoint_bytes is None:
        # No quota to check: skip listing every checkpoint in the namespace, which costs
        # O(checkpoints) per admission and dominated admission at thousands of them.
        return policy, session, view, QuotaUse(0, 0), snapshot_class
    live = [
        c
        for c in k8s.list_custom("checkpoints", namespace)
        if c["metadata"]["name"] != own_name and ((c.get("status") or {}).get("phase") in LIVE or unshown(c))
    ]
    used = sum(parse_quantity((c.get("status") or {}).get("restoreSize") or 0) for c in live)
    return policy, session, view, QuotaUse(len(live), used), snapshot_class


def check(namespace: str, name: str, spec: CheckpointSpec, settings: Settings) -> Rejection | None:
    """The webhook's answer: a rejection only for what cannot change. A checkpoint that would
    wait (its Session is Provisioning, or not created yet by the rest of the same apply) is
    let in: the status path waits for it."""
    try:
        policy, _, view, quota, snapshot_class = observe_admission(namespace, spec, name, settings)
    except PolicyError as err:
        return Rejection(RejectReason.INVALID_POLICY, str(err))
    answer = admit(name, spec, policy, view, quota, snapshot_class, _patience(settings), hooks_enabled=settings.hooks)
    return answer if isinstance(answer, Rejection) else None


def _patience(settings: Settings, body: dict | None = None) -> Patience:
    made = (body or {}).get("metadata", {}).get("creationTimestamp")
    waited = max(timedelta(0), _now() - parse_time(made)) if made else timedelta(0)
    return Patience(waited, settings.wait_timeout, settings.missing_grace)


def _admit(body: dict, settings: Settings, seen_at: float | None) -> None:
    meta = body["metadata"]
    spec = CheckpointSpec.model_validate(body["spec"])
    try:
        policy, session, view, quota, snapshot_class = observe_admission(
            meta["namespace"], spec, meta["name"], settings, seen_at, cache.version(body)
        )
        rejection = admit(
            meta["name"],
            spec,
            policy,
            view,
            quota,
            snapshot_class,
            _patience(settings, body),
            hooks_enabled=settings.hooks,
        )
    except PolicyError as err:
        rejection = Rejection(RejectReason.INVALID_POLICY, str(err))
    if isinstance(rejection, Wait):
        _write_waiting(body, rejection)
        return
    if rejection is not None:
        write_status(
            body,
            {
                "phase": CheckpointPhase.REJECTED.value,
                "reason": rejection.reason.value,
                "message": rejection.message,
                "conditions": ready_condition(body, False, rejection.reason, rejection.message),
            },
            event=(rejection.reason.value, rejection.message),
            warn=True,
        )
        return
    assert session is not None and snapshot_class is not None
    cursor = view.cursor or event_log(session).cursor()
    created = _now()
    session_spec = session.get("spec") or {}
    cut = {
        "throughSequence": cursor.seq,
        "throughEventId": cursor.id,
        "harnessRevision": (session_spec.get("harness") or {}).get("revision"),
        "profileRevision": (session_spec.get("profile") or {}).get("revision"),
        "volumeSnapshotName": snapshot_name(meta["name"]),
        "createdAt": rfc3339(created),
        "expiresAt": rfc3339(created + effective_ttl(spec.ttl, policy)),
    }
    pending = _pending_status(body, cut, view.claim)
    hooks = checkpoint_hooks.initial_status(session)
    quota = policy.max_checkpoints is not None or policy.max_checkpoint_bytes is not None
    if hooks or quota or (body.get("status") or {}).get("phase") is not None:
        # Written first: the hooks' steps write beside it, a quota counts it, and one that
        # waited shows Pending already (its waiting reason would otherwise stay).
        write_status(body, {**({"hooks": hooks} if hooks else {}), **pending})
    else:
        _hold_unwritten(body, pending)
    body["status"]["_claim"] = view.claim
    body["status"]["_class"] = snapshot_class
    body["status"]["_session"] = session


def _write_waiting(body: dict, wait: Wait) -> None:
    status = body.get("status") or {}
    if (status.get("phase"), status.get("reason"), status.get("message")) == (
        CheckpointPhase.PENDING,
        wait.reason,
        wait.message,
    ):
        return  # said already: a poll that finds nothing new writes nothing
    first = status.get("phase") is None
    write_status(
        body,
        {
            "phase": CheckpointPhase.PENDING.value,
            "reason": wait.reason.value,
            "message": wait.message,
            "conditions": ready_condition(body, False, wait.reason, wait.message),
        },
        event=(wait.reason.value, wait.message) if first else None,
    )


# --- snapshot progress ----------------------------------------------------------------


def _progress(body: dict, settings: Settings, watched: dict | None = None) -> None:
    meta, status = body["metadata"], body["status"]
    namespace = meta["namespace"]
    vs_name = status.get("volumeSnapshotName") or snapshot_name(meta["name"])
    if "_claim" in status:  # admitted in this very pass: nothing made it yet (and creating is safe to repeat)
        snapshot = None
    elif watched is not None and watched["metadata"]["name"] == vs_name:
        snapshot = watched
    else:
        snapshot = k8s.get_volume_snapshot(namespace, vs_name)
    if snapshot is None:
        claim, snapshot_class = status.get("_claim"), status.get("_class")
        if claim is None:
            session = cache.session(namespace, body["spec"]["sessionName"]) or {}
            claim = (session.get("status") or {}).get("workspaceClaimName")
            pvc = cache.claim(namespace, claim) if claim else None
            wanted = ((session.get("spec") or {}).get("workspace") or {}).get("volumeSnapshotClassName")
            snapshot_class = _snapshot_class(k8s.csi_driver_of_claim(pvc) if pvc else None, wanted)
        if claim is None or snapshot_class is None:
            _fail(body, FailReason.SNAPSHOT_FAILED, "the session's workspace is gone; nothing to snapshot")
            return
        refused = checkpoint_hooks.before_cut(body, write_status, status.get("_session"))
        if refused:
            _fail(body, FailReason.HOOK_FAILED, refused)  # before the cut: no snapshot, no postCheckpoint
            return
        failpoints.hit("checkpoint.before_snapshot_created")
        cut = {k: status.get(k) for k in CUT_FIELDS}
        snapshot = k8s.ensure_volume_snapshot(build_volume_snapshot(body, claim, snapshot_class, cut))
        failpoints.hit("checkpoint.after_snapshot_created")
        made_at = _own_cut(snapshot, body)
        if made_at is not None and made_at != cut and UNWRITTEN in status:
            # An earlier pass asked for it at another cut (and stopped before writing it): the snapshot's holds.
            _hold_unwritten(body, _pending_status(body, made_at, claim))
    if owned_by_other(snapshot, body):
        # Left by an earlier Checkpoint of this name (a late pass made it after that one's
        # finalizer ran): the garbage collector is deleting it; ours is made once it is gone.
        k8s.request_volume_snapshot_deletion(namespace, vs_name)
        return
    _tie_to_session(body)
    state = snapshot_state(snapshot)
    if state.error:
        checkpoint_hooks.after_cut(body, write_status)
        _fail(body, FailReason.SNAPSHOT_FAILED, f"VolumeSnapshot {vs_name}: {state.error}")
        return
    if not state.ready:
        created = parse_time(status["createdAt"])
        if UNWRITTEN in status and _shown_now(status["createdAt"]):
            write_status(body, _unwritten(status))  # slow: show Pending from now on
        if _now() - created > settings.snapshot_timeout:
            checkpoint_hooks.after_cut(body, write_status)
            _fail(
                body,
                FailReason.SNAPSHOT_TIMEOUT,
                f"VolumeSnapshot {vs_name} was not ready within {settings.snapshot_timeout} "
                "(SAVEPOINT_SNAPSHOT_TIMEOUT)",
            )
        return  # the VolumeSnapshot watch brings us back
    checkpoint_hooks.after_cut(body, write_status)
    _become_ready(body, state.restore_size)


def _tie_to_session(body: dict) -> None:
    """Make the Checkpoint its Session's (an ownerReference, and the session label), so
    deleting the Session deletes its checkpoints; one admitted without a Pending write
    gets its cut too (CUT_ANNOTATION), which says it is admitted. After the snapshot is
    asked for, not before: it is not on the way to the snapshot, which starts one request
    sooner, and the snapshot carries the cut meanwhile."""
    meta, name = body["metadata"], body["spec"]["sessionName"]
    unwritten = body["status"].get(UNWRITTEN)
    cut = cut_annotation(unwritten) if unwritten else None
    owned = any(r.get("kind") == "Session" and r.get("name") == name for r in meta.get("ownerReferences") or ())
    if owned and (cut is None or (meta.get("annotations") or {}).get(CUT_ANNOTATION) == cut):
        return
    session = body["status"].get("_session") or cache.session(meta["namespace"], name)
    if session is None:
        return  # gone: its deletion takes nothing of ours with it, and the Ready write finds out
    patched = k8s.patch_custom(
        "checkpoints",
        meta["namespace"],
        meta["name"],
        {
            "metadata": {
                "ownerReferences": [{**owner_reference(session), "controller": False}],
                "labels": {SESSION_LABEL: name},
                **({"annotations": {CUT_ANNOTATION: cut}} if cut else {}),
            }
        },
    )
    if patched is not None:
        meta["ownerReferences"] = patched["metadata"].get("ownerReferences")
        meta["annotations"] = patched["metadata"].get("annotations")
        cache.checkpoints.put(patched)


def _fail(body: dict, reason: FailReason, message: str) -> None:
    _tie_to_session(body)  # a Failed one goes with its Session too
    write_status(
        body,
        {
            **_unwritten(body["status"]),  # its cut and clock: Failed ones are deleted after expiresAt
            "phase": CheckpointPhase.FAILED.value,
            "reason": reason.value,
            "message": message,
            "resume": None,
            "conditions": ready_condition(body, False, reason, message),
        },
        event=(reason.value, message),
        warn=True,
    )
    # A Failed checkpoint never becomes Ready: whatever its snapshot holds (a half-made or
    # late one) is of no use, so it goes now; the message above keeps its error. Failed
    # is written first, so a pass that stops in between does not make it again.
    vs_name = body["status"].get("volumeSnapshotName")
    if vs_name:
        k8s.request_volume_snapshot_deletion(body["metadata"]["namespace"], vs_name)


def _become_ready(body: dict, restore_size: str | None) -> None:
    meta, status, spec = body["metadata"], body["status"], body["spec"]
    # The owner reference admission set names the session's uid: enough to write its log.
    refs = meta.get("ownerReferences") or []
    owner = next((r for r in refs if r.get("kind") == "Session" and r["name"] == spec["sessionName"]), None)
    session = (
        {"metadata": {"namespace": meta["namespace"], "name": owner["name"], "uid": owner["uid"]}}
        if owner
        else k8s.get_custom("sessions", meta["namespace"], spec["sessionName"])
    )
    if session is not None:
        with _appending[hash((meta["namespace"], spec["sessionName"])) % len(_appending)]:
            _append_created(body, session)
        # The Session's own pass, woken by this append, sets status.latestCheckpoint from the log.
    ready_at = _now()
    snapshot_ms = int((ready_at - parse_time(status["createdAt"])).total_seconds() * 1000)
    log.info(
        "checkpoint %s/%s is Ready (VolumeSnapshot %s, %d ms)",
        meta["namespace"],
        meta["name"],
        status.get("volumeSnapshotName"),
        snapshot_ms,
    )
    metrics.checkpoint_seconds.observe(snapshot_ms / 1000)
    # No Event: the status says it (phase, readyAt, the Ready condition), and an Event was
    # one request in every checkpoint's thirteen.
    write_status(
        body,
        {
            **_unwritten(status),  # the cut, when no Pending was written
            "phase": CheckpointPhase.READY.value,
            "reason": None,
            "message": None,
            "readyAt": rfc3339(ready_at),
            "restoreSize": restore_size,
            "conditions": ready_condition(
                body, True, Reason.SNAPSHOT_READY, f"restorable; snapshot took ~{snapshot_ms} ms"
            ),
        },
    )


# Checkpoints of one Session that become Ready together append to its log one at a time
# (a lock per stripe of Sessions): each then writes against the chunk the one before it
# wrote, instead of racing it for the same version and paying a read and a write again.
_appending = [threading.Lock() for _ in range(64)]


def _append_created(body: dict, session: dict) -> None:
    meta, status, spec = body["metadata"], body["status"], body["spec"]
    watched = cache.sessions.get(meta["namespace"], spec["sessionName"]) or {}
    elog = event_log(session)
    # The newest chunk as the watch (or the append before this one) showed it: the append writes without reading first.
    elog.seed(cache.chunks.newest(meta["namespace"], spec["sessionName"]))
    # Once: a retried pass finds its own event after the cut, by the checkpoint's uid.
    elog.append_once(
        CHECKPOINT_CREATED,
        {
            "checkpoint": meta["name"],
            "uid": meta["uid"],
            "throughSequence": status.get("throughSequence"),
            "throughEventId": status.get("throughEventId"),
            "label": spec.get("label"),
        },
        after=status.get("throughSequence") or 0,
        same=lambda e: e.type == CHECKPOINT_CREATED and e.data.get("uid") == meta["uid"],
        newest_hint=((watched.get("status") or {}).get("eventLog") or {}).get("chunks"),
    )


# --- deletion ---------------------------------------------------------------------------


def drop_snapshot(namespace: str, vs_name: str, owner_uid: str | None = None, owned: dict | None = None) -> None:
    """Ask for the deletion of a VolumeSnapshot whose Checkpoint is gone (its DELETED event,
    or a snapshot a late pass made after it went), when it is that Checkpoint's (an owner
    whose uid is `owner_uid`; any Checkpoint owner for `owned`, whose Checkpoint is gone).
    The garbage collector would delete it too: this is sooner, and does not depend on it."""
    snapshot = owned or k8s.get_volume_snapshot(namespace, vs_name)
    if snapshot is None:
        return
    refs = [r for r in snapshot["metadata"].get("ownerReferences") or [] if r.get("kind") == "Checkpoint"]
    if refs and (owner_uid is None or any(r.get("uid") == owner_uid for r in refs)):
        k8s.request_volume_snapshot_deletion(namespace, vs_name)


def release(namespace: str, name: str) -> None:
    """Take kopf's finalizer off a Checkpoint being deleted (one made while the operator
    still had a delete handler), after asking for its VolumeSnapshot's deletion: the
    garbage collector would delete it too (its ownerReference), this is only sooner."""
    body = k8s.get_custom("checkpoints", namespace, name)
    if body is None or KOPF_FINALIZER not in (body["metadata"].get("finalizers") or ()):
        return
    status = body.get("status") or {}
    k8s.request_volume_snapshot_deletion(namespace, status.get("volumeSnapshotName") or snapshot_name(name))
    rest = [f for f in body["metadata"]["finalizers"] if f != KOPF_FINALIZER]
    # The resourceVersion makes it conditional: a finalizer added meanwhile is not lost.
    meta = {"finalizers": rest, "resourceVersion": body["metadata"]["resourceVersion"]}
    k8s.patch_custom("checkpoints", namespace, name, {"metadata": meta})


# --- automatic checkpoints ---------------------------------------------------------------


def automatic_name(session: str, run_seq: int) -> str:
    return f"{session}-run-{run_seq}"


def ensure_automatic(session: dict, run_completed_seq: int, keep_last: int | None, ttl: str | None = None) -> None:
    """Take the checkpoint for one run.completed; keep only the newest keep_last automatic ones."""
    meta = session["metadata"]
    name = automatic_name(meta["name"], run_completed_seq)
    spec = {"sessionName": meta["name"], "label": f"after run (event {run_completed_seq})"}
    if ttl:
        spec["ttl"] = ttl  # checkpointPolicy.ttl, still capped by the namespace
    k8s.create_custom(
        "checkpoints",
        meta["namespace"],
        {
            "apiVersion": API_VERSION,
            "kind": "Checkpoint",
            "metadata": {
                "name": name,
                "labels": {AUTOMATIC_LABEL: "true", SESSION_LABEL: meta["name"], RUN_SEQ_LABEL: str(run_completed_seq)},
            },
            "spec": spec,
        },
    )
    if keep_last is None:
        return
    automatic = [
        c
        for c in k8s.list_custom(
            "checkpoints", meta["namespace"], f"{AUTOMATIC_LABEL}=true,{SESSION_LABEL}={meta['name']}"
        )
        if not c["metadata"].get("deletionTimestamp")
    ]
    automatic.sort(key=lambda c: int(c["metadata"]["labels"].get(RUN_SEQ_LABEL, "0")))
    for old in automatic[:-keep_last]:
        k8s.delete_custom("checkpoints", meta["namespace"], old["metadata"]["name"])
