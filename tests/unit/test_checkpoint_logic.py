"""The pure Checkpoint decisions: workspace policy, admission's rules in order, TTL, snapshot class and name."""

from __future__ import annotations

from datetime import timedelta

import pytest

from savepoint.checkpoint import (
    CHECKPOINT_LABEL,
    MAX_TTL,
    Policy,
    PolicyError,
    QuotaUse,
    Rejection,
    RejectReason,
    SessionView,
    Wait,
    admit,
    build_volume_snapshot,
    effective_ttl,
    moves_checkpoint,
    parse_quantity,
    pick_snapshot_class,
    policy_from_annotations,
    snapshot_name,
)
from savepoint.constants import (
    ANNOTATION_LOG_RETENTION,
    ANNOTATION_MAX_BYTES,
    ANNOTATION_MAX_COUNT,
    ANNOTATION_TTL,
    ANNOTATION_ZDR,
)
from savepoint.models import CheckpointSpec

DAY = timedelta(days=1)
SPEC = CheckpointSpec.model_validate({"sessionName": "s"})
READY = SessionView(exists=True, phase="Ready", claim="s-workspace")


def test_policy_defaults_to_the_operators_ttl_and_no_limits():
    assert policy_from_annotations(None, 30 * DAY) == Policy(ttl_cap=30 * DAY)


def test_policy_reads_every_annotation():
    policy = policy_from_annotations(
        {
            ANNOTATION_TTL: "2d",
            ANNOTATION_ZDR: "True",
            ANNOTATION_LOG_RETENTION: "12h",
            ANNOTATION_MAX_COUNT: "5",
            ANNOTATION_MAX_BYTES: "10Gi",
        },
        30 * DAY,
    )
    assert policy == Policy(
        ttl_cap=2 * DAY,
        zero_data_retention=True,
        log_retention=timedelta(hours=12),
        max_checkpoints=5,
        max_checkpoint_bytes=10 * 2**30,
    )


@pytest.mark.parametrize("value", ["yes", "", "1"])
def test_zero_data_retention_is_only_the_word_true(value):
    assert not policy_from_annotations({ANNOTATION_ZDR: value}, DAY).zero_data_retention


@pytest.mark.parametrize(
    ("key", "value"), [(ANNOTATION_TTL, "soon"), (ANNOTATION_MAX_COUNT, "five"), (ANNOTATION_MAX_BYTES, "lots")]
)
def test_a_bad_annotation_is_a_policy_error_naming_it(key, value):
    with pytest.raises(PolicyError, match=f"namespace annotation {key}={value!r}"):
        policy_from_annotations({key: value}, DAY)


@pytest.mark.parametrize(("text", "size"), [("1048576", 2**20), ("500M", 500 * 10**6), ("1.5Ki", 1536), (7, 7)])
def test_parse_quantity(text, size):
    assert parse_quantity(text) == size


@pytest.mark.parametrize(
    ("spec_ttl", "cap", "ttl"),
    [
        (None, 30 * DAY, 30 * DAY),
        ("1d", 30 * DAY, DAY),
        ("90d", 30 * DAY, 30 * DAY),
        ("99999999999999999999d", 30 * DAY, 30 * DAY),
        (None, timedelta(days=10**6), MAX_TTL),
    ],
)
def test_effective_ttl_is_the_spec_capped_by_the_namespace(spec_ttl, cap, ttl):
    assert effective_ttl(spec_ttl, Policy(ttl_cap=cap)) == ttl


NO_LIMITS = Policy(ttl_cap=DAY)
NOTHING_USED = QuotaUse(0, 0)


def _admit(view=READY, policy=NO_LIMITS, quota=NOTHING_USED, snapshot_class="csi", **kw):
    return admit("c1", SPEC, policy, view, quota, snapshot_class, **kw)


@pytest.mark.parametrize(
    ("view", "policy", "quota", "snapshot_class", "reason"),
    [
        (READY, Policy(DAY), QuotaUse(0, 0), "csi", None),
        (SessionView(exists=True, phase="Paused", claim="c"), Policy(DAY), QuotaUse(0, 0), "csi", None),
        # Zero data retention comes first: even a missing session is refused for it.
        (SessionView(exists=False), Policy(DAY, zero_data_retention=True), QuotaUse(0, 0), "csi", "ZeroDataRetention"),
        (SessionView(exists=True, phase="Running"), Policy(DAY), QuotaUse(0, 0), "csi", "SessionBusy"),
        (SessionView(exists=True, phase="AwaitingApproval"), Policy(DAY), QuotaUse(0, 0), "csi", "SessionBusy"),
        (SessionView(exists=True, phase="Failed"), Policy(DAY), QuotaUse(0, 0), "csi", "SessionNotReady"),
        (SessionView(exists=True, phase="Ended"), Policy(DAY), QuotaUse(0, 0), "csi", "SessionNotReady"),
        (READY, Policy(DAY, max_checkpoints=2), QuotaUse(2, 0), "csi", "QuotaExceeded"),
        (READY, Policy(DAY, max_checkpoints=2), QuotaUse(1, 0), "csi", None),
        (READY, Policy(DAY, max_checkpoint_bytes=100), QuotaUse(0, 100), "csi", "QuotaExceeded"),
        (READY, Policy(DAY, max_checkpoint_bytes=100), QuotaUse(9, 99), "csi", None),
        # Quota before the snapshot class.
        (READY, Policy(DAY, max_checkpoints=0), QuotaUse(0, 0), None, "QuotaExceeded"),
        (READY, Policy(DAY), QuotaUse(0, 0), None, "SnapshotsUnsupported"),
    ],
)
def test_admission_rules_in_order(view, policy, quota, snapshot_class, reason):
    answer = _admit(view, policy, quota, snapshot_class)
    if reason is None:
        assert answer is None
    else:
        assert isinstance(answer, Rejection) and answer.reason == RejectReason(reason)
        assert "s" in answer.message


