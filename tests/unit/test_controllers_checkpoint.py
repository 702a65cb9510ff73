"""Table tests of whole Checkpoint passes against the in-memory API (tests/unit/fake_api.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest
from kubernetes.client.exceptions import ApiException

from savepoint.checkpoint import rfc3339, snapshot_name
from savepoint.config import Settings
from savepoint.constants import API_VERSION, SESSION_LABEL
from savepoint.controllers import cache
from savepoint.controllers.checkpoint import reconcile_checkpoint
from savepoint.cut import cut_of
from savepoint.eventlog import EventLog
from tests.unit.fake_api import FakeAPI, Request

NS = "team"
DRIVER = "hostpath.csi.k8s.io"
SETTINGS = Settings(hooks=False)


def session(phase: str | None = "Ready", deleting: bool = False) -> dict:
    meta: dict = {"name": "s", "namespace": NS, "uid": "uid-s"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "apiVersion": API_VERSION,
        "kind": "Session",
        "metadata": meta,
        "spec": {"harness": {"image": "h", "revision": "r1"}},
        "status": {"phase": phase, "workspaceClaimName": "s-workspace"} if phase else {},
    }


def checkpoint(name: str = "cp", created: datetime | None = None) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": "Checkpoint",
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"uid-{name}",
            "creationTimestamp": rfc3339(created or datetime.now(UTC)),
        },
        "spec": {"sessionName": "s"},
    }


def world(api: FakeAPI, the_session: dict | None, events: list[str] = (), annotations: dict | None = None) -> None:
    api.add("namespaces", {"metadata": {"name": NS, "annotations": annotations or {}}})
    api.add("storageclasses", {"metadata": {"name": "fast"}, "provisioner": DRIVER})
    api.add("volumesnapshotclasses", {"metadata": {"name": "snaps"}, "driver": DRIVER})
    api.add(
        "persistentvolumeclaims",
        {"metadata": {"name": "s-workspace", "namespace": NS}, "spec": {"storageClassName": "fast"}},
    )
    if the_session is not None:
        api.add("sessions", the_session)
        elog = EventLog(api.core(), NS, "s")
        for kind in events:
            elog.append(kind, {"runId": "r"} if kind.startswith("run.") else {})


@pytest.fixture
def api(monkeypatch) -> FakeAPI:
    return FakeAPI().install(monkeypatch)


def status(api: FakeAPI, name: str = "cp") -> dict:
    return (api.get("checkpoints", NS, name) or {}).get("status") or {}


def log_types(api: FakeAPI) -> list[str]:
    return [e.type for e in EventLog(api.core(), NS, "s").read()]


@dataclass
class Admission:
    id: str
    session: dict | None
    events: list[str] = field(default_factory=list)
    annotations: dict = field(default_factory=dict)
    age: timedelta = timedelta(0)
    phase: str | None = ""
    reason: str | None = None
    snapshot: bool = False


ADMISSIONS = [
    Admission("session missing, just created: waits", None, phase="Pending", reason="WaitingForSession"),
    Admission(
        "session missing past the grace: rejected",
        None,
        age=timedelta(minutes=1),
        phase="Rejected",
        reason="SessionNotFound",
    ),
    Admission("session provisioning: waits", session("Provisioning"), phase="Pending", reason="WaitingForSession"),
    Admission(
        "session provisioning past the wait timeout: rejected",
        session("Provisioning"),
        age=timedelta(hours=1),
        phase="Rejected",
        reason="SessionNotReady",
    ),
    # Admitted: the snapshot is asked for with the cut on it, and no Pending is written (a
    # fast snapshot goes straight to Ready).
    Admission("session ready: accepted, snapshot made", session("Ready"), phase=None, snapshot=True),
    Admission("session failed: rejected", session("Failed"), phase="Rejected", reason="SessionNotReady"),
    Admission(
        "a run in flight in the log: busy", session("Ready"), ["run.started"], phase="Rejected", reason="SessionBusy"
    ),
    Admission(
        "an approval pending in the log: busy",
        session("Ready"),
        ["agent.approval_request"],
        phase="Rejected",
        reason="SessionBusy",
    ),
    Admission(
        "zero data retention namespace",
        session("Ready"),
        annotations={"savepoint.dev/zero-data-retention": "true"},
        phase="Rejected",
        reason="ZeroDataRetention",
    ),
    Admission(
        "a bad namespace annotation",
        session("Ready"),
        annotations={"savepoint.dev/checkpoint-ttl": "soon"},
        phase="Rejected",
        reason="InvalidWorkspacePolicy",
    ),
]


@pytest.mark.parametrize("case", ADMISSIONS, ids=lambda c: c.id)
def test_admission(api, case):
    world(api, case.session, case.events, case.annotations)
    api.add("checkpoints", checkpoint(created=datetime.now(UTC) - case.age))
    reconcile_checkpoint(NS, "cp", SETTINGS)
    got = status(api)
    assert (got.get("phase"), got.get("reason")) == (case.phase, case.reason)
    assert (snapshot_name("cp") in api.names("volumesnapshots")) == case.snapshot
    if case.phase is not None:
        assert api.get("checkpoints", NS, "cp")["status"]["observedGeneration"] == 1
    if case.phase == "Rejected":
        assert api.events[-1][1:] == (case.reason, got["message"], True)


def test_accepted_checkpoint_is_cut_owned_and_snapshotted_by_deterministic_names(api):
    world(api, session("Ready"), ["message", "message"])
    api.add("checkpoints", checkpoint())
    api.requests.clear()
    reconcile_checkpoint(NS, "cp", SETTINGS)
    cp = api.get("checkpoints", NS, "cp")
    owner = {"apiVersion": API_VERSION, "kind": "Session", "name": "s", "uid": "uid-s", "blockOwnerDeletion": True}
    assert cp["metadata"]["ownerReferences"] == [{**owner, "controller": False}]
    assert cp["metadata"]["labels"][SESSION_LABEL] == "s"
    vs = api.get("volumesnapshots", NS, "sp-cp")
    assert vs["spec"] == {"volumeSnapshotClassName": "snaps", "source": {"persistentVolumeClaimName": "s-workspace"}}
    assert [(r["kind"], r["uid"]) for r in vs["metadata"]["ownerReferences"]] == [("Checkpoint", "uid-cp")]
    # The cut is written with the snapshot's request (then on the Checkpoint with its
    # owner), not in a Pending status first: whatever stops after the request, the
    # snapshot says what it was cut at.
    cut = cut_of(vs)
    assert (cut["throughSequence"], cut["volumeSnapshotName"]) == (2, "sp-cp")
    assert cut_of(cp) == cut
    assert "status" not in cp
    assert [(r.verb, r.kind) for r in api.writes()] == [("create", "volumesnapshots"), ("patch", "checkpoints")]


def _ready_snapshot(api: FakeAPI, name: str = "sp-cp") -> None:
    api.patch("volumesnapshots", NS, name, {"status": {"readyToUse": True, "restoreSize": "1Gi"}})


def test_snapshot_ready_makes_the_checkpoint_ready_and_logs_it_once(api):
    world(api, session("Ready"), ["message"])
    api.add("checkpoints", checkpoint())
    reconcile_checkpoint(NS, "cp", SETTINGS)
    reconcile_checkpoint(NS, "cp", SETTINGS)  # the snapshot is not ready yet: nothing changes
    assert status(api) == {}
    _ready_snapshot(api)
    reconcile_checkpoint(NS, "cp", SETTINGS)
    got = status(api)
    assert (got["phase"], got["restoreSize"]) == ("Ready", "1Gi")
    # The one status write carries the cut and the clock too.
    assert (got["throughSequence"], got["volumeSnapshotName"]) == (1, "sp-cp")
    assert got["createdAt"] and got["expiresAt"] and got["resume"] == {"kind": "snapshot"}
    # A retried pass over a Ready-but-not-yet-written checkpoint must not append again.
    api.patch("checkpoints", NS, "cp", {"status": {"phase": "Pending"}}, status=True)
    reconcile_checkpoint(NS, "cp", SETTINGS)
    assert log_types(api) == ["message", "checkpoint.created"]
    assert status(api)["phase"] == "Ready"


def test_with_the_watched_newest_chunk_ready_costs_one_log_write_and_one_status_write(api):
    """The chunk watch's copy of the newest chunk (controllers/cache.py) is what the append
    writes against: no read of the log, no Event, no label on the snapshot."""
    world(api, session("Ready"), ["message"])
    api.add("checkpoints", checkpoint())
    reconcile_checkpoint(NS, "cp", SETTINGS)
    _ready_snapshot(api)
    cache.chunks.observe("MODIFIED", api.get("configmaps", NS, "s-log-000001"))
    api.requests.clear()
    try:
        reconcile_checkpoint(NS, "cp", SETTINGS)
    finally:
        cache.clear()
    assert [(r.verb, r.kind) for r in api.requests if r.kind != "checkpoints" or r.verb != "get"] == [
        ("get", "volumesnapshots"),
        ("patch", "configmaps"),
        ("patch_status", "checkpoints"),
    ]
    assert log_types(api) == ["message", "checkpoint.created"]


def test_a_snapshot_error_fails_the_checkpoint_and_asks_to_delete_the_snapshot(api):
    world(api, session("Ready"))
    api.add("checkpoints", checkpoint())
    reconcile_checkpoint(NS, "cp", SETTINGS)
    api.patch("volumesnapshots", NS, "sp-cp", {"status": {"error": {"message": "disk on fire"}}})
    reconcile_checkpoint(NS, "cp", SETTINGS)
    got = status(api)
    assert (got["phase"], got["reason"]) == ("Failed", "SnapshotFailed")
    assert "disk on fire" in got["message"]
    assert "sp-cp" not in api.names("volumesnapshots")
    writes = [(r.verb, r.kind) for r in api.writes()]
    assert writes[-2:] == [("patch_status", "checkpoints"), ("delete", "volumesnapshots")]


def test_a_snapshot_of_that_name_already_there_is_used(api):
    """A 409 on create: an earlier pass made it (deterministic name), so this one reads it."""
    world(api, session("Ready"))
    api.add("checkpoints", checkpoint())
    api.add(
        "volumesnapshots",
        {
            "metadata": {
                "name": "sp-cp",
                "namespace": NS,
                "ownerReferences": [{"kind": "Checkpoint", "name": "cp", "uid": "uid-cp"}],
            },
            "status": {"readyToUse": True, "restoreSize": "5Mi"},
        },
    )
    reconcile_checkpoint(NS, "cp", SETTINGS)
    assert Request("create", "volumesnapshots", NS, "sp-cp") in api.requests
    assert Request("get", "volumesnapshots", NS, "sp-cp") in api.requests
    assert (status(api)["phase"], status(api)["restoreSize"]) == ("Ready", "5Mi")


def test_a_snapshot_left_by_an_earlier_checkpoint_of_that_name_is_deleted_not_used(api):
    world(api, session("Ready"))
    api.add("checkpoints", checkpoint())
    old = {"kind": "Checkpoint", "name": "cp", "uid": "uid-of-an-older-cp"}
    api.add("volumesnapshots", {"metadata": {"name": "sp-cp", "namespace": NS, "ownerReferences": [old]}})
    reconcile_checkpoint(NS, "cp", SETTINGS)
    assert status(api) == {}  # admitted again (at the cut then) once that one is gone
    assert "sp-cp" not in api.names("volumesnapshots")


def test_an_error_on_create_fails_the_pass_and_a_rerun_converges(api):
    world(api, session("Ready"))
    api.add("checkpoints", checkpoint())
    api.fail("create", "volumesnapshots", 500)
    with pytest.raises(ApiException) as err:
        reconcile_checkpoint(NS, "cp", SETTINGS)
    assert err.value.status == 500
    assert status(api) == {} and cut_of(api.get("checkpoints", NS, "cp")) is None  # nothing asked for, nothing said
    assert api.names("volumesnapshots") == []
    reconcile_checkpoint(NS, "cp", SETTINGS)
    assert api.names("volumesnapshots") == ["sp-cp"]
    _ready_snapshot(api)
    reconcile_checkpoint(NS, "cp", SETTINGS)
    assert status(api)["phase"] == "Ready"
    assert log_types(api) == ["checkpoint.created"]


def test_a_conflict_on_the_log_append_is_retried_and_appends_once(api):
    world(api, session("Ready"), ["message"])
    api.add("checkpoints", checkpoint())
    reconcile_checkpoint(NS, "cp", SETTINGS)
    _ready_snapshot(api)
    api.fail("patch", "configmaps", 409)
    reconcile_checkpoint(NS, "cp", SETTINGS)
    assert status(api)["phase"] == "Ready"
    assert log_types(api) == ["message", "checkpoint.created"]


def test_a_checkpoint_gone_is_nothing_to_do(api):
    world(api, session("Ready"))
    reconcile_checkpoint(NS, "cp", SETTINGS)
    assert api.writes() == []


def test_a_settled_checkpoint_is_not_touched(api):
    world(api, session("Ready"))
    api.add("checkpoints", {**checkpoint(), "status": {"phase": "Rejected", "reason": "SessionBusy"}})
    reconcile_checkpoint(NS, "cp", SETTINGS)
    assert api.writes() == []


def test_a_checkpoint_deleted_with_kopfs_old_finalizer_is_released(api):
    """A Checkpoint made while the operator still had a delete handler carries kopf's
    finalizer: its release asks for the snapshot's deletion and takes only that finalizer
    off (conditionally on the resourceVersion it read)."""
    from savepoint.controllers.checkpoint import KOPF_FINALIZER, release

    world(api, session())
    body = checkpoint()
    body["metadata"]["finalizers"] = [KOPF_FINALIZER, "example.com/keep"]
    body["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    body["status"] = {"phase": "Ready", "volumeSnapshotName": "sp-cp"}
    api.add("checkpoints", body)
    api.add("volumesnapshots", {"metadata": {"name": "sp-cp", "namespace": NS}})
    release(NS, "cp")
    assert api.get("checkpoints", NS, "cp")["metadata"]["finalizers"] == ["example.com/keep"]
    assert any(r.verb == "delete" and r.kind == "volumesnapshots" for r in api.writes())
    writes = len(api.writes())
    release(NS, "cp")  # released already: nothing more to do
    assert len(api.writes()) == writes


def test_a_gone_checkpoints_snapshot_is_deleted_only_if_it_was_that_checkpoints(api):
    """Its DELETED event asks for its snapshot's deletion at once (not waiting for the
    garbage collector), but never for a snapshot of the same name owned by a newer
    Checkpoint of that name."""
    from savepoint.controllers.checkpoint import drop_snapshot

    def snapshot(owner_uid: str) -> dict:
        refs = [{"apiVersion": API_VERSION, "kind": "Checkpoint", "name": "cp", "uid": owner_uid}]
        return {"metadata": {"name": "sp-cp", "namespace": NS, "ownerReferences": refs}}

    api.add("volumesnapshots", snapshot("uid-new"))
    drop_snapshot(NS, "sp-cp", "uid-old")
    assert api.names("volumesnapshots") == ["sp-cp"]
    drop_snapshot(NS, "sp-cp", "uid-new")
    assert api.names("volumesnapshots") == []
    drop_snapshot(NS, "sp-cp", "uid-new")  # gone already: nothing to do


def test_one_namespace_read_serves_every_checkpoint_that_arrived_before_it(api):
    """The checkpoint policy is read after the Checkpoint arrived, so an annotation set before
    it was made applies; one read serves all that arrived before that read started."""
    import time

    world(api, session("Ready"), annotations={"savepoint.dev/max-checkpoint-ttl": "1h"})
    arrived = time.monotonic()
    namespace_reads = lambda: sum(1 for r in api.requests if (r.verb, r.kind) == ("get", "namespaces"))  # noqa: E731
    try:
        assert cache.namespace_annotations(NS, arrived) == {"savepoint.dev/max-checkpoint-ttl": "1h"}
        cache.namespace_annotations(NS, arrived)
        assert namespace_reads() == 1
        api.patch("namespaces", "", NS, {"metadata": {"annotations": {"savepoint.dev/max-checkpoint-ttl": "2h"}}})
        later = time.monotonic()  # a checkpoint made after the new annotation
        assert cache.namespace_annotations(NS, later)["savepoint.dev/max-checkpoint-ttl"] == "2h"
        assert cache.namespace_annotations(NS, None)["savepoint.dev/max-checkpoint-ttl"] == "2h"  # the webhook's
        assert namespace_reads() == 3
    finally:
        cache.clear()


def _ready_and_overdue(api) -> str:
    """A Ready checkpoint "cp" whose expiresAt has passed; that expiresAt."""
    world(api, session("Ready"), ["message"])
    api.add("checkpoints", checkpoint())
    reconcile_checkpoint(NS, "cp", SETTINGS)
    _ready_snapshot(api)
    reconcile_checkpoint(NS, "cp", SETTINGS)
    past = rfc3339(datetime.now(UTC) - timedelta(seconds=1))
    api.patch("checkpoints", NS, "cp", {"status": {"expiresAt": past}}, status=True)
    return past


def test_an_expiry_asks_for_the_snapshots_deletion_and_writes_expired_and_nothing_else(api):
    """A storm of thousands costs the deletion and the status each: no read, no Event."""
    from savepoint.controllers.expiry import ExpiryQueue, drain

    _ready_and_overdue(api)
    queue = ExpiryQueue()
    queue.observe("MODIFIED", api.get("checkpoints", NS, "cp"))
    api.requests.clear()
    api.events.clear()
    assert drain(SETTINGS, queue)["expired"] == 1
    assert status(api)["phase"] == "Expired" and "sp-cp" not in api.names("volumesnapshots")
    assert [(r.verb, r.kind) for r in api.requests] == [
        ("delete", "volumesnapshots"),
        ("patch_status", "checkpoints"),
    ]
    assert api.events == []


def test_a_storm_asks_for_every_deletion_before_any_expired_write(api):
    """The CSI stack deletes at its own pace once asked: a storm hands it every deletion
    first, then writes the statuses, each under its checkpoint's lock until written."""
    from savepoint.controllers import object_lock
    from savepoint.controllers.expiry import ExpiryQueue, drain

    world(api, session("Ready"), ["message"])
    names = [f"cp{i}" for i in range(5)]
    past = rfc3339(datetime.now(UTC) - timedelta(seconds=1))
    queue = ExpiryQueue()
    for name in names:
        api.add("checkpoints", checkpoint(name))
        reconcile_checkpoint(NS, name, SETTINGS)
        _ready_snapshot(api, f"sp-{name}")
        reconcile_checkpoint(NS, name, SETTINGS)
        api.patch("checkpoints", NS, name, {"status": {"expiresAt": past}}, status=True)
        queue.observe("MODIFIED", api.get("checkpoints", NS, name))
    api.requests.clear()
    assert drain(Settings(hooks=False, expiry_workers=1), queue)["expired"] == 5  # one thread: a fixed order
    sent = [(r.verb, r.kind) for r in api.requests]
    assert sent == [("delete", "volumesnapshots")] * 5 + [("patch_status", "checkpoints")] * 5
    assert all(status(api, name)["phase"] == "Expired" for name in names)
    assert not any(object_lock("checkpoint", NS, name).locked() for name in names)


