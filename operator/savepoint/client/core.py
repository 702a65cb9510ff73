"""The client's logic without I/O, shared by the sync and the async client.

Every operation is a generator. It yields requests (`Create`, `Get`, `Watch`, ...) and
is sent back the API server's answer, or has an `ApiError` thrown in where the server
refused. It returns the operation's result (a wire object) or raises the exception of
the reason. A driver runs it: `sync.Client` on `kubernetes`, `aio.AsyncClient` on
`kubernetes.aio` (the asyncio client shipped in the same package). So naming,
idempotency, the waiting state machine and the error mapping exist once, and the two
drivers only carry requests to the server.

Waiting is a watch of the one object (a `metadata.name` field selector), from the
resourceVersion of the object last read: no events are missed between the read and
the watch, and nothing is polled. A watch that ends early is resumed from the last
resourceVersion seen; one that answers 410 Gone (the version was compacted) is resumed
after a fresh GET. Each new state is reported as a `Progress`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from savepoint.client.errors import (
    AlreadyExists,
    ApiError,
    CheckpointOfAnotherSession,
    ClientError,
    IdempotencyKeyConflict,
    InvalidRequest,
    NotFound,
    ObjectDeleted,
    SessionFailed,
    SessionNotReady,
    WaitTimeout,
    error_class,
    reason_error,
)
from savepoint.client.objects import KINDS, typed
from savepoint.constants import IDEMPOTENCY_KEY_ANNOTATION
from savepoint.cut import cut_of
from savepoint.models import API_VERSION, CheckpointSpec, ForkSpec, SessionSpec

# Prefix of generated names; the server appends 5 random characters. Kept short so the
# name stays a valid label value (63 characters), which the operator relies on.
MAX_GENERATE_PREFIX = 40
# A watch is also closed by the client this long after the server should have ended it.
WATCH_GRACE_SECONDS = 10

# ---------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Create:
    plural: str
    namespace: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Get:
    plural: str
    namespace: str
    name: str


@dataclass(frozen=True)
class List:
    """Answered with the list's items; namespace None lists every namespace."""

    plural: str
    namespace: str | None
    label_selector: str | None = None


@dataclass(frozen=True)
class Patch:
    """A JSON merge patch."""

    plural: str
    namespace: str
    name: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Delete:
    plural: str
    namespace: str
    name: str


@dataclass(frozen=True)
class Watch:
    """Open a watch of one object; answered with its first event, or None when the stream ended."""

    plural: str
    namespace: str
    name: str
    resource_version: str
    timeout_seconds: int


@dataclass(frozen=True)
class NextEvent:
    """The next event of the open watch ({"type", "object"}), or None when it ended."""


@dataclass(frozen=True)
class Report:
    """Hand a Progress to the caller's on_progress; answered with None."""

    progress: Progress


Request = Create | Get | List | Patch | Delete | Watch | NextEvent | Report
Operation = Generator[Request, Any, Any]


@dataclass(frozen=True)
class Progress:
    """One step of an operation: `created` or `reused` (its object), then each new `state` while waiting."""

    step: str
    kind: str
    name: str
    namespace: str
    state: str
    elapsed: float
    raw: dict[str, Any] = field(repr=False, compare=False)

    @property
    def phase(self) -> str | None:
        return (self.raw.get("status") or {}).get("phase")

    @property
    def line(self) -> str:
        """The line `kubectl savepoint` prints, e.g. `[   2.1s] Pending: snapshot ... not ready yet`."""
        return f"[{self.elapsed:6.1f}s] {self.state}"

    @property
    def object(self) -> Any:
        """The typed Session, Checkpoint or Fork as of this step."""
        return typed(self.raw, self.kind)


# ------------------------------------------------------------------------ pure logic


