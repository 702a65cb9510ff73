"""Fork, rollback and their errors on the real control plane, with real data."""

from __future__ import annotations

import pytest
from kubernetes import client

from savepoint.eventlog import EventLog
from savepoint.models import GROUP, VERSION
from tests.conftest import wait_for
from tests.csi_data import pvc_data_dir
from tests.integration.test_checkpoint import checksums, make_checkpoint, wait_checkpoint, write_files
from tests.integration.test_session import get_session, make_session, wait_phase


def make_fork(crds, namespace: str, name: str, source: dict, target: str | None = None, mode: str = "Fork", **extra):
    spec = {"source": source, "mode": mode, **extra}
    if target:
        spec["target"] = {"sessionName": target, **spec.get("target", {})}
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Fork", "metadata": {"name": name}, "spec": spec}
    return crds.create_namespaced_custom_object(GROUP, VERSION, namespace, "forks", body)


def wait_fork(crds, namespace: str, name: str, timeout: float = 120) -> dict:
    def done():
        body = crds.get_namespaced_custom_object(GROUP, VERSION, namespace, "forks", name)
        return body if (body.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None

    return wait_for(done, timeout=timeout, what=f"fork {name} finished")


def exists(crds, namespace: str, plural: str, name: str) -> bool:
    try:
        crds.get_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)
        return True
    except client.ApiException as err:
        if err.status == 404:
            return False
        raise


def session_exists(crds, namespace: str, name: str) -> bool:
    return exists(crds, namespace, "sessions", name)


@pytest.fixture
def checkpointed(operator, core, crds, namespace):
    """Session s1 with files and a short conversation, checkpointed as c1."""
    make_session(crds, namespace, "s1")
    s1 = wait_phase(crds, namespace, "s1", "Ready", timeout=90)
    workspace = pvc_data_dir(core, namespace, s1["status"]["workspaceClaimName"])
    write_files(workspace)
    log = EventLog(core, namespace, "s1")
    log.append("user.message", {"text": "build it"})
    log.append("run.started", {"runId": "r1"})
    log.append("run.completed", {"runId": "r1"})
    wait_phase(crds, namespace, "s1", "Ready")
    make_checkpoint(crds, namespace, "c1")
    ckpt = wait_checkpoint(crds, namespace, "c1", "Ready")
    return {"workspace": workspace, "files": checksums(workspace), "log": log, "checkpoint": ckpt}


def test_rollback_restores_the_checkpoint_files_and_keeps_every_event(checkpointed, core, crds, namespace):
    workspace, log = checkpointed["workspace"], checkpointed["log"]
    through = checkpointed["checkpoint"]["status"]["throughSequence"]
    old_expiry = checkpointed["checkpoint"]["status"]["expiresAt"]
    uid = get_session(crds, namespace, "s1")["metadata"]["uid"]
    (workspace / "notes.md").write_text("after the checkpoint\n")
    (workspace / "extra.txt").write_text("new file\n")
    log.append("user.message", {"text": "undo that"})
    before = log.cursor().seq

    make_fork(crds, namespace, "rb1", {"checkpoint": "c1"}, mode="Rollback")
    fork = wait_fork(crds, namespace, "rb1")
    assert fork["status"]["phase"] == "Succeeded", fork["status"]
    body = wait_phase(crds, namespace, "s1", "Ready")
    assert body["metadata"]["uid"] == uid
    assert body["status"]["restore"]["mode"] == "snapshot"
    restored = pvc_data_dir(core, namespace, body["status"]["workspaceClaimName"])
    assert checksums(restored) == checkpointed["files"]

    events = log.read()
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert len(events) == before + 1  # nothing deleted; one session.rollback added
    rollback = events[-1]
    assert rollback.type == "session.rollback" and rollback.data["toSequence"] == through
    history = log.effective_history()
    assert history[-1].type == "session.rollback"
    assert "undo that" not in [e.data.get("text") for e in history]
    ckpt = crds.get_namespaced_custom_object(GROUP, VERSION, namespace, "checkpoints", "c1")
    assert ckpt["status"]["expiresAt"] >= old_expiry


