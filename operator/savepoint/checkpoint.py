"""Pure decisions for a Checkpoint: workspace policy, admission, expiry, snapshot shape.

The same `admit()` answers the admission webhook and the status path, so a user sees
the same reason either way.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Any

from savepoint.constants import (
    ANNOTATION_LOG_RETENTION,
    ANNOTATION_MAX_BYTES,
    ANNOTATION_MAX_COUNT,
    ANNOTATION_TTL,
    ANNOTATION_ZDR,
    CHECKPOINT_LABEL,
    CUT_ANNOTATION,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    SESSION_LABEL,
    SNAPSHOT_GROUP,
    SNAPSHOT_VERSION,
)

# Re-exported for the handlers and controllers that read it here.
from savepoint.constants import AUTOMATIC_LABEL as AUTOMATIC_LABEL
from savepoint.cut import cut_annotation
from savepoint.durations import parse_duration
from savepoint.eventlog import Cursor
from savepoint.models import CheckpointSpec, SessionPhase
from savepoint.session import busy, owner_reference

# Re-exported: controllers/checkpoint.py reads the time helpers here.
from savepoint.timestamps import parse_rfc3339 as parse_time  # noqa: F401
from savepoint.timestamps import rfc3339 as rfc3339


class RejectReason(StrEnum):
    SESSION_BUSY = "SessionBusy"
    SESSION_NOT_READY = "SessionNotReady"
    QUOTA_EXCEEDED = "QuotaExceeded"
    ZERO_DATA_RETENTION = "ZeroDataRetention"
    SNAPSHOTS_UNSUPPORTED = "SnapshotsUnsupported"
    SESSION_NOT_FOUND = "SessionNotFound"
    INVALID_POLICY = "InvalidWorkspacePolicy"
    HOOKS_DISABLED = "HooksDisabled"


class FailReason(StrEnum):
    SNAPSHOT_FAILED = "SnapshotFailed"
    SNAPSHOT_TIMEOUT = "SnapshotTimeout"
    SNAPSHOT_LOST = "SnapshotLost"
    HOOK_FAILED = "HookFailed"


class WaitReason(StrEnum):
    WAITING_FOR_SESSION = "WaitingForSession"


@dataclass(frozen=True)
class Rejection:
    reason: RejectReason
    message: str


@dataclass(frozen=True)
class Wait:
    """Not yet: what the checkpoint needs can still come (its Session is Provisioning, or
    not created yet by the rest of the same apply). It stays Pending and is asked again."""

    reason: WaitReason
    message: str


@dataclass(frozen=True)
class Patience:
    """How long admission waits: `waited` is the checkpoint's age (zero at the webhook),
    `timeout` the bound for a Provisioning Session, `missing_grace` for a missing one."""

    waited: timedelta = timedelta(0)
    timeout: timedelta = timedelta(minutes=10)
    missing_grace: timedelta = timedelta(seconds=10)


@dataclass(frozen=True)
class Policy:
    """A namespace's workspace policy (DESIGN section 6)."""

    ttl_cap: timedelta
    zero_data_retention: bool = False
    log_retention: timedelta | None = None
    max_checkpoints: int | None = None
    max_checkpoint_bytes: int | None = None


class PolicyError(ValueError):
    """A namespace annotation does not parse; the message names it."""


