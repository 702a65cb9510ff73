"""The API of savepoint.dev/v1alpha1: one pydantic model per spec and status.

These models are the single source of the CRDs (hack/update-crds renders them into
crds/*.yaml) and of the operator's reading of objects. camelCase on the wire,
snake_case in Python. Validation that the API server can do lives here as schema
constraints and CEL rules (`x-kubernetes-validations`), so `kubectl apply` is refused
before anything is stored.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

# Re-exported: code that reads the models finds the API names beside them.
from savepoint.constants import API_VERSION as API_VERSION
from savepoint.constants import GROUP as GROUP
from savepoint.constants import VERSION as VERSION

# Go-style durations with positive units only ("30d", "1h30m", "90s"); a sign is refused.
DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h|d|w))+$"
# Session names leave room for derived names such as "<session>-log-000001".
MAX_SESSION_NAME = 48
# A reference to another object is its name in the same namespace: a lowercase RFC 1123
# subdomain, never "namespace/name" (`[.]` rather than an escaped dot: CEL string literals).
LOCAL_NAME = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def cel(rule: str, message: str, field_path: str | None = None, reason: str | None = None) -> dict[str, str]:
    """One `x-kubernetes-validations` entry."""
    entry = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    if reason:
        entry["reason"] = reason
    return entry


def validations(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


def local_name(kind: str) -> dict[str, str]:
    """The CEL rule of a field that names another object of the same namespace."""
    return cel(
        f"self.matches('{LOCAL_NAME}')",
        f"must be the name of a {kind} in this namespace (a lowercase DNS name); "
        "objects in other namespaces cannot be referenced",
    )


FREE_FORM: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


class Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    def wire(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase, unset fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# --- shared ---------------------------------------------------------------------------


class Condition(Model):
    type: str
    status: str = Field(json_schema_extra={"enum": ["True", "False", "Unknown"]})
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class Revisioned(Model):
    name: str = Field(max_length=253)
    revision: str = Field(default="", max_length=253)


# --- Session --------------------------------------------------------------------------


class OperatingMode(StrEnum):
    RUNNING = "Running"
    PAUSED = "Paused"


class SessionPhase(StrEnum):
    PROVISIONING = "Provisioning"
    READY = "Ready"
    RUNNING = "Running"
    AWAITING_APPROVAL = "AwaitingApproval"
    PAUSED = "Paused"
    ENDED = "Ended"
    FAILED = "Failed"


class WorkspaceSpec(Model):
    size: str = Field(default="1Gi", pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$", max_length=32)
    storage_class_name: str | None = Field(default=None, max_length=253)
    volume_snapshot_class_name: str | None = Field(default=None, max_length=253)
    mount_path: str = Field(default="/workspace", pattern=r"^/.*", max_length=4096)
    reclaim_on_pause: bool = False


# A container name in a Pod (an RFC 1123 label).
CONTAINER_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# A hook holds a worker thread while it runs: bounded well below the snapshot timeout.
MAX_HOOK_SECONDS = 300


class ExecAction(Model):
    # argv, run without a shell (wrap it in `sh -c` for one); each word non-empty.
    command: list[Annotated[str, Field(min_length=1, max_length=4096)]] = Field(min_length=1, max_length=64)


class CheckpointHook(Model):
    """A command run in the sandbox through the API server's pods/exec (docs/checkpoints.md)."""

    exec: ExecAction
    # The container to run it in; default: the Pod template's first container.
    container: str | None = Field(default=None, max_length=63, pattern=CONTAINER_NAME)
    timeout_seconds: int = Field(default=30, ge=1, le=MAX_HOOK_SECONDS)


class CheckpointHooks(Model):
    # Runs before the cut; a failure fails the checkpoint (HookFailed) and no snapshot is taken.
    pre_checkpoint: CheckpointHook | None = None
    # Runs once the snapshot is cut or has failed; a failure is a Warning and a condition only.
    post_checkpoint: CheckpointHook | None = None


