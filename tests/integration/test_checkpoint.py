"""The Checkpoint controller end to end: real snapshots of real files, policy, expiry."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from kubernetes import client

from savepoint import k8s
from savepoint import runtime as runtime_module
from savepoint.checkpoint import CHECKPOINT_LABEL, moves_checkpoint, parse_quantity
from savepoint.config import Settings
from savepoint.controllers import checkpoint as controller
from savepoint.controllers import expiry
from savepoint.cut import cut_of
from savepoint.eventlog import EventLog
from savepoint.models import GROUP, VERSION
from tests.conftest import SNAP, make_stuck_snapshot, wait_for
from tests.csi_data import pvc_data_dir
from tests.integration.test_session import make_session, wait_phase


def checksums(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def write_files(root: Path) -> None:
    (root / "src").mkdir(exist_ok=True)
    (root / "src" / "main.py").write_text("print('hello')\n")
    (root / "notes.md").write_text("# plan\n")
    (root / "blob.bin").write_bytes(os.urandom(1 << 20))


def make_checkpoint(crds, namespace: str, name: str, session: str = "s1", **spec) -> dict:
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Checkpoint",
        "metadata": {"name": name},
        "spec": {"sessionName": session, **spec},
    }
    return crds.create_namespaced_custom_object(GROUP, VERSION, namespace, "checkpoints", body)


def get_checkpoint(crds, namespace: str, name: str) -> dict | None:
    try:
        return crds.get_namespaced_custom_object(GROUP, VERSION, namespace, "checkpoints", name)
    except client.ApiException as err:
        if err.status == 404:
            return None
        raise


def wait_checkpoint(crds, namespace: str, name: str, *phases: str, timeout: float = 90) -> dict:
    def reached():
        body = get_checkpoint(crds, namespace, name)
        return body if body and (body.get("status") or {}).get("phase") in phases else None

    return wait_for(reached, timeout=timeout, what=f"checkpoint {name} in {phases}")


def get_snapshot(crds, namespace: str, name: str) -> dict | None:
    try:
        return crds.get_namespaced_custom_object(*SNAP, namespace, "volumesnapshots", name)
    except client.ApiException as err:
        if err.status == 404:
            return None
        raise


@pytest.fixture
def s1(operator, crds, namespace):
    make_session(crds, namespace, "s1", profile={"name": "p", "revision": "3"})
    return wait_phase(crds, namespace, "s1", "Ready", timeout=90)


def restore_into(core, namespace: str, snapshot: str, claim: str) -> Path:
    core.create_namespaced_persistent_volume_claim(
        namespace,
        {
            "metadata": {"name": claim},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "64Mi"}},
                "dataSource": {"apiGroup": SNAP[0], "kind": "VolumeSnapshot", "name": snapshot},
            },
        },
    )
    wait_for(
        lambda: core.read_namespaced_persistent_volume_claim(claim, namespace).status.phase == "Bound",
        timeout=60,
        what=f"restored claim {claim} bound",
    )
    return pvc_data_dir(core, namespace, claim)


def test_checkpoint_snapshots_the_workspace_at_the_log_cursor(s1, core, crds, namespace):
    workspace = pvc_data_dir(core, namespace, s1["status"]["workspaceClaimName"])
    write_files(workspace)
    before = checksums(workspace)
    log = EventLog(core, namespace, "s1")
    log.append("run.started", {"runId": "r1"})
    last = log.append("run.completed", {"runId": "r1"})
    wait_phase(crds, namespace, "s1", "Ready")

    make_checkpoint(crds, namespace, "c1", label="first")
    body = wait_checkpoint(crds, namespace, "c1", "Ready", "Failed", "Rejected")
    status = body["status"]
    assert status["phase"] == "Ready", status
    assert status["throughSequence"] == last.seq and status["throughEventId"] == last.id
    assert status["harnessRevision"] == "7" and status["profileRevision"] == "3"
    assert status["resume"] == {"kind": "snapshot"}
    created, expires = (datetime.strptime(status[k], "%Y-%m-%dT%H:%M:%SZ") for k in ("createdAt", "expiresAt"))
    assert expires - created == timedelta(days=30)
    assert parse_quantity(status["restoreSize"]) > 0
    assert not any(k in str(status) for k in ("print('hello')", "runId"))  # secret-free metadata

    # The log records the checkpoint and the session points at it.
    events = log.read()
    assert events[-1].type == "checkpoint.created" and events[-1].data["checkpoint"] == "c1"
    wait_for(
        lambda: (
            crds.get_namespaced_custom_object(GROUP, VERSION, namespace, "sessions", "s1")["status"].get(
                "latestCheckpoint"
            )
            == "c1"
        ),
        what="session latestCheckpoint",
    )

    # Change the workspace; the snapshot still holds the checkpoint's files.
    (workspace / "notes.md").write_text("changed\n")
    (workspace / "src" / "main.py").unlink()
    restored = restore_into(core, namespace, status["volumeSnapshotName"], "restored")
    assert checksums(restored) == before

    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "SnapshotReady") and "restorable" in ready["message"]


def test_deleting_a_checkpoint_deletes_its_snapshot(s1, crds, namespace):
    """No finalizer: the Checkpoint goes at once, and the garbage collector deletes the
    VolumeSnapshot it owns."""
    make_checkpoint(crds, namespace, "c1")
    body = wait_checkpoint(crds, namespace, "c1", "Ready")
    assert not body["metadata"].get("finalizers")
    vs = body["status"]["volumeSnapshotName"]
    assert get_snapshot(crds, namespace, vs) is not None
    crds.delete_namespaced_custom_object(GROUP, VERSION, namespace, "checkpoints", "c1")
    wait_for(lambda: get_checkpoint(crds, namespace, "c1") is None, timeout=60, what="checkpoint deleted")
    wait_for(lambda: get_snapshot(crds, namespace, vs) is None, timeout=60, what=f"VolumeSnapshot {vs} collected")


def test_expiry_deletes_the_snapshot_and_keeps_the_object(s1, crds, namespace):
    make_checkpoint(crds, namespace, "short", ttl="1s")
    body = wait_checkpoint(crds, namespace, "short", "Ready", "Expired")
    vs = body["status"]["volumeSnapshotName"]
    snapshot = get_snapshot(crds, namespace, vs)
    content = (snapshot or {}).get("status", {}).get("boundVolumeSnapshotContentName")
    body = wait_checkpoint(crds, namespace, "short", "Expired", timeout=60)
    assert body["status"]["resume"] == {"kind": "event_log"}
    assert body["status"]["reason"] == "TTLExpired"
    wait_for(lambda: get_snapshot(crds, namespace, vs) is None, timeout=60, what="expired snapshot deleted")
    if content:
        wait_for(
            lambda: get_content(crds, content) is None, timeout=60, what=f"VolumeSnapshotContent {content} deleted"
        )


def get_content(crds, name: str) -> dict | None:
    try:
        return crds.get_cluster_custom_object(*SNAP, "volumesnapshotcontents", name)
    except client.ApiException as err:
        if err.status == 404:
            return None
        raise


def test_overdue_checkpoints_expire_when_the_operator_starts(s1, operator, crds, namespace):
    # Long enough that, on a loaded machine, the operator is stopped before it expires it.
    make_checkpoint(crds, namespace, "while-down", ttl="20s")
    body = wait_checkpoint(crds, namespace, "while-down", "Ready")
    operator.stop()
    try:
        expires = datetime.strptime(body["status"]["expiresAt"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
        while datetime.now(UTC) < expires + timedelta(seconds=1):
            time.sleep(0.5)
        assert get_checkpoint(crds, namespace, "while-down")["status"]["phase"] == "Ready"
    finally:
        operator.start()
    expired = wait_checkpoint(crds, namespace, "while-down", "Expired", timeout=30)
    vs = expired["status"]["volumeSnapshotName"]
    wait_for(lambda: get_snapshot(crds, namespace, vs) is None, timeout=30, what="snapshot deleted at start-up")


def test_restart_after_snapshot_creation_makes_exactly_one_snapshot(s1, operator, crds, namespace):
    operator.stop()
    operator.start(SAVEPOINT_FAILPOINTS="checkpoint.after_snapshot_created")
    make_checkpoint(crds, namespace, "crashy")
    assert operator.wait_exit(60, "checkpoint.after_snapshot_created") == -9
    # Killed after the snapshot was asked for, before anything else was written: no
    # phase, and the snapshot alone carries the cut it was made at.
    assert (get_checkpoint(crds, namespace, "crashy").get("status") or {}).get("phase") is None
    made_at = cut_of(get_snapshot(crds, namespace, "sp-crashy"))
    assert made_at is not None and made_at["volumeSnapshotName"] == "sp-crashy"
    EventLog(client.CoreV1Api(crds.api_client), namespace, "s1").append("message", {"text": "after the cut"})
    operator.start()
    body = wait_checkpoint(crds, namespace, "crashy", "Ready", "Failed")
    assert body["status"]["phase"] == "Ready"
    snapshots = crds.list_namespaced_custom_object(
        *SNAP, namespace, "volumesnapshots", label_selector="savepoint.dev/checkpoint=crashy"
    )["items"]
    assert [s["metadata"]["name"] for s in snapshots] == [body["status"]["volumeSnapshotName"]]
    assert body["status"]["throughSequence"] == made_at["throughSequence"]  # the snapshot's cut, not a later one
    created = [
        e for e in EventLog(client.CoreV1Api(crds.api_client), namespace, "s1").read() if e.type == "checkpoint.created"
    ]
    assert len(created) == 1


def test_namespace_cap_shortens_the_ttl(s1, core, crds, namespace):
    core.patch_namespace(namespace, {"metadata": {"annotations": {"savepoint.dev/checkpoint-ttl": "1h"}}})
    make_checkpoint(crds, namespace, "capped", ttl="2h")
    status = wait_checkpoint(crds, namespace, "capped", "Ready", "Pending")["status"]
    created, expires = (datetime.strptime(status[k], "%Y-%m-%dT%H:%M:%SZ") for k in ("createdAt", "expiresAt"))
    assert expires - created == timedelta(hours=1)


def _rejected(crds, namespace, name) -> dict:
    return wait_checkpoint(crds, namespace, name, "Rejected", "Ready", "Failed")["status"]


def test_rejections_say_why(s1, core, crds, namespace):
    make_checkpoint(crds, namespace, "nosession", session="ghost")
    status = _rejected(crds, namespace, "nosession")
    assert (status["phase"], status["reason"]) == ("Rejected", "SessionNotFound")
    assert "ghost" in status["message"]

    log = EventLog(core, namespace, "s1")
    log.append("run.started", {"runId": "r9"})
    make_checkpoint(crds, namespace, "busy")
    status = _rejected(crds, namespace, "busy")
    assert (status["phase"], status["reason"]) == ("Rejected", "SessionBusy")
    assert "run in flight" in status["message"]
    log.append("run.completed", {"runId": "r9"})
    assert get_snapshot(crds, namespace, "sp-busy") is None


def test_waiting_for_session_and_snapshots_unsupported(operator, crds, namespace):
    # No toleration for the kwok taint: the Pod never schedules, the session stays Provisioning.
    # The checkpoint waits for it (tests/integration/test_converge.py: up to the bound).
    make_session(crds, namespace, "stuck", podTemplate={"spec": {"containers": [{"name": "a", "image": "x"}]}})
    make_checkpoint(crds, namespace, "early", session="stuck")
    status = wait_checkpoint(crds, namespace, "early", "Pending", "Rejected", "Ready")["status"]
    assert (status["phase"], status["reason"]) == ("Pending", "WaitingForSession")

    make_session(crds, namespace, "noclass", workspace={"size": "64Mi", "volumeSnapshotClassName": "missing"})
    wait_phase(crds, namespace, "noclass", "Ready", timeout=90)
    make_checkpoint(crds, namespace, "unsupported", session="noclass")
    status = _rejected(crds, namespace, "unsupported")
    assert status["reason"] == "SnapshotsUnsupported"


def test_zero_data_retention_and_quota(s1, core, crds, namespace):
    core.patch_namespace(namespace, {"metadata": {"annotations": {"savepoint.dev/max-checkpoints": "1"}}})
    make_checkpoint(crds, namespace, "one")
    assert wait_checkpoint(crds, namespace, "one", "Ready")["status"]["phase"] == "Ready"
    make_checkpoint(crds, namespace, "two")
    status = _rejected(crds, namespace, "two")
    assert status["reason"] == "QuotaExceeded" and "max-checkpoints=1" in status["message"]

    core.patch_namespace(namespace, {"metadata": {"annotations": {"savepoint.dev/zero-data-retention": "true"}}})
    make_checkpoint(crds, namespace, "zdr")
    status = _rejected(crds, namespace, "zdr")
    assert status["reason"] == "ZeroDataRetention"
    assert get_snapshot(crds, namespace, "sp-zdr") is None


def test_automatic_checkpoints_keep_last(operator, core, crds, namespace):
    make_session(crds, namespace, "auto", checkpointPolicy={"afterEachRun": True, "keepLast": 2, "ttl": "2d"})
    wait_phase(crds, namespace, "auto", "Ready", timeout=90)
    make_checkpoint(crds, namespace, "mine", session="auto", label="keep me")
    wait_checkpoint(crds, namespace, "mine", "Ready")
    log = EventLog(core, namespace, "auto")
    names = []
    for i in range(3):
        log.append("run.started", {"runId": f"r{i}"})
        done = log.append("run.completed", {"runId": f"r{i}"})
        names.append(controller.automatic_name("auto", done.seq))
        auto = wait_checkpoint(crds, namespace, names[-1], "Ready", "Rejected")
        assert auto["spec"]["ttl"] == "2d"  # checkpointPolicy.ttl reaches the automatic checkpoints

    def pruned():
        left = {
            c["metadata"]["name"]
            for c in crds.list_namespaced_custom_object(GROUP, VERSION, namespace, "checkpoints")["items"]
            if not c["metadata"].get("deletionTimestamp")
        }
        return left if left == {"mine", *names[1:]} else None

    wait_for(pruned, timeout=60, what="the oldest automatic checkpoint pruned")


def make_overdue(crds, namespace: str, name: str) -> None:
    """Move a Checkpoint's expiresAt five minutes into the past, as if the operator had been down."""
    past = (datetime.now(UTC) - timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
    crds.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, "checkpoints", name, {"status": {"expiresAt": past}}
    )


