"""Table tests of whole Fork passes (forks and rollbacks) against the in-memory API."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from kubernetes.client.exceptions import ApiException

from savepoint.config import Settings
from savepoint.constants import API_VERSION, FORK_ANNOTATION, RESTORING_ANNOTATION, SESSION_LABEL
from savepoint.controllers.fork import reconcile_fork
from savepoint.eventlog import EventLog
from savepoint.fork import target_claim_name
from tests.unit.fake_api import FakeAPI

NS = "team"
SETTINGS = Settings()


@pytest.fixture
def api(monkeypatch) -> FakeAPI:
    return FakeAPI().install(monkeypatch)


def session(name: str = "s", phase: str = "Ready", claim: str | None = None) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": "Session",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}"},
        "spec": {"harness": {"name": "agent", "revision": "r1"}},
        "status": {"phase": phase, "workspaceClaimName": claim or f"{name}-workspace"},
    }


def checkpoint(name: str, phase: str = "Ready", through: int = 2, event_id: str | None = "e2") -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": "Checkpoint",
        "metadata": {"name": name, "namespace": NS, "labels": {SESSION_LABEL: "s"}},
        "spec": {"sessionName": "s"},
        "status": {
            "phase": phase,
            "volumeSnapshotName": f"sp-{name}",
            "throughSequence": through,
            "throughEventId": event_id,
            "expiresAt": "2126-01-02T00:00:00Z",
        },
    }


def fork(source: dict, mode: str = "Fork", target: str | None = "t") -> dict:
    spec: dict = {"source": source, "mode": mode}
    if target:
        spec["target"] = {"sessionName": target}
    return {
        "apiVersion": API_VERSION,
        "kind": "Fork",
        "metadata": {"name": "f", "namespace": NS, "uid": "uid-f", "generation": 1},
        "spec": spec,
    }


def log(api: FakeAPI, name: str = "s") -> EventLog:
    return EventLog(api.core(), NS, name)


def world(api: FakeAPI, events: int = 3, checkpoints: list[dict] = ()) -> list:
    api.add("namespaces", {"metadata": {"name": NS}})
    api.add("sessions", session())
    written = [log(api).append("message", {"n": n}) for n in range(1, events + 1)]
    for body in checkpoints:
        api.add("checkpoints", body)
    return written


def fork_status(api: FakeAPI) -> dict:
    return api.get("forks", NS, "f").get("status") or {}


@dataclass
class Case:
    id: str
    source: dict
    checkpoints: list[dict] = field(default_factory=list)
    phase: str = "Restoring"
    reason: str | None = None
    restore: str | None = None
    through: int | None = None
    checkpoint: str | None = None
    target_source: dict | None = None


PLANS = [
    Case(
        "from a ready checkpoint",
        {"checkpoint": "cp"},
        [checkpoint("cp")],
        restore="snapshot",
        through=2,
        checkpoint="cp",
        target_source={"checkpoint": "cp"},
    ),
    Case(
        "from a session: its newest ready checkpoint",
        {"session": "s"},
        [checkpoint("old", through=1), checkpoint("new", through=3), checkpoint("bad", phase="Failed", through=9)],
        restore="snapshot",
        through=3,
        checkpoint="new",
        target_source={"checkpoint": "new"},
    ),
    Case(
        "from a session without checkpoints: its whole log",
        {"session": "s"},
        restore="event_log_rebuild",
        through=3,
        target_source={"session": "s"},
    ),
    Case(
        "at an event",
        {"session": "s", "atEvent": "2"},
        restore="event_log_rebuild",
        through=2,
        target_source={"session": "s", "atEvent": "2"},
    ),
    Case("at an event the log does not have", {"session": "s", "atEvent": "7"}, phase="Failed", reason="EventNotFound"),
    Case("from a session that is not there", {"session": "ghost"}, phase="Failed", reason="SessionNotFound"),
    Case(
        "from an expired checkpoint",
        {"checkpoint": "cp"},
        [checkpoint("cp", phase="Expired")],
        phase="Failed",
        reason="CheckpointExpired",
    ),
    Case(
        "from a failed checkpoint",
        {"checkpoint": "cp"},
        [checkpoint("cp", phase="Failed")],
        phase="Failed",
        reason="CheckpointNotReady",
    ),
    Case(
        "from a pending checkpoint: waits",
        {"checkpoint": "cp"},
        [checkpoint("cp", phase="Pending")],
        phase="Pending",
        reason="WaitingForCheckpoint",
    ),
    Case(
        "from a checkpoint not created yet: waits", {"checkpoint": "cp"}, phase="Pending", reason="WaitingForCheckpoint"
    ),
]


@pytest.mark.parametrize("case", PLANS, ids=lambda c: c.id)
def test_fork_plan(api, case):
    world(api, checkpoints=case.checkpoints)
    api.add("forks", fork(case.source))
    reconcile_fork(NS, "f", SETTINGS)
    got = fork_status(api)
    assert (got["phase"], got.get("reason")) == (case.phase, case.reason)
    if case.restore is None:
        assert api.names("sessions") == ["s"]  # nothing is made before the source resolves
        return
    plan = got["plan"]
    assert (plan["restore"], plan["through_sequence"], plan.get("checkpoint")) == (
        case.restore,
        case.through,
        case.checkpoint,
    )
    target = api.get("sessions", NS, "t")
    assert target["spec"]["source"] == case.target_source
    assert target["metadata"]["annotations"][FORK_ANNOTATION] == "uid-f"
    assert target["metadata"]["annotations"]["savepoint.dev/through-sequence"] == str(case.through)
    assert target["spec"]["harness"]["name"] == "agent"


def test_the_plan_is_pinned_and_the_fork_succeeds_when_its_target_is_ready(api):
    world(api)
    api.add("forks", fork({"session": "s"}))
    reconcile_fork(NS, "f", SETTINGS)
    log(api).append("message", {"n": 4})  # the log moves on: the pinned plan does not
    reconcile_fork(NS, "f", SETTINGS)
    assert fork_status(api)["plan"]["through_sequence"] == 3
    assert fork_status(api)["phase"] == "Restoring"
    api.patch("sessions", NS, "t", {"status": {"phase": "Ready"}}, status=True)
    reconcile_fork(NS, "f", SETTINGS)
    got = fork_status(api)
    assert (got["phase"], got["targetSession"]) == ("Succeeded", "t")
    assert got["conditions"][0]["status"] == "True"
    reconcile_fork(NS, "f", SETTINGS)  # terminal: no more writes
    assert api.writes()[-1].verb == "patch_status" and fork_status(api)["phase"] == "Succeeded"


def test_a_fork_made_just_after_its_source_changed_copies_the_change_though_the_watch_lags(api):
    from savepoint.controllers import cache

    world(api)
    cache.sessions.put(api.get("sessions", NS, "s"))  # the watch's copy: revision r1
    api.patch("sessions", NS, "s", {"spec": {"harness": {"revision": "r2"}}})
    api.create("forks", NS, fork({"session": "s"}))
    reconcile_fork(NS, "f", SETTINGS)
    assert api.get("sessions", NS, "t")["spec"]["harness"]["revision"] == "r2"


def test_a_target_of_that_name_made_by_someone_else_fails_the_fork(api):
    world(api)
    api.add("sessions", session("t"))
    api.add("forks", fork({"session": "s"}))
    reconcile_fork(NS, "f", SETTINGS)
    assert (fork_status(api)["phase"], fork_status(api)["reason"]) == ("Failed", "TargetExists")


def test_a_target_the_api_server_refuses_fails_the_fork_with_its_reason(api):
    world(api)
    api.add("forks", fork({"session": "s"}))
    api.fail("create", "sessions", 422, reason="Invalid")
    reconcile_fork(NS, "f", SETTINGS)
    got = fork_status(api)
    assert (got["phase"], got["reason"]) == ("Failed", "InvalidTarget")
    assert got["message"].startswith("the API server refused session t")


def test_a_server_error_creating_the_target_is_raised_and_a_rerun_converges(api):
    world(api)
    api.add("forks", fork({"session": "s"}))
    api.fail("create", "sessions", 500)
    with pytest.raises(ApiException):
        reconcile_fork(NS, "f", SETTINGS)
    assert fork_status(api)["phase"] == "Pending" and "t" not in api.names("sessions")
    reconcile_fork(NS, "f", SETTINGS)
    assert fork_status(api)["phase"] == "Restoring" and "t" in api.names("sessions")


def test_a_fork_asks_for_its_targets_restored_claim_as_it_makes_the_target(api):
    """The restore is a fork's longest step: the claim is asked for right after the target
    Session, before the Session's own first pass (which finds it made)."""
    world(api, checkpoints=[checkpoint("cp")])
    api.add("forks", fork({"checkpoint": "cp"}))
    reconcile_fork(NS, "f", SETTINGS)
    claim = api.get("persistentvolumeclaims", NS, "t-workspace")
    assert claim["spec"]["dataSource"] == {
        "apiGroup": "snapshot.storage.k8s.io",
        "kind": "VolumeSnapshot",
        "name": "sp-cp",
    }
    assert claim["metadata"]["ownerReferences"][0]["uid"] == api.get("sessions", NS, "t")["metadata"]["uid"]
    # Right after the target (the plan's pin goes beside the target's create), before the
    # Fork's Restoring status.
    made = [(r.verb, r.kind) for r in api.writes() if r.kind != "forks"]
    assert made[made.index(("create", "sessions")) + 1] == ("create", "persistentvolumeclaims")
    last = [r for r in api.writes() if r.kind in ("forks", "persistentvolumeclaims")][-2:]
    assert [r.kind for r in last] == ["persistentvolumeclaims", "forks"]
    assert fork_status(api)["phase"] == "Restoring" and fork_status(api)["plan"]["checkpoint"] == "cp"