def test_a_failed_deletion_leaves_the_checkpoint_ready_unlocked_and_queued(api):
    from savepoint.controllers import object_lock
    from savepoint.controllers.expiry import ExpiryQueue, drain

    _ready_and_overdue(api)
    queue = ExpiryQueue()
    queue.observe("MODIFIED", api.get("checkpoints", NS, "cp"))
    api.fail("delete", "volumesnapshots", 500)
    assert drain(SETTINGS, queue)["expired"] == 0
    assert status(api)["phase"] == "Ready" and not object_lock("checkpoint", NS, "cp").locked()
    assert drain(SETTINGS, queue)["expired"] == 1  # put back, and expired at the next pass
    assert status(api)["phase"] == "Expired" and "sp-cp" not in api.names("volumesnapshots")


def test_expiries_are_counted_once_written(api):
    """savepoint_checkpoint_expiries_total counts Expired written: a failed write, tried
    again at the next pass, counts once (the expiry bench stops on this count)."""
    from savepoint import metrics
    from savepoint.controllers.expiry import ExpiryQueue, drain

    _ready_and_overdue(api)
    queue = ExpiryQueue()
    queue.observe("MODIFIED", api.get("checkpoints", NS, "cp"))
    before = metrics.expiries._value.get()
    api.fail("patch_status", "checkpoints", 500)
    assert drain(SETTINGS, queue)["expired"] == 0
    assert metrics.expiries._value.get() == before
    assert drain(SETTINGS, queue)["expired"] == 1
    assert status(api)["phase"] == "Expired" and metrics.expiries._value.get() == before + 1


