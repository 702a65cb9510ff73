"""Pure decisions for a Session: observed objects in, desired objects and status out.

Nothing here talks to the API server; controllers/session.py gathers what it observes,
calls these functions, and writes the results through savepoint.k8s.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from savepoint import constants
from savepoint.conditions import ConditionType, Reason, set_condition
from savepoint.constants import API_VERSION, POD_BOOT_MS, POD_CREATED_MS, SESSION_LABEL
from savepoint.eventlog import Event, summarize
from savepoint.models import SANDBOX_ACCOUNT_PREFIX, OperatingMode, SessionPhase, SessionSpec
from savepoint.usage import HeartbeatSeen, count_pauses

MANAGED_BY = {constants.MANAGED_BY_LABEL: constants.MANAGED_BY}
WORKSPACE_VOLUME = "workspace"
# On a Session restored from spec.source: when its restore started (the Fork sets it).
RESTORE_STARTED_MS = constants.RESTORE_STARTED_MS_ANNOTATION


# A session whose Pod runs on its workspace: idle (Ready), or busy with a run or an approval.
LIVE_PHASES = (SessionPhase.READY, SessionPhase.RUNNING, SessionPhase.AWAITING_APPROVAL)
_BUSY: dict[str | None, str] = {
    SessionPhase.RUNNING: "has a run in flight",
    SessionPhase.AWAITING_APPROVAL: "has an approval pending",
}


def activity(events: Sequence[Event]) -> SessionPhase:
    """What the log says a live session is doing (its status can lag the log): AwaitingApproval
    while an approval request has no answer, Running while a run is in flight, else Ready."""
    summary = summarize(events)
    if summary["approval_pending"]:
        return SessionPhase.AWAITING_APPROVAL
    if summary["run_in_flight"]:
        return SessionPhase.RUNNING
    return SessionPhase.READY


def busy(session: str, phase: str | None) -> str | None:
    """Why `session` in `phase` cannot be checkpointed or rolled back now; None unless a run
    or an approval is open."""
    what = _BUSY.get(phase)
    return f"session {session} {what}" if what else None


def owner_reference(body: dict[str, Any], kind: str = "Session") -> dict[str, Any]:
    """The controller ownerReference to one of Savepoint's objects (`kind` when the body has none)."""
    return {
        "apiVersion": body.get("apiVersion", API_VERSION),
        "kind": body.get("kind", kind),
        "name": body["metadata"]["name"],
        "uid": body["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


# The chart's ValidatingAdmissionPolicy (templates/sandbox-policy.yaml) recognises a
# sandbox by SANDBOX_ACCOUNT_PREFIX, the prefix of its ServiceAccount's name (and the
# Session CRD's CEL rule refuses any other account); keep them in step.


def sandbox_account(session: str) -> str:
    """The ServiceAccount a session's Pod runs as (savepoint.sandbox: what it may do)."""
    return f"{SANDBOX_ACCOUNT_PREFIX}{session}"


def pod_name(session: str) -> str:
    return session


def claim_name(session: str) -> str:
    return f"{session}-workspace"


def build_pvc(body: dict[str, Any], spec: SessionSpec, name: str, data_source: dict | None = None) -> dict:
    ws = spec.workspace
    claim: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": name,
            "namespace": body["metadata"]["namespace"],
            "labels": {SESSION_LABEL: body["metadata"]["name"], **MANAGED_BY},
            "ownerReferences": [owner_reference(body)],
        },
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": ws.size}},
        },
    }
    if ws.storage_class_name:
        claim["spec"]["storageClassName"] = ws.storage_class_name
    if data_source:
        claim["spec"]["dataSource"] = data_source
    return claim


class PodTemplateError(ValueError):
    """The Session's podTemplate cannot make a Pod; the message names the field."""


