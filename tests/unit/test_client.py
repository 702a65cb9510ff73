"""savepoint.client without a cluster: the reason mapping, scrubbing, and the core's state machine.

The core's operations are generators of requests; here they are driven with scripted
answers, which is how both real drivers run them.
"""

from __future__ import annotations

import json

import pytest

from savepoint.client import core, errors
from savepoint.client.objects import Checkpoint, Fork, Session, typed
from savepoint.models import CheckpointPhase, SessionSpec


@pytest.mark.parametrize(
    ("reason", "cls", "status"),
    [
        ("SessionBusy", errors.SessionBusy, 409),
        ("CheckpointExpired", errors.CheckpointExpired, 409),
        ("TTLExpired", errors.CheckpointExpired, 409),
        ("SessionHistoryUnavailable", errors.SessionHistoryUnavailable, 409),
        ("QuotaExceeded", errors.QuotaExceeded, 409),
        ("SessionNotReady", errors.SessionNotReady, 409),
        ("CheckpointNotReady", errors.CheckpointNotReady, 409),
        ("ZeroDataRetention", errors.ZeroDataRetention, 409),
        ("TargetExists", errors.TargetExists, 409),
        ("SnapshotsUnsupported", errors.SnapshotsUnsupported, 501),
        ("HooksDisabled", errors.HooksDisabled, 501),
        ("SessionNotFound", errors.SessionNotFound, 404),
        ("CheckpointNotFound", errors.CheckpointNotFound, 404),
        ("EventNotFound", errors.EventNotFound, 404),
        ("InvalidTarget", errors.InvalidTarget, 422),
        ("SnapshotFailed", errors.SnapshotFailed, 500),
        ("SnapshotTimeout", errors.SnapshotTimeout, 504),
        ("HookFailed", errors.HookFailed, 500),
    ],
)
def test_each_reason_has_its_class_and_rest_status(reason, cls, status):
    err = errors.reason_error(reason, f"Rejected: {reason}: why")
    assert type(err) is cls
    assert err.http_status == status
    assert err.reason == ("CheckpointExpired" if reason == "TTLExpired" else reason)
    assert str(err) == f"Rejected: {reason}: why"


def test_an_unknown_reason_still_raises_with_that_reason():
    err = errors.reason_error("SomethingNew", "Failed: SomethingNew: x")
    assert type(err) is errors.OperationFailed
    assert (err.reason, err.http_status) == ("SomethingNew", 500)


def test_not_found_classes_share_a_base():
    assert issubclass(errors.SessionNotFound, errors.NotFound)
    assert issubclass(errors.SessionBusy, errors.Conflict)
    assert issubclass(errors.WaitTimeout, TimeoutError)


def test_values_of_sensitive_fields_are_scrubbed_from_messages():
    message = (
        'Session.savepoint.dev "s1" is invalid: spec.podTemplate.spec.containers[0].env[0].value: '
        'Invalid value: "hunter2": must be short, spec.ttl: Invalid value: "3x": spec.ttl in body should match'
    )
    scrubbed = errors.scrub(message)
    assert "hunter2" not in scrubbed
    assert "env[0].value: Invalid value: (value not shown)" in scrubbed
    assert 'spec.ttl: Invalid value: "3x"' in scrubbed  # not sensitive: kept, it says what to fix
    assert "hunter2" not in str(errors.ApiError(422, message))


def _status_body(code: int, reason: str, message: str, causes=()) -> str:
    return json.dumps(
        {"kind": "Status", "code": code, "reason": reason, "message": message, "details": {"causes": list(causes)}}
    )


def test_api_errors_map_to_reasons_or_invalid_request():
    denied = core.api_error(
        409,
        _status_body(
            409,
            "Conflict",
            'admission webhook "checkpoints.savepoint.dev" denied the request: SessionBusy: session s1 has a run',
        ),
    )
    err = core.request_error(denied, "creating the checkpoint")
    assert type(err) is errors.SessionBusy and err.http_status == 409
    assert str(err).startswith("creating the checkpoint: admission webhook")

    invalid = core.api_error(
        422, _status_body(422, "Invalid", "spec.ttl: Invalid value", [{"field": "spec.ttl", "message": "bad"}])
    )
    err = core.request_error(invalid, "creating the checkpoint")
    assert type(err) is errors.InvalidRequest and err.field == "spec.ttl" and err.http_status == 422

    missing = core.request_error(
        core.api_error(404, _status_body(404, "NotFound", "the server could not find the requested resource")), ""
    )
    assert type(missing) is errors.ApiError and "CRDs installed" in str(missing)
    forbidden = core.request_error(core.api_error(403, _status_body(403, "Forbidden", "no")), "")
    assert (type(forbidden), forbidden.http_status, forbidden.reason) == (errors.ApiError, 403, "Forbidden")
    assert core.api_error(500, b"not json", "Internal").message == "Internal"