def test_sweep_expires_overdue_checkpoints_found_at_start(s1, crds, namespace):
    """What the operator does at start-up: one sweep expires everything already overdue."""
    make_checkpoint(crds, namespace, "overdue")
    wait_checkpoint(crds, namespace, "overdue", "Ready")
    make_overdue(crds, namespace, "overdue")
    expiry.sweep(Settings(namespaces=(namespace,)), expiry.ExpiryQueue())
    body = wait_checkpoint(crds, namespace, "overdue", "Expired", timeout=30)
    assert body["status"]["reason"] == "TTLExpired"


def test_the_sweep_lists_a_page_at_a_time_and_misses_none(s1, crds, namespace, monkeypatch):
    """The start-up sweep lists every Checkpoint of the cluster: a page of k8s.LIST_PAGE at a
    time, so thousands never arrive as one response; an overdue one on the last page expires."""
    for name in ("p1", "p2", "p3", "p4", "overdue"):
        make_checkpoint(crds, namespace, name)
    for name in ("p1", "p2", "p3", "p4", "overdue"):
        wait_checkpoint(crds, namespace, name, "Ready")
    make_overdue(crds, namespace, "overdue")
    pages: list[int | None] = []
    listing = client.CustomObjectsApi.list_namespaced_custom_object

    def spy(self, *args, **kwargs):
        pages.append(kwargs.get("limit"))
        return listing(self, *args, **kwargs)

    monkeypatch.setattr(k8s, "LIST_PAGE", 2)
    monkeypatch.setattr(client.CustomObjectsApi, "list_namespaced_custom_object", spy)
    listed = [c["metadata"]["name"] for c in k8s.iter_custom("checkpoints", namespace)]
    assert sorted(listed) == ["overdue", "p1", "p2", "p3", "p4"]
    assert pages == [2, 2, 2]
    pages.clear()
    assert expiry.sweep(Settings(namespaces=(namespace,)), expiry.ExpiryQueue())["expired"] == 1
    assert pages == [2, 2, 2]
    assert wait_checkpoint(crds, namespace, "overdue", "Expired", timeout=30)["status"]["reason"] == "TTLExpired"