def test_a_plan_from_a_checkpoint_is_pinned_in_the_restoring_status_and_a_lost_one_written_again(api):
    """A Ready checkpoint resolves the same on every pass: its plan is pinned in the one
    status write the fork makes while its target restores (Restoring), not in one of its
    own before it; a pass that lost that write makes it again."""
    world(api, checkpoints=[checkpoint("cp")])
    api.add("forks", fork({"checkpoint": "cp"}))
    api.fail("patch_status", "forks", 500)
    with pytest.raises(ApiException):
        reconcile_fork(NS, "f", SETTINGS)
    assert "t" in api.names("sessions") and "plan" not in fork_status(api)
    reconcile_fork(NS, "f", SETTINGS)
    status = fork_status(api)
    assert (status["plan"]["checkpoint"], status["phase"], status["targetSession"]) == ("cp", "Restoring", "t")
    assert [r.verb for r in api.writes() if r.kind == "forks"] == ["patch_status", "patch_status"]
    assert api.get("sessions", NS, "t")["metadata"]["annotations"][FORK_ANNOTATION] == "uid-f"
    api.patch("sessions", NS, "t", {"status": {"phase": "Ready"}}, status=True)
    reconcile_fork(NS, "f", SETTINGS)
    assert (fork_status(api)["phase"], fork_status(api)["targetSession"]) == ("Succeeded", "t")


