"""Pure decisions for a Fork: resolve its source, name what it makes, merge overrides."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from savepoint.checkpoint import Patience
from savepoint.constants import API_VERSION, FORK_ANNOTATION, PARENT_SESSION_LABEL

# Re-exported: the Session and Fork controllers read it here.
from savepoint.constants import RESTORING_ANNOTATION as RESTORING_ANNOTATION
from savepoint.eventlog import Event
from savepoint.models import SANDBOX_ACCOUNT_PREFIX, CheckpointPhase, ForkMode, ForkSpec, RestoreMode
from savepoint.timestamps import parse_rfc3339


class ForkReason(StrEnum):
    CHECKPOINT_EXPIRED = "CheckpointExpired"
    SESSION_HISTORY_UNAVAILABLE = "SessionHistoryUnavailable"
    CHECKPOINT_NOT_READY = "CheckpointNotReady"
    CHECKPOINT_NOT_FOUND = "CheckpointNotFound"
    SESSION_BUSY = "SessionBusy"
    SESSION_NOT_READY = "SessionNotReady"
    SESSION_NOT_FOUND = "SessionNotFound"
    TARGET_EXISTS = "TargetExists"
    INVALID_TARGET = "InvalidTarget"
    EVENT_NOT_FOUND = "EventNotFound"


WAITING_FOR_CHECKPOINT = "WaitingForCheckpoint"


class ForkWait(Exception):
    """Not yet: the Fork's checkpoint can still become Ready (it is Pending, or not created
    yet by the rest of the same apply). The Fork stays Pending and is asked again."""

    reason = WAITING_FOR_CHECKPOINT


class ForkError(Exception):
    """A terminal failure of a Fork: `reason` is one of ForkReason."""

    def __init__(self, reason: ForkReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Plan:
    """What a Fork will do, once its source is resolved."""

    mode: ForkMode
    restore: RestoreMode
    source_session: str
    checkpoint: str | None  # the checkpoint whose snapshot is restored, if any
    snapshot: str | None
    through_sequence: int  # the log prefix copied (fork) or rolled back to (rollback)
    through_event_id: str | None


def effective_phase(status: dict[str, Any], now: datetime | None = None) -> str | None:
    """A checkpoint's phase as a restore must take it: one past its expiresAt is Expired,
    whether or not the expiry has written that yet (its snapshot may be on its way out:
    a storm of thousands falling due together takes a while to write)."""
    phase = status.get("phase")
    if phase in (CheckpointPhase.READY, CheckpointPhase.PENDING) and status.get("expiresAt"):
        try:
            if parse_rfc3339(status["expiresAt"]) <= (now or datetime.now(UTC)):
                return CheckpointPhase.EXPIRED.value
        except ValueError:
            pass
    return phase


def checkpoint_unusable(name: str, body: dict[str, Any] | None) -> ForkError | None:
    """Why checkpoint `name` cannot be restored from now, one message per reason; None once
    it is Ready. Whether a missing or Pending one is worth waiting for is the caller's call."""
    if body is None:
        return ForkError(ForkReason.CHECKPOINT_NOT_FOUND, f"checkpoint {name} not found")
    status = body.get("status") or {}
    phase = effective_phase(status)
    if phase == CheckpointPhase.EXPIRED:
        return ForkError(
            ForkReason.CHECKPOINT_EXPIRED,
            f"checkpoint {name} expired at {status.get('expiresAt')}; its snapshot is gone "
            "(fork from the session's log with source.session and atEvent instead)",
        )
    if phase in (CheckpointPhase.FAILED, CheckpointPhase.REJECTED):
        detail = f"{status.get('reason')}: {status.get('message')}" if status.get("reason") else "no reason given"
        return ForkError(ForkReason.CHECKPOINT_NOT_READY, f"checkpoint {name} ended {phase} ({detail})")
    if phase != CheckpointPhase.READY:
        return ForkError(ForkReason.CHECKPOINT_NOT_READY, f"checkpoint {name} is {phase or 'not admitted'}, not Ready")
    return None