def test_an_expiry_taken_before_a_rollback_moved_expiresat_keeps_the_checkpoint(api):
    """A storm's entry waits for a worker; a rollback refreshes the checkpoint's clock
    meanwhile, through the queue: the worker finds it not due and deletes nothing."""
    from savepoint.controllers import expiry
    from savepoint.controllers.fork import _refresh_expiry

    past = _ready_and_overdue(api)
    expiry.clocks.observe("MODIFIED", api.get("checkpoints", NS, "cp"))
    [key], _ = expiry.clocks.take_due(datetime.now(UTC), SETTINGS.expired_grace)

    _refresh_expiry(NS, "cp", SETTINGS)  # no watch event delivered yet
    assert expiry.expire_due([key], SETTINGS, expiry.clocks) == 0
    assert status(api)["phase"] == "Ready" and "sp-cp" in api.names("volumesnapshots")
    # Without the refresh, the copy the watch gave says due, and the worker expires it.
    api.patch("checkpoints", NS, "cp", {"status": {"expiresAt": past}}, status=True)
    expiry.clocks.observe("MODIFIED", api.get("checkpoints", NS, "cp"))
    assert expiry.expire_due([key], SETTINGS, expiry.clocks) == 1
    assert status(api)["phase"] == "Expired" and "sp-cp" not in api.names("volumesnapshots")