_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_quantity(text: str | int) -> int:
    """Bytes from a Kubernetes quantity such as 10Gi, 500M or 1048576."""
    text = str(text).strip()
    for suffix, factor in sorted(_SUFFIX.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(float(text))


def policy_from_annotations(annotations: dict[str, str] | None, default_ttl: timedelta) -> Policy:
    annotations = annotations or {}

    def get(key: str, parse):
        if key not in annotations:
            return None
        try:
            return parse(annotations[key])
        except (ValueError, TypeError, OverflowError) as err:
            raise PolicyError(f"namespace annotation {key}={annotations[key]!r}: {err}") from None

    cap = get(ANNOTATION_TTL, parse_duration)
    return Policy(
        ttl_cap=cap if cap is not None else default_ttl,
        zero_data_retention=str(annotations.get(ANNOTATION_ZDR, "")).lower() == "true",
        log_retention=get(ANNOTATION_LOG_RETENTION, parse_duration),
        max_checkpoints=get(ANNOTATION_MAX_COUNT, int),
        max_checkpoint_bytes=get(ANNOTATION_MAX_BYTES, parse_quantity),
    )


@dataclass(frozen=True)
class SessionView:
    """What admission needs to know about the checkpoint's Session."""

    exists: bool
    phase: str | None = None
    claim: str | None = None
    storage_class: str | None = None
    cursor: Cursor | None = None  # the log's end as admission read it (the cut)
    hooks: bool = False  # the Session's checkpointPolicy has a pre- or postCheckpoint hook


@dataclass(frozen=True)
class QuotaUse:
    live_count: int
    live_bytes: int


def admit(
    name: str,
    spec: CheckpointSpec,
    policy: Policy,
    session: SessionView,
    quota: QuotaUse,
    snapshot_class: str | None,
    patience: Patience | None = None,
    hooks_enabled: bool = True,
) -> Rejection | Wait | None:
    """None to accept; a Wait while what is missing can still come; otherwise the terminal
    rejection and why, in DESIGN's order. What cannot change is refused at once."""
    patience = patience or Patience()
    if policy.zero_data_retention:
        return Rejection(
            RejectReason.ZERO_DATA_RETENTION,
            "this workspace keeps no checkpoints (namespace annotation savepoint.dev/zero-data-retention)",
        )
    if not session.exists:
        if patience.waited < patience.missing_grace:
            return Wait(WaitReason.WAITING_FOR_SESSION, f"waiting for session {spec.session_name} to be created")
        return Rejection(RejectReason.SESSION_NOT_FOUND, f"session {spec.session_name} not found")
    if session.hooks and not hooks_enabled:
        return Rejection(
            RejectReason.HOOKS_DISABLED,
            f"session {spec.session_name} has checkpointPolicy.hooks, and this operator runs no hooks "
            "(SAVEPOINT_HOOKS=false, chart value hooks.enabled); remove the hooks or enable them",
        )
    running = busy(spec.session_name, session.phase)
    if running:
        return Rejection(RejectReason.SESSION_BUSY, running)
    if session.phase in (None, SessionPhase.PROVISIONING):
        if patience.waited < patience.timeout:
            return Wait(
                WaitReason.WAITING_FOR_SESSION,
                f"waiting for session {spec.session_name} to be Ready (it is {session.phase or 'new'}; "
                f"up to {patience.timeout}, SAVEPOINT_WAIT_TIMEOUT)",
            )
        return Rejection(
            RejectReason.SESSION_NOT_READY,
            f"session {spec.session_name} is still {session.phase or 'not provisioned'} after "
            f"{patience.timeout} (SAVEPOINT_WAIT_TIMEOUT)",
        )
    if session.phase not in (SessionPhase.READY, SessionPhase.PAUSED):
        return Rejection(RejectReason.SESSION_NOT_READY, f"session {spec.session_name} is {session.phase}")
    if policy.max_checkpoints is not None and quota.live_count >= policy.max_checkpoints:
        return Rejection(
            RejectReason.QUOTA_EXCEEDED,
            f"the workspace already holds {quota.live_count} live checkpoints "
            f"(savepoint.dev/max-checkpoints={policy.max_checkpoints})",
        )
    if policy.max_checkpoint_bytes is not None and quota.live_bytes >= policy.max_checkpoint_bytes:
        return Rejection(
            RejectReason.QUOTA_EXCEEDED,
            f"live checkpoints use {quota.live_bytes} bytes "
            f"(savepoint.dev/max-checkpoint-bytes={policy.max_checkpoint_bytes})",
        )
    if snapshot_class is None:
        return Rejection(
            RejectReason.SNAPSHOTS_UNSUPPORTED,
            f"no VolumeSnapshotClass serves the CSI driver of session {spec.session_name}'s workspace",
        )
    return None


# Beyond any real retention, and small enough that now + ttl is still a date.
MAX_TTL = timedelta(days=36500)


def effective_ttl(spec_ttl: str | None, policy: Policy) -> timedelta:
    """min(spec.ttl, namespace cap); the cap already defaults to the operator's 30d."""
    cap = min(policy.ttl_cap, MAX_TTL)
    if spec_ttl is None:
        return cap
    try:
        return min(parse_duration(spec_ttl), cap)
    except OverflowError:  # "99999999999999999999d": more than a timedelta holds, so more than the cap
        return cap


def snapshot_name(checkpoint: str) -> str:
    """Deterministic, so a retry finds the snapshot the first try made; hashed when long."""
    name = f"sp-{checkpoint}"
    if len(name) <= 63:
        return name
    digest = hashlib.sha256(checkpoint.encode()).hexdigest()[:10]
    # A cut that ends in "." would make "x.-<digest>", which is not a valid name.
    return f"{name[:52].rstrip('.-')}-{digest}"


def checkpoint_label_value(checkpoint: str) -> str:
    """The checkpoint's name as a label value (at most 63 characters), hashed when longer.

    Checkpoint names may be 253 characters; a longer one is also kept whole in the
    annotation CHECKPOINT_LABEL, which the VolumeSnapshot watch reads before the label.
    """
    if len(checkpoint) <= 63:
        return checkpoint
    digest = hashlib.sha256(checkpoint.encode()).hexdigest()[:10]
    return f"{checkpoint[:52].rstrip('.-')}-{digest}"


def checkpoint_owner(body: dict[str, Any]) -> dict[str, Any]:
    """The ownerReference that ties a VolumeSnapshot to its Checkpoint's uid.

    The garbage collector deletes a snapshot whose owner is gone, so a snapshot a late pass
    creates after the Checkpoint's finalizer was released is removed all the same: the
    finalizer alone cannot see a snapshot made after it ran.
    """
    return owner_reference(body, "Checkpoint")


def _owner_uids(snapshot: dict[str, Any]) -> set[str]:
    refs = snapshot.get("metadata", {}).get("ownerReferences") or []
    return {r.get("uid") for r in refs if r.get("kind") == "Checkpoint"}


def owned_by_other(snapshot: dict[str, Any], body: dict[str, Any]) -> bool:
    """Whether a snapshot of this name belongs to an earlier Checkpoint of the same name
    (its owner's uid differs): the garbage collector is deleting it, it is not ours to use."""
    uids = _owner_uids(snapshot)
    return bool(uids) and body["metadata"]["uid"] not in uids


def owned_by(snapshot: dict[str, Any], body: dict[str, Any]) -> bool:
    """Whether a snapshot names this Checkpoint (its uid) as an owner."""
    return body["metadata"]["uid"] in _owner_uids(snapshot)


def build_volume_snapshot(
    body: dict[str, Any], claim: str, snapshot_class: str, cut: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The VolumeSnapshot of a Checkpoint; with `cut`, annotated with the cut it is made at."""
    meta = body["metadata"]
    label = checkpoint_label_value(meta["name"])
    # The whole name only where the label cannot hold it: every byte of a snapshot is paid
    # again by each of its writes and watch events (docs/performance.md).
    annotations = {CHECKPOINT_LABEL: meta["name"]} if label != meta["name"] else {}
    if cut is not None:
        annotations[CUT_ANNOTATION] = cut_annotation(cut)
    return {
        "apiVersion": f"{SNAPSHOT_GROUP}/{SNAPSHOT_VERSION}",
        "kind": "VolumeSnapshot",
        "metadata": {
            "name": snapshot_name(meta["name"]),
            "namespace": meta["namespace"],
            "ownerReferences": [checkpoint_owner(body)],
            **({"annotations": annotations} if annotations else {}),
            "labels": {
                CHECKPOINT_LABEL: label,
                SESSION_LABEL: body["spec"]["sessionName"],
                MANAGED_BY_LABEL: MANAGED_BY,
            },
        },
        "spec": {
            "volumeSnapshotClassName": snapshot_class,
            "source": {"persistentVolumeClaimName": claim},
        },
    }


@dataclass(frozen=True)
class SnapshotState:
    ready: bool
    error: str | None
    restore_size: str | None


def moves_checkpoint(event_type: str | None, snapshot: dict[str, Any]) -> str | None:
    """The Checkpoint a VolumeSnapshot's watch event moves on, or None. Only a ready or
    failed snapshot does: the snapshotter's many intermediate updates would each cost a
    pass that finds nothing to do (the pending poll keeps the timeout's clock). Not one
    being deleted (expiry, or its Checkpoint going)."""
    meta = snapshot.get("metadata") or {}
    if event_type not in ("ADDED", "MODIFIED") or meta.get("deletionTimestamp"):
        return None
    state = snapshot_state(snapshot)
    if not (state.ready or state.error is not None):
        return None
    # The label holds a hashed name when the checkpoint's is longer than a label value may be.
    return (meta.get("annotations") or {}).get(CHECKPOINT_LABEL) or (meta.get("labels") or {}).get(CHECKPOINT_LABEL)


# The API server's word for a write that lost an optimistic-concurrency race. The snapshot
# controller reports its own lost races (adding its finalizer to a claim that many
# snapshots are being taken of at once) in a snapshot's status.error, and tries again.
CONFLICT = "the object has been modified; please apply your changes to the latest version"


def snapshot_state(snapshot: dict[str, Any] | None) -> SnapshotState:
    """A VolumeSnapshot's readiness and error. An error that is only the snapshot
    controller's own lost update race is no error: it retries, and the snapshot is made."""
    status = (snapshot or {}).get("status") or {}
    error = (status.get("error") or {}).get("message")
    if error and CONFLICT in error:
        error = None
    size = status.get("restoreSize")
    return SnapshotState(
        ready=bool(status.get("readyToUse")), error=error, restore_size=str(size) if size is not None else None
    )


def pick_snapshot_class(classes: list[dict[str, Any]], driver: str | None, wanted: str | None) -> str | None:
    """The class named by the Session, else the driver's default class, else its only class."""
    if driver is None:
        return None
    mine = [c for c in classes if c.get("driver") == driver]
    if wanted:
        return wanted if any(c["metadata"]["name"] == wanted for c in mine) else None
    defaults = [
        c
        for c in mine
        if (c["metadata"].get("annotations") or {}).get("snapshot.storage.k8s.io/is-default-class") == "true"
    ]
    if defaults:
        return defaults[0]["metadata"]["name"]
    return mine[0]["metadata"]["name"] if len(mine) == 1 else None