def test_a_plan_from_the_newest_checkpoint_is_pinned_before_anything_is_made(api):
    """{session: S} resolves to S's newest Ready checkpoint, which a later pass may find
    newer: its plan is pinned before the target is made."""
    world(api, checkpoints=[checkpoint("cp")])
    api.add("forks", fork({"session": "s"}))
    api.fail("patch_status", "forks", 500)
    with pytest.raises(ApiException):
        reconcile_fork(NS, "f", SETTINGS)
    assert api.names("sessions") == ["s"]


def test_a_fork_rebuilt_from_the_log_alone_leaves_its_claim_to_the_session(api):
    world(api)
    api.add("forks", fork({"session": "s", "atEvent": "2"}))
    reconcile_fork(NS, "f", SETTINGS)
    assert "t" in api.names("sessions") and api.names("persistentvolumeclaims") == []


# --- rollback -------------------------------------------------------------------------


def rollback_world(api: FakeAPI) -> str:
    world(api, events=4, checkpoints=[checkpoint("cp", through=2)])
    api.add("pods", {"metadata": {"name": "s", "namespace": NS}})
    api.add(
        "persistentvolumeclaims", {"metadata": {"name": "s-workspace", "namespace": NS, "labels": {SESSION_LABEL: "s"}}}
    )
    api.add("forks", fork({"checkpoint": "cp"}, mode="Rollback", target=None))
    return target_claim_name("s", "f")