def test_deleting_the_session_deletes_its_checkpoints(s1, crds, namespace):
    make_checkpoint(crds, namespace, "c1")
    vs = wait_checkpoint(crds, namespace, "c1", "Ready")["status"]["volumeSnapshotName"]
    crds.delete_namespaced_custom_object(GROUP, VERSION, namespace, "sessions", "s1")
    wait_for(lambda: get_checkpoint(crds, namespace, "c1") is None, timeout=90, what="checkpoint collected")
    wait_for(lambda: get_snapshot(crds, namespace, vs) is None, timeout=60, what="snapshot deleted")


def test_webhook_answers_kubectl_apply_synchronously(webhook, s1, core, crds, namespace):
    core.patch_namespace(namespace, {"metadata": {"labels": {webhook: "true"}}})
    EventLog(core, namespace, "s1").append("run.started", {"runId": "r1"})
    with pytest.raises(client.ApiException) as caught:
        make_checkpoint(crds, namespace, "refused")
    assert caught.value.status == 409
    assert "SessionBusy: session s1 has a run in flight" in caught.value.body
    assert get_checkpoint(crds, namespace, "refused") is None  # nothing stored
    # A Session that does not exist yet may come in the same apply: the webhook lets the
    # checkpoint in, and the status path refuses it after the missing grace.
    make_checkpoint(crds, namespace, "ghost", session="ghost")
    assert _rejected(crds, namespace, "ghost")["reason"] == "SessionNotFound"