def test_a_slow_snapshot_shows_pending_with_its_cut(api, monkeypatch):
    """A snapshot not ready PENDING_SHOWN_AFTER after the cut: the next pass writes Pending,
    with the cut the snapshot carries; one ready sooner is never written Pending."""
    from savepoint.controllers import checkpoint as controller

    world(api, session("Ready"), ["message"])
    api.add("checkpoints", checkpoint())
    reconcile_checkpoint(NS, "cp", SETTINGS)
    reconcile_checkpoint(NS, "cp", SETTINGS)
    assert status(api) == {}
    later = datetime.now(UTC) + controller.PENDING_SHOWN_AFTER + timedelta(seconds=1)
    monkeypatch.setattr(controller, "_now", lambda: later)
    reconcile_checkpoint(NS, "cp", SETTINGS)
    got = status(api)
    assert (got["phase"], got["throughSequence"], got["volumeSnapshotName"]) == ("Pending", 1, "sp-cp")
    made_at = cut_of(api.get("volumesnapshots", NS, "sp-cp"))
    assert {k: got.get(k) for k in made_at} == made_at
    _ready_snapshot(api)
    reconcile_checkpoint(NS, "cp", SETTINGS)
    assert status(api)["phase"] == "Ready"


def test_a_pass_after_a_stop_between_the_snapshot_and_the_owner_takes_the_snapshots_cut(api):
    """The snapshot was asked for, and the process stopped before anything else was
    written (here: the owner patch fails). A run starts meanwhile; the next process lists
    the Checkpoint, and its pass takes the cut from the snapshot instead of admitting it
    again (which would refuse it now, the Session busy)."""
    world(api, session("Ready"), ["message"])
    api.add("checkpoints", checkpoint())
    api.fail("patch", "checkpoints", 500)
    with pytest.raises(ApiException):
        reconcile_checkpoint(NS, "cp", SETTINGS, seen=api.get("checkpoints", NS, "cp"))
    assert status(api) == {} and cut_of(api.get("checkpoints", NS, "cp")) is None
    EventLog(api.core(), NS, "s").append("run.started", {"runId": "r"})
    _ready_snapshot(api)
    cache.clear()
    reconcile_checkpoint(NS, "cp", SETTINGS, seen=api.get("checkpoints", NS, "cp"), listed=True)
    got = status(api)
    assert (got["phase"], got["throughSequence"]) == ("Ready", 1)
    assert log_types(api) == ["message", "run.started", "checkpoint.created"]
    assert api.names("volumesnapshots") == ["sp-cp"]