def test_a_rollback_claims_the_session_swaps_its_disk_and_logs_once(api):
    claim = rollback_world(api)
    reconcile_fork(NS, "f", SETTINGS)
    s = api.get("sessions", NS, "s")
    assert s["metadata"]["annotations"][RESTORING_ANNOTATION] == "f"
    new = api.get("persistentvolumeclaims", NS, claim)
    assert new["spec"]["dataSource"] == {
        "apiGroup": "snapshot.storage.k8s.io",
        "kind": "VolumeSnapshot",
        "name": "sp-cp",
    }
    assert fork_status(api)["phase"] == "Restoring"
    assert api.names("pods") == []  # the Pod goes first, in the same pass
    reconcile_fork(NS, "f", SETTINGS)  # the new claim is not Bound yet: wait
    assert api.get("sessions", NS, "s")["status"]["workspaceClaimName"] == "s-workspace"

    api.patch("persistentvolumeclaims", NS, claim, {"status": {"phase": "Bound"}})
    api.fail("patch", "sessions", 500)  # the hand-back fails once, after the swap
    with pytest.raises(ApiException):
        reconcile_fork(NS, "f", SETTINGS)
    reconcile_fork(NS, "f", SETTINGS)
    s = api.get("sessions", NS, "s")
    assert s["status"]["workspaceClaimName"] == claim
    assert RESTORING_ANNOTATION not in (s["metadata"].get("annotations") or {})
    rollbacks = [e for e in log(api).read() if e.type == "session.rollback"]
    assert [(e.data["toSequence"], e.data["fork"]) for e in rollbacks] == [(2, "uid-f")]

    # The checkpoint's expiry starts again once the Session is back, with the Fork's success;
    # the old claim is deleted then too, not while the new Pod starts.
    assert api.get("checkpoints", NS, "cp")["status"]["expiresAt"] == "2126-01-02T00:00:00Z"
    assert sorted(api.names("persistentvolumeclaims")) == sorted([claim, "s-workspace"])
    reconcile_fork(NS, "f", SETTINGS)
    assert fork_status(api)["phase"] == "Succeeded"
    assert api.names("persistentvolumeclaims") == [claim]
    assert api.get("checkpoints", NS, "cp")["status"]["expiresAt"] != "2126-01-02T00:00:00Z"


def test_a_rollback_releases_the_old_claim_once_the_session_is_back_or_has_failed(api):
    """The swapped-out claim outlives the new Pod's start (its deletion is the CSI driver's
    work on the same cores), and goes once the Session is back, or has failed on the new
    one: the Fork then fails too, saying why, instead of staying Restoring."""
    from savepoint.controllers import cache

    claim = rollback_world(api)
    reconcile_fork(NS, "f", SETTINGS)
    api.patch("persistentvolumeclaims", NS, claim, {"status": {"phase": "Bound"}})
    cache.sessions.put(api.patch("sessions", NS, "s", {"status": {"phase": "Provisioning"}}, status=True))
    reconcile_fork(NS, "f", SETTINGS)  # swapped and handed back, the Session not yet back
    assert sorted(api.names("persistentvolumeclaims")) == sorted([claim, "s-workspace"])
    cache.sessions.put(api.get("sessions", NS, "s"))
    reconcile_fork(NS, "f", SETTINGS)
    assert sorted(api.names("persistentvolumeclaims")) == sorted([claim, "s-workspace"])
    failed = {"phase": "Failed", "conditions": [{"type": "Ready", "status": "False", "message": "no such image"}]}
    cache.sessions.put(api.patch("sessions", NS, "s", {"status": failed}, status=True))
    reconcile_fork(NS, "f", SETTINGS)
    assert api.names("persistentvolumeclaims") == [claim]
    status = fork_status(api)
    assert (status["phase"], status["reason"]) == ("Failed", "SessionNotReady")
    assert status["message"] == "session s failed on the restored workspace: no such image"