def _scrape(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def _sample(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{wanted}}}") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_count_transitions(operator, s1, crds, namespace):
    assert _scrape(f"{operator.metrics_url}/healthz").strip() == "ok"
    before = _scrape(f"{operator.metrics_url}/metrics")
    make_checkpoint(crds, namespace, "counted")
    wait_checkpoint(crds, namespace, "counted", "Ready")
    make_checkpoint(crds, namespace, "refused", session="ghost")
    wait_checkpoint(crds, namespace, "refused", "Rejected")
    after = _scrape(f"{operator.metrics_url}/metrics")
    name = "savepoint_checkpoint_transitions_total"
    assert _sample(after, name, phase="Ready", reason="") == _sample(before, name, phase="Ready", reason="") + 1
    rejected = dict(phase="Rejected", reason="SessionNotFound")
    assert _sample(after, name, **rejected) == _sample(before, name, **rejected) + 1
    assert _sample(after, "savepoint_checkpoint_duration_seconds_count") >= 1
    # The Ready checkpoint's cut is one checkpoint.created event the operator appended.
    appends = dict(type="checkpoint.created")
    assert _sample(after, "savepoint_eventlog_appends_total", **appends) == (
        _sample(before, "savepoint_eventlog_appends_total", **appends) + 1
    )
    assert "savepoint_eventlog_conflicts_total " in after