def test_a_missing_or_provisioning_session_is_waited_for_never_rejected_at_once():
    assert isinstance(_admit(SessionView(exists=False)), Wait)
    assert isinstance(_admit(SessionView(exists=True, phase="Provisioning")), Wait)
    assert isinstance(_admit(SessionView(exists=True, phase=None)), Wait)


def test_busy_messages_say_what_is_in_flight():
    assert "run in flight" in _admit(SessionView(exists=True, phase="Running")).message
    assert "approval pending" in _admit(SessionView(exists=True, phase="AwaitingApproval")).message


def cls(name: str, driver: str, default: bool = False) -> dict:
    annotations = {"snapshot.storage.k8s.io/is-default-class": "true"} if default else {}
    return {"metadata": {"name": name, "annotations": annotations}, "driver": driver}


@pytest.mark.parametrize(
    ("classes", "driver", "wanted", "picked"),
    [
        ([cls("a", "d1")], None, None, None),
        ([cls("a", "d1")], "d1", None, "a"),
        ([cls("a", "d2")], "d1", None, None),
        ([cls("a", "d1"), cls("b", "d1")], "d1", None, None),
        ([cls("a", "d1"), cls("b", "d1", default=True)], "d1", None, "b"),
        ([cls("a", "d1"), cls("b", "d1", default=True)], "d1", "a", "a"),
        ([cls("a", "d1"), cls("x", "d2")], "d1", "x", None),
        ([cls("a", "d1")], "d1", "gone", None),
    ],
)
def test_pick_snapshot_class(classes, driver, wanted, picked):
    assert pick_snapshot_class(classes, driver, wanted) == picked


def test_snapshot_name_is_deterministic_and_fits_a_name():
    assert snapshot_name("cp") == "sp-cp"
    long = "c" * 200
    assert snapshot_name(long) == snapshot_name(long) and len(snapshot_name(long)) <= 63
    assert snapshot_name(long) != snapshot_name("c" * 199)
    # A cut that ends in "." would make "x.-<digest>", which is not a valid name.
    assert ".-" not in snapshot_name("a" * 48 + "." + "b" * 100)


@pytest.mark.parametrize("name", ["c1", "c" * 63, "c" * 64, "c" * 253])
def test_a_snapshot_names_its_checkpoint_whole_once(name):
    """The label holds the name when it fits a label value; only a longer one is repeated
    whole in the annotation. Either way the watch finds the checkpoint it moves on."""
    body = {"metadata": {"name": name, "namespace": "ns", "uid": "u1"}, "spec": {"sessionName": "s"}}
    snap = build_volume_snapshot(body, "s-workspace", "csi", {"throughSequence": 3})
    label = snap["metadata"]["labels"][CHECKPOINT_LABEL]
    annotations = snap["metadata"]["annotations"]
    assert len(label) <= 63 and (label == name) == (len(name) <= 63)
    assert annotations.get(CHECKPOINT_LABEL) == (None if label == name else name)
    assert moves_checkpoint("MODIFIED", {**snap, "status": {"readyToUse": True}}) == name


def snapshot(ready: bool = False, error: str | None = None, deleting: bool = False, name: str = "c1") -> dict:
    meta: dict = {"name": f"sp-{name}", "annotations": {CHECKPOINT_LABEL: name}, "labels": {CHECKPOINT_LABEL: name}}
    if deleting:
        meta["deletionTimestamp"] = "2030-01-01T00:00:00Z"
    status: dict = {"readyToUse": ready}
    if error:
        status["error"] = {"message": error}
    return {"metadata": meta, "status": status}


@pytest.mark.parametrize(
    ("event_type", "body", "moved"),
    [
        ("MODIFIED", snapshot(ready=True), "c1"),
        ("ADDED", snapshot(error="no space"), "c1"),
        ("MODIFIED", snapshot(), None),  # the snapshotter's intermediate updates
        ("MODIFIED", snapshot(ready=True, deleting=True), None),  # expiry deletes it
        ("DELETED", snapshot(ready=True), None),
        ("BOOKMARK", {"metadata": {"resourceVersion": "9"}}, None),
        ("MODIFIED", snapshot(ready=True, name="x" * 80), "x" * 80),  # the annotation holds the whole name
    ],
)
def test_a_snapshot_event_moves_its_checkpoint_only_once_it_is_settled(event_type, body, moved):
    assert moves_checkpoint(event_type, body) == moved