def test_client_side_validation_names_the_field_without_its_value():
    with pytest.raises(errors.InvalidRequest) as caught:
        drive(
            core.create_checkpoint(
                "ns", "s1", label=None, ttl="-5d", key=None, wait_ready=False, timeout=1, clock=clock()
            )
        )
    assert caught.value.field == "spec.ttl" and "-5d" not in str(caught.value)
    with pytest.raises(errors.InvalidRequest) as caught:
        core.build_session("s1", {"workspace": {"size": "lots"}, "podTemplate": {"env": "secret"}})
    assert caught.value.field == "spec.workspace.size"
    body = core.build_session("s1", SessionSpec(), labels={"team": "a"})
    assert body["metadata"] == {"name": "s1", "labels": {"team": "a"}} and body["spec"]["operatingMode"] == "Running"


def test_typed_objects_parse_the_wire_form():
    ckpt = typed(
        {
            "apiVersion": "savepoint.dev/v1alpha1",
            "kind": "Checkpoint",
            "metadata": {"name": "c1", "resourceVersion": "7", "creationTimestamp": "2030-01-01T00:00:00Z"},
            "spec": {"sessionName": "s1", "label": "x"},
            "status": {"phase": "Ready", "throughSequence": 4, "resume": {"kind": "snapshot"}},
        }
    )
    assert isinstance(ckpt, Checkpoint) and ckpt.name == "c1"
    assert ckpt.status.phase is CheckpointPhase.READY and ckpt.status.through_sequence == 4
    assert ckpt.spec.session_name == "s1" and ckpt.metadata.resource_version == "7"
    assert ckpt.wire()["status"]["throughSequence"] == 4
    assert isinstance(typed({"metadata": {"name": "s"}}, "Session"), Session)
    assert isinstance(typed({"metadata": {"name": "f"}, "spec": {"source": {"checkpoint": "c"}}}, "Fork"), Fork)


# --- the core's operations, driven with scripted answers ------------------------------


def clock(step: float = 0.1):
    now = [0.0]

    def tick() -> float:
        now[0] += step
        return now[0]

    return tick


def drive(operation, answers=(), reports=None):
    """Run an operation: each request gets the next answer (an exception is thrown in)."""
    answers = list(answers)
    requests = []
    send, error = None, None
    while True:
        try:
            request = operation.throw(error) if error is not None else operation.send(send)
        except StopIteration as stop:
            drive.requests = requests
            return stop.value
        send, error = None, None
        if isinstance(request, core.Report):
            if reports is not None:
                reports.append(request.progress)
            continue
        requests.append(request)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            error = answer
        else:
            send = answer


def ckpt(name="c1", rv="1", **status):
    return {
        "apiVersion": "savepoint.dev/v1alpha1",
        "kind": "Checkpoint",
        "metadata": {"name": name, "resourceVersion": rv},
        "spec": {"sessionName": "s1"},
        "status": status,
    }


def event(kind, obj):
    return {"type": kind, "object": obj}


def create(wait=True, key=None, timeout=60.0):
    return core.create_checkpoint(
        "ns", "s1", label=None, ttl=None, key=key, wait_ready=wait, timeout=timeout, clock=clock()
    )


def test_create_then_watch_from_the_created_version_until_ready():
    reports: list[core.Progress] = []
    result = drive(
        create(),
        [
            ckpt(rv="10"),
            event("MODIFIED", ckpt(rv="11", phase="Pending")),
            event("BOOKMARK", {"metadata": {"resourceVersion": "12"}}),
            event("MODIFIED", ckpt(rv="13", phase="Ready", throughSequence=2)),
        ],
        reports,
    )
    assert result["status"]["phase"] == "Ready"
    create_req, watch_req, *rest = drive.requests
    assert isinstance(create_req, core.Create) and create_req.body["metadata"]["generateName"] == "s1-ckpt-"
    assert isinstance(watch_req, core.Watch) and watch_req.resource_version == "10" and watch_req.name == "c1"
    assert all(isinstance(r, core.NextEvent) for r in rest)  # one watch for the whole wait
    assert [(p.step, p.state) for p in reports] == [
        ("created", ""),
        ("state", "Waiting for the operator"),
        ("state", "Pending"),
        ("state", "Ready"),
    ]
    assert reports[-1].object.status.through_sequence == 2


def test_a_rejection_raises_its_reason_with_the_typed_object():
    with pytest.raises(errors.SessionBusy) as caught:
        drive(
            create(),
            [ckpt(), event("MODIFIED", ckpt(phase="Rejected", reason="SessionBusy", message="s1 has a run in flight"))],
        )
    assert str(caught.value) == "Rejected: SessionBusy: s1 has a run in flight"
    assert caught.value.object.status.reason == "SessionBusy"


