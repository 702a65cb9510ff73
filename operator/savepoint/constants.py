"""Every name Savepoint puts on the wire, once: API group and version, labels,
annotations and condition reasons.

Standard library only, and importing nothing of savepoint: the event-log client
(`savepoint.eventlog`), which runs inside sandboxes, imports it too. The reasons a
Checkpoint is refused or fails with (`checkpoint.RejectReason`, `checkpoint.FailReason`)
and a Fork fails with (`fork.ForkReason`) stay beside the decisions that give them; the
annotations and keys of the event log's chunk format are `savepoint.eventlog`'s own.
"""

from __future__ import annotations

from enum import StrEnum

# --- API -------------------------------------------------------------------------------

GROUP = "savepoint.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

SNAPSHOT_GROUP = "snapshot.storage.k8s.io"
SNAPSHOT_VERSION = "v1"

# The content type of a JSON merge patch (RFC 7386): what each of our PATCHes sends.
MERGE_PATCH = "application/merge-patch+json"

# --- labels ----------------------------------------------------------------------------

# On every object made for a Session (Pod, claim, log chunks, sandbox RBAC, its
# Checkpoints and VolumeSnapshots): the Session's name. The operator's watches select it.
SESSION_LABEL = "savepoint.dev/session"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "savepoint"
# On a VolumeSnapshot: its Checkpoint's name (hashed when longer than a label value).
CHECKPOINT_LABEL = "savepoint.dev/checkpoint"
# On a Checkpoint taken by checkpointPolicy.afterEachRun, with the run.completed sequence.
AUTOMATIC_LABEL = "savepoint.dev/automatic"
RUN_SEQ_LABEL = "savepoint.dev/run-seq"
# On the Checkpoint that keeps a paused workspace (workspace.reclaimOnPause).
RECLAIM_LABEL = "savepoint.dev/reclaim"
# On a Session a Fork made: the source session's name.
PARENT_SESSION_LABEL = "savepoint.dev/parent-session"

# On a namespace: the Pod Security level its sandbox Pod templates are held to (savepoint.podsecurity).
POD_SECURITY_LABEL = "savepoint.dev/pod-security"

# The one ConfigMap a sandbox writes its resource samples to: `<session>-heartbeat`,
# labelled SESSION_LABEL, its sample a JSON object under this data key (savepoint.usage).
HEARTBEAT_SUFFIX = "-heartbeat"
HEARTBEAT_KEY = "sample"

# --- annotations -----------------------------------------------------------------------

# Namespace (workspace) policy, DESIGN section 6.
ANNOTATION_TTL = "savepoint.dev/checkpoint-ttl"
ANNOTATION_ZDR = "savepoint.dev/zero-data-retention"
ANNOTATION_LOG_RETENTION = "savepoint.dev/log-retention"
ANNOTATION_MAX_COUNT = "savepoint.dev/max-checkpoints"
ANNOTATION_MAX_BYTES = "savepoint.dev/max-checkpoint-bytes"

# On a Session a Fork made: the uid of that Fork.
FORK_ANNOTATION = "savepoint.dev/fork"
# On a Session being rolled back: the name of the Fork doing it.
RESTORING_ANNOTATION = "savepoint.dev/restoring"
# On a Session a Fork made: the log prefix to copy (the sequence number it ends at).
THROUGH_SEQUENCE_ANNOTATION = "savepoint.dev/through-sequence"
# On a Session being restored: when its restore started (ms since the epoch).
RESTORE_STARTED_MS_ANNOTATION = "savepoint.dev/restore-started-ms"
# On a sandbox Pod, by the operator's clock (ms since the epoch): made, and booted.
POD_CREATED_MS = "savepoint.dev/created-ms"
POD_BOOT_MS = "savepoint.dev/boot-ms"
# On a VolumeSnapshot a Checkpoint asked for, and on that Checkpoint: the cut it was
# made at (status fields, as JSON), while its Pending status is not written (a fast
# snapshot goes straight to Ready; controllers/checkpoint.py).
CUT_ANNOTATION = "savepoint.dev/cut"
# On an object `kubectl savepoint --idempotency-key` created: the key.
IDEMPOTENCY_KEY_ANNOTATION = "savepoint.dev/idempotency-key"

# --- conditions ------------------------------------------------------------------------


class ConditionType(StrEnum):
    READY = "Ready"
    WORKSPACE_BOUND = "WorkspaceBound"
    POD_RUNNING = "PodRunning"
    EVENT_LOG_READABLE = "EventLogReadable"
    IDLE = "Idle"  # spec.idle: True while the operator keeps the session paused for idleness
    HEARTBEAT_STALE = "HeartbeatStale"
    # On a Checkpoint of a Session with hooks: how each hook went.
    PRE_CHECKPOINT_HOOK = "PreCheckpointHook"
    POST_CHECKPOINT_HOOK = "PostCheckpointHook"


class Reason(StrEnum):
    """Condition reasons (a Checkpoint's rejections and failures: checkpoint.py)."""

    # Session
    PROVISIONING = "Provisioning"
    WORKSPACE_PENDING = "WorkspacePending"
    WORKSPACE_BOUND = "WorkspaceBound"
    POD_PENDING = "PodPending"
    POD_RUNNING = "PodRunning"
    POD_FAILED = "PodFailed"
    IMAGE_UNAVAILABLE = "ImageUnavailable"  # the kubelet cannot get the image and will not retry
    VOLUME_MOUNT_FAILED = "VolumeMountFailed"  # the kubelet's FailedMount (the CSI node plugin refused)
    CONTAINER_WAITING = "ContainerWaiting"  # the kubelet is retrying (pull back-off, config error)
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
    HEARTBEAT_STALE = "HeartbeatStale"  # the sandbox's heartbeat stopped
    HEARTBEAT_FRESH = "HeartbeatFresh"
    SANDBOX_NOT_RUNNING = "SandboxNotRunning"  # no Pod running: no heartbeat expected
    ROLLING_BACK = "RollingBack"  # a Fork is swapping the workspace: no Pod meanwhile
    # Checkpoint
    SNAPSHOTTING = "Snapshotting"
    SNAPSHOT_READY = "SnapshotReady"
    TTL_EXPIRED = "TTLExpired"
    HOOK_SUCCEEDED = "HookSucceeded"
    HOOK_FAILED = "HookFailed"
    HOOK_SKIPPED = "HookSkipped"
    HOOK_INTERRUPTED = "HookInterrupted"
