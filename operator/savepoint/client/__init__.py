"""savepoint.client: Savepoint's typed Python client (docs/python-client.md).

    from savepoint.client import Client

    client = Client(namespace="team-a")
    checkpoint = client.checkpoints.create("s1", label="before refactor", idempotency_key="req-42")
    print(checkpoint.status.through_sequence, checkpoint.status.expires_at)

Objects are the pydantic models of savepoint.models (Session, Checkpoint, Fork with typed
spec and status); failures are exceptions of savepoint.client.errors, one per reason.
"""

from savepoint.client.aio import AsyncClient, AsyncSessionLog
from savepoint.client.core import Progress
from savepoint.client.errors import (
    AlreadyExists,
    ApiError,
    CheckpointExpired,
    CheckpointNotFound,
    CheckpointNotReady,
    CheckpointOfAnotherSession,
    ClientError,
    ConfigurationError,
    Conflict,
    EventNotFound,
    ForkNotFound,
    HookFailed,
    HooksDisabled,
    IdempotencyKeyConflict,
    InvalidRequest,
    InvalidTarget,
    InvalidWorkspacePolicy,
    NotFound,
    ObjectDeleted,
    OperationFailed,
    QuotaExceeded,
    SessionBusy,
    SessionFailed,
    SessionHistoryUnavailable,
    SessionNotFound,
    SessionNotReady,
    SnapshotFailed,
    SnapshotLost,
    SnapshotsUnsupported,
    SnapshotTimeout,
    TargetExists,
    WaitTimeout,
    ZeroDataRetention,
)
from savepoint.client.objects import Checkpoint, Fork, ObjectMeta, Session
from savepoint.client.sync import Client, SessionLog

__all__ = [
    "AlreadyExists",
    "ApiError",
    "AsyncClient",
    "AsyncSessionLog",
    "Checkpoint",
    "CheckpointExpired",
    "CheckpointNotFound",
    "CheckpointNotReady",
    "CheckpointOfAnotherSession",
    "Client",
    "ClientError",
    "ConfigurationError",
    "Conflict",
    "EventNotFound",
    "Fork",
    "ForkNotFound",
    "HookFailed",
    "HooksDisabled",
    "IdempotencyKeyConflict",
    "InvalidRequest",
    "InvalidTarget",
    "InvalidWorkspacePolicy",
    "NotFound",
    "ObjectDeleted",
    "ObjectMeta",
    "OperationFailed",
    "Progress",
    "QuotaExceeded",
    "Session",
    "SessionBusy",
    "SessionFailed",
    "SessionHistoryUnavailable",
    "SessionLog",
    "SessionNotFound",
    "SessionNotReady",
    "SnapshotFailed",
    "SnapshotLost",
    "SnapshotTimeout",
    "SnapshotsUnsupported",
    "TargetExists",
    "WaitTimeout",
    "ZeroDataRetention",
]
