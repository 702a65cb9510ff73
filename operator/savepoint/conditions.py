"""Condition types and reasons as named constants, and pure helpers to set them."""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any


class ConditionType(StrEnum):
    READY = "Ready"
    WORKSPACE_BOUND = "WorkspaceBound"
    POD_RUNNING = "PodRunning"
    EVENT_LOG_READABLE = "EventLogReadable"


class Reason(StrEnum):
    # Session
    PROVISIONING = "Provisioning"
    WORKSPACE_PENDING = "WorkspacePending"
    WORKSPACE_BOUND = "WorkspaceBound"
    POD_PENDING = "PodPending"
    POD_RUNNING = "PodRunning"
    POD_FAILED = "PodFailed"
    POD_SUCCEEDED = "PodSucceeded"
    PAUSED = "Paused"
    RUN_IN_FLIGHT = "RunInFlight"
    APPROVAL_PENDING = "ApprovalPending"
    IDLE = "Idle"
    LOG_READABLE = "LogReadable"
    LOG_MALFORMED = "LogMalformed"
    LOG_UNAVAILABLE = "LogUnavailable"
    INVALID_POD_TEMPLATE = "InvalidPodTemplate"
    POD_TEMPLATE_FORBIDDEN = "PodTemplateForbidden"


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    conditions: list[dict[str, Any]],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    generation: int | None,
    now: str | None = None,
) -> list[dict[str, Any]]:
    """Return conditions with one entry replaced; lastTransitionTime moves only on a status change."""
    wanted = "True" if status else "False"
    previous = next((c for c in conditions if c.get("type") == type_), None)
    moved = previous is None or previous.get("status") != wanted
    entry = {
        "type": type_,
        "status": wanted,
        "reason": reason,
        "message": message,
        "lastTransitionTime": (now or now_rfc3339()) if moved else previous.get("lastTransitionTime"),
        "observedGeneration": generation,
    }
    return [c for c in conditions if c.get("type") != type_] + [entry]