def test_a_pending_checkpoint_keeps_the_snapshot_watch_open(never_ready_class, operator, s1, crds, namespace):
    """The operator's one VolumeSnapshot watch is open while a checkpoint is unsettled
    (here admitted, and held by a snapshot that never becomes ready), and says so."""
    make_stuck_snapshot(crds, namespace, "held", "s1", never_ready_class)
    make_checkpoint(crds, namespace, "held")
    wait_for(lambda: cut_of(get_checkpoint(crds, namespace, "held")), what="checkpoint held admitted")
    assert _sample(_scrape(f"{operator.metrics_url}/metrics"), "savepoint_snapshot_watches_open") == 1


def _requests(text: str, client: str, verb: str) -> float:
    """savepoint_api_requests_total of one client and verb, summed over the codes."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("savepoint_api_requests_total{")
        and f'client="{client}"' in line
        and f'verb="{verb}"' in line
    )


def test_kopf_requests_are_counted(operator, s1, crds, namespace):
    """kopf's own traffic (its lists and watches, its bookkeeping patch on a new Session)
    counts with client="kopf" beside ours."""
    before = _scrape(f"{operator.metrics_url}/metrics")
    make_checkpoint(crds, namespace, "kopf-counted")
    wait_checkpoint(crds, namespace, "kopf-counted", "Ready")
    middle = _scrape(f"{operator.metrics_url}/metrics")
    make_session(crds, namespace, "kopf-s2")
    wait_phase(crds, namespace, "kopf-s2", "Ready", timeout=90)
    after = _scrape(f"{operator.metrics_url}/metrics")
    assert _requests(after, "kopf", "GET") > 0, "kopf's initial lists are not counted"
    assert _requests(after, "kopf", "WATCH") > 0, "kopf's watch streams are not counted"
    assert _requests(after, "kopf", "PATCH") > _requests(middle, "kopf", "PATCH"), "kopf's patches are not counted"
    assert _requests(middle, "operator", "POST") > _requests(before, "operator", "POST")  # ours: the VolumeSnapshot


def test_a_checkpoint_pass_reads_nothing_the_watch_handed_it(s1, crds, namespace, operator_process, monkeypatch):
    """A new Checkpoint's first pass starts from the body its create event carried, and
    the pass a VolumeSnapshot event starts uses that snapshot: neither is read again (a
    GET each, at thousands of checkpoints). This test's process plays the operator."""
    from savepoint import k8s

    operator_process.stop()
    make_checkpoint(crds, namespace, "c1")
    body = get_checkpoint(crds, namespace, "c1")
    reads: list[str] = []
    real_custom, real_snapshot = k8s.get_custom, k8s.get_volume_snapshot
    monkeypatch.setattr(k8s, "get_custom", lambda plural, *args: reads.append(plural) or real_custom(plural, *args))
    monkeypatch.setattr(
        k8s, "get_volume_snapshot", lambda *args: reads.append("volumesnapshots") or real_snapshot(*args)
    )
    settings = Settings(namespaces=(namespace,))

    controller.reconcile_checkpoint(namespace, "c1", settings, seen=body)
    admitted = get_checkpoint(crds, namespace, "c1")
    assert (admitted.get("status") or {}).get("phase") is None and cut_of(admitted) is not None, admitted
    assert "checkpoints" not in reads
    status = cut_of(admitted)

    def ready_snapshot() -> dict | None:
        snap = crds.get_namespaced_custom_object(
            "snapshot.storage.k8s.io", "v1", namespace, "volumesnapshots", status["volumeSnapshotName"]
        )
        return snap if (snap.get("status") or {}).get("readyToUse") else None

    snapshot = wait_for(ready_snapshot, timeout=60, what="the snapshot ready")
    reads.clear()
    controller.reconcile_checkpoint(namespace, "c1", settings, snapshot=snapshot)
    assert get_checkpoint(crds, namespace, "c1")["status"]["phase"] == "Ready"
    assert "volumesnapshots" not in reads