def check_checkpoint(name: str, body: dict[str, Any] | None, patience: Patience | None = None) -> dict[str, Any]:
    """The checkpoint, usable; ForkWait while it can still become so; otherwise the
    ForkError that says why not. Never downgrades: Expired is CheckpointExpired at once."""
    patience = patience or Patience()
    refusal = checkpoint_unusable(name, body)
    if refusal is None:
        assert body is not None
        return body
    if body is None:
        if patience.waited < patience.missing_grace:
            raise ForkWait(f"waiting for checkpoint {name} to be created")
        raise refusal
    phase = effective_phase(body.get("status") or {})
    if phase not in (CheckpointPhase.EXPIRED, CheckpointPhase.FAILED, CheckpointPhase.REJECTED):
        if patience.waited < patience.timeout:
            raise ForkWait(
                f"waiting for checkpoint {name} to be Ready (it is {phase or 'new'}; "
                f"up to {patience.timeout}, SAVEPOINT_WAIT_TIMEOUT)"
            )
        raise ForkError(
            ForkReason.CHECKPOINT_NOT_READY,
            f"checkpoint {name} is still {phase or 'not admitted'} after {patience.timeout} (SAVEPOINT_WAIT_TIMEOUT)",
        )
    raise refusal


def find_event(events: Sequence[Event], at_event: str) -> Event | None:
    """The event an atEvent names: by its id, or by its sequence number written as a number."""
    return next((e for e in events if e.id == at_event or str(e.seq) == at_event), None)


def named_seq(at_event: str) -> int | None:
    """The sequence number an atEvent names: a number, or an event id (its 12-digit prefix)."""
    head = at_event.split("-", 1)[0]
    return int(head) if head.isdigit() and int(head) > 0 else None


def plan_from_checkpoint(spec: ForkSpec, checkpoint: dict[str, Any]) -> Plan:
    status = checkpoint["status"]
    return Plan(
        mode=spec.mode,
        restore=RestoreMode.SNAPSHOT,
        source_session=checkpoint["spec"]["sessionName"],
        checkpoint=checkpoint["metadata"]["name"],
        snapshot=status["volumeSnapshotName"],
        through_sequence=int(status.get("throughSequence") or 0),
        through_event_id=status.get("throughEventId"),
    )


def newest_live(checkpoints: list[dict[str, Any]]) -> dict[str, Any] | None:
    ready = [c for c in checkpoints if effective_phase(c.get("status") or {}) == CheckpointPhase.READY]
    return max(
        ready, key=lambda c: (c["status"].get("throughSequence") or 0, c["status"].get("readyAt") or ""), default=None
    )


def target_claim_name(session: str, fork: str) -> str:
    """The workspace claim a rollback swaps in: derived from the Fork so a retry finds it."""
    digest = hashlib.sha256(fork.encode()).hexdigest()[:8]
    return f"{session}-ws-{digest}"


def merge(base: Any, override: Any) -> Any:
    """Deep-merge override over base (JSON merge patch semantics: None deletes)."""
    if not isinstance(base, dict) or not isinstance(override, dict):
        return copy.deepcopy(override)
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge(merged.get(key), value)
    return merged


def build_target_session(
    fork: dict[str, Any], source_session: dict[str, Any], plan: Plan, at_event: str | None
) -> dict[str, Any]:
    spec = ForkSpec.model_validate(fork["spec"])
    base = copy.deepcopy(source_session.get("spec") or {})
    base.pop("source", None)
    pod_spec = (base.get("podTemplate") or {}).get("spec")
    if isinstance(pod_spec, dict):
        # The source's own sandbox account is not the target's: the target gets its own.
        own = f"{SANDBOX_ACCOUNT_PREFIX}{source_session['metadata']['name']}"
        for key in ("serviceAccountName", "serviceAccount"):
            if pod_spec.get(key) == own:
                del pod_spec[key]
    base["operatingMode"] = "Running"
    overrides = dict(spec.target.overrides) if spec.target else {}
    overrides.pop("source", None)
    target_spec = merge(base, overrides)
    if plan.restore == RestoreMode.SNAPSHOT:
        target_spec["source"] = {"checkpoint": plan.checkpoint}
    else:
        target_spec["source"] = {"session": plan.source_session}
        if at_event:
            target_spec["source"]["atEvent"] = at_event
    meta = fork["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": "Session",
        "metadata": {
            "name": spec.target.session_name if spec.target else None,
            "namespace": meta["namespace"],
            "annotations": {FORK_ANNOTATION: meta["uid"]},
            "labels": {PARENT_SESSION_LABEL: plan.source_session},
        },
        "spec": target_spec,
    }