def test_fork_from_checkpoint_has_its_own_disk_and_log(checkpointed, core, crds, namespace):
    through = checkpointed["checkpoint"]["status"]["throughSequence"]
    checkpointed["log"].append("user.message", {"text": "only in the source"})
    make_fork(crds, namespace, "f1", {"checkpoint": "c1"}, target="s2")
    fork = wait_fork(crds, namespace, "f1")
    assert fork["status"]["phase"] == "Succeeded", fork["status"]
    assert fork["status"]["restoreMode"] == "snapshot"
    s2 = wait_phase(crds, namespace, "s2", "Ready")
    assert s2["status"]["parentSession"] == "s1" and s2["status"]["forkedFromCheckpoint"] == "c1"
    fork_disk = pvc_data_dir(core, namespace, s2["status"]["workspaceClaimName"])
    assert checksums(fork_disk) == checkpointed["files"]
    (fork_disk / "notes.md").write_text("fork only\n")
    assert checksums(checkpointed["workspace"]) == checkpointed["files"]

    fork_log = EventLog(core, namespace, "s2")
    events = fork_log.read()
    source_events = checkpointed["log"].read(1, through)
    assert [(e.seq, e.id) for e in events[:through]] == [(e.seq, e.id) for e in source_events]
    assert events[through].type == "session.forked" and len(events) == through + 1
    fork_log.append("user.message", {"text": "fork speaks"})
    assert "fork speaks" not in [e.data.get("text") for e in checkpointed["log"].read()]


def test_kopf_writes_nothing_on_a_fork(checkpointed, core, crds, namespace):
    """A Fork has no kopf change handler: its passes start from its watch events, and kopf
    writes none of its progress or last-handled-configuration annotations on it (each
    was a patch of the Fork while its claim was restoring)."""
    make_fork(crds, namespace, "f1", {"checkpoint": "c1"}, target="s2")
    fork = wait_fork(crds, namespace, "f1")
    assert fork["status"]["phase"] == "Succeeded", fork["status"]
    wait_phase(crds, namespace, "s2", "Ready")
    assert not [k for k in fork["metadata"].get("annotations") or {} if k.startswith("savepoint.dev/")]
    assert {m["manager"] for m in fork["metadata"]["managedFields"]} & {"kopf"} == set()

    def reasons() -> set[str]:
        return {e.reason for e in core.list_namespaced_event(namespace, field_selector="involvedObject.name=f1").items}

    wait_for(lambda: {"Restoring", "Succeeded"} <= reasons(), what="the fork's Restoring and Succeeded Events")


def test_a_waiting_fork_is_deleted_at_once_while_the_operator_is_down(operator, crds, namespace):
    """Nothing of the operator's holds a Fork back from deletion (no finalizer, kopf's
    neither): one still waiting for its checkpoint goes at once with no operator running."""
    make_fork(crds, namespace, "f1", {"checkpoint": "not-yet"}, target="s2")

    def waiting() -> dict | None:
        body = crds.get_namespaced_custom_object(GROUP, VERSION, namespace, "forks", "f1")
        return body if (body.get("status") or {}).get("reason") == "WaitingForCheckpoint" else None

    assert not wait_for(waiting, what="the fork waiting for its checkpoint")["metadata"].get("finalizers")
    operator.stop()
    try:
        crds.delete_namespaced_custom_object(GROUP, VERSION, namespace, "forks", "f1")
        wait_for(
            lambda: not exists(crds, namespace, "forks", "f1"),
            timeout=10,
            what="the fork deleted with the operator down",
        )
    finally:
        operator.start()


def test_fork_at_event_rebuilds_from_the_log(checkpointed, core, crds, namespace):
    first = checkpointed["log"].read(1, 1)[0]
    make_fork(crds, namespace, "f2", {"session": "s1", "atEvent": first.id}, target="s3")
    fork = wait_fork(crds, namespace, "f2")
    assert fork["status"]["phase"] == "Succeeded", fork["status"]
    s3 = wait_phase(crds, namespace, "s3", "Ready")
    assert s3["status"]["restore"]["mode"] == "event_log_rebuild"
    assert checksums(pvc_data_dir(core, namespace, s3["status"]["workspaceClaimName"])) == {}
    events = EventLog(core, namespace, "s3").read()
    assert [e.id for e in events[:1]] == [first.id] and events[1].type == "session.forked"