def test_the_pass_that_starts_the_pod_after_a_swap_reads_nothing_of_the_namespace(api):
    """The Pod's Pod Security check reads the namespace's labels (kept 5 s): a copy gone
    stale while the claim restored is read beside the swap, not by the pass after it."""
    from savepoint.controllers import cache
    from savepoint.controllers.session import reconcile_session

    claim = rollback_world(api)
    template = {"spec": {"containers": [{"name": "agent", "image": "agent:1"}]}}
    api.patch("sessions", NS, "s", {"spec": {"podTemplate": template}})
    reconcile_fork(NS, "f", SETTINGS)
    api.patch("persistentvolumeclaims", NS, claim, {"status": {"phase": "Bound"}})
    cache._namespaces.clear()  # the copy kept went stale while the claim restored
    reads: list[tuple[str, str]] = []

    def swapped(name: str) -> None:
        api.requests.clear()
        reconcile_session(NS, name, SETTINGS)
        reads.extend((r.verb, r.kind) for r in api.requests if r.verb in ("get", "list"))

    reconcile_fork(NS, "f", SETTINGS, swapped=swapped)
    assert "s" in api.names("pods")
    assert ("get", "namespaces") not in reads


@pytest.mark.parametrize("erased", [False, True], ids=["as read", "an event erased meanwhile"])
def test_after_the_swap_the_pass_that_starts_the_pod_reads_no_whole_log(api, monkeypatch, erased):
    """The events through the target, read while the claim restored, fold the rollback into
    the digest the Session's passes keep: the pass after the swap lists no chunks, and its
    status reads as a whole read would. An event erased since that read voids it."""
    from savepoint import eventlog
    from savepoint.controllers import cache, logview
    from savepoint.controllers import fork as forks
    from savepoint.controllers.session import reconcile_session
    from savepoint.logdigest import Digest

    monkeypatch.setattr(eventlog, "on_chunk", cache.chunks.put)  # as the operator starts
    claim = rollback_world(api)
    template = {"spec": {"containers": [{"name": "agent", "image": "agent:1"}]}}
    api.patch("sessions", NS, "s", {"spec": {"podTemplate": template}})
    view = logview.observe(api.get("sessions", NS, "s"), log(api))  # as a Session pass keeps it
    api.patch("sessions", NS, "s", {"status": {"eventLog": {"chunks": view.chunks}}}, status=True)
    reconcile_fork(NS, "f", SETTINGS)
    forks._targets[(NS, "f")].result()
    if erased:
        first = log(api).read(1, 1)[0].to_json()
        assert '"n":1' in first
        erasure = {"data": {"000000000001": first.replace('"n":1', '"n":0')}}
        cache.chunks.observe("MODIFIED", api.patch("configmaps", NS, "s-log-000001", erasure))
    api.patch("persistentvolumeclaims", NS, claim, {"status": {"phase": "Bound"}})
    lists: list[str] = []

    def swapped(name: str) -> None:
        api.requests.clear()
        reconcile_session(NS, name, SETTINGS)
        lists.extend(r.name for r in api.requests if (r.verb, r.kind) == ("list", "configmaps"))

    reconcile_fork(NS, "f", SETTINGS, swapped=swapped)
    assert "s" in api.names("pods")
    assert bool(lists) == erased
    whole = Digest.of(log(api).read())
    written = api.get("sessions", NS, "s")["status"]
    assert (written["eventLog"]["lastSequence"], written["eventLog"]["lastEventId"]) == whole.cursor
    assert whole.cursor[0] == 5 and cache.log_views.get(NS, "s").digest == whole