def test_an_ended_watch_resumes_from_the_last_version_and_410_re_reads():
    gone = errors.ApiError(410, "too old resource version", "Expired")
    result = drive(
        create(),
        [
            ckpt(rv="10"),
            event("MODIFIED", ckpt(rv="11", phase="Pending")),
            None,  # the server ended the watch
            gone,  # resuming from 11 is too old
            ckpt(rv="20", phase="Pending"),  # the fresh GET
            event("MODIFIED", ckpt(rv="21", phase="Ready")),
        ],
    )
    assert result["metadata"]["resourceVersion"] == "21"
    kinds = [type(r).__name__ for r in drive.requests]
    assert kinds == ["Create", "Watch", "NextEvent", "Watch", "Get", "Watch"]
    assert [r.resource_version for r in drive.requests if isinstance(r, core.Watch)] == ["10", "11", "20"]


def test_deleted_while_waiting_and_timeout():
    with pytest.raises(errors.ObjectDeleted):
        drive(create(), [ckpt(), event("DELETED", ckpt())])
    with pytest.raises(errors.WaitTimeout) as caught:
        drive(create(timeout=0.25), [ckpt(), event("MODIFIED", ckpt(phase="Pending")), None])
    assert str(caught.value) == "timed out after 0.25s; last state: Pending"
    assert caught.value.http_status == 504


def test_an_idempotency_key_reuses_the_same_request_and_refuses_another():
    exists = errors.ApiError(409, "already exists", "AlreadyExists")
    name = core.key_name("ckpt", "k1")
    stored = {**ckpt(name=name, phase="Ready"), "spec": {"sessionName": "s1", "ttl": None}}
    reports: list[core.Progress] = []
    result = drive(create(key="k1"), [exists, stored], reports)
    assert result["metadata"]["name"] == name and [p.step for p in reports][0] == "reused"
    assert isinstance(drive.requests[1], core.Get) and drive.requests[1].name == name

    other = {**stored, "spec": {"sessionName": "s2"}}
    with pytest.raises(errors.IdempotencyKeyConflict) as caught:
        drive(create(key="k1"), [exists, other])
    assert caught.value.http_status == 422 and "already names checkpoint" in str(caught.value)


def test_rollback_checks_the_checkpoint_belongs_to_the_session():
    op = core.rollback("ns", "s1", "c9", key=None, wait_done=False, timeout=1, clock=clock())
    with pytest.raises(errors.CheckpointNotFound) as caught:
        drive(op, [errors.ApiError(404, "not found", "NotFound")])
    assert str(caught.value) == "CheckpointNotFound: checkpoint c9 not found in namespace ns"
    op = core.rollback("ns", "s1", "c9", key=None, wait_done=False, timeout=1, clock=clock())
    with pytest.raises(errors.CheckpointOfAnotherSession):
        drive(op, [{**ckpt(name="c9"), "spec": {"sessionName": "other"}}])


def test_session_waits_follow_the_newest_generation():
    up = core.session_outcome(core.UP_PHASES)
    stale = {"metadata": {"name": "s1", "generation": 2}, "status": {"observedGeneration": 1, "phase": "Ready"}}
    assert up(stale) is None
    fresh = {"metadata": {"name": "s1", "generation": 2}, "status": {"observedGeneration": 2, "phase": "Running"}}
    assert up(fresh).ok
    failed = {
        "metadata": {"name": "s1", "generation": 1},
        "status": {
            "observedGeneration": 1,
            "phase": "Failed",
            "conditions": [{"type": "Ready", "status": "False", "reason": "PodFailed", "message": "exit 1"}],
        },
    }
    outcome = up(failed)
    assert outcome == core.Outcome(False, "Failed: PodFailed: exit 1")
    err = core.failure("Session", failed, outcome.message)
    assert type(err) is errors.SessionFailed and err.reason == "PodFailed"
    assert core.session_outcome(("Paused",))(fresh) is None


def test_the_namespace_is_the_kubeconfig_contexts(tmp_path, monkeypatch):
    from savepoint.client import sync

    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [
                    {"name": "a", "context": {"cluster": "c", "user": "u", "namespace": "team-a"}},
                    {"name": "b", "context": {"cluster": "c", "user": "u"}},
                ],
                "current-context": "a",
            }
        )
    )
    assert sync.kubeconfig_namespace(str(path), None) == "team-a"
    assert sync.kubeconfig_namespace(str(path), "b") == "default"
    assert sync.Client(kubeconfig=str(path)).namespace == "team-a"
    assert sync.Client("team-z", kubeconfig=str(path), context="b").namespace == "team-z"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(errors.ConfigurationError) as caught:
        sync.Client(kubeconfig=str(tmp_path / "missing"))
    assert str(caught.value).startswith("cannot load a kubeconfig")
