"""The client's exceptions: one class per reason, each with `.reason` and `.http_status`.

`.http_status` is the code a REST API in front of Savepoint answers with (the seeds'
APIs: 409 for a state that forbids the request, 501 when the cluster cannot snapshot,
404 for a missing object). `reason_error()` maps an operator reason (a Checkpoint's or
a Fork's `status.reason`, or the reason an admission webhook names) to its class; a
reason it does not know still raises, as `OperationFailed` with that reason.

Messages come from the operator's statuses (secret-free by design) or the API server.
`scrub()` still removes the values the API server echoes back for fields that may hold
env values or credentials, so no message carries one.
"""

from __future__ import annotations

import re
from typing import Any

from savepoint.errors import SavepointError


class ClientError(SavepointError):
    """Base class of every error savepoint.client raises on purpose."""

    reason = "Error"
    http_status = 500

    def __init__(self, message: str, *, reason: str | None = None, http_status: int | None = None, obj: Any = None):
        super().__init__(scrub(message))
        self.message = scrub(message)
        if reason is not None:
            self.reason = reason
        if http_status is not None:
            self.http_status = http_status
        # The typed object the failure was read from (a Rejected Checkpoint, a Failed Fork), if any.
        self.object = obj


# --- 404 ------------------------------------------------------------------------------


class NotFound(ClientError):
    reason, http_status = "NotFound", 404


class SessionNotFound(NotFound):
    reason = "SessionNotFound"


class CheckpointNotFound(NotFound):
    reason = "CheckpointNotFound"


class ForkNotFound(NotFound):
    reason = "ForkNotFound"


class EventNotFound(NotFound):
    reason = "EventNotFound"


# --- 409: the state of a session, checkpoint or workspace forbids the request ---------


class Conflict(ClientError):
    reason, http_status = "Conflict", 409


class SessionBusy(Conflict):
    """A run is in flight or an approval is pending."""

    reason = "SessionBusy"


class SessionNotReady(Conflict):
    """The session is provisioning, ended or failed."""

    reason = "SessionNotReady"


class QuotaExceeded(Conflict):
    reason = "QuotaExceeded"


class ZeroDataRetention(Conflict):
    """The workspace keeps no checkpoints."""

    reason = "ZeroDataRetention"


class InvalidWorkspacePolicy(Conflict):
    """The namespace's savepoint.dev/* annotations cannot be read."""

    reason = "InvalidWorkspacePolicy"


class CheckpointExpired(Conflict):
    """The checkpoint's snapshot is gone; it is never reinterpreted as a log-only fork."""

    reason = "CheckpointExpired"


class SessionHistoryUnavailable(Conflict):
    """The log prefix is incomplete (retention, erasure or zero data retention)."""

    reason = "SessionHistoryUnavailable"


class CheckpointNotReady(Conflict):
    reason = "CheckpointNotReady"


class TargetExists(Conflict):
    reason = "TargetExists"


class AlreadyExists(Conflict):
    reason = "AlreadyExists"


# --- 501 ------------------------------------------------------------------------------


class SnapshotsUnsupported(ClientError):
    """No VolumeSnapshotClass for the workspace's CSI driver."""

    reason, http_status = "SnapshotsUnsupported", 501


class HooksDisabled(ClientError):
    """The session has checkpoint hooks and the operator runs none (SAVEPOINT_HOOKS=false)."""

    reason, http_status = "HooksDisabled", 501


# --- 422: the request itself cannot be done -------------------------------------------