def test_the_pod_starts_on_the_restored_claim_once_swapped_and_recorded_not_before(api):
    """Told of the swap, the Session's pass starts the Pod on the restored claim while the
    hold is still on (the hand-back goes on beside it); a hold that this process has not
    seen swapped (a restart) keeps the Pod away until the hand-back."""
    from savepoint.controllers import cache
    from savepoint.controllers.fork import forget_rollback
    from savepoint.controllers.session import reconcile_session

    claim = rollback_world(api)
    template = {"spec": {"containers": [{"name": "agent", "image": "agent:1"}]}}
    api.patch("sessions", NS, "s", {"spec": {"podTemplate": template}})
    reconcile_fork(NS, "f", SETTINGS)
    api.patch("persistentvolumeclaims", NS, claim, {"status": {"phase": "Bound"}})
    seen: list[tuple] = []

    def swapped(name: str) -> None:
        held = api.get("sessions", NS, name)
        recorded = [e.type for e in log(api).read()][-1]
        reconcile_session(NS, name, SETTINGS)
        pod = api.get("pods", NS, name)
        volumes = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["spec"]["volumes"]}
        seen.append((held["metadata"]["annotations"].get(RESTORING_ANNOTATION), recorded, claim in volumes.values()))

    api.fail("patch", "sessions", 500)  # the hand-back fails once, after the swap and the Pod
    with pytest.raises(ApiException):
        reconcile_fork(NS, "f", SETTINGS, swapped=swapped)
    assert seen == [("f", "session.rollback", True)]
    made = api.get("pods", NS, "s")["metadata"]["uid"]

    # A restart right then: the pass sees the hold and the swap, not that this process swapped.
    forget_rollback(NS, "f")
    cache.clear()
    reconcile_session(NS, "s", SETTINGS)
    assert api.names("pods") == []  # the hold keeps it away
    reconcile_fork(NS, "f", SETTINGS)  # the retried pass goes straight to the hand-back
    assert RESTORING_ANNOTATION not in (api.get("sessions", NS, "s")["metadata"].get("annotations") or {})
    reconcile_session(NS, "s", SETTINGS)
    assert api.get("pods", NS, "s")["metadata"]["uid"] != made
    assert [e.type for e in log(api).read()].count("session.rollback") == 1


@pytest.mark.parametrize(
    ("events", "phase", "reason"),
    [
        (["run.started"], "Ready", "SessionBusy"),
        ([], "Running", "SessionBusy"),
        ([], "Provisioning", "SessionNotReady"),
    ],
)
def test_a_rollback_of_a_session_that_is_busy_or_not_ready_fails_untouched(api, events, phase, reason):
    rollback_world(api)
    api.patch("sessions", NS, "s", {"status": {"phase": phase}}, status=True)
    for kind in events:
        log(api).append(kind, {"runId": "r"})
    reconcile_fork(NS, "f", SETTINGS)
    assert (fork_status(api)["phase"], fork_status(api)["reason"]) == ("Failed", reason)
    assert RESTORING_ANNOTATION not in (api.get("sessions", NS, "s")["metadata"].get("annotations") or {})
    assert api.names("persistentvolumeclaims") == ["s-workspace"]


def test_a_rollback_checks_the_newest_chunk_afresh_for_a_run_not_the_whole_log(api):
    """With the digest the Session's passes keep, the run-in-flight check reads the newest
    chunk by name (a list would wait for the API server's cache): a run started since the
    digest was made still refuses the rollback."""
    from savepoint.controllers import logview

    rollback_world(api)
    view = logview.observe(api.get("sessions", NS, "s"), log(api))  # as a Session pass keeps it
    api.patch("sessions", NS, "s", {"status": {"eventLog": {"chunks": view.chunks}}}, status=True)
    log(api).append("run.started", {"runId": "r"})
    api.requests.clear()
    reconcile_fork(NS, "f", SETTINGS)
    assert (fork_status(api)["phase"], fork_status(api)["reason"]) == ("Failed", "SessionBusy")
    assert [r for r in api.requests if (r.verb, r.kind) == ("list", "configmaps")] == []
    assert ("get", "configmaps") in [(r.verb, r.kind) for r in api.requests]


def test_a_rollback_deletes_the_old_pod_beside_its_restoring_status(api):
    claim = rollback_world(api)
    reconcile_fork(NS, "f", SETTINGS)
    assert api.names("pods") == [] and fork_status(api)["phase"] == "Restoring"
    assert claim in api.names("persistentvolumeclaims")


def test_a_rollback_asks_for_its_claim_before_it_checks_the_log_and_holds_the_session(api):
    """The claim's binding is the rollback's longest step: it starts before the rest."""
    claim = rollback_world(api)
    api.requests.clear()
    reconcile_fork(NS, "f", SETTINGS)
    order = [(r.verb, r.kind, r.name) for r in api.requests]
    made = order.index(("create", "persistentvolumeclaims", claim))
    assert made < order.index(("patch", "sessions", "s"))  # the hold
    assert all(kind != "configmaps" for _, kind, _ in order[:made])  # the log's check