class CheckpointPolicy(Model):
    ttl: str | None = Field(default=None, pattern=DURATION_PATTERN, max_length=32)
    after_each_run: bool = False
    keep_last: int | None = Field(default=None, ge=1, le=1000)
    hooks: CheckpointHooks | None = None


# A zero duration (only zero digits, whatever the units) would pause a session the moment
# it is idle, before anyone could talk to it.
ZERO_DURATION = r"^([0]+([.][0]+)?(ms|s|m|h|d|w))+$"


class IdlePolicy(Model):
    """Pause a session nobody talks to, and wake it with the conversation (docs/idle.md)."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "!has(self.wakeOnTypes) || size(self.wakeOnTypes) > 0",
                "wakeOnTypes must name at least one event type (leave it out for user.message)",
                field_path=".wakeOnTypes",
            ),
        )
    )

    pause_after: str = Field(
        pattern=DURATION_PATTERN,
        max_length=32,
        json_schema_extra=validations(
            cel(
                f"!self.matches('{ZERO_DURATION}')",
                "pauseAfter must be longer than zero, such as 15m or 90s",
            )
        ),
    )
    checkpoint: bool = False
    wake_on_event: bool = False
    wake_on_types: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(
        default_factory=lambda: ["user.message"], max_length=32
    )


class SessionSource(Model):
    """Where a forked session came from: `{checkpoint}` | `{session, atEvent}` | `{session}`."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel("has(self.checkpoint) != has(self.session)", "exactly one of checkpoint or session must be set"),
            cel("!has(self.atEvent) || has(self.session)", "atEvent needs session", field_path=".atEvent"),
        )
    )

    checkpoint: str | None = Field(
        default=None, max_length=253, json_schema_extra=validations(local_name("Checkpoint"))
    )
    session: str | None = Field(default=None, max_length=253, json_schema_extra=validations(local_name("Session")))
    at_event: str | None = Field(default=None, max_length=64)


# A Pod template is free-form, except for the fields a CEL rule reads (a rule cannot see
# fields the schema leaves unknown): the ServiceAccount, which must be the sandbox's own.
POD_TEMPLATE = {
    **FREE_FORM,
    "properties": {
        "spec": {
            **FREE_FORM,
            "properties": {
                "serviceAccountName": {"type": "string", "maxLength": 253},
                "serviceAccount": {"type": "string", "maxLength": 253},
            },
        }
    },
}
SANDBOX_ACCOUNT_PREFIX = "savepoint-sandbox-"


def _own_account_rule(key: str) -> dict[str, str]:
    return cel(
        f"!has(self.spec.podTemplate) || !has(self.spec.podTemplate.spec) || "
        f"!has(self.spec.podTemplate.spec.{key}) || "
        f"self.spec.podTemplate.spec.{key} == '{SANDBOX_ACCOUNT_PREFIX}' + self.metadata.name",
        f"spec.podTemplate.spec.{key}: a sandbox runs as its own ServiceAccount "
        f"{SANDBOX_ACCOUNT_PREFIX}<session>, the only one it gets a token for; leave it unset",
        field_path=f".spec.podTemplate.spec.{key}",
        reason="FieldValueForbidden",
    )


SESSION_RULES = (_own_account_rule("serviceAccountName"), _own_account_rule("serviceAccount"))


class SessionSpec(Model):
    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "has(self.source) == has(oldSelf.source) && (!has(self.source) || self.source == oldSelf.source)",
                "source is immutable",
                field_path=".source",
            )
        )
    )

    pod_template: dict[str, Any] = Field(default_factory=dict, json_schema_extra=POD_TEMPLATE)
    workspace: WorkspaceSpec = Field(default_factory=WorkspaceSpec)
    harness: Revisioned | None = None
    profile: Revisioned | None = None
    operating_mode: OperatingMode = OperatingMode.RUNNING
    checkpoint_policy: CheckpointPolicy = Field(default_factory=CheckpointPolicy)
    idle: IdlePolicy | None = None
    source: SessionSource | None = None


