"""Pure Session decisions: no cluster."""

from __future__ import annotations

import pytest

from savepoint.models import SessionPhase, SessionSpec
from savepoint.session import (
    POD_BOOT_MS,
    Observed,
    PodTemplateError,
    build_pod,
    build_pvc,
    build_status,
    derive_phase,
)

BODY = {
    "apiVersion": "savepoint.dev/v1alpha1",
    "kind": "Session",
    "metadata": {"name": "s1", "namespace": "ns", "uid": "u-1", "generation": 3},
}
TEMPLATE = {"spec": {"containers": [{"name": "agent", "image": "agent:1", "env": [{"name": "A", "value": "1"}]}]}}


def seen(**kw) -> Observed:
    base = dict(
        pod={"metadata": {"name": "s1"}, "status": {"phase": "Running"}},
        pvc={"status": {"phase": "Bound"}},
        log_cursor=(4, "e4"),
        log_chunks=1,
        log_error=None,
        run_in_flight=False,
        approval_pending=False,
        runs=2,
    )
    base.update(kw)
    return Observed(**base)


def spec(**kw) -> SessionSpec:
    return SessionSpec.model_validate({"podTemplate": TEMPLATE, **kw})


@pytest.mark.parametrize(
    ("observed", "mode", "phase"),
    [
        (seen(), "Running", SessionPhase.READY),
        (seen(run_in_flight=True), "Running", SessionPhase.RUNNING),
        (seen(run_in_flight=True, approval_pending=True), "Running", SessionPhase.AWAITING_APPROVAL),
        (seen(pvc={"status": {"phase": "Pending"}}), "Running", SessionPhase.PROVISIONING),
        (seen(pod=None), "Running", SessionPhase.PROVISIONING),
        (seen(pod={"metadata": {}, "status": {"phase": "Pending"}}), "Running", SessionPhase.PROVISIONING),
        (seen(pod={"metadata": {}, "status": {"phase": "Failed"}}), "Running", SessionPhase.FAILED),
        (seen(pod={"metadata": {}, "status": {"phase": "Succeeded"}}), "Running", SessionPhase.ENDED),
        (seen(pod=None), "Paused", SessionPhase.PAUSED),
        (seen(), "Paused", SessionPhase.PROVISIONING),
        (seen(log_cursor=None, log_error="chunk s1-log-000001 key x: bad"), "Running", SessionPhase.PROVISIONING),
    ],
)
def test_phase(observed, mode, phase):
    assert derive_phase(spec(operatingMode=mode), observed)[0] == phase


def test_pod_mounts_workspace_and_keeps_template():
    pod = build_pod(BODY, spec(workspace={"mountPath": "/work"}), "s1-workspace", 123)
    container = pod["spec"]["containers"][0]
    assert {"name": "workspace", "mountPath": "/work"} in container["volumeMounts"]
    assert {"name": "A", "value": "1"} in container["env"]
    assert {"name": "SAVEPOINT_SESSION", "value": "s1"} in container["env"]
    assert pod["spec"]["volumes"] == [{"name": "workspace", "persistentVolumeClaim": {"claimName": "s1-workspace"}}]
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert pod["metadata"]["labels"]["savepoint.dev/session"] == "s1"


def test_pod_without_containers_names_the_field():
    with pytest.raises(PodTemplateError, match=r"spec.podTemplate.spec.containers"):
        build_pod(BODY, SessionSpec.model_validate({}), "c", 0)


def test_pvc_from_workspace():
    pvc = build_pvc(BODY, spec(workspace={"size": "2Gi", "storageClassName": "fast"}), "s1-workspace")
    assert pvc["spec"]["resources"]["requests"]["storage"] == "2Gi"
    assert pvc["spec"]["storageClassName"] == "fast"


def test_status_carries_cursor_usage_and_conditions():
    pod = {"metadata": {"name": "s1", "annotations": {POD_BOOT_MS: "850"}}, "status": {"phase": "Running"}}
    status = build_status(BODY, spec(), seen(pod=pod), "s1-workspace", now="2026-01-01T00:00:00Z")
    assert status["phase"] == "Ready"
    assert status["eventLog"] == {"lastSequence": 4, "lastEventId": "e4", "chunks": 1}
    assert status["usage"] == {"runs": 2, "bootMs": 850, "pauses": 0}
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True" and ready["observedGeneration"] == 3


def test_condition_transition_time_moves_only_on_change():
    first = build_status(BODY, spec(), seen(), "c", now="2026-01-01T00:00:00Z")
    again = build_status({**BODY, "status": first}, spec(), seen(run_in_flight=True), "c", now="2026-01-02T00:00:00Z")
    ready = next(c for c in again["conditions"] if c["type"] == "Ready")
    assert ready["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert ready["reason"] == "RunInFlight"


def _waiting(reason: str, message: str = "") -> dict:
    return {
        "metadata": {"name": "s1"},
        "status": {
            "phase": "Pending",
            "containerStatuses": [
                {
                    "name": "agent",
                    "image": "example.invalid/agent:1",
                    "state": {"waiting": {"reason": reason, "message": message}},
                }
            ],
        },
    }


def test_an_image_the_node_will_never_have_fails_the_session_naming_it():
    phase, reason, message = derive_phase(
        SessionSpec.model_validate({"podTemplate": TEMPLATE}),
        seen(pod=_waiting("ErrImageNeverPull", "not present with pull policy")),
    )
    assert phase == SessionPhase.FAILED
    assert reason == "ImageUnavailable"
    assert "ErrImageNeverPull" in message and "example.invalid/agent:1" in message and "agent" in message


def test_a_pull_back_off_waits_and_says_why():
    phase, reason, message = derive_phase(
        SessionSpec.model_validate({"podTemplate": TEMPLATE}), seen(pod=_waiting("ImagePullBackOff"))
    )
    assert phase == SessionPhase.PROVISIONING
    assert reason == "ContainerWaiting" and "ImagePullBackOff" in message


def test_a_container_waiting_for_its_first_start_is_plain_pending():
    phase, reason, _ = derive_phase(
        SessionSpec.model_validate({"podTemplate": TEMPLATE}), seen(pod=_waiting("ContainerCreating"))
    )
    assert phase == SessionPhase.PROVISIONING and reason == "PodPending"


def test_the_kubelets_failed_mount_is_the_sessions_reason():
    pod = {"metadata": {"name": "s1"}, "status": {"phase": "Pending"}}
    warning = 'FailedMount: MountVolume.SetUp failed for volume "pvc-1" : rpc error: code = NotFound'
    phase, reason, message = derive_phase(
        SessionSpec.model_validate({"podTemplate": TEMPLATE}), seen(pod=pod, pod_warning=warning)
    )
    assert phase == SessionPhase.PROVISIONING
    assert reason == "VolumeMountFailed" and "MountVolume.SetUp failed" in message