def test_a_pending_poll_reads_the_snapshot_alone_until_a_pass_has_work(
    never_ready_class, s1, crds, namespace, operator_process, monkeypatch
):
    """The poll of a Pending checkpoint whose snapshot is still being made sends one GET
    (the snapshot), not a pass's two; once the snapshot timeout is due it runs the pass,
    which fails the checkpoint. This test's process plays the operator."""
    from savepoint import k8s

    operator_process.stop()
    make_stuck_snapshot(crds, namespace, "c1", "s1", never_ready_class)
    make_checkpoint(crds, namespace, "c1")
    settings = Settings(namespaces=(namespace,), snapshot_timeout=timedelta(minutes=10))
    controller.reconcile_checkpoint(namespace, "c1", settings, seen=get_checkpoint(crds, namespace, "c1"))
    assert cut_of(get_checkpoint(crds, namespace, "c1")) is not None  # admitted; Pending not shown yet

    reads: list[str] = []
    real_custom, real_snapshot = k8s.get_custom, k8s.get_volume_snapshot
    monkeypatch.setattr(k8s, "get_custom", lambda plural, *args: reads.append(plural) or real_custom(plural, *args))
    monkeypatch.setattr(
        k8s, "get_volume_snapshot", lambda *args: reads.append("volumesnapshots") or real_snapshot(*args)
    )
    assert controller.poll_pending(namespace, "c1", settings) is False
    assert reads == ["volumesnapshots"]
    assert (get_checkpoint(crds, namespace, "c1").get("status") or {}).get("phase") is None

    reads.clear()
    due = Settings(namespaces=(namespace,), snapshot_timeout=timedelta(0))
    assert controller.poll_pending(namespace, "c1", due) is True
    # The snapshot read once, not again by the pass; the checkpoint comes from the cache
    # (this process's own write a moment ago), not from a read.
    assert reads == ["volumesnapshots"]
    status = get_checkpoint(crds, namespace, "c1")["status"]
    assert (status["phase"], status["reason"]) == ("Failed", "SnapshotTimeout"), status