def key_name(prefix: str, key: str) -> str:
    """The object name an idempotency key stands for: the same key, the same name."""
    return f"{prefix}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def generate_prefix(base: str, kind: str) -> str:
    """A generateName prefix such as `s1-ckpt-`, trimmed so the final name stays short."""
    stem = base[: MAX_GENERATE_PREFIX - len(kind) - 2].rstrip("-.")
    return f"{stem}-{kind}-"


def _metadata(prefix: str, base: str, kind: str, key: str | None) -> dict[str, Any]:
    if key:
        return {"name": key_name(prefix, key), "annotations": {IDEMPOTENCY_KEY_ANNOTATION: key}}
    return {"generateName": generate_prefix(base, kind)}


def build_checkpoint(
    session: str, *, label: str | None = None, ttl: str | None = None, key: str | None = None
) -> dict[str, Any]:
    spec: dict[str, Any] = {"sessionName": session}
    if label is not None:
        spec["label"] = label
    if ttl is not None:
        spec["ttl"] = ttl
    return {
        "apiVersion": API_VERSION,
        "kind": "Checkpoint",
        "metadata": _metadata("ckpt", session, "ckpt", key),
        "spec": spec,
    }


def build_fork(
    *,
    target: str,
    checkpoint: str | None = None,
    session: str | None = None,
    at_event: str | None = None,
    overrides: dict[str, Any] | None = None,
    key: str | None = None,
) -> dict[str, Any]:
    """A Fork into a new session `target`, from a checkpoint, or from a session's log."""
    if (checkpoint is None) == (session is None):
        raise ValueError("a fork needs exactly one of checkpoint or session")
    source: dict[str, Any] = {"checkpoint": checkpoint} if checkpoint else {"session": session}
    if at_event is not None:
        if session is None:
            raise ValueError("--at-event forks from a session, not a checkpoint")
        source["atEvent"] = at_event
    target_spec: dict[str, Any] = {"sessionName": target}
    if overrides:
        target_spec["overrides"] = overrides
    return {
        "apiVersion": API_VERSION,
        "kind": "Fork",
        "metadata": _metadata("fork", target, "fork", key),
        "spec": {"source": source, "mode": "Fork", "target": target_spec},
    }


def build_rollback(session: str, checkpoint: str, *, key: str | None = None) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "Fork",
        "metadata": _metadata("rollback", session, "rollback", key),
        "spec": {"source": {"checkpoint": checkpoint}, "mode": "Rollback"},
    }


def build_session(
    name: str, spec: SessionSpec | dict[str, Any], *, labels: dict[str, str] | None = None
) -> dict[str, Any]:
    """A Session body; a dict spec is validated against SessionSpec first (and sent as given)."""
    if isinstance(spec, SessionSpec):
        wire = spec.wire()
    else:
        validate_spec("Session", SessionSpec, spec)
        wire = spec
    metadata: dict[str, Any] = {"name": name}
    if labels:
        metadata["labels"] = labels
    return {"apiVersion": API_VERSION, "kind": "Session", "metadata": metadata, "spec": wire}


def validate_spec(kind: str, model: Any, spec: dict[str, Any]) -> None:
    """Raise InvalidRequest naming the first bad field; the message never quotes the value."""
    try:
        model.model_validate(spec)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in ("spec", *first["loc"]))
        raise InvalidRequest(f"invalid {kind.lower()}: {where}: {first['msg']}", field=where) from None


