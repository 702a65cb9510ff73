"""The Fork controller: forks make a new Session; rollbacks swap a Session's disk in place.

A fork validates everything it can before it creates anything (an expired checkpoint
or an unreadable log prefix leaves no Session behind), then creates the target
Session with `spec.source` set; the Session controller restores disk and log and the
Fork succeeds when the target is Ready. A rollback is driven here step by step, each
step observable, so a restart resumes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

from pydantic import ValidationError

from savepoint import failpoints, k8s, metrics
from savepoint.checkpoint import (
    SNAPSHOT_GROUP,
    Patience,
    effective_ttl,
    policy_from_annotations,
)
from savepoint.conditions import set_condition
from savepoint.config import Settings
from savepoint.constants import THROUGH_SEQUENCE_ANNOTATION
from savepoint.controllers import cache, expiry, logview, object_lock, write_status
from savepoint.controllers.logs import event_log
from savepoint.errors import EventLogError, HistoryUnavailable
from savepoint.fork import (
    FORK_ANNOTATION,
    RESTORING_ANNOTATION,
    ForkError,
    ForkReason,
    ForkWait,
    Plan,
    build_target_session,
    check_checkpoint,
    find_event,
    named_seq,
    newest_live,
    plan_from_checkpoint,
    target_claim_name,
)
from savepoint.models import FINISHED_FORK_PHASES, ForkMode, ForkPhase, ForkSpec, RestoreMode, SessionPhase, SessionSpec
from savepoint.session import (
    LIVE_PHASES,
    RESTORE_STARTED_MS,
    SESSION_LABEL,
    build_pvc,
    busy,
    claim_name,
    pod_name,
)
from savepoint.timestamps import parse_rfc3339, rfc3339

log = logging.getLogger(__name__)
THROUGH_ANNOTATION = THROUGH_SEQUENCE_ANNOTATION


def _now() -> datetime:
    return datetime.now(UTC)


# The Ready condition's reason in each phase without a reason of its own.
_PHASE_REASON = {
    ForkPhase.PENDING: "Resolved",
    ForkPhase.RESTORING: "Restoring",
    ForkPhase.SUCCEEDED: "Succeeded",
    ForkPhase.FAILED: "Failed",
}


def _ready_condition(body: dict, status: dict) -> list[dict]:
    """Ready (True once Succeeded), so `kubectl wait --for=condition=Ready` works on a Fork."""
    phase = ForkPhase(status["phase"])
    reason = status.get("reason") or _PHASE_REASON[phase]
    message = status.get("message") or {
        ForkPhase.PENDING: "source resolved",
        ForkPhase.RESTORING: f"restoring session {status.get('targetSession')}",
        ForkPhase.SUCCEEDED: f"session {status.get('targetSession')} is ready",
    }.get(phase, "")
    old = (body.get("status") or {}).get("conditions") or []
    return set_condition(
        old, "Ready", phase == ForkPhase.SUCCEEDED, reason, message, body["metadata"].get("generation")
    )


def _write(body: dict, status: dict, event: tuple[str, str] | None = None, warn: bool = False) -> None:
    if "phase" in status:
        status = {**status, "conditions": _ready_condition(body, status)}
    cache.forks.put(write_status("forks", body, status, metrics.fork_transitions, event, warn))


def _fail(body: dict, err: ForkError) -> None:
    _write(
        body,
        {
            "phase": ForkPhase.FAILED.value,
            "reason": err.reason.value,
            "message": str(err),
            "completedAt": rfc3339(_now()),
        },
        event=(err.reason.value, str(err)),
        warn=True,
    )


# --- which forks an event moves on ------------------------------------------------------
# Read from the unfinished Forks the cache keeps (fed by their watch and our own writes).


def waiting_on_session(namespace: str, session: str) -> list[str]:
    """Unfinished forks by the session they wait on (status.targetSession: the fork's new
    session, or the session a rollback swaps), so that session's events move them on."""
    return cache.forks.names(namespace, lambda f: (f.get("status") or {}).get("targetSession") == session)