class InvalidRequest(ClientError):
    """Refused before anything was stored: the client's own validation, the CRD schema or CEL."""

    reason, http_status = "Invalid", 422

    def __init__(self, message: str, *, field: str | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.field = field


class InvalidTarget(InvalidRequest):
    reason = "InvalidTarget"


class IdempotencyKeyConflict(InvalidRequest):
    """The key already names an object made for a different request."""

    reason = "IdempotencyKeyConflict"


class CheckpointOfAnotherSession(InvalidRequest):
    """A rollback names a checkpoint that was taken from another session."""

    reason = "CheckpointOfAnotherSession"


# --- 5xx: the operation ran and failed ------------------------------------------------


class OperationFailed(ClientError):
    """A Checkpoint, Fork or Session ended Failed; `.reason` is the operator's."""

    reason, http_status = "Failed", 500


class SnapshotFailed(OperationFailed):
    reason = "SnapshotFailed"


class SnapshotLost(OperationFailed):
    reason = "SnapshotLost"


class SnapshotTimeout(OperationFailed):
    reason, http_status = "SnapshotTimeout", 504


class HookFailed(OperationFailed):
    reason = "HookFailed"


class SessionFailed(OperationFailed):
    reason = "SessionFailed"


class ConfigurationError(ClientError):
    """No kubeconfig (or in-cluster service account) to reach the API server with."""

    reason, http_status = "Configuration", 500


class ObjectDeleted(ClientError):
    """The object being waited on was deleted."""

    reason, http_status = "Deleted", 410


class WaitTimeout(ClientError, TimeoutError):
    """`timeout` passed before the operation finished; it goes on without the caller."""

    reason, http_status = "Timeout", 504

    def __init__(self, message: str, *, last_state: str = "", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.last_state = last_state


class ApiError(ClientError):
    """Any other answer of the API server (403 forbidden, 500, 503 ...), with its code."""

    reason = "ApiError"

    def __init__(self, status: int, message: str, reason: str | None = None, *, field: str | None = None) -> None:
        super().__init__(message, reason=reason or "ApiError", http_status=status)
        self.status = status
        self.field = field  # the first field the server named, for a refused object


# --- reasons --------------------------------------------------------------------------

_BY_REASON: dict[str, type[ClientError]] = {
    cls.reason: cls
    for cls in (
        SessionNotFound,
        CheckpointNotFound,
        ForkNotFound,
        EventNotFound,
        SessionBusy,
        SessionNotReady,
        QuotaExceeded,
        ZeroDataRetention,
        InvalidWorkspacePolicy,
        CheckpointExpired,
        SessionHistoryUnavailable,
        CheckpointNotReady,
        TargetExists,
        SnapshotsUnsupported,
        HooksDisabled,
        InvalidTarget,
        SnapshotFailed,
        SnapshotLost,
        SnapshotTimeout,
        HookFailed,
    )
}
# The expiry controller's reason on an Expired checkpoint.
_BY_REASON["TTLExpired"] = CheckpointExpired


def error_class(reason: str | None) -> type[ClientError] | None:
    return _BY_REASON.get(reason or "")


def reason_error(reason: str | None, message: str, *, obj: Any = None) -> ClientError:
    """The exception for an operator reason; an unknown one is an OperationFailed of that reason."""
    cls = error_class(reason)
    if cls is None:
        return OperationFailed(message, reason=reason or "Failed", obj=obj)
    return cls(message, obj=obj)


# --- secrets out of messages ----------------------------------------------------------

# The API server's validation messages quote the refused value: `FIELD: Invalid value: VALUE: why`.
_INVALID_VALUE = re.compile(
    r'(?P<field>[\w.\[\]\-/"]+): Invalid value: (?P<value>"(?:[^"\\]|\\.)*"|\{.*?\}|\[.*?\]|[^:\s]+)'
)
_SENSITIVE_FIELD = re.compile(r"(?i)(env|secret|password|passwd|token|credential|podtemplate|key|data)")
REDACTED = "(value not shown)"


def scrub(message: str) -> str:
    """`message` without the values the API server quotes for fields that may hold secrets."""

    def redact(match: re.Match[str]) -> str:
        if _SENSITIVE_FIELD.search(match["field"]):
            return f"{match['field']}: Invalid value: {REDACTED}"
        return match[0]

    return _INVALID_VALUE.sub(redact, message)
