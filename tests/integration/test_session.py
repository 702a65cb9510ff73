"""The Session controller on the real control plane: Pod, workspace, log, phase."""

from __future__ import annotations

import pytest
from kubernetes import client

from savepoint.eventlog import EventLog
from savepoint.models import GROUP, VERSION
from tests.conftest import wait_for

KWOK_POD = {
    "spec": {
        "containers": [{"name": "agent", "image": "example.invalid/agent:1"}],
        "nodeSelector": {"type": "kwok"},
        "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
    }
}


def workspace_claim(pod: client.V1Pod) -> str:
    return next(v.persistent_volume_claim.claim_name for v in pod.spec.volumes if v.name == "workspace")


def make_session(crds, namespace: str, name: str, **spec) -> dict:
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Session",
        "metadata": {"name": name},
        "spec": {
            "podTemplate": KWOK_POD,
            "workspace": {"size": "64Mi"},
            "harness": {"name": "h", "revision": "7"},
            **spec,
        },
    }
    return crds.create_namespaced_custom_object(GROUP, VERSION, namespace, "sessions", body)


def get_session(crds, namespace: str, name: str) -> dict:
    return crds.get_namespaced_custom_object(GROUP, VERSION, namespace, "sessions", name)


def wait_phase(crds, namespace: str, name: str, phase: str, timeout: float = 60) -> dict:
    def reached():
        body = get_session(crds, namespace, name)
        return body if (body.get("status") or {}).get("phase") == phase else None

    return wait_for(reached, timeout=timeout, what=f"session {name} phase {phase}")


@pytest.fixture
def ready_session(operator, crds, namespace):
    make_session(crds, namespace, "s1")
    return wait_phase(crds, namespace, "s1", "Ready")


def test_session_gets_workspace_pod_and_log(ready_session, core: client.CoreV1Api, namespace):
    status = ready_session["status"]
    uid = ready_session["metadata"]["uid"]
    pod = core.read_namespaced_pod("s1", namespace)
    pvc = core.read_namespaced_persistent_volume_claim(status["workspaceClaimName"], namespace)
    chunk = core.read_namespaced_config_map("s1-log-000001", namespace)
    for obj in (pod, pvc, chunk):
        assert [r.uid for r in obj.metadata.owner_references] == [uid]
    assert pod.status.phase == "Running"
    assert workspace_claim(pod) == pvc.metadata.name
    assert pvc.status.phase == "Bound"
    assert status["restore"] == {"mode": "fresh"}
    assert status["eventLog"]["lastSequence"] == 0
    assert status["usage"]["bootMs"] >= 0
    assert status["observedGeneration"] == ready_session["metadata"]["generation"]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=s1,involvedObject.kind=Session")
    assert any(e.reason == "Ready" for e in events.items)


def test_phase_follows_the_log(ready_session, core, crds, namespace):
    log = EventLog(core, namespace, "s1")
    log.append("run.started", {"runId": "r1"})
    wait_phase(crds, namespace, "s1", "Running")
    log.append("agent.approval_request", {"requestId": "q1", "tool": "rm -rf"})
    wait_phase(crds, namespace, "s1", "AwaitingApproval")
    log.append("user.approval", {"requestId": "q1", "approved": True})
    wait_phase(crds, namespace, "s1", "Running")
    log.append("run.completed", {"runId": "r1"})
    body = wait_phase(crds, namespace, "s1", "Ready")
    assert body["status"]["usage"]["runs"] == 1
    assert body["status"]["eventLog"]["lastSequence"] == 4


def test_pause_keeps_workspace_and_resume_reuses_it(ready_session, core, crds, namespace):
    claim = ready_session["status"]["workspaceClaimName"]
    pvc_uid = core.read_namespaced_persistent_volume_claim(claim, namespace).metadata.uid
    crds.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, "sessions", "s1", {"spec": {"operatingMode": "Paused"}}
    )
    wait_phase(crds, namespace, "s1", "Paused")
    with pytest.raises(client.ApiException) as gone:
        core.read_namespaced_pod("s1", namespace)
    assert gone.value.status == 404
    assert core.read_namespaced_persistent_volume_claim(claim, namespace).metadata.uid == pvc_uid

    crds.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, "sessions", "s1", {"spec": {"operatingMode": "Running"}}
    )
    wait_phase(crds, namespace, "s1", "Ready")
    pod = core.read_namespaced_pod("s1", namespace)
    assert workspace_claim(pod) == claim
    assert core.read_namespaced_persistent_volume_claim(claim, namespace).metadata.uid == pvc_uid


def test_deleted_pod_comes_back(ready_session, core, crds, namespace):
    old = core.read_namespaced_pod("s1", namespace).metadata.uid
    core.delete_namespaced_pod("s1", namespace, grace_period_seconds=0)

    def replaced():
        try:
            pod = core.read_namespaced_pod("s1", namespace)
        except client.ApiException:
            return False
        return pod.metadata.uid != old and pod.status.phase == "Running"

    wait_for(replaced, timeout=60, what="a new sandbox Pod")