def test_the_snapshot_watch_starts_from_now_and_says_when_its_version_is_gone(s1, crds, namespace):
    """The operator watches VolumeSnapshots from the version of a one-item listing, so a
    restart reads none of the snapshots already there; a version the API server no longer
    keeps is Expired, after which the runtime watches from now again and polls Pending ones."""
    version = k8s.collection_version(k8s.VOLUME_SNAPSHOTS, namespace, CHECKPOINT_LABEL)
    make_checkpoint(crds, namespace, "watched")
    seen = []
    for event_type, body in k8s.watch(k8s.VOLUME_SNAPSHOTS, namespace, version, CHECKPOINT_LABEL, timeout=20):
        seen.append((event_type, body["metadata"].get("name")))
        if moves_checkpoint(event_type, body) == "watched":
            break
    assert seen[0] == ("ADDED", "sp-watched") and all(name == "sp-watched" for _, name in seen)
    with pytest.raises(k8s.Expired):
        list(k8s.watch(k8s.VOLUME_SNAPSHOTS, namespace, "1", CHECKPOINT_LABEL, timeout=5))


def test_the_snapshot_watch_is_opened_for_each_new_checkpoint_before_its_snapshot_is_made(
    s1, crds, namespace, operator_process, monkeypatch
):
    """The runtime's VolumeSnapshot watch is closed while no checkpoint is unsettled, and a
    checkpoint's admission opens it before making its snapshot, even when reading the
    version to watch from is slow (held 3 s here, longer than the snapshot takes). Each
    checkpoint is made Ready by its snapshot's watch event alone: no poll runs in this
    test's runtime. The second comes after the watch closed again. This test's process
    plays the operator."""
    operator_process.stop()
    real_version = k8s.collection_version
    monkeypatch.setattr(k8s, "collection_version", lambda *args: time.sleep(3) or real_version(*args))
    monkeypatch.setattr(runtime_module, "SNAPSHOT_WATCH_WINDOW_SECONDS", 1)
    runtime = runtime_module.Runtime(Settings(namespaces=(namespace,)))
    snapshots = runtime.snapshot_watches[namespace]
    threading.Thread(target=snapshots.run, daemon=True).start()

    def admission_step(name: str) -> bool:
        """One admission pass, on this thread as on one of the runtime's; whether `name` is Ready."""
        item = runtime.admissions.take(timeout=0.5)
        if item is not None:
            runtime._admission_pass(*item)
        return (get_checkpoint(crds, namespace, name).get("status") or {}).get("phase") == "Ready"

    for name in ("first", "second"):
        assert not snapshots.is_open
        make_checkpoint(crds, namespace, name)
        runtime.observe_checkpoint("ADDED", get_checkpoint(crds, namespace, name))
        wait_for(lambda n=name: admission_step(n), timeout=60, interval=0, what=f"checkpoint {name} Ready")
        wait_for(lambda: not snapshots.is_open, timeout=10, what="the snapshot watch closed")
