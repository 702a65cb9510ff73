"""Pure decisions behind convergence: what waits, until when, and what ends at once."""

from __future__ import annotations

from datetime import timedelta

import pytest

from savepoint import failpoints
from savepoint.checkpoint import (
    Patience,
    Policy,
    QuotaUse,
    Rejection,
    SessionView,
    Wait,
    admit,
    build_volume_snapshot,
    owned_by_other,
)
from savepoint.controllers.session import restore_ms
from savepoint.eventlog import Cursor
from savepoint.fork import ForkError, ForkWait, check_checkpoint, newest_live
from savepoint.models import CheckpointSpec
from savepoint.session import RESTORE_STARTED_MS

SPEC = CheckpointSpec.model_validate({"sessionName": "s1"})
POLICY = Policy(ttl_cap=timedelta(days=30))
TEN_MIN = timedelta(minutes=10)


def patience(waited: float) -> Patience:
    return Patience(timedelta(seconds=waited), TEN_MIN, timedelta(seconds=10))


def decide(view: SessionView, waited: float = 0.0):
    return admit("c1", SPEC, POLICY, view, QuotaUse(0, 0), "csi-class", patience(waited))


@pytest.mark.parametrize("phase", [None, "Provisioning"])
def test_a_provisioning_session_waits_then_is_not_ready_after_the_bound(phase):
    view = SessionView(exists=True, phase=phase)
    waiting = decide(view, waited=599)
    assert isinstance(waiting, Wait) and waiting.reason == "WaitingForSession"
    rejected = decide(view, waited=600)
    assert isinstance(rejected, Rejection) and rejected.reason == "SessionNotReady"
    assert "SAVEPOINT_WAIT_TIMEOUT" in rejected.message


def test_a_missing_session_waits_only_the_missing_grace():
    assert isinstance(decide(SessionView(exists=False), waited=0), Wait)
    rejected = decide(SessionView(exists=False), waited=10)
    assert isinstance(rejected, Rejection) and rejected.reason == "SessionNotFound"


@pytest.mark.parametrize(
    ("phase", "reason"),
    [
        ("Failed", "SessionNotReady"),
        ("Ended", "SessionNotReady"),
        ("being deleted", "SessionNotReady"),
        ("Running", "SessionBusy"),
        ("AwaitingApproval", "SessionBusy"),
    ],
)
def test_what_cannot_change_is_refused_at_once(phase, reason):
    answer = decide(SessionView(exists=True, phase=phase), waited=0)
    assert isinstance(answer, Rejection) and answer.reason == reason


def test_a_ready_session_is_admitted():
    assert decide(SessionView(exists=True, phase="Ready", claim="ws", cursor=Cursor(3, "x"))) is None


def ckpt(phase: str | None, reason: str | None = None, expires: str = "2126-01-01T00:00:00Z") -> dict:
    status = {"phase": phase, "reason": reason, "message": "why", "expiresAt": expires}
    return {"metadata": {"name": "c1"}, "status": {k: v for k, v in status.items() if v is not None}}


@pytest.mark.parametrize("phase", [None, "Pending"])
def test_a_fork_of_a_pending_checkpoint_waits_then_fails_after_the_bound(phase):
    with pytest.raises(ForkWait) as waiting:
        check_checkpoint("c1", ckpt(phase), patience(599))
    assert waiting.value.reason == "WaitingForCheckpoint"
    with pytest.raises(ForkError) as failed:
        check_checkpoint("c1", ckpt(phase), patience(600))
    assert failed.value.reason == "CheckpointNotReady" and "SAVEPOINT_WAIT_TIMEOUT" in str(failed.value)


@pytest.mark.parametrize(("phase", "reason"), [("Failed", "SnapshotTimeout"), ("Rejected", "SessionNotReady")])
def test_a_fork_fails_at_once_with_the_reason_its_checkpoint_ended_with(phase, reason):
    with pytest.raises(ForkError) as failed:
        check_checkpoint("c1", ckpt(phase, reason), patience(0))
    assert failed.value.reason == "CheckpointNotReady"
    assert f"ended {phase}" in str(failed.value) and reason in str(failed.value)


def test_an_expired_checkpoint_is_checkpoint_expired_at_once():
    with pytest.raises(ForkError) as failed:
        check_checkpoint("c1", ckpt("Expired", "TTLExpired"), patience(0))
    assert failed.value.reason == "CheckpointExpired"


@pytest.mark.parametrize("phase", ["Ready", "Pending"])
def test_a_checkpoint_past_its_expiry_is_expired_before_the_expiry_writes_it(phase):
    """Between expiresAt and the expiry's status write (a storm takes a while), a fork
    must not restore from a snapshot that may be on its way out."""
    past = ckpt(phase, expires="2026-01-01T00:00:00Z")
    with pytest.raises(ForkError) as failed:
        check_checkpoint("c1", past, patience(0))
    assert failed.value.reason == "CheckpointExpired"
    assert newest_live([past]) is None
    assert newest_live([past, ckpt("Ready")]) is not None


def test_a_missing_checkpoint_waits_only_the_missing_grace():
    with pytest.raises(ForkWait):
        check_checkpoint("c1", None, patience(9))
    with pytest.raises(ForkError) as failed:
        check_checkpoint("c1", None, patience(10))
    assert failed.value.reason == "CheckpointNotFound"


def test_every_snapshot_is_owned_by_its_checkpoint():
    body = {
        "apiVersion": "savepoint.dev/v1alpha1",
        "kind": "Checkpoint",
        "metadata": {"name": "c1", "namespace": "ns", "uid": "u-1"},
        "spec": {"sessionName": "s1"},
    }
    snapshot = build_volume_snapshot(body, "ws", "csi-class")
    assert snapshot["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "savepoint.dev/v1alpha1",
            "kind": "Checkpoint",
            "name": "c1",
            "uid": "u-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert not owned_by_other(snapshot, body)
    assert owned_by_other(snapshot, {**body, "metadata": {**body["metadata"], "uid": "u-2"}})
    assert not owned_by_other({"metadata": {}}, body)  # made by hand or by an older operator


def test_restore_ms_is_set_once_from_the_restore_start_to_ready(monkeypatch):
    from savepoint.controllers import session

    monkeypatch.setattr(session, "now_ms", lambda: 10_000)
    started = {RESTORE_STARTED_MS: "2500"}
    restored = {"restore": {"mode": "snapshot"}}
    assert restore_ms(started, {**restored, "phase": "Provisioning"}) is None
    assert restore_ms(started, {**restored, "phase": "Ready"}) == 7500
    assert restore_ms(started, {**restored, "phase": "Ready", "usage": {"restoreMs": 7500}}) is None
    assert restore_ms({}, {**restored, "phase": "Ready"}) is None


def test_failpoints_parse_kill_and_sleep():
    assert failpoints._parse("a, b=sleep:2.5,") == {"a": None, "b": 2.5}
    with pytest.raises(ValueError, match="sleep:SECONDS"):
        failpoints._parse("a=explode")