def test_a_first_sight_that_finds_its_snapshot_made_at_another_cut_takes_that_cut(api):
    """A snapshot of ours already there (a pass that stopped before writing anything)
    holds the cut it was made at: the 409 on create reads it, and its cut wins."""
    from savepoint.checkpoint import build_volume_snapshot

    world(api, session("Ready"), ["message", "message", "message"])
    body = api.add("checkpoints", checkpoint())
    now = datetime.now(UTC)
    made_at = {
        "throughSequence": 1,
        "throughEventId": "e1",
        "volumeSnapshotName": "sp-cp",
        "createdAt": rfc3339(now),
        "expiresAt": rfc3339(now + timedelta(days=1)),
    }
    api.add("volumesnapshots", build_volume_snapshot(body, "s-workspace", "snaps", made_at))
    _ready_snapshot(api)
    reconcile_checkpoint(NS, "cp", SETTINGS, seen=body)
    got = status(api)
    assert (got["phase"], got["throughSequence"], got["throughEventId"]) == ("Ready", 1, "e1")


def test_a_quota_counts_a_checkpoint_admitted_without_a_pending_write(api):
    world(api, session("Ready"))
    api.add("checkpoints", checkpoint("cp1"))
    reconcile_checkpoint(NS, "cp1", SETTINGS)
    assert status(api, "cp1") == {}
    api.patch("namespaces", "", NS, {"metadata": {"annotations": {"savepoint.dev/max-checkpoints": "1"}}})
    api.add("checkpoints", checkpoint("cp2"))
    try:
        reconcile_checkpoint(NS, "cp2", SETTINGS)
    finally:
        cache.clear()
    assert (status(api, "cp2")["phase"], status(api, "cp2")["reason"]) == ("Rejected", "QuotaExceeded")