def test_deleting_the_session_removes_pod_claim_and_log(ready_session, core, crds, namespace):
    claim = ready_session["status"]["workspaceClaimName"]
    crds.delete_namespaced_custom_object(GROUP, VERSION, namespace, "sessions", "s1")

    def all_gone():
        pods = core.list_namespaced_pod(namespace, label_selector="savepoint.dev/session=s1").items
        claims = [c for c in core.list_namespaced_persistent_volume_claim(namespace).items if c.metadata.name == claim]
        chunks = core.list_namespaced_config_map(namespace, label_selector="savepoint.dev/session").items
        return not pods and not claims and not chunks

    wait_for(all_gone, timeout=90, what="Pod, claim and log chunks of a deleted session to go")



def test_deleting_the_namespace_ends_its_sessions_without_errors(operator, crds, core, namespace):
    """Deleting a namespace deletes its Pods and claims before its Sessions: the passes
    their events ask for are refused (403 NamespaceTerminating) and must end quietly, not
    log a traceback per Session and retry."""
    for i in range(4):
        make_session(crds, namespace, f"s{i}")
    for i in range(4):
        wait_phase(crds, namespace, f"s{i}", "Ready")
    logged = operator.log_path.stat().st_size
    core.delete_namespace(namespace)

    def gone() -> bool:
        try:
            core.read_namespace(namespace)
        except client.ApiException as err:
            return err.status == 404
        return False

    wait_for(gone, timeout=120, what=f"namespace {namespace} to go")
    with open(operator.log_path, errors="replace") as log:
        log.seek(logged)
        lines = [line for line in log if namespace in line]
    assert not [line for line in lines if " ERROR " in line], lines
    assert any(f"namespace {namespace} is being deleted" in line for line in lines), lines


def test_corrupt_log_gives_a_condition_and_spares_other_sessions(ready_session, core, crds, namespace):
    make_session(crds, namespace, "s2")
    wait_phase(crds, namespace, "s2", "Ready")
    EventLog(core, namespace, "s1").append("note", {"n": 1})
    core.patch_namespaced_config_map("s1-log-000001", namespace, {"data": {"000000000001": "{not json"}})

    def flagged():
        cond = {c["type"]: c for c in (get_session(crds, namespace, "s1").get("status") or {}).get("conditions", [])}
        log_cond = cond.get("EventLogReadable")
        return log_cond if log_cond and log_cond["status"] == "False" else None

    cond = wait_for(flagged, timeout=60, what="EventLogReadable=False on s1")
    assert "s1-log-000001" in cond["message"] and "000000000001" in cond["message"]
    EventLog(core, namespace, "s2").append("run.started", {"runId": "x"})
    wait_phase(crds, namespace, "s2", "Running")


def test_invalid_pod_template_fails_with_the_field(operator, crds, namespace):
    make_session(crds, namespace, "broken", podTemplate={"spec": {"containers": []}})
    body = wait_phase(crds, namespace, "broken", "Failed")
    ready = next(c for c in body["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "InvalidPodTemplate"
    assert "spec.podTemplate.spec.containers" in ready["message"]


def test_resume_passes_take_pods_and_claims_from_one_listing_per_namespace(operator, crds, namespace, monkeypatch):
    """After a restart, the first resume pass in a namespace lists its Session Pods and
    claims once, and the other resume passes there read none of them one by one (two GETs
    each before). A later pass, not a resume, reads them fresh."""
    from savepoint import k8s
    from savepoint.config import Settings
    from savepoint.controllers import session as controller

    names = ("r1", "r2", "r3")
    for name in names:
        make_session(crds, namespace, name)
    bodies = [wait_phase(crds, namespace, name, "Ready", timeout=90) for name in names]

    calls: list[str] = []
    for fn_name in ("get_pod", "get_pvc", "list_pods", "list_pvcs"):
        real = getattr(k8s, fn_name)
        monkeypatch.setattr(k8s, fn_name, lambda *args, _real=real, _name=fn_name: calls.append(_name) or _real(*args))

    # This test's process plays the restarted operator: no pass has run here yet.
    for name, body in zip(names, bodies, strict=True):
        controller.reconcile_session(namespace, name, Settings(), seen=body, resumed=True)
    assert sorted(calls) == ["list_pods", "list_pvcs"], "not one listing of each for the namespace"
    for name in names:  # the passes found their Pods and claims: nothing made again, still Ready
        assert get_session(crds, namespace, name)["status"]["phase"] == "Ready"

    controller.reconcile_session(namespace, "r1", Settings())
    assert sorted(calls) == ["get_pod", "get_pvc", "list_pods", "list_pvcs"]