class EventLogStatus(Model):
    last_sequence: int = 0
    last_event_id: str = ""
    chunks: int = 0


class RestoreMode(StrEnum):
    SNAPSHOT = "snapshot"
    EVENT_LOG_REBUILD = "event_log_rebuild"
    FRESH = "fresh"


class RestoreStatus(Model):
    mode: RestoreMode
    reason: str | None = None
    checkpoint: str | None = None
    through_sequence: int | None = None


class RunDurations(Model):
    p50: int | None = None
    max: int | None = None


class ApprovalUsage(Model):
    requested: int = 0
    approved: int = 0
    denied: int = 0
    wait_ms_total: int = 0


class TokenUsage(Model):
    input: int = 0
    output: int = 0
    total: int = 0


class UsageStatus(Model):
    """The operator's clock (bootMs, restoreMs, snapshotMs, pauses) and the log (the rest:
    savepoint.usage.derive_usage; the event shapes are in docs/event-log.md)."""

    boot_ms: int | None = None
    restore_ms: int | None = None
    snapshot_ms: int | None = None
    runs: int = 0
    run_duration_ms: RunDurations | None = None
    interrupts: int = 0
    pauses: int = 0
    approvals: ApprovalUsage | None = None
    tokens: TokenUsage | None = None
    llm_calls: int = 0


class ResourcesStatus(Model):
    """The newest sample of the sandbox's own heartbeat (savepoint.usage.parse_sample)."""

    load1: float | None = None
    mem_bytes: int | None = None
    mem_limit_bytes: int | None = None
    disk_bytes: int | None = None
    sampled_at: str | None = None


class IdleStatus(Model):
    """The operator's own pause of an idle session (spec.idle); spec.operatingMode stays the user's."""

    paused: bool = False
    # When the operator paused the session, the log's last sequence then (a wake needs a
    # newer event) and the spec's generation then (a change to the spec ends the pause).
    paused_at: str | None = None
    through_sequence: int | None = None
    generation: int | None = None
    # Set by a wake until the session is Ready again: the waking event and its time.
    woken_by_sequence: int | None = None
    woken_by_type: str | None = None
    woken_at: str | None = None
    # The last wake's time from the waking event to Ready.
    last_wake_ms: int | None = None


class SessionStatus(Model):
    observed_generation: int | None = None
    phase: SessionPhase | None = None
    pod_name: str | None = None
    workspace_claim_name: str | None = None
    event_log: EventLogStatus | None = None
    restore: RestoreStatus | None = None
    latest_checkpoint: str | None = None
    parent_session: str | None = None
    forked_from_checkpoint: str | None = None
    # Set while a paused session's workspace lives only in this checkpoint (reclaimOnPause).
    reclaimed_checkpoint: str | None = None
    idle: IdleStatus | None = None
    usage: UsageStatus | None = None
    resources: ResourcesStatus | None = None
    conditions: list[Condition] = Field(default_factory=list)


# --- Checkpoint -----------------------------------------------------------------------


class CheckpointPhase(StrEnum):
    PENDING = "Pending"
    READY = "Ready"
    REJECTED = "Rejected"
    FAILED = "Failed"
    EXPIRED = "Expired"


# Phases a Checkpoint's pass has nothing to do for (expiry is the expiry loop's job).
SETTLED_CHECKPOINT_PHASES = frozenset(
    {CheckpointPhase.READY, CheckpointPhase.FAILED, CheckpointPhase.REJECTED, CheckpointPhase.EXPIRED}
)


class ResumeKind(StrEnum):
    SNAPSHOT = "snapshot"
    EVENT_LOG = "event_log"