def test_a_snapshot_made_without_a_cut_keeps_the_checkpoints_first_cut_and_clock(api, monkeypatch):
    """A snapshot of that name already there, made by someone else (no owner, no cut): the
    cut stays the one the Checkpoint's owner patch carries, so later passes neither admit it
    again nor restart its clock, and the snapshot timeout fails it."""
    from savepoint.controllers import checkpoint as controller

    world(api, session("Ready"), ["message"])
    api.add("checkpoints", checkpoint())
    api.add("volumesnapshots", {"metadata": {"name": "sp-cp", "namespace": NS}})
    reconcile_checkpoint(NS, "cp", SETTINGS)
    first = cut_of(api.get("checkpoints", NS, "cp"))
    assert first is not None and status(api) == {}
    EventLog(api.core(), NS, "s").append("message", {})
    later = datetime.now(UTC) + controller.PENDING_SHOWN_AFTER + timedelta(seconds=1)
    monkeypatch.setattr(controller, "_now", lambda: later)
    reconcile_checkpoint(NS, "cp", SETTINGS)
    got = status(api)
    assert (got["phase"], got["throughSequence"], got["createdAt"]) == ("Pending", 1, first["createdAt"])
    timed_out = later + SETTINGS.snapshot_timeout
    monkeypatch.setattr(controller, "_now", lambda: timed_out)
    reconcile_checkpoint(NS, "cp", SETTINGS)
    assert (status(api)["phase"], status(api)["reason"]) == ("Failed", "SnapshotTimeout")