def test_fork_latest_uses_the_newest_checkpoint(checkpointed, core, crds, namespace):
    make_fork(crds, namespace, "f3", {"session": "s1"}, target="s4")
    fork = wait_fork(crds, namespace, "f3")
    assert fork["status"]["restoreMode"] == "snapshot" and fork["status"]["phase"] == "Succeeded"


def test_expired_checkpoint_is_never_downgraded(checkpointed, crds, namespace):
    make_checkpoint(crds, namespace, "brief", ttl="2s")
    wait_checkpoint(crds, namespace, "brief", "Expired", timeout=60)
    make_fork(crds, namespace, "f-exp", {"checkpoint": "brief"}, target="never")
    fork = wait_fork(crds, namespace, "f-exp")
    assert (fork["status"]["phase"], fork["status"]["reason"]) == ("Failed", "CheckpointExpired")
    assert not session_exists(crds, namespace, "never")


def test_missing_and_existing_targets(checkpointed, crds, namespace):
    make_fork(crds, namespace, "f-missing", {"checkpoint": "nope"}, target="x1")
    assert wait_fork(crds, namespace, "f-missing")["status"]["reason"] == "CheckpointNotFound"
    make_fork(crds, namespace, "f-exists", {"checkpoint": "c1"}, target="s1")
    assert wait_fork(crds, namespace, "f-exists")["status"]["reason"] == "TargetExists"


def test_rollback_while_busy_is_refused(checkpointed, crds, namespace):
    checkpointed["log"].append("run.started", {"runId": "r2"})
    wait_phase(crds, namespace, "s1", "Running")
    make_fork(crds, namespace, "rb-busy", {"checkpoint": "c1"}, mode="Rollback")
    assert wait_fork(crds, namespace, "rb-busy")["status"]["reason"] == "SessionBusy"


def test_history_unavailable(checkpointed, core, crds, namespace):
    log = checkpointed["log"]
    first = log.read(1, 1)[0]
    log.append("user.message", {"text": "secret"}, subject="alice")
    log.erase("alice")
    make_fork(crds, namespace, "f-erased", {"session": "s1", "atEvent": str(log.cursor().seq)}, target="x2")
    fork = wait_fork(crds, namespace, "f-erased")
    assert fork["status"]["reason"] == "SessionHistoryUnavailable"
    assert not session_exists(crds, namespace, "x2")
    assert first.seq == 1


def _pause(crds, namespace, name, mode):
    crds.patch_namespaced_custom_object(GROUP, VERSION, namespace, "sessions", name, {"spec": {"operatingMode": mode}})


def _reclaimed(crds, namespace, name) -> str:
    def done():
        status = get_session(crds, namespace, name).get("status") or {}
        return status.get("reclaimedCheckpoint") if status.get("phase") == "Paused" else None

    return wait_for(done, timeout=120, what=f"session {name} paused with its workspace reclaimed")


def test_resume_restores_a_reclaimed_workspace(operator, core, crds, namespace):
    make_session(crds, namespace, "r1", workspace={"size": "64Mi", "reclaimOnPause": True})
    body = wait_phase(crds, namespace, "r1", "Ready", timeout=90)
    old_claim = body["status"]["workspaceClaimName"]
    workspace = pvc_data_dir(core, namespace, old_claim)
    write_files(workspace)
    files = checksums(workspace)
    _pause(crds, namespace, "r1", "Paused")
    checkpoint = _reclaimed(crds, namespace, "r1")
    wait_for(
        lambda: (
            old_claim not in {c.metadata.name for c in core.list_namespaced_persistent_volume_claim(namespace).items}
        ),
        timeout=60,
        what="the paused session's claim deleted",
    )
    _pause(crds, namespace, "r1", "Running")
    body = wait_phase(crds, namespace, "r1", "Ready", timeout=90)
    assert body["status"]["restore"]["mode"] == "snapshot" and body["status"]["restore"]["checkpoint"] == checkpoint
    assert checksums(pvc_data_dir(core, namespace, body["status"]["workspaceClaimName"])) == files