def _objects(value: Any, path: str) -> list[dict]:
    """A list of objects from the free-form template, or the PodTemplateError naming the field."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise PodTemplateError(f"{path}: must be a list of objects")
    return value


def build_pod(body: dict[str, Any], spec: SessionSpec, claim: str, created_ms: int) -> dict:
    """The sandbox Pod: the user's template plus the workspace volume, labels and owner."""
    session = body["metadata"]["name"]
    template = copy.deepcopy(spec.pod_template)
    meta = template.get("metadata") or {}
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k) or {}, dict) for k in ("labels", "annotations")):
        raise PodTemplateError("spec.podTemplate.metadata: labels and annotations must be objects")
    pod_spec = template.get("spec")
    if not isinstance(pod_spec, dict) or not pod_spec.get("containers"):
        raise PodTemplateError("spec.podTemplate.spec.containers: at least one container is required")
    _objects(pod_spec["containers"], "spec.podTemplate.spec.containers")
    volumes = _objects(pod_spec.get("volumes"), "spec.podTemplate.spec.volumes")
    volumes = [v for v in volumes if v.get("name") != WORKSPACE_VOLUME]
    volumes.append({"name": WORKSPACE_VOLUME, "persistentVolumeClaim": {"claimName": claim}})
    pod_spec["volumes"] = volumes
    env = [
        {"name": "SAVEPOINT_SESSION", "value": session},
        {"name": "SAVEPOINT_NAMESPACE", "value": body["metadata"]["namespace"]},
        {"name": "SAVEPOINT_SESSION_UID", "value": body["metadata"]["uid"]},
        {"name": "SAVEPOINT_WORKSPACE", "value": spec.workspace.mount_path},
    ]
    for i, container in enumerate(pod_spec["containers"]):
        if not isinstance(container, dict) or not container.get("name"):
            raise PodTemplateError(f"spec.podTemplate.spec.containers[{i}].name: required")
        where = f"spec.podTemplate.spec.containers[{i}]"
        mounts = _objects(container.get("volumeMounts"), f"{where}.volumeMounts")
        mounts = [m for m in mounts if m.get("name") != WORKSPACE_VOLUME]
        mounts.append({"name": WORKSPACE_VOLUME, "mountPath": spec.workspace.mount_path})
        container["volumeMounts"] = mounts
        names = {e.get("name") for e in env}
        own = _objects(container.get("env"), f"{where}.env")
        container["env"] = env + [e for e in own if e.get("name") not in names]
    # The sandbox runs as its own account, which may append to this session's log and do
    # nothing else; a template's account would be a way into another session's rights.
    pod_spec.pop("serviceAccount", None)  # the deprecated alias of serviceAccountName
    pod_spec["serviceAccountName"] = sandbox_account(session)
    if pod_spec.get("automountServiceAccountToken") is not False:  # an explicit "no token" stays
        pod_spec["automountServiceAccountToken"] = True
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(session),
            "namespace": body["metadata"]["namespace"],
            "labels": {**(meta.get("labels") or {}), SESSION_LABEL: session, **MANAGED_BY},
            "annotations": {**(meta.get("annotations") or {}), POD_CREATED_MS: str(created_ms)},
            "ownerReferences": [owner_reference(body)],
        },
        "spec": pod_spec,
    }


@dataclass(frozen=True)
class Observed:
    """What the Session handler saw in the cluster on this pass."""

    pod: dict | None
    pvc: dict | None
    log_cursor: tuple[int, str] | None  # None when the log could not be read
    log_chunks: int
    log_error: str | None
    run_in_flight: bool
    approval_pending: bool
    runs: int
    last_run_completed: int = 0  # seq of the newest run.completed in the effective history
    latest_checkpoint: str | None = None  # named by the log's newest checkpoint.created
    pod_warning: str | None = None  # the kubelet's FailedMount of a Pod that stays Pending
    usage: dict[str, Any] | None = None  # usage.derive_usage of the log; None when unread
    heartbeat: HeartbeatSeen | None = None  # None when no heartbeat object has been seen


def pod_phase(pod: dict | None) -> str | None:
    if pod is None or pod.get("metadata", {}).get("deletionTimestamp"):
        return None
    return (pod.get("status") or {}).get("phase")


def child_digest(obj: dict[str, Any]) -> tuple:
    """What a Session pass reads from its Pod or claim. Other changes (the snapshot
    controller's finalizer on a claim being snapshotted, our own annotations) leave it
    as it is, and need no pass."""
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    return (
        meta.get("uid"),
        bool(meta.get("deletionTimestamp")),
        status.get("phase"),
        tuple(
            ((c.get("state") or {}).get("waiting") or {}).get("reason")
            for c in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
        ),
        (obj.get("spec") or {}).get("volumeName"),
        tuple(sorted(r.get("uid", "") for r in meta.get("ownerReferences") or [])),
    )


# Waiting reasons of the kubelet that no retry can cure: the image is not on the node and
# may not be pulled, or its name cannot be parsed.
TERMINAL_WAITING = frozenset({"ErrImageNeverPull", "InvalidImageName"})
RETRIED_WAITING = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "CrashLoopBackOff",
    }
)


