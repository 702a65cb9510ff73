"""Table tests of whole Session passes against the in-memory API: what a pass makes, and
the phase it writes from the claim, the Pod and the log it finds."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from kubernetes.client.exceptions import ApiException

from savepoint.config import Settings
from savepoint.constants import API_VERSION
from savepoint.controllers.session import reconcile_session
from savepoint.eventlog import EventLog
from savepoint.session import build_pod
from tests.unit.fake_api import FakeAPI

NS = "team"
SETTINGS = Settings()
TEMPLATE = {"spec": {"containers": [{"name": "agent", "image": "agent:1"}]}}


@pytest.fixture
def api(monkeypatch) -> FakeAPI:
    return FakeAPI().install(monkeypatch)


def session(mode: str = "Running", template: dict | None = None) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": "Session",
        "metadata": {"name": "s", "namespace": NS, "uid": "uid-s", "generation": 1},
        "spec": {"harness": {"name": "agent"}, "podTemplate": template or TEMPLATE, "operatingMode": mode},
    }


def owned(name: str, **rest) -> dict:
    owner = {"apiVersion": API_VERSION, "kind": "Session", "name": "s", "uid": "uid-s", "controller": True}
    return {"metadata": {"name": name, "namespace": NS, "ownerReferences": [owner]}, **rest}


def container(waiting: str | None = None) -> dict:
    state = {"waiting": {"reason": waiting, "message": "no such image"}} if waiting else {"running": {}}
    return {"name": "agent", "image": "agent:1", "state": state}


def status(api: FakeAPI) -> dict:
    return api.get("sessions", NS, "s").get("status") or {}


def ready_reason(api: FakeAPI) -> str:
    return next(c["reason"] for c in status(api)["conditions"] if c["type"] == "Ready")


@dataclass
class Case:
    id: str
    claim: str | None = None  # the claim's status.phase; None: no claim yet
    pod: str | None = None  # the Pod's status.phase; None: no Pod yet
    waiting: str | None = None  # a container's waiting reason
    events: list[str] = field(default_factory=list)
    mode: str = "Running"
    phase: str = ""
    reason: str = ""


PHASES = [
    Case("nothing made yet", phase="Provisioning", reason="WorkspacePending"),
    Case("claim pending", claim="Pending", pod="Pending", phase="Provisioning", reason="WorkspacePending"),
    Case("claim bound, Pod pending", claim="Bound", pod="Pending", phase="Provisioning", reason="PodPending"),
    Case(
        "an image that may never be pulled",
        claim="Bound",
        pod="Pending",
        waiting="ErrImageNeverPull",
        phase="Failed",
        reason="ImageUnavailable",
    ),
    Case(
        "an image pull backing off",
        claim="Bound",
        pod="Pending",
        waiting="ImagePullBackOff",
        phase="Provisioning",
        reason="ContainerWaiting",
    ),
    Case("Pod running, log idle", claim="Bound", pod="Running", phase="Ready", reason="Idle"),
    Case(
        "a run in flight", claim="Bound", pod="Running", events=["run.started"], phase="Running", reason="RunInFlight"
    ),
    Case(
        "a run completed",
        claim="Bound",
        pod="Running",
        events=["run.started", "run.completed"],
        phase="Ready",
        reason="Idle",
    ),
    Case(
        "an approval pending",
        claim="Bound",
        pod="Running",
        events=["agent.approval_request"],
        phase="AwaitingApproval",
        reason="ApprovalPending",
    ),
    Case("Pod failed", claim="Bound", pod="Failed", phase="Failed", reason="PodFailed"),
    Case("Pod exited", claim="Bound", pod="Succeeded", phase="Ended", reason="PodSucceeded"),
    Case("paused, Pod gone", claim="Bound", mode="Paused", phase="Paused", reason="Paused"),
]


@pytest.mark.parametrize("case", PHASES, ids=lambda c: c.id)
def test_phase_from_claim_pod_and_log(api, case):
    api.add("namespaces", {"metadata": {"name": NS}})
    body = api.add("sessions", session(case.mode))
    if case.claim:
        api.add("persistentvolumeclaims", owned("s-workspace", status={"phase": case.claim}))
    if case.pod:
        pod = build_pod(body, _spec(body), "s-workspace", 0)
        pod["status"] = {"phase": case.pod, "containerStatuses": [container(case.waiting)]}
        api.add("pods", pod)
    elog = EventLog(api.core(), NS, "s")
    for kind in case.events:
        elog.append(kind, {"runId": "r1"})
    reconcile_session(NS, "s", SETTINGS)
    assert (status(api)["phase"], ready_reason(api)) == (case.phase, case.reason)
    assert status(api)["observedGeneration"] == 1
    assert status(api)["eventLog"]["lastSequence"] == len(case.events)


def _spec(body: dict):
    from savepoint.models import SessionSpec

    return SessionSpec.model_validate(body["spec"])


def test_a_first_pass_makes_the_log_account_claim_and_pod_by_their_names(api):
    api.add("namespaces", {"metadata": {"name": NS}})
    api.add("sessions", session())
    reconcile_session(NS, "s", SETTINGS)
    assert api.names("configmaps") == ["s-log-000001"]
    assert api.names("serviceaccounts") == api.names("roles") == api.names("rolebindings") == ["savepoint-sandbox-s"]
    assert api.names("persistentvolumeclaims") == ["s-workspace"]
    assert api.names("pods") == ["s"]
    pod = api.get("pods", NS, "s")
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid-s"
    assert pod["spec"]["serviceAccountName"] == "savepoint-sandbox-s"
    creates = [r.kind for r in api.writes() if r.verb == "create"]
    # The account before the Pod that runs as it; the status is written once, at the end.
    assert creates.index("rolebindings") < creates.index("pods")
    assert [r.verb for r in api.writes() if r.kind == "sessions"] == ["patch_status"]
    assert status(api)["workspaceClaimName"] == "s-workspace"
    assert status(api)["restore"] == {"mode": "fresh"}


def test_a_pass_that_must_read_the_whole_log_makes_the_pod_first(api):
    """A rollback's hand-back (or a restart) reads the whole log again: a Session without
    an idle policy asks for its Pod before that read, which the Pod does not wait on."""
    from savepoint.controllers import cache

    api.add("namespaces", {"metadata": {"name": NS}})
    api.add("sessions", session())
    reconcile_session(NS, "s", SETTINGS)
    api.delete("pods", NS, "s")
    cache.clear()  # no digest kept: the next pass lists the log
    api.requests.clear()
    reconcile_session(NS, "s", SETTINGS)
    order = [(r.verb, r.kind) for r in api.requests]
    assert order.index(("create", "pods")) < order.index(("list", "configmaps"))


def test_a_second_pass_makes_nothing_again(api):
    api.add("namespaces", {"metadata": {"name": NS}})
    api.add("sessions", session())
    reconcile_session(NS, "s", SETTINGS)
    made = len([r for r in api.writes() if r.verb == "create"])
    reconcile_session(NS, "s", SETTINGS)
    assert len([r for r in api.writes() if r.verb == "create"]) == made


def test_pausing_deletes_the_pod_and_keeps_the_claim(api):
    api.add("namespaces", {"metadata": {"name": NS}})
    api.add("sessions", session())
    reconcile_session(NS, "s", SETTINGS)
    # The user's write, and the pass its watch event brings (kopf's on.update, with the body).
    paused = api.patch("sessions", NS, "s", {"spec": {"operatingMode": "Paused"}})
    reconcile_session(NS, "s", SETTINGS, seen=paused)
    assert api.names("pods") == []
    assert api.names("persistentvolumeclaims") == ["s-workspace"]
    assert status(api)["observedGeneration"] == 2


def test_a_pod_the_api_server_refuses_fails_the_session_naming_the_template(api):
    api.add("namespaces", {"metadata": {"name": NS}})
    api.add("sessions", session())
    api.fail("create", "pods", 422, reason="Invalid")
    reconcile_session(NS, "s", SETTINGS)
    assert (status(api)["phase"], ready_reason(api)) == ("Failed", "InvalidPodTemplate")
    message = next(c["message"] for c in status(api)["conditions"] if c["type"] == "Ready")
    assert message.startswith("spec.podTemplate: the API server refused the Pod")


def test_a_template_without_containers_fails_without_a_request_for_the_pod(api):
    api.add("namespaces", {"metadata": {"name": NS}})
    api.add("sessions", session(template={"spec": {}}))
    reconcile_session(NS, "s", SETTINGS)
    assert (status(api)["phase"], ready_reason(api)) == ("Failed", "InvalidPodTemplate")
    assert not any(r.kind == "pods" and r.verb == "create" for r in api.requests)


def test_a_server_error_on_the_pod_raises_and_a_rerun_converges(api):
    api.add("namespaces", {"metadata": {"name": NS}})
    api.add("sessions", session())
    api.fail("create", "pods", 500)
    with pytest.raises(ApiException):
        reconcile_session(NS, "s", SETTINGS)
    assert api.names("pods") == []
    reconcile_session(NS, "s", SETTINGS)
    assert api.names("pods") == ["s"]
    assert status(api)["phase"] == "Provisioning"


def test_a_pod_of_that_name_owned_by_another_session_waits(api):
    import kopf

    api.add("namespaces", {"metadata": {"name": NS}})
    api.add("sessions", session())
    api.add("pods", {"metadata": {"name": "s", "namespace": NS, "ownerReferences": [{"uid": "uid-older"}]}})
    with pytest.raises(kopf.TemporaryError):
        reconcile_session(NS, "s", SETTINGS)
    assert api.get("pods", NS, "s")["metadata"]["ownerReferences"] == [{"uid": "uid-older"}]


def test_an_account_that_may_not_list_roles_reads_them_one_by_one(api):
    api.add("namespaces", {"metadata": {"name": NS}})
    api.add("sessions", session())
    api.fail("list", "rolebindings", 403, reason="Forbidden")
    reconcile_session(NS, "s", SETTINGS)
    assert api.names("rolebindings") == ["savepoint-sandbox-s"]
    assert ("get", "rolebindings") in [(r.verb, r.kind) for r in api.requests]
    assert api.names("pods") == ["s"]


def test_a_role_deleted_behind_the_operators_back_is_made_again(api):
    api.add("namespaces", {"metadata": {"name": NS}})
    api.add("sessions", session())
    reconcile_session(NS, "s", SETTINGS)
    api.delete("roles", NS, "savepoint-sandbox-s")
    for _ in range(12):  # one chunk each: enough that the Role's window of chunk names must grow
        EventLog(api.core(), NS, "s", max_chunk_bytes=1024, rollover_bytes=1).append("message", {"n": 1})
    reconcile_session(NS, "s", SETTINGS)
    assert api.names("roles") == ["savepoint-sandbox-s"]
    # The widening found it gone (404), so the pass made it again with the wider window.
    assert [r.verb for r in api.requests if r.kind == "roles"][-3:] == ["patch", "get", "create"]


def test_after_each_run_a_checkpoint_is_taken_once_per_run_and_only_the_newest_kept(api):
    api.add("namespaces", {"metadata": {"name": NS}})
    body = session()
    body["spec"]["checkpointPolicy"] = {"afterEachRun": True, "keepLast": 2}
    api.add("sessions", body)
    api.add("persistentvolumeclaims", owned("s-workspace", status={"phase": "Bound"}))
    pod = build_pod(api.get("sessions", NS, "s"), _spec(body), "s-workspace", 0)
    api.add("pods", {**pod, "status": {"phase": "Running", "containerStatuses": [container()]}})
    elog = EventLog(api.core(), NS, "s")
    completed = []
    for run in ("r1", "r2", "r3"):
        elog.append("run.started", {"runId": run})
        completed.append(elog.append("run.completed", {"runId": run}).seq)
        reconcile_session(NS, "s", SETTINGS)
        reconcile_session(NS, "s", SETTINGS)  # a second pass over the same run takes nothing more
    assert api.names("checkpoints") == [f"s-run-{seq}" for seq in completed[1:]]
    assert [r.name for r in api.requests if (r.verb, r.kind) == ("delete", "checkpoints")] == [f"s-run-{completed[0]}"]


def test_ready_is_written_before_the_pods_boot_time_is_kept_and_both_agree(api):
    """The boot time is kept on the Pod so later passes report the same figure, after the
    status write: a Session that just came up is not kept from Ready by that request."""
    from savepoint.constants import POD_BOOT_MS

    api.add("namespaces", {"metadata": {"name": NS}})
    body = api.add("sessions", session())
    api.add("persistentvolumeclaims", owned("s-workspace", status={"phase": "Bound"}))
    pod = build_pod(body, _spec(body), "s-workspace", 0)
    pod["status"] = {"phase": "Running", "containerStatuses": [container()]}
    api.add("pods", pod)
    api.requests.clear()
    reconcile_session(NS, "s", SETTINGS)
    writes = [(r.verb, r.kind) for r in api.writes()]
    assert writes.index(("patch_status", "sessions")) < writes.index(("patch", "pods"))
    kept = api.get("pods", NS, "s")["metadata"]["annotations"][POD_BOOT_MS]
    assert status(api)["phase"] == "Ready" and status(api)["usage"]["bootMs"] == int(kept)


def running_world(api: FakeAPI, annotations: dict | None = None) -> dict:
    """Session s with its claim Bound and its Pod Running; the Pod as added."""
    api.add("namespaces", {"metadata": {"name": NS}})
    body = session()
    body["metadata"]["annotations"] = annotations or {}
    body = api.add("sessions", body)
    api.add("persistentvolumeclaims", owned("s-workspace", status={"phase": "Bound"}))
    pod = build_pod(body, _spec(body), "s-workspace", 0)
    pod["status"] = {"phase": "Running", "containerStatuses": [container()]}
    return api.add("pods", pod)


def test_a_pass_brought_by_an_older_event_of_the_pod_does_not_time_its_boot_again(api):
    """An update of the Pod sent before the boot annotation (the kubelet's) may arrive after
    it: the pass it brings finds the annotated Pod the write answered, and writes nothing,
    so the Session's bootMs stays the figure first kept."""
    from savepoint.constants import POD_BOOT_MS
    from savepoint.controllers import cache

    before = running_world(api)
    reconcile_session(NS, "s", SETTINGS)
    kept = api.get("pods", NS, "s")["metadata"]["annotations"][POD_BOOT_MS]
    cache.pods.observe("MODIFIED", before)
    api.requests.clear()
    reconcile_session(NS, "s", SETTINGS)
    assert api.writes() == []
    assert status(api)["usage"]["bootMs"] == int(kept)


def test_a_held_sessions_status_shows_no_pod_at_once_and_the_pods_deletion_writes_nothing(api):
    """While a rollback holds the Session its Pod is on the way out: the first pass under
    the hold writes the status without it, so the Pod's DELETED event brings no second write."""
    from savepoint.constants import RESTORING_ANNOTATION
    from savepoint.controllers import cache

    pod = running_world(api, {RESTORING_ANNOTATION: "f"})
    api.patch("sessions", NS, "s", {"status": {"phase": "Ready", "podName": "s"}}, status=True)
    reconcile_session(NS, "s", SETTINGS)
    assert (status(api)["phase"], ready_reason(api), status(api).get("podName")) == (
        "Provisioning",
        "RollingBack",
        None,
    )
    assert api.names("pods") == []
    cache.pods.observe("DELETED", pod)
    api.requests.clear()
    reconcile_session(NS, "s", SETTINGS)
    assert [(r.verb, r.kind) for r in api.writes()] == []


# --- a Session restored from a checkpoint (a fork's target) -----------------------------


def restore_world(api: FakeAPI) -> None:
    """Session p with three events, its checkpoint cp through event 2, and Session t made
    from cp, as a Fork makes its target."""
    api.add("namespaces", {"metadata": {"name": NS}})
    api.add("sessions", {**session(), "metadata": {"name": "p", "namespace": NS, "uid": "uid-p", "generation": 1}})
    for n in range(1, 4):
        EventLog(api.core(), NS, "p").append("message", {"n": n})
    api.add(
        "checkpoints",
        {
            "apiVersion": API_VERSION,
            "kind": "Checkpoint",
            "metadata": {"name": "cp", "namespace": NS},
            "spec": {"sessionName": "p"},
            "status": {
                "phase": "Ready",
                "volumeSnapshotName": "sp-cp",
                "throughSequence": 2,
                "expiresAt": "2126-01-02T00:00:00Z",
            },
        },
    )
    target = session()
    target["metadata"].update(name="t", uid="uid-t")
    target["spec"]["source"] = {"checkpoint": "cp"}
    api.add("sessions", target)


def test_a_restore_writes_the_new_log_without_listing_it(api, monkeypatch):
    """A list waits for the API server's cache to catch up (up to 0.1 s): the target's log,
    which no pass has reported yet, is written unread, and its view folds what was written."""
    from savepoint import eventlog
    from savepoint.controllers import cache

    monkeypatch.setattr(eventlog, "on_chunk", cache.chunks.put)  # as the operator starts
    restore_world(api)
    reconcile_session(NS, "t", SETTINGS)
    listed = [r for r in api.requests if (r.verb, r.kind, r.name) == ("list", "configmaps", "savepoint.dev/session=t")]
    assert listed == []
    events = EventLog(api.core(), NS, "t").read()
    assert [(e.seq, e.type) for e in events] == [(1, "message"), (2, "message"), (3, "session.forked")]
    assert api.get("sessions", NS, "t")["status"]["eventLog"]["chunks"] == 1


def test_a_restore_started_again_after_a_restart_forks_the_log_once(api, monkeypatch):
    from tests.unit.fake_api import forget_process_memory

    restore_world(api)
    api.fail("patch_status", "sessions", 500)  # the pass stops after the log, before its status
    with pytest.raises(ApiException):
        reconcile_session(NS, "t", SETTINGS)
    forget_process_memory(monkeypatch)
    reconcile_session(NS, "t", SETTINGS)
    events = EventLog(api.core(), NS, "t").read()
    assert [(e.seq, e.type) for e in events] == [(1, "message"), (2, "message"), (3, "session.forked")]
    api.patch("persistentvolumeclaims", NS, "t-workspace", {"status": {"phase": "Bound"}})
    reconcile_session(NS, "t", SETTINGS)
    assert api.get("sessions", NS, "t")["status"]["restore"]["throughSequence"] == 2
    assert len(EventLog(api.core(), NS, "t").read()) == 3