def rollbacks_waiting_on(namespace: str, session: str) -> list[str]:
    """The unfinished rollbacks among those: only a rollback's steps wait on the Session's
    Pod and claim (a fork's new Session tells it all through its own status)."""
    return cache.forks.names(
        namespace,
        lambda f: (
            (f.get("spec") or {}).get("mode") == ForkMode.ROLLBACK
            and (f.get("status") or {}).get("targetSession") == session
        ),
    )


# (namespace, fork) -> how far each rollback has come in this process, until the Fork is
# done or gone: HELD once it placed its hold, SWAPPED once its claim swap and its
# session.rollback record are both in.
HELD, SWAPPED = "held", "swapped"
_here: dict[tuple[str, str], str] = {}
# (namespace, fork) -> the read of the Session's events through the rollback's target,
# sent once the hold is placed, while the claim restores (logview.read_target).
_targets: dict[tuple[str, str], Future[logview.Target]] = {}


def swapped_in(namespace: str, fork: str) -> bool:
    """Whether the rollback `fork` has swapped the restored claim in and recorded
    session.rollback, in this process: the Pod may start on that claim while the hold is
    released. After a restart it is false until the hand-back."""
    return _here.get((namespace, fork)) == SWAPPED


def forget_rollback(namespace: str, fork: str) -> None:
    _here.pop((namespace, fork), None)
    _targets.pop((namespace, fork), None)


def held(namespace: str, session: str) -> bool:
    """Whether a rollback holds this Session, as its watch (or our own write) last showed it."""
    return cache.sessions.matches(
        namespace, session, lambda s: RESTORING_ANNOTATION in (s["metadata"].get("annotations") or {})
    )


def waiting_on_checkpoint(namespace: str, checkpoint: str) -> list[str]:
    """Unfinished forks still waiting for this checkpoint (no plan resolved yet)."""
    return cache.forks.names(
        namespace,
        lambda f: (
            ((f.get("spec") or {}).get("source") or {}).get("checkpoint") == checkpoint
            and not (f.get("status") or {}).get("plan")
        ),
    )


def reconcile_fork(
    namespace: str, name: str, settings: Settings, swapped: Callable[[str], None] = lambda session: None
) -> str | None:
    """One pass; the name of the Session a rollback handed back in it (released from its
    hold, on the restored claim). `swapped` is told the Session whose claim a rollback has
    just swapped in: its pass may start the Pod on it then, while the hold is released."""
    with object_lock("fork", namespace, name):
        return _reconcile(namespace, name, settings, swapped)