@pytest.mark.parametrize("restarted", [False, True], ids=["held here", "held before a restart"])
def test_a_rollback_waiting_for_its_claim_reads_nothing_then_swaps(api, restarted):
    """While the watches show the old Pod going or gone and the new claim unbound, each
    pass a Session, Pod or claim event brings makes no request. The one that finds the Pod
    gone and the claim Bound swaps from those copies when this process placed the hold (no
    pass of the Session here makes a Pod while it is held), and reads the Session and its
    Pod afresh first when the hold is older than the process."""
    from savepoint.controllers import cache
    from savepoint.controllers.fork import forget_rollback

    claim = rollback_world(api)
    pod = api.get("pods", NS, "s")
    reconcile_fork(NS, "f", SETTINGS)
    if restarted:
        forget_rollback(NS, "f")
    cache.claims.observe("ADDED", api.get("persistentvolumeclaims", NS, claim))
    # The old Pod stopping (a real kubelet takes seconds): each of its events asks again.
    cache.pods.observe(
        "MODIFIED", {**pod, "metadata": {**pod["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    )
    api.requests.clear()
    reconcile_fork(NS, "f", SETTINGS)
    assert api.requests == []
    cache.pods.observe("DELETED", pod)
    reconcile_fork(NS, "f", SETTINGS)
    reconcile_fork(NS, "f", SETTINGS)
    assert api.requests == []

    api.patch("persistentvolumeclaims", NS, claim, {"status": {"phase": "Bound"}})
    cache.claims.observe("MODIFIED", api.get("persistentvolumeclaims", NS, claim))
    api.requests.clear()
    reconcile_fork(NS, "f", SETTINGS)
    reads = {(r.verb, r.kind) for r in api.requests} & {("get", "pods"), ("get", "sessions")}
    assert reads == ({("get", "pods"), ("get", "sessions")} if restarted else set())
    assert api.get("sessions", NS, "s")["status"]["workspaceClaimName"] == claim


def test_a_rollback_asks_for_its_claim_beside_its_fresh_reads_when_the_watch_shows_the_session(api):
    from savepoint.controllers import cache

    claim = rollback_world(api)
    cache.sessions.observe("ADDED", api.get("sessions", NS, "s"))
    api.requests.clear()
    reconcile_fork(NS, "f", SETTINGS)
    creates = [r for r in api.requests if (r.verb, r.kind) == ("create", "persistentvolumeclaims")]
    assert [r.name for r in creates] == [claim]  # asked for once, not again after the reads
    assert api.get("sessions", NS, "s")["metadata"]["annotations"][RESTORING_ANNOTATION] == "f"
    # One status write beside them, Restoring with the plan pinned in it (not Pending, then
    # Restoring, while the claim restores), and its Event once.
    assert [r.verb for r in api.writes() if r.kind == "forks"] == ["patch_status"]
    status = fork_status(api)
    assert (status["phase"], status["targetSession"], status["plan"]["checkpoint"]) == ("Restoring", "s", "cp")
    assert [reason for name, reason, *_ in api.events if name == "f"] == ["Restoring"]


def test_a_rollback_whose_session_was_made_again_takes_its_early_claim_away(api):
    """The watch's copy is of an older Session of the same name: the claim asked for beside
    the fresh reads is that one's, so it is deleted, and nothing is held."""
    from savepoint.controllers import cache

    claim = rollback_world(api)
    older = api.get("sessions", NS, "s")
    cache.sessions.observe("ADDED", {**older, "metadata": {**older["metadata"], "uid": "uid-older"}})
    reconcile_fork(NS, "f", SETTINGS)
    assert claim not in api.names("persistentvolumeclaims")
    assert RESTORING_ANNOTATION not in (api.get("sessions", NS, "s")["metadata"].get("annotations") or {})
    assert fork_status(api).get("phase") != "Failed"


def test_a_rollback_refused_after_a_restart_takes_away_the_claim_an_earlier_pass_made(api):
    claim = rollback_world(api)
    # A pass made the claim and stopped before the hold; meanwhile a run started.
    api.add("persistentvolumeclaims", {"metadata": {"name": claim, "namespace": NS, "labels": {SESSION_LABEL: "s"}}})
    api.patch("sessions", NS, "s", {"status": {"phase": "Running"}}, status=True)
    reconcile_fork(NS, "f", SETTINGS)
    assert (fork_status(api)["phase"], fork_status(api)["reason"]) == ("Failed", "SessionBusy")
    assert api.names("persistentvolumeclaims") == ["s-workspace"]
