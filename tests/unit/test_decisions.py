"""Decisions that more than one controller takes, each written once: is a checkpoint
usable, which event an atEvent names, is a session busy."""

from datetime import timedelta

import pytest

from savepoint.checkpoint import Policy, QuotaUse, Rejection, SessionView, admit
from savepoint.eventlog import Event
from savepoint.fork import ForkReason, checkpoint_unusable, find_event, named_seq
from savepoint.idle import pause_deadline
from savepoint.logdigest import Digest
from savepoint.models import CheckpointSpec, IdlePolicy, SessionPhase
from savepoint.session import activity, busy

T = "2026-01-01T00:00:00.000000Z"


def ckpt(phase: str | None, **status: str) -> dict:
    return {"metadata": {"name": "c1"}, "status": {"phase": phase, **status} if phase else {}}


@pytest.mark.parametrize(
    ("body", "reason", "words"),
    [
        (None, ForkReason.CHECKPOINT_NOT_FOUND, "checkpoint c1 not found"),
        (ckpt("Expired", expiresAt="2026-01-01T00:00:00Z"), ForkReason.CHECKPOINT_EXPIRED, "expired at 2026-01-01"),
        (
            ckpt("Failed", reason="SnapshotTimeout", message="slow"),
            ForkReason.CHECKPOINT_NOT_READY,
            "ended Failed (SnapshotTimeout: slow)",
        ),
        (ckpt("Rejected"), ForkReason.CHECKPOINT_NOT_READY, "ended Rejected (no reason given)"),
        (ckpt("Pending"), ForkReason.CHECKPOINT_NOT_READY, "checkpoint c1 is Pending, not Ready"),
        (ckpt(None), ForkReason.CHECKPOINT_NOT_READY, "checkpoint c1 is not admitted, not Ready"),
    ],
)
def test_an_unusable_checkpoint_says_why_in_one_message_per_reason(body, reason, words):
    refusal = checkpoint_unusable("c1", body)
    assert refusal is not None and refusal.reason == reason
    assert words in str(refusal)


def test_a_ready_checkpoint_is_usable():
    assert checkpoint_unusable("c1", ckpt("Ready", volumeSnapshotName="sp-c1")) is None


def events(*types: str) -> list[Event]:
    return [Event(i, f"{i:012d}-abcdef", t, T, {}) for i, t in enumerate(types, start=1)]


def test_at_event_names_an_event_by_id_or_by_sequence_number():
    log = events("user.message", "run.started", "run.completed")
    assert find_event(log, "2").seq == 2
    assert find_event(log, "000000000003-abcdef").seq == 3
    assert find_event(log, "4") is None
    assert find_event(log, "000000000002-ffffff") is None  # the id's random part counts
    assert find_event(log, "02") is None  # a number as the log writes it, not its prefix


@pytest.mark.parametrize(
    ("at_event", "seq"),
    [("7", 7), ("000000000012-abcdef", 12), ("0", None), ("-1", None), ("x-1", None), ("", None)],
)
def test_the_sequence_an_at_event_names(at_event, seq):
    assert named_seq(at_event) == seq


@pytest.mark.parametrize(
    ("types", "phase"),
    [
        ((), SessionPhase.READY),
        (("run.started", "run.completed"), SessionPhase.READY),
        (("run.started",), SessionPhase.RUNNING),
        (("agent.approval_request",), SessionPhase.AWAITING_APPROVAL),
        (("run.started", "agent.approval_request"), SessionPhase.AWAITING_APPROVAL),  # the approval comes first
        (("agent.approval_request", "user.approval"), SessionPhase.READY),
    ],
)
def test_the_log_says_what_a_live_session_is_doing(types, phase):
    assert activity(events(*types)) == phase


def test_only_a_run_or_an_approval_makes_a_session_busy():
    assert busy("s1", "Running") == "session s1 has a run in flight"
    assert busy("s1", SessionPhase.AWAITING_APPROVAL) == "session s1 has an approval pending"
    for phase in ("Ready", "Paused", "Provisioning", None):
        assert busy("s1", phase) is None


def test_checkpoint_admission_and_the_idle_pause_agree_with_the_busy_decision():
    spec = CheckpointSpec.model_validate({"sessionName": "s1"})
    policy = Policy(ttl_cap=timedelta(days=1))
    answer = admit("c1", spec, policy, SessionView(True, "Running"), QuotaUse(0, 0), "csi-class")
    assert answer == Rejection("SessionBusy", busy("s1", "Running"))
    idle = IdlePolicy.model_validate({"pauseAfter": "1m"})
    assert pause_deadline(idle, Digest.of(events("run.started")), None) is None
    assert pause_deadline(idle, Digest.of(events("run.started", "run.completed")), None) is not None