def container_problem(pod: dict | None) -> tuple[bool, str] | None:
    """(terminal, message) when a sandbox container cannot start, naming it, its image and the
    kubelet's reason and message; None when every container is starting or running."""
    statuses = (pod or {}).get("status") or {}
    for status in [*(statuses.get("initContainerStatuses") or []), *(statuses.get("containerStatuses") or [])]:
        waiting = (status.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason") or ""
        if reason in TERMINAL_WAITING or reason in RETRIED_WAITING:
            detail = f": {waiting['message']}" if waiting.get("message") else ""
            message = f"container {status.get('name')} (image {status.get('image')}) cannot start: {reason}{detail}"
            return reason in TERMINAL_WAITING, message[:1024]
    return None


def pvc_bound(pvc: dict | None) -> bool:
    return pvc is not None and (pvc.get("status") or {}).get("phase") == "Bound"


def derive_phase(spec: SessionSpec, seen: Observed) -> tuple[SessionPhase, str, str]:
    """(phase, reason, message) from spec and observation; the first match wins."""
    phase = pod_phase(seen.pod)
    if phase == "Failed":
        return SessionPhase.FAILED, Reason.POD_FAILED, "the sandbox Pod failed"
    if phase == "Succeeded":
        return SessionPhase.ENDED, Reason.POD_SUCCEEDED, "the sandbox Pod exited"
    if spec.operating_mode == OperatingMode.PAUSED:
        if seen.pod is None:
            return SessionPhase.PAUSED, Reason.PAUSED, "paused: the Pod is deleted, the workspace kept"
        return SessionPhase.PROVISIONING, Reason.PAUSED, "pausing: waiting for the Pod to go"
    if not pvc_bound(seen.pvc):
        return SessionPhase.PROVISIONING, Reason.WORKSPACE_PENDING, "waiting for the workspace volume to bind"
    if phase != "Running":
        problem = container_problem(seen.pod)
        if problem is not None:
            terminal, message = problem
            if terminal:
                return SessionPhase.FAILED, Reason.IMAGE_UNAVAILABLE, message
            return SessionPhase.PROVISIONING, Reason.CONTAINER_WAITING, message
        if seen.pod_warning:
            return (
                SessionPhase.PROVISIONING,
                Reason.VOLUME_MOUNT_FAILED,
                f"the kubelet cannot start the Pod: {seen.pod_warning}"[:1024],
            )
        return SessionPhase.PROVISIONING, Reason.POD_PENDING, f"waiting for the Pod (phase {phase or 'absent'})"
    if seen.log_cursor is None:
        return SessionPhase.PROVISIONING, Reason.LOG_UNAVAILABLE, seen.log_error or "event log not readable"
    if seen.approval_pending:
        return SessionPhase.AWAITING_APPROVAL, Reason.APPROVAL_PENDING, "an approval request has no answer"
    if seen.run_in_flight:
        return SessionPhase.RUNNING, Reason.RUN_IN_FLIGHT, "a run is in flight"
    return SessionPhase.READY, Reason.IDLE, "ready"


def build_status(
    body: dict[str, Any], spec: SessionSpec, seen: Observed, claim: str, now: str | None = None
) -> dict[str, Any]:
    """The Session's whole status (except fields other controllers own) from one observation."""
    old = body.get("status") or {}
    generation = body["metadata"].get("generation")
    phase, reason, message = derive_phase(spec, seen)
    conditions = list(old.get("conditions") or [])
    conditions = set_condition(
        conditions,
        ConditionType.WORKSPACE_BOUND,
        pvc_bound(seen.pvc),
        Reason.WORKSPACE_BOUND if pvc_bound(seen.pvc) else Reason.WORKSPACE_PENDING,
        f"PersistentVolumeClaim {claim}",
        generation,
        now,
    )
    running = pod_phase(seen.pod) == "Running"
    conditions = set_condition(
        conditions,
        ConditionType.POD_RUNNING,
        running,
        Reason.POD_RUNNING
        if running
        else (Reason.PAUSED if spec.operating_mode == OperatingMode.PAUSED else Reason.POD_PENDING),
        f"Pod {pod_name(body['metadata']['name'])} phase {pod_phase(seen.pod) or 'absent'}",
        generation,
        now,
    )
    conditions = set_condition(
        conditions,
        ConditionType.EVENT_LOG_READABLE,
        seen.log_error is None,
        Reason.LOG_READABLE if seen.log_error is None else Reason.LOG_MALFORMED,
        seen.log_error or "event log readable",
        generation,
        now,
    )
    ready = phase in LIVE_PHASES
    conditions = set_condition(conditions, ConditionType.READY, ready, reason, message, generation, now)

    if seen.heartbeat is not None:
        stale = running and seen.heartbeat.stale
        conditions = set_condition(
            conditions,
            ConditionType.HEARTBEAT_STALE,
            stale,
            Reason.HEARTBEAT_STALE if stale else (Reason.HEARTBEAT_FRESH if running else Reason.SANDBOX_NOT_RUNNING),
            seen.heartbeat.message(running),
            generation,
            now,
        )

    usage = dict(old.get("usage") or {})
    if seen.usage is not None:
        usage.update(seen.usage)
    else:
        usage["runs"] = seen.runs
    usage["pauses"] = count_pauses(old.get("phase"), phase.value, int(usage.get("pauses") or 0))
    boot = ((seen.pod or {}).get("metadata", {}).get("annotations") or {}).get(POD_BOOT_MS)
    if boot is not None:
        usage["bootMs"] = int(boot)
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "phase": phase.value,
        "podName": pod_name(body["metadata"]["name"]) if seen.pod else None,
        "workspaceClaimName": claim,
        "usage": usage,
        "conditions": conditions,
    }
    if seen.log_cursor is not None:
        status["eventLog"] = {
            "lastSequence": seen.log_cursor[0],
            "lastEventId": seen.log_cursor[1],
            "chunks": seen.log_chunks,
        }
    if seen.latest_checkpoint:
        status["latestCheckpoint"] = seen.latest_checkpoint
    if seen.heartbeat is not None:
        status["resources"] = seen.heartbeat.resources
    return status