def _reconcile(namespace: str, name: str, settings: Settings, swapped: Callable[[str], None]) -> str | None:
    body = cache.fork(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    status = body.get("status") or {}
    if status.get("phase") in FINISHED_FORK_PHASES:
        return None
    spec = ForkSpec.model_validate(body["spec"])
    try:
        plan, pin = resolve(namespace, spec, body, settings)
        if spec.mode == ForkMode.ROLLBACK:
            return _rollback(body, spec, plan, settings, swapped, pin)
        _fork(body, spec, plan, pin)
    except ForkWait as wait:
        _write_waiting(body, str(wait))
    except ForkError as err:
        _fail(body, err)
    return None


def _write_waiting(body: dict, message: str) -> None:
    status = body.get("status") or {}
    if (status.get("phase"), status.get("reason"), status.get("message")) == (
        ForkPhase.PENDING,
        ForkWait.reason,
        message,
    ):
        return  # said already: a timer pass that finds nothing new writes nothing
    first = status.get("phase") is None
    _write(
        body,
        {"phase": ForkPhase.PENDING.value, "reason": ForkWait.reason, "message": message},
        event=(ForkWait.reason, message) if first else None,
    )


def _patience(settings: Settings, body: dict) -> Patience:
    made = body["metadata"].get("creationTimestamp")
    waited = max(timedelta(0), _now() - parse_rfc3339(made)) if made else timedelta(0)
    return Patience(waited, settings.wait_timeout, settings.missing_grace)


def _read_prefix(namespace: str, session: dict, through: int, checkpoint: str | None = None) -> None:
    try:
        if through:
            event_log(session).read(1, through)
    except HistoryUnavailable as err:
        message = str(err)
        if checkpoint:
            message = (
                f"the log prefix of checkpoint {checkpoint} (events 1..{through}) is gone: {message}; "
                "its snapshot is kept, and a rollback to it still works"
            )
        raise ForkError(ForkReason.SESSION_HISTORY_UNAVAILABLE, message) from None
    except EventLogError as err:
        raise ForkError(ForkReason.SESSION_HISTORY_UNAVAILABLE, f"the log cannot be read: {err}") from None


# The status fields that pin a resolved plan, when the pass has yet to write them: they
# go into the pass's next status write (Restoring), or alone when it has none to send.
Pin = dict[str, Any] | None


def resolve(namespace: str, spec: ForkSpec, body: dict, settings: Settings) -> tuple[Plan, Pin]:
    """Turn the Fork's source into a Plan; raise ForkWait while its checkpoint can still
    become Ready, or the ForkError that explains why not.

    A plan is pinned in the Fork's status, so a later pass (after a restart too) does not
    resolve it again against a moving log. A plan from a named checkpoint resolves the same
    on every pass (a Ready checkpoint's snapshot and cursor never change): its pin is
    returned, to go into the Restoring status the first step writes. Any other is pinned
    here, before anything is made from it."""
    pinned = (body.get("status") or {}).get("plan")
    if pinned:  # resolved on an earlier pass: do not re-resolve against a moving log
        # A merge patch drops null fields, so read each one with its default.
        plan = Plan(
            mode=ForkMode(pinned["mode"]),
            restore=RestoreMode(pinned["restore"]),
            source_session=pinned["source_session"],
            checkpoint=pinned.get("checkpoint"),
            snapshot=pinned.get("snapshot"),
            through_sequence=int(pinned.get("through_sequence") or 0),
            through_event_id=pinned.get("through_event_id"),
        )
        return plan, None
    source = spec.source
    if source.checkpoint:
        ckpt = check_checkpoint(
            source.checkpoint,
            k8s.get_custom("checkpoints", namespace, source.checkpoint),
            _patience(settings, body),
        )
        plan = plan_from_checkpoint(spec, ckpt)
    else:
        assert source.session is not None  # the CRD's CEL rule: a checkpoint or a session
        session = k8s.get_custom("sessions", namespace, source.session)
        if session is None:
            raise ForkError(ForkReason.SESSION_NOT_FOUND, f"session {source.session} not found")
        if source.at_event:
            plan = _plan_at_event(spec, session, source.at_event)
        else:
            latest = newest_live(k8s.list_custom("checkpoints", namespace, f"{SESSION_LABEL}={source.session}"))
            if latest is not None:
                plan = plan_from_checkpoint(spec, latest)
            else:
                cursor = event_log(session).cursor()
                plan = Plan(spec.mode, RestoreMode.EVENT_LOG_REBUILD, source.session, None, None, cursor.seq, cursor.id)
    session = cache.session(namespace, plan.source_session)
    if session is None:
        raise ForkError(ForkReason.SESSION_NOT_FOUND, f"session {plan.source_session} not found")
    if spec.mode == ForkMode.FORK:
        # A fork copies the prefix into its new log; a rollback keeps the session's own log,
        # so a prefix that retention deleted does not stop it restoring the snapshot.
        _read_prefix(namespace, session, plan.through_sequence, plan.checkpoint)
    fields = {k: (v.value if hasattr(v, "value") else v) for k, v in plan.__dict__.items()}
    pending = {
        "phase": ForkPhase.PENDING.value,
        "reason": None,
        "message": None,
        "plan": fields,
        "restoreMode": plan.restore.value,
        "startedAt": rfc3339(_now()),
    }
    if source.checkpoint:
        return plan, pending
    _write(body, pending)
    return plan, None


def _plan_at_event(spec: ForkSpec, session: dict, at_event: str) -> Plan:
    elog = event_log(session)
    try:
        events = elog.read(partial=True)
    except EventLogError as err:
        raise ForkError(ForkReason.SESSION_HISTORY_UNAVAILABLE, str(err)) from None
    match = find_event(events, at_event)
    wanted = named_seq(at_event)
    if match is None and wanted is not None and events and wanted < events[0].seq:
        # Before the oldest event left: deleted by retention, which the strict read names.
        _read_prefix("", session, wanted)
    if match is None:
        raise ForkError(ForkReason.EVENT_NOT_FOUND, f"session {session['metadata']['name']} has no event {at_event}")
    return Plan(spec.mode, RestoreMode.EVENT_LOG_REBUILD, session["metadata"]["name"], None, None, match.seq, match.id)


# --- fork -------------------------------------------------------------------------------


def _fork(body: dict, spec: ForkSpec, plan: Plan, pin: Pin = None) -> None:
    meta = body["metadata"]
    namespace = meta["namespace"]
    target_name = spec.target.session_name if spec.target else None
    assert target_name is not None  # the CRD's CEL rule requires it for a Fork
    # Before the target is made (no targetSession in status), the watch has nothing to show
    # of it: create it without a read first (one that exists answers 409, then is read).
    made = (body.get("status") or {}).get("targetSession") is not None
    target = cache.session(namespace, target_name) if made else cache.sessions.get(namespace, target_name)
    restoring = {"phase": ForkPhase.RESTORING.value, "targetSession": target_name}
    announce = (
        "Restoring",
        f"session {target_name} from {plan.checkpoint or plan.source_session} "
        f"through event {plan.through_sequence} ({plan.restore.value})",
    )
    if target is None:
        # The source as it stood when the Fork was made: a change applied with the Fork,
        # or just before it, goes into the target (the watch's copy may lag it).
        source_session = cache.session_as_of(namespace, plan.source_session, None, cache.version(body))
        if source_session is None:
            raise ForkError(ForkReason.SESSION_NOT_FOUND, f"session {plan.source_session} not found")
        new = build_target_session(body, source_session, plan, spec.source.at_event)
        new["metadata"]["annotations"][THROUGH_ANNOTATION] = str(plan.through_sequence)
        # The restore starts now: the target's usage.restoreMs runs from here to its Ready.
        new["metadata"]["annotations"][RESTORE_STARTED_MS] = str(int(time.time() * 1000))
        try:
            SessionSpec.model_validate(new["spec"])
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
            message = f"target.overrides make an invalid Session: {problems}"
            raise ForkError(ForkReason.INVALID_TARGET, message) from None
        try:
            created = k8s.create_custom("sessions", namespace, new)
        except k8s.Refused as err:
            raise ForkError(
                ForkReason.INVALID_TARGET, f"the API server refused session {target_name}: {err.message}"
            ) from None
        if created is None:  # there already: ours from an earlier pass, or another's (checked below)
            target = k8s.get_custom("sessions", namespace, target_name)
        else:
            target = created
            if plan.restore == RestoreMode.SNAPSHOT and plan.snapshot:
                # The restore is a fork's longest step: it starts now, not once the new
                # Session's event brings its first pass (which finds the claim made).
                cache.claims.put(_ensure_restored_claim(created, claim_name(target_name), plan))
            # The plan's pin, when it is still to write, goes into the same status.
            _write(body, {**(pin or {}), **restoring}, event=announce)
            pin = None
    if target is None:
        return
    if (target["metadata"].get("annotations") or {}).get(FORK_ANNOTATION) != meta["uid"]:
        raise ForkError(ForkReason.TARGET_EXISTS, f"session {target_name} already exists")
    if pin is not None:
        _write(body, {**pin, **restoring}, event=announce)  # a pass that made the target and stopped before it
    phase = (target.get("status") or {}).get("phase")
    if phase == SessionPhase.FAILED:
        cond: dict = next((c for c in target["status"].get("conditions", []) if c["type"] == "Ready"), {})
        reason = (
            ForkReason.SESSION_HISTORY_UNAVAILABLE
            if cond.get("reason") == ForkReason.SESSION_HISTORY_UNAVAILABLE
            else ForkReason.SESSION_NOT_READY
        )
        raise ForkError(reason, f"target session {target_name} failed: {cond.get('message', '')}")
    if phase in LIVE_PHASES:
        _succeed(body, target_name)


def _succeed(body: dict, target: str) -> None:
    status = body.get("status") or {}
    started = parse_rfc3339(status["startedAt"]) if status.get("startedAt") else _now()
    elapsed = int((_now() - started).total_seconds() * 1000)
    metrics.restore_seconds.labels(status.get("restoreMode") or "snapshot").observe(elapsed / 1000)
    log.info(
        "fork %s/%s succeeded: session %s is ready (%d ms)",
        body["metadata"]["namespace"],
        body["metadata"]["name"],
        target,
        elapsed,
    )
    _write(
        body,
        {
            "phase": ForkPhase.SUCCEEDED.value,
            "targetSession": target,
            "reason": None,
            "message": None,
            "completedAt": rfc3339(_now()),
            "restoreMs": elapsed,
        },
        event=("Succeeded", f"session {target} is ready"),
    )


# --- rollback ---------------------------------------------------------------------------


def _waits_for_claim(namespace: str, session: dict | None, fork: str, claim: str) -> bool:
    """Whether, as the watches show it, this held rollback has nothing to do but wait: for
    the old Pod, already being deleted, to go (its DELETED event brings the next pass), or
    with it gone for the new claim to bind. Such a pass (each Session, Pod and claim event
    brings one) reads nothing from the API server."""
    if session is None or (session["metadata"].get("annotations") or {}).get(RESTORING_ANNOTATION) != fork:
        return False
    pvc = cache.claims.get(namespace, claim)
    if pvc is None:
        return False
    pod = cache.pod(namespace, pod_name(session["metadata"]["name"]))
    if pod is not None:
        return bool(pod["metadata"].get("deletionTimestamp"))
    return (pvc.get("status") or {}).get("phase") != "Bound"


def _ready_to_swap(namespace: str, session: dict | None, fork: str, claim: str) -> bool:
    """Whether this process placed the hold (so no pass of it makes the Pod meanwhile), and
    the watches show the old Pod gone and the restored claim Bound, not yet swapped in."""
    if session is None or _here.get((namespace, fork)) != HELD:
        return False
    if (session["metadata"].get("annotations") or {}).get(RESTORING_ANNOTATION) != fork:
        return False
    if _claim_of(session) == claim:
        return False
    pvc = cache.claims.get(namespace, claim)
    bound = pvc is not None and (pvc.get("status") or {}).get("phase") == "Bound"
    return bound and cache.pod(namespace, pod_name(session["metadata"]["name"])) is None


def _claim_of(session: dict) -> str | None:
    return (session.get("status") or {}).get("workspaceClaimName")


def _handed_back(session: dict, fork: str, claim: str) -> bool:
    """Whether this rollback swapped the claim in and released the Session on an earlier pass."""
    held_by = (session["metadata"].get("annotations") or {}).get(RESTORING_ANNOTATION)
    return held_by != fork and _claim_of(session) == claim


def _until_back(body: dict, session: dict, plan: Plan, settings: Settings) -> None:
    """Succeed once the handed-back Session is live again (a run may already have started
    on the restored workspace), its old claims released."""
    phase = (session.get("status") or {}).get("phase")
    namespace = body["metadata"]["namespace"]
    if phase in LIVE_PHASES:
        # The checkpoint's expiry starts again now that the session runs on it: after the
        # Session is back, not on its way (a retried pass refreshes it again).
        _together(lambda: _release_old_claims(session), lambda: _refresh_expiry(namespace, plan.checkpoint, settings))
        _succeed(body, session["metadata"]["name"])
        forget_rollback(namespace, body["metadata"]["name"])
    elif phase == SessionPhase.FAILED:
        _release_old_claims(session)
        ready: dict = next((c for c in session["status"].get("conditions") or [] if c.get("type") == "Ready"), {})
        name = session["metadata"]["name"]
        message = f"session {name} failed on the restored workspace: {ready.get('message', '')}"
        raise ForkError(ForkReason.SESSION_NOT_READY, message)


def _release_old_claims(session: dict) -> None:
    """Delete the Session's claims but the one it is on: the one the rollback swapped out,
    and any a pass that stopped after its swap left behind. Once the Session is back, not
    while its Pod starts: deleting a volume is the CSI driver's work, on the same cores."""
    namespace, name = session["metadata"]["namespace"], session["metadata"]["name"]
    claims = k8s.list_pvcs(namespace, f"{SESSION_LABEL}={name}")
    old = [
        c["metadata"]["name"]
        for c in claims
        if c["metadata"]["name"] != _claim_of(session) and not c["metadata"].get("deletionTimestamp")
    ]
    if old:
        _together(*(lambda claim=claim: k8s.delete_pvc(namespace, claim) for claim in old))


def _rollback(
    body: dict, spec: ForkSpec, plan: Plan, settings: Settings, swapped: Callable[[str], None], pin: Pin = None
) -> str | None:
    meta = body["metadata"]
    namespace = meta["namespace"]
    claim = target_claim_name(plan.source_session, meta["name"])
    seen = cache.sessions.get(namespace, plan.source_session)
    if pin is not None and (seen is None or not _first_step(seen, meta["name"], claim)):
        _write(body, pin)  # no first step to write it with
        pin = None
    # The Restoring status, once written in this pass without its Event (the first step's).
    announced = False
    if _waits_for_claim(namespace, seen, meta["name"], claim):
        return None
    if seen is not None and _handed_back(seen, meta["name"], claim):
        _until_back(body, seen, plan, settings)  # as the watch shows it
        return None
    if _ready_to_swap(namespace, seen, meta["name"], claim):
        # Held by this rollback since a hold no pass of the Session in this process saw
        # coming, the old Pod gone and the claim Bound, as the watches show it: none of
        # the Session's passes makes a Pod while it is held, so the copies tell it all.
        session, pod = seen, None
        made: dict | None = None
    else:
        # Every other step reads the Session and its Pod afresh, together: whether a run
        # started, the hold, and the Pod that must be gone before the claim is swapped. A
        # rollback's first step also asks for the restored claim beside them, when the
        # watch's copy of the Session shows nothing that refuses it: the restore is the
        # rollback's longest step. The fresh copy is checked again below. The Restoring
        # status (the plan pinned in it) goes beside them: the restore has started.
        early = seen if seen is not None and _first_step(seen, meta["name"], claim) else None
        first = {**pin, "phase": ForkPhase.RESTORING.value, "targetSession": plan.source_session} if pin else None
        session, pod, made, _ = _together(
            lambda: k8s.get_custom("sessions", namespace, plan.source_session),
            lambda: k8s.get_pod(namespace, pod_name(plan.source_session)),
            lambda: _ensure_restored_claim(early, claim, plan) if early is not None else None,
            (lambda: _write(body, first)) if first else (lambda: None),
        )
        announced, pin = first is not None, None
        if made is not None and (session is None or session["metadata"]["uid"] != _owner_uid(made)):
            # The Session was made again under the same name since the watch showed it:
            # the claim belongs to the old one, which the garbage collector takes.
            # The Fork's timer brings the next pass.
            k8s.delete_pvc(namespace, claim)
            return None
    if session is None:
        raise ForkError(ForkReason.SESSION_NOT_FOUND, f"session {plan.source_session} not found")
    annotations = session["metadata"].get("annotations") or {}
    name = session["metadata"]["name"]

    if annotations.get(RESTORING_ANNOTATION) != meta["name"]:
        if _handed_back(session, meta["name"], claim):
            _until_back(body, session, plan, settings)
            return None
        try:
            _may_roll_back(session)
            # The restore starts before the log is checked and the session held: its claim
            # binding is the rollback's longest step, and it goes on while those and the
            # Pod's deletion happen. A refusal takes it away again, on this pass or, after
            # a restart in between, on the next one.
            if made is None:
                _ensure_restored_claim(session, claim, plan)
            _check_idle(session)
        except ForkError:
            k8s.delete_pvc(namespace, claim)
            raise
        hold = {"metadata": {"annotations": {RESTORING_ANNOTATION: meta["name"]}}}
        with object_lock("session", namespace, name):
            # Between two of the Session's passes: none is half-way, making a Pod from a
            # body without the hold, and each later one reads this body or a newer one.
            cache.sessions.put(k8s.patch_custom("sessions", namespace, name, hold))
            _here[(namespace, meta["name"])] = HELD
        # The events through the target, read while the claim restores: the rollback's
        # record then folds into the Session's digest, and the pass that starts the Pod
        # reads no whole log (a list, which waits for the API server's cache).
        read = partial(logview.read_target, session, event_log(session), plan.through_sequence)
        _targets[(namespace, meta["name"])] = _steps.submit(read)

        def restoring() -> None:
            message = f"rolling session {name} back to {plan.checkpoint} (event {plan.through_sequence})"
            if announced:
                k8s.post_event(body, "Restoring", message)
            else:
                status = {"phase": ForkPhase.RESTORING.value, "targetSession": name}
                _write(body, status, event=("Restoring", message))

        if pod is not None and _claim_of(session) != claim:
            # Step 1 below, beside the status: the old sandbox's stop is what a new Pod of
            # the same name waits for.
            _together(restoring, lambda: k8s.delete_pod(namespace, pod_name(name), uid=pod["metadata"]["uid"]))
            return None
        restoring()
        # On at once: a Session pass that started before the hold may still make the Pod
        # again, and step 1 deletes it again on the next pass.

    # A pass that stopped after the swap (step 4) left the Session on the restored claim,
    # where its Pod may already run (swapped_in): steps 1 and 2 are behind it.
    if _claim_of(session) != claim:
        # 1. The Pod must be gone: running processes do not survive a rollback.
        if pod is not None:
            k8s.delete_pod(namespace, pod_name(name), uid=pod["metadata"]["uid"])
            return None
        # 2. A new claim restored from the snapshot (made on the first pass; a restart may have missed it).
        pvc = cache.claim(namespace, claim) or _ensure_restored_claim(session, claim, plan)
        failpoints.hit("rollback.after_claim_created")
        if (pvc.get("status") or {}).get("phase") != "Bound":
            return None
    # 3. The rollback is recorded in the same log, once: written against the chunk watch's
    # copy of the newest chunk (a stale copy costs a fresh read, never a repeat).
    elog = event_log(session)
    elog.seed(cache.chunks.newest(namespace, name))

    def record() -> None:
        written = elog.append_once(
            "session.rollback",
            {
                "checkpoint": plan.checkpoint,
                "toSequence": plan.through_sequence,
                "toEventId": plan.through_event_id,
                "fork": meta["uid"],
            },
            after=plan.through_sequence,
            same=lambda e: e.type == "session.rollback" and e.data.get("fork") == meta["uid"],
        )
        target = _targets.pop((namespace, meta["name"]), None)
        if written is not None and target is not None and target.done() and target.exception() is None:
            logview.rolled_back(session, elog, written, target.result())

    # 4. Swap the claim in (the checkpoint's expiry is refreshed, and the old claim deleted,
    # once the Session is back). Beside the append: the hold keeps the Pod away until both
    # are in, and each is safe to repeat if the pass stops between. Beside them too, the
    # namespace's labels when the copy kept is stale: the Pod's Pod Security check reads
    # them, and the pass that starts the Pod then waits for no read.
    started = time.monotonic()
    swap = {
        "workspaceClaimName": claim,
        "restore": {"mode": "snapshot", "checkpoint": plan.checkpoint, "throughSequence": plan.through_sequence},
    }
    _, written, _ = _together(
        record,
        lambda: k8s.patch_status("sessions", namespace, name, swap),
        lambda: cache.namespace_meta(namespace),
    )
    cache.sessions.put(written)
    failpoints.hit("rollback.after_swap")
    # With both in, the Session's pass starts the Pod on the restored claim now, while step
    # 5 releases the hold and the old claims (swapped_in).
    _here[(namespace, meta["name"])] = SWAPPED
    swapped(name)
    # 5. Hand the session back to its controller.
    released = {"metadata": {"annotations": {RESTORING_ANNOTATION: None}}}
    cache.sessions.put(k8s.patch_custom("sessions", namespace, name, released))
    log.info("rollback of %s/%s swapped in %s in %.0f ms", namespace, name, claim, (time.monotonic() - started) * 1000)
    return name


# Threads for the requests of a rollback step that do not wait for each other.
_steps = ThreadPoolExecutor(6, thread_name_prefix="rollback-step")


def _together(*calls: Callable[[], Any]) -> list[Any]:
    """Run the calls at once; their answers in order, or the first one's error once all are done."""
    running = [_steps.submit(call) for call in calls]
    wait(running)
    return [done.result() for done in running]


def _may_roll_back(session: dict) -> None:
    """Refuse (ForkError) a rollback of a Session that is running, not Ready or Paused, or
    held by another rollback, as its status and annotations say."""
    name, sstatus = session["metadata"]["name"], session.get("status") or {}
    phase = sstatus.get("phase")
    running = busy(name, phase)
    if running:
        raise ForkError(ForkReason.SESSION_BUSY, running)
    if phase not in (SessionPhase.READY, SessionPhase.PAUSED):
        raise ForkError(ForkReason.SESSION_NOT_READY, f"session {name} is {phase or 'not provisioned'}")
    holder = (session["metadata"].get("annotations") or {}).get(RESTORING_ANNOTATION)
    if holder:
        raise ForkError(ForkReason.SESSION_BUSY, f"session {name} is being rolled back by {holder}")


def _first_step(session: dict, fork: str, claim: str) -> bool:
    """Whether this copy of the Session shows a rollback about to take its first step: not
    held by it yet, not handed back, and nothing that refuses it."""
    if (session["metadata"].get("annotations") or {}).get(RESTORING_ANNOTATION) == fork:
        return False
    if _handed_back(session, fork, claim):
        return False
    try:
        _may_roll_back(session)
    except ForkError:
        return False
    return True


def _owner_uid(obj: dict) -> str | None:
    return next((ref.get("uid") for ref in obj["metadata"].get("ownerReferences") or []), None)


def _ensure_restored_claim(session: dict, claim: str, plan: Plan) -> dict:
    """The Session's claim `claim`, restored from the plan's snapshot (made, or read when there)."""
    source_spec = SessionSpec.model_validate(session.get("spec") or {})
    data_source = {"apiGroup": SNAPSHOT_GROUP, "kind": "VolumeSnapshot", "name": plan.snapshot}
    return k8s.ensure_pvc(build_pvc(session, source_spec, claim, data_source))


def _check_idle(session: dict) -> None:
    """The log, not the (possibly lagging) status, decides whether a run is in flight: the
    digest the Session's passes keep, with the newest chunk read afresh (one GET; the whole
    log is read only when no digest is kept, as after a start)."""
    try:
        view = logview.observe(session, event_log(session), fresh_after=time.monotonic())
    except EventLogError:
        return
    running = busy(session["metadata"]["name"], view.digest.activity())
    if running:
        raise ForkError(ForkReason.SESSION_BUSY, running)


def _refresh_expiry(namespace: str, checkpoint: str | None, settings: Settings) -> None:
    if not checkpoint:
        return
    # Under the lock an expiry takes, written through its queue: an expiry of the old
    # expiresAt either happened before this or sees the new one.
    with object_lock("checkpoint", namespace, checkpoint):
        body = k8s.get_custom("checkpoints", namespace, checkpoint)
        if body is None:
            return
        ns = k8s.get_namespace(namespace)
        policy = policy_from_annotations(ns["metadata"].get("annotations"), settings.default_checkpoint_ttl)
        ttl = effective_ttl(body["spec"].get("ttl"), policy)
        expiry.refreshed(k8s.patch_status("checkpoints", namespace, checkpoint, {"expiresAt": rfc3339(_now() + ttl)}))