def same_request(existing: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether an object found under an idempotency key's name is the one we would create.

    Only the fields we set are compared: the API server adds defaults to the rest.
    """

    def covers(have: Any, want: Any) -> bool:
        if isinstance(want, dict):
            return isinstance(have, dict) and all(covers(have.get(k), v) for k, v in want.items())
        return have == want

    return covers(existing.get("spec") or {}, wanted["spec"])


@dataclass(frozen=True)
class Outcome:
    ok: bool
    message: str


def _reason_text(phase: str, status: dict[str, Any]) -> str:
    parts = [phase]
    if status.get("reason"):
        parts.append(status["reason"])
    if status.get("message"):
        parts.append(status["message"])
    return ": ".join(parts)


def checkpoint_outcome(obj: dict[str, Any]) -> Outcome | None:
    """Ready: success; Rejected, Failed, Expired: a terminal failure; else still going."""
    status = obj.get("status") or {}
    phase = status.get("phase")
    name = obj["metadata"]["name"]
    if phase == "Ready":
        through = status.get("throughSequence")
        where = f" through event {through}" if through is not None else ""
        expires = f", expires {status['expiresAt']}" if status.get("expiresAt") else ""
        return Outcome(True, f"checkpoint {name} is Ready{where}{expires}")
    if phase in ("Rejected", "Failed", "Expired"):
        return Outcome(False, _reason_text(phase, status))
    return None


def fork_outcome(obj: dict[str, Any]) -> Outcome | None:
    """Succeeded: success; Failed: a terminal failure; else still going."""
    status = obj.get("status") or {}
    phase = status.get("phase")
    name = obj["metadata"]["name"]
    rollback = (obj.get("spec") or {}).get("mode") == "Rollback"
    if phase == "Succeeded":
        target = status.get("targetSession") or "?"
        how = f" ({status['restoreMode']})" if status.get("restoreMode") else ""
        what = f"session {target} rolled back" if rollback else f"session {target} is Ready"
        return Outcome(True, f"{what}{how}; fork {name} Succeeded")
    if phase == "Failed":
        return Outcome(False, _reason_text(phase, status))
    return None


UP_PHASES = ("Ready", "Running", "AwaitingApproval")


def _ready_condition(status: dict[str, Any]) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})


def session_outcome(phases: tuple[str, ...]) -> Callable[[dict[str, Any]], Outcome | None]:
    """Done once the session, as of its newest spec, is in one of `phases`; Failed or Ended ends the wait."""

    def decide(obj: dict[str, Any]) -> Outcome | None:
        status = obj.get("status") or {}
        if (status.get("observedGeneration") or 0) < (obj["metadata"].get("generation") or 0):
            return None  # the operator has not seen the change yet
        phase = status.get("phase")
        if phase in phases:
            return Outcome(True, f"session {obj['metadata']['name']} is {phase}")
        if phase in ("Failed", "Ended"):
            ready = _ready_condition(status)
            return Outcome(False, _reason_text(phase, {"reason": ready.get("reason"), "message": ready.get("message")}))
        return None

    return decide


def state_text(obj: dict[str, Any]) -> str:
    """The current state of a waited-on object, e.g. `Pending: snapshot ... not ready yet`."""
    status = obj.get("status") or {}
    through = _cut_sequence(obj)
    if not status.get("phase") and through is not None:
        return f"Snapshotting: through event {through}"  # admitted; no Pending written (a fast snapshot)
    phase = status.get("phase") or "Waiting for the operator"
    detail = status.get("message") or ""
    ready = _ready_condition(status)
    if not detail and ready and ready.get("status") != "True":
        detail = ready.get("message") or ready.get("reason") or ""
    return f"{phase}: {detail}" if detail else phase


def _cut_sequence(obj: dict[str, Any]) -> int | None:
    """The event an admitted Checkpoint is cut at, from its cut annotation (None: none)."""
    cut = cut_of(obj)
    return cut["throughSequence"] if cut else None


def progress_line(obj: dict[str, Any], elapsed: float) -> str:
    """One line for the current state of a waited-on object, e.g. `[  2.1s] Pending: ...`."""
    return f"[{elapsed:6.1f}s] {state_text(obj)}"


class Tracker:
    """Which states of a waited-on object are new, and whether the wait is decided."""

    def __init__(self, kind: str, namespace: str, decide: Callable[[dict[str, Any]], Outcome | None], started: float):
        self.kind = kind
        self.namespace = namespace
        self.decide = decide
        self.started = started
        self.last = ""

    def observe(self, obj: dict[str, Any], now: float) -> tuple[Progress | None, Outcome | None]:
        state = state_text(obj)
        progress = None
        if state != self.last:
            self.last = state
            progress = Progress(
                "state", self.kind, obj["metadata"]["name"], self.namespace, state, now - self.started, obj
            )
        return progress, self.decide(obj)


def failure(kind: str, obj: dict[str, Any], message: str) -> ClientError:
    """The exception for an object that ended badly: the class of its reason."""
    status = obj.get("status") or {}
    reason = status.get("reason")
    if kind == "Session":
        reason = _ready_condition(status).get("reason")
        cls = SessionFailed if status.get("phase") == "Failed" else SessionNotReady
        return cls(message, reason=reason or cls.reason, obj=typed(obj, kind))
    if status.get("phase") == "Expired" and not reason:
        reason = "CheckpointExpired"
    return reason_error(reason, message, obj=typed(obj, kind))


# --- the API server's errors ----------------------------------------------------------

_ADMISSION = re.compile(r"denied the request: (?P<reason>[A-Z][A-Za-z]+): ")
_MISSING_API = "the server could not find the requested resource"


def api_error(status: int, body: str | bytes | None, fallback: str | None = None) -> ApiError:
    """An ApiError from an answer's code and body (a metav1.Status, when the server sent one)."""
    message, reason, field_path = "", None, None
    try:
        parsed = json.loads(body) if body else {}
    except (TypeError, ValueError):
        parsed = {}
    if isinstance(parsed, dict):
        message = parsed.get("message") or ""
        reason = parsed.get("reason")
        causes = (parsed.get("details") or {}).get("causes") or []
        field_path = next((c.get("field") for c in causes if c.get("field")), None)
    return ApiError(status, message or str(fallback or status), reason, field=field_path)


def request_error(err: ApiError, doing: str) -> ClientError:
    """What a refused request means: a reason's exception (webhook), InvalidRequest (schema, CEL) or the ApiError."""
    message = f"{doing}: {err.message}" if doing else err.message
    denied = _ADMISSION.search(err.message)
    cls = error_class(denied["reason"]) if denied else None
    if cls is not None:
        return cls(message)
    if err.status in (400, 422):
        return InvalidRequest(message, field=err.field)
    if err.status == 404 and _MISSING_API in err.message:
        return ApiError(404, f"{message} (are the savepoint.dev CRDs installed?)", "NotFound")
    return ApiError(err.status, message, err.reason, field=err.field)


def not_found(kind: str, name: str, namespace: str) -> NotFound:
    cls = error_class(f"{kind}NotFound")
    assert cls is not None and issubclass(cls, NotFound)
    return cls(f"{cls.reason}: {kind.lower()} {name} not found in namespace {namespace}")


# ---------------------------------------------------------------------- operations


def get(kind: str, namespace: str, name: str, *, missing_ok: bool = False) -> Operation:
    """The object, or <Kind>NotFound (None with missing_ok)."""
    try:
        return (yield Get(KINDS[kind].plural, namespace, name))
    except ApiError as err:
        if err.status == 404 and _MISSING_API not in err.message:
            if missing_ok:
                return None
            raise not_found(kind, name, namespace) from None
        raise request_error(err, "") from None


def list_objects(kind: str, namespace: str | None, label_selector: str | None = None) -> Operation:
    """Every object of the kind in the namespace (None: every namespace), oldest first."""
    try:
        items = yield List(KINDS[kind].plural, namespace, label_selector)
    except ApiError as err:
        raise request_error(err, "") from None
    return sorted(items, key=lambda o: (o["metadata"].get("creationTimestamp") or "", o["metadata"]["name"]))


def create_once(namespace: str, body: dict[str, Any]) -> Operation:
    """Create the object; under an idempotency key, an existing one for the same request is reused."""
    kind = body["kind"]
    plural = KINDS[kind].plural
    try:
        created = yield Create(plural, namespace, body)
    except ApiError as err:
        name = body["metadata"].get("name")
        if err.status != 409 or not name or err.reason != "AlreadyExists":
            raise request_error(err, f"creating the {kind.lower()}") from None
        existing = yield from get(kind, namespace, name, missing_ok=True)
        if existing is None:  # deleted between our create and get: try once more
            return (yield from create_once(namespace, body))
        if not same_request(existing, body):
            key = body["metadata"]["annotations"][IDEMPOTENCY_KEY_ANNOTATION]
            raise IdempotencyKeyConflict(
                f"idempotency key {key!r} already names {kind.lower()} {name} with a different spec; "
                "use a new key for a new request"
            ) from None
        yield Report(Progress("reused", kind, name, namespace, "", 0.0, existing))
        return existing
    yield Report(Progress("created", kind, created["metadata"]["name"], namespace, "", 0.0, created))
    return created


def wait(
    kind: str,
    namespace: str,
    obj: dict[str, Any],
    decide: Callable[[dict[str, Any]], Outcome | None],
    *,
    timeout: float,
    clock: Callable[[], float],
    deleted_ok: bool = False,
) -> Operation:
    """Watch `obj` from its resourceVersion until `decide` says done; return it or raise the failure.

    `deleted_ok`: the object's deletion is the success (returns None), not ObjectDeleted.
    """
    plural = KINDS[kind].plural
    name = obj["metadata"]["name"]
    started = clock()
    deadline = started + timeout
    tracker = Tracker(kind, namespace, decide, started)
    current = obj
    version = obj["metadata"].get("resourceVersion") or ""

    def deleted() -> ClientError:
        return ObjectDeleted(f"{kind.lower()} {name} was deleted while waiting")

    while True:
        done = yield from _settle(tracker, current, clock)
        if done is not None:
            return done
        remaining = deadline - clock()
        if remaining <= 0:
            raise WaitTimeout(f"timed out after {timeout:g}s; last state: {tracker.last}", last_state=tracker.last)
        try:
            event = yield Watch(plural, namespace, name, version, max(1, math.ceil(remaining)))
            while event is not None:
                seen = event["object"]
                version = (seen.get("metadata") or {}).get("resourceVersion") or version
                if event["type"] == "DELETED":
                    if deleted_ok:
                        return None
                    raise deleted()
                if event["type"] in ("ADDED", "MODIFIED"):
                    current = seen
                    done = yield from _settle(tracker, current, clock)
                    if done is not None:
                        return done
                if clock() >= deadline:
                    break
                event = yield NextEvent()
        except ApiError as err:
            if err.status != 410:
                raise request_error(err, f"watching {kind.lower()} {name}") from None
            fresh = yield from get(kind, namespace, name, missing_ok=True)
            if fresh is None:
                if deleted_ok:
                    return None
                raise deleted() from None
            current, version = fresh, fresh["metadata"].get("resourceVersion") or ""


def _settle(tracker: Tracker, obj: dict[str, Any], clock: Callable[[], float]) -> Operation:
    """Report a new state; return the object when done, raise its failure, or None to keep waiting."""
    progress, outcome = tracker.observe(obj, clock())
    if progress is not None:
        yield Report(progress)
    if outcome is None:
        return None
    if outcome.ok:
        return obj
    raise failure(tracker.kind, obj, outcome.message)


def wait_named(namespace: str, kind: str, name: str, *, timeout: float, clock: Callable[[], float]) -> Operation:
    """Wait for an existing Checkpoint (Ready) or Fork (Succeeded)."""
    obj = yield from get(kind, namespace, name)
    decide = checkpoint_outcome if kind == "Checkpoint" else fork_outcome
    return (yield from wait(kind, namespace, obj, decide, timeout=timeout, clock=clock))


def wait_session(
    namespace: str, name: str, phases: tuple[str, ...], *, timeout: float, clock: Callable[[], float]
) -> Operation:
    obj = yield from get("Session", namespace, name)
    return (yield from wait("Session", namespace, obj, session_outcome(phases), timeout=timeout, clock=clock))


def create_checkpoint(
    namespace: str,
    session: str,
    *,
    label: str | None,
    ttl: str | None,
    key: str | None,
    wait_ready: bool,
    timeout: float,
    clock: Callable[[], float],
) -> Operation:
    body = build_checkpoint(session, label=label, ttl=ttl, key=key)
    validate_spec("Checkpoint", CheckpointSpec, body["spec"])
    obj = yield from create_once(namespace, body)
    if not wait_ready:
        return obj
    return (yield from wait("Checkpoint", namespace, obj, checkpoint_outcome, timeout=timeout, clock=clock))


def create_fork(
    namespace: str,
    body: dict[str, Any],
    *,
    wait_done: bool,
    timeout: float,
    clock: Callable[[], float],
) -> Operation:
    validate_spec("Fork", ForkSpec, body["spec"])
    obj = yield from create_once(namespace, body)
    if not wait_done:
        return obj
    return (yield from wait("Fork", namespace, obj, fork_outcome, timeout=timeout, clock=clock))


def rollback(
    namespace: str,
    session: str,
    to: str,
    *,
    key: str | None,
    wait_done: bool,
    timeout: float,
    clock: Callable[[], float],
) -> Operation:
    checkpoint = yield from get("Checkpoint", namespace, to)
    owner = (checkpoint.get("spec") or {}).get("sessionName")
    if owner != session:
        raise CheckpointOfAnotherSession(
            f"checkpoint {to} belongs to session {owner}, not {session}: a rollback restores a "
            f"session's own checkpoint (use `fork {to} --name NEW` to start a new session from it)"
        )
    body = build_rollback(session, to, key=key)
    return (yield from create_fork(namespace, body, wait_done=wait_done, timeout=timeout, clock=clock))


def create_session(
    namespace: str,
    body: dict[str, Any],
    *,
    wait_up: bool,
    timeout: float,
    clock: Callable[[], float],
) -> Operation:
    name = body["metadata"]["name"]
    try:
        obj = yield Create("sessions", namespace, body)
    except ApiError as err:
        if err.status == 409 and err.reason == "AlreadyExists":
            raise AlreadyExists(f"AlreadyExists: session {name} already exists in namespace {namespace}") from None
        raise request_error(err, "creating the session") from None
    yield Report(Progress("created", "Session", name, namespace, "", 0.0, obj))
    if not wait_up:
        return obj
    return (yield from wait("Session", namespace, obj, session_outcome(UP_PHASES), timeout=timeout, clock=clock))


def set_operating_mode(
    namespace: str, name: str, mode: str, *, wait_done: bool, timeout: float, clock: Callable[[], float]
) -> Operation:
    """Pause (mode Paused) or resume (Running) a session; wait for Paused, or for it to be up."""
    try:
        obj = yield Patch("sessions", namespace, name, {"spec": {"operatingMode": mode}})
    except ApiError as err:
        if err.status == 404 and _MISSING_API not in err.message:
            raise not_found("Session", name, namespace) from None
        raise request_error(err, f"setting session {name} to {mode}") from None
    if not wait_done:
        return obj
    phases = ("Paused",) if mode == "Paused" else UP_PHASES
    return (yield from wait("Session", namespace, obj, session_outcome(phases), timeout=timeout, clock=clock))


def delete(
    kind: str, namespace: str, name: str, *, wait_gone: bool, timeout: float, clock: Callable[[], float]
) -> Operation:
    plural = KINDS[kind].plural
    try:
        yield Delete(plural, namespace, name)
    except ApiError as err:
        if err.status == 404 and _MISSING_API not in err.message:
            raise not_found(kind, name, namespace) from None
        raise request_error(err, f"deleting {kind.lower()} {name}") from None
    if not wait_gone:
        return None
    current = yield from get(kind, namespace, name, missing_ok=True)
    if current is None:
        return None
    yield from wait(kind, namespace, current, lambda _: None, timeout=timeout, clock=clock, deleted_ok=True)
    return None