def test_the_snapshot_controllers_own_lost_update_race_is_not_a_failure(api):
    """Many snapshots of one claim at once: the snapshot controller's update of the claim
    loses a race, it says so in the snapshot's status.error, and it tries again. The
    checkpoint waits for it; a driver's error still fails it."""
    world(api, session("Ready"))
    api.add("checkpoints", checkpoint())
    reconcile_checkpoint(NS, "cp", SETTINGS)
    conflict = (
        "Failed to create snapshot content with error snapshot controller failed to update s-workspace on API "
        'server: Operation cannot be fulfilled on persistentvolumeclaims "s-workspace": the object has been '
        "modified; please apply your changes to the latest version and try again"
    )
    api.patch("volumesnapshots", NS, "sp-cp", {"status": {"error": {"message": conflict}}})
    reconcile_checkpoint(NS, "cp", SETTINGS)
    assert status(api).get("phase") is None and "sp-cp" in api.names("volumesnapshots")
    api.patch("volumesnapshots", NS, "sp-cp", {"status": {"error": None, "readyToUse": True, "restoreSize": "1Gi"}})
    reconcile_checkpoint(NS, "cp", SETTINGS)
    assert status(api)["phase"] == "Ready"


HOOKS = {"checkpointPolicy": {"hooks": {"preCheckpoint": {"exec": {"command": ["true"]}}}}}


def _session_reads(api) -> int:
    return sum(1 for r in api.requests if (r.verb, r.kind) == ("get", "sessions"))


def test_a_checkpoint_made_after_hooks_were_added_runs_them_though_the_watch_lags(api):
    """Hooks added to the Session, then a checkpoint asked for at once: the watch's copy of
    the Session may not show the hooks yet, and admission must not take them from it."""
    import time

    world(api, session("Ready"), ["message"])
    cache.sessions.put(api.get("sessions", NS, "s"))  # the watch's copy: no hooks
    api.patch("sessions", NS, "s", {"spec": {"harness": {"name": "agent"}, **HOOKS}})
    made = api.create("checkpoints", NS, checkpoint())  # after the hooks, so a higher resourceVersion
    reconcile_checkpoint(NS, "cp", Settings(hooks=True), seen=made, seen_at=time.monotonic())
    # It has no sandbox Pod to run the hook in, so the hook is skipped, and says so.
    assert status(api)["hooks"] == {"preCheckpoint": {"phase": "Skipped"}}
    assert "PreCheckpointHook" in [c["type"] for c in status(api)["conditions"]]