class CheckpointSpec(Model):
    session_name: str = Field(
        min_length=1,
        max_length=253,
        json_schema_extra=validations(cel("self == oldSelf", "sessionName is immutable"), local_name("Session")),
    )
    label: str | None = Field(default=None, max_length=256)
    ttl: str | None = Field(default=None, pattern=DURATION_PATTERN, max_length=32)


class CheckpointResume(Model):
    kind: ResumeKind
    # False once log retention has deleted part of events 1..throughSequence: the snapshot
    # stays (a rollback restores it) but a fork, which copies that prefix, cannot be made.
    log_prefix_available: bool | None = None
    message: str | None = None


class HookPhase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SKIPPED = "Skipped"
    INTERRUPTED = "Interrupted"


# Written before the next side effect: a restart never runs preCheckpoint after the cut,
# nor postCheckpoint twice.
class HookRunStatus(Model):
    """How one hook ran for this checkpoint."""

    phase: HookPhase
    exit_code: int | None = None
    duration_ms: int | None = None


class CheckpointHooksStatus(Model):
    pre_checkpoint: HookRunStatus | None = None
    post_checkpoint: HookRunStatus | None = None


class CheckpointStatus(Model):
    observed_generation: int | None = None
    phase: CheckpointPhase | None = None
    reason: str | None = None
    message: str | None = None
    through_sequence: int | None = None
    through_event_id: str | None = None
    harness_revision: str | None = None
    profile_revision: str | None = None
    volume_snapshot_name: str | None = None
    restore_size: str | None = None
    resume: CheckpointResume | None = None
    created_at: str | None = None
    ready_at: str | None = None
    expires_at: str | None = None
    # Only for a checkpoint of a Session with hooks.
    hooks: CheckpointHooksStatus | None = None
    conditions: list[Condition] = Field(default_factory=list)


# --- Fork -----------------------------------------------------------------------------


class ForkMode(StrEnum):
    FORK = "Fork"
    ROLLBACK = "Rollback"


class ForkPhase(StrEnum):
    PENDING = "Pending"
    RESTORING = "Restoring"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


# Phases a Fork ends in.
FINISHED_FORK_PHASES = frozenset({ForkPhase.SUCCEEDED, ForkPhase.FAILED})


class ForkSource(SessionSource):
    pass


class ForkTarget(Model):
    session_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_SESSION_NAME,
        json_schema_extra=validations(local_name("Session")),
    )
    overrides: dict[str, Any] = Field(default_factory=dict, json_schema_extra=FREE_FORM)


class ForkSpec(Model):
    model_config = ConfigDict(
        json_schema_extra=validations(
            cel("self.source == oldSelf.source", "source is immutable", field_path=".source"),
            cel("self.mode == oldSelf.mode", "mode is immutable", field_path=".mode"),
            cel(
                "has(self.target) == has(oldSelf.target) && (!has(self.target) || self.target == oldSelf.target)",
                "target is immutable",
                field_path=".target",
            ),
            cel(
                "self.mode != 'Rollback' || has(self.source.checkpoint)",
                "a Rollback needs source.checkpoint",
                field_path=".source",
            ),
            cel(
                "self.mode != 'Fork' || (has(self.target) && has(self.target.sessionName))",
                "a Fork needs target.sessionName",
                field_path=".target",
            ),
        )
    )

    source: ForkSource
    mode: ForkMode = ForkMode.FORK
    target: ForkTarget | None = None


class ForkStatus(Model):
    observed_generation: int | None = None
    phase: ForkPhase | None = None
    reason: str | None = None
    message: str | None = None
    target_session: str | None = None
    restore_mode: RestoreMode | None = None
    started_at: str | None = None
    completed_at: str | None = None
    restore_ms: int | None = None
    # The resolved source (checkpoint, snapshot, cursor), pinned on the first pass.
    plan: dict[str, Any] | None = Field(default=None, json_schema_extra=FREE_FORM)
    conditions: list[Condition] = Field(default_factory=list)