def test_resume_after_expiry_rebuilds_from_the_log(operator, core, crds, namespace):
    core.patch_namespace(namespace, {"metadata": {"annotations": {"savepoint.dev/checkpoint-ttl": "3s"}}})
    make_session(crds, namespace, "r2", workspace={"size": "64Mi", "reclaimOnPause": True})
    wait_phase(crds, namespace, "r2", "Ready", timeout=90)
    EventLog(core, namespace, "r2").append("user.message", {"text": "remember me"})
    _pause(crds, namespace, "r2", "Paused")
    checkpoint = _reclaimed(crds, namespace, "r2")
    wait_checkpoint(crds, namespace, checkpoint, "Expired", timeout=60)
    _pause(crds, namespace, "r2", "Running")
    body = wait_phase(crds, namespace, "r2", "Ready", timeout=90)
    assert body["status"]["restore"]["mode"] == "event_log_rebuild"
    assert body["status"]["restore"]["reason"] == "checkpoint_expired"
    events = EventLog(core, namespace, "r2").read()
    assert events[-1].type == "session.rebuilt" and "remember me" in [e.data.get("text") for e in events]


def test_rollback_interrupted_after_the_new_claim_completes_exactly_once(checkpointed, operator, core, crds, namespace):
    operator.stop()
    operator.start(SAVEPOINT_FAILPOINTS="rollback.after_claim_created")
    (checkpointed["workspace"] / "notes.md").write_text("changed\n")
    make_fork(crds, namespace, "rb-crash", {"checkpoint": "c1"}, mode="Rollback")
    assert operator.wait_exit(90, "rollback.after_claim_created") == -9
    pods = core.list_namespaced_pod(namespace, label_selector="savepoint.dev/session=s1").items
    assert all(p.metadata.deletion_timestamp for p in pods)  # the Pod is gone or going; no swap yet
    operator.start()
    fork = wait_fork(crds, namespace, "rb-crash")
    assert fork["status"]["phase"] == "Succeeded", fork["status"]
    body = wait_phase(crds, namespace, "s1", "Ready")
    rollbacks = [e for e in checkpointed["log"].read() if e.type == "session.rollback"]
    assert len(rollbacks) == 1
    claims = core.list_namespaced_persistent_volume_claim(namespace, label_selector="savepoint.dev/session=s1").items

    def one_claim():
        live = [
            c.metadata.name
            for c in core.list_namespaced_persistent_volume_claim(
                namespace, label_selector="savepoint.dev/session=s1"
            ).items
            if not c.metadata.deletion_timestamp
        ]
        return live == [body["status"]["workspaceClaimName"]]

    wait_for(one_claim, timeout=60, what="exactly one workspace claim")
    assert claims  # the session kept a claim throughout
    assert checksums(pvc_data_dir(core, namespace, body["status"]["workspaceClaimName"])) == checkpointed["files"]


def test_restore_ms_runs_from_the_fork_to_the_target_ready(checkpointed, crds, namespace):
    """usage.restoreMs of a forked session spans the whole restore (disk clone, log copy,
    Pod start), as this test's own clock sees it, not one pass of the controller."""
    import time

    asked = time.time()
    make_fork(crds, namespace, "f-timed", {"checkpoint": "c1"}, target="t-timed")
    made = wait_for(lambda: session_exists(crds, namespace, "t-timed"), timeout=60, interval=0.05, what="target made")
    seen_made = time.time()
    assert made
    body = wait_for(
        lambda: (lambda b: b if (b.get("status") or {}).get("phase") == "Ready" else None)(
            get_session(crds, namespace, "t-timed")
        ),
        timeout=120,
        interval=0.05,
        what="target Ready",
    )
    seen_ready = time.time()
    took = body["status"]["usage"]["restoreMs"]
    # At least from when the target certainly existed to when it was certainly not yet
    # Ready (one poll before); at most from the Fork's creation to Ready being seen.
    assert took >= (seen_ready - seen_made) * 1000 - 300, (took, seen_ready - seen_made)
    assert took <= (seen_ready - asked) * 1000 + 500, (took, seen_ready - asked)