def test_the_watchs_copy_of_the_session_serves_when_it_is_newer_than_the_checkpoint(api):
    import time

    world(api, session("Ready"), ["message"])
    made = api.create("checkpoints", NS, checkpoint())
    api.patch("sessions", NS, "s", {"metadata": {"labels": {"touched": "yes"}}})
    cache.sessions.put(api.get("sessions", NS, "s"))  # written after the Checkpoint was made
    reconcile_checkpoint(NS, "cp", SETTINGS, seen=made, seen_at=time.monotonic())
    assert _session_reads(api) == 0
    assert api.names("volumesnapshots") == ["sp-cp"]


def test_one_session_read_serves_every_checkpoint_that_arrived_before_it(api):
    """A burst's checkpoints of one Session share a read that started after they arrived;
    one that arrived after that read started reads the Session again."""
    import time

    world(api, session("Ready"), ["message"])
    cache.sessions.put(api.get("sessions", NS, "s"))
    first, second = (api.create("checkpoints", NS, checkpoint(name)) for name in ("cp1", "cp2"))
    arrived = time.monotonic()
    reconcile_checkpoint(NS, "cp1", SETTINGS, seen=first, seen_at=arrived)
    reconcile_checkpoint(NS, "cp2", SETTINGS, seen=second, seen_at=arrived)
    assert _session_reads(api) == 1
    third = api.create("checkpoints", NS, checkpoint("cp3"))
    reconcile_checkpoint(NS, "cp3", SETTINGS, seen=third, seen_at=time.monotonic())
    assert _session_reads(api) == 2
    assert api.names("volumesnapshots") == ["sp-cp1", "sp-cp2", "sp-cp3"]


def _chunk_reads(api) -> int:
    return sum(1 for r in api.requests if (r.verb, r.kind) in (("get", "configmaps"), ("list", "configmaps")))


def test_admission_reads_the_newest_chunk_unless_the_watchs_copy_was_written_after_the_checkpoint(api):
    """A copy of the newest chunk written after the Checkpoint was made holds every event
    appended before it: admission cuts and checks the log from it, reading nothing. A copy
    older than the Checkpoint, or a sealed one (a newer chunk may follow it), is read again."""
    import time

    world(api, session("Ready"), ["message"])
    for name in ("cp1", "cp2"):
        api.create("checkpoints", NS, checkpoint(name))
    EventLog(api.core(), NS, "s").append("message", {"n": 2})  # after both Checkpoints were made
    reconcile_checkpoint(NS, "cp1", SETTINGS, seen=api.get("checkpoints", NS, "cp1"), seen_at=time.monotonic())
    cache.chunks.observe("MODIFIED", api.get("configmaps", NS, "s-log-000001"))
    api.requests.clear()
    reconcile_checkpoint(NS, "cp2", SETTINGS, seen=api.get("checkpoints", NS, "cp2"), seen_at=time.monotonic())
    assert _chunk_reads(api) == 0
    # The log's end: the message appended after the Checkpoint was made is in the cut.
    assert cut_of(api.get("volumesnapshots", NS, "sp-cp2"))["throughSequence"] == 2

    made = api.create("checkpoints", NS, checkpoint("cp3"))  # newer than the watch's copy of the chunk
    api.requests.clear()
    reconcile_checkpoint(NS, "cp3", SETTINGS, seen=made, seen_at=time.monotonic())
    assert _chunk_reads(api) == 1

    made = api.create("checkpoints", NS, checkpoint("cp4"))
    sealed = {"metadata": {"annotations": {"savepoint.dev/sealed": "true"}}}
    cache.chunks.observe("MODIFIED", api.patch("configmaps", NS, "s-log-000001", sealed))  # newer, but sealed
    api.requests.clear()
    reconcile_checkpoint(NS, "cp4", SETTINGS, seen=made, seen_at=time.monotonic())
    assert _chunk_reads(api) >= 1
