"""A Session is no way around Pod security, on the real control plane: hostile templates are
refused before any Pod is made (by the CRD's CEL rule, the webhook, or the Session's status),
naming the field; the namespace's level applies; a clean template still goes Ready."""

from __future__ import annotations

import copy

import pytest
from kubernetes import client

from savepoint.models import GROUP, VERSION
from savepoint.session import sandbox_account
from tests.conftest import wait_for
from tests.integration.test_session import KWOK_POD, get_session, make_session, wait_phase


def template(**spec) -> dict:
    body = copy.deepcopy(KWOK_POD)
    body["spec"].update(spec)
    return body


def container(**security) -> dict:
    return template(containers=[{"name": "agent", "image": "example.invalid/agent:1", "securityContext": security}])


C0 = "spec.podTemplate.spec.containers[0].securityContext"
# (session name, template, the field the refusal must name)
HOSTILE = [
    ("privileged", container(privileged=True), f"{C0}.privileged"),
    ("host-pid", template(hostPID=True), "spec.podTemplate.spec.hostPID"),
    ("host-ipc", template(hostIPC=True), "spec.podTemplate.spec.hostIPC"),
    ("host-network", template(hostNetwork=True), "spec.podTemplate.spec.hostNetwork"),
    (
        "host-path",
        template(volumes=[{"name": "root", "hostPath": {"path": "/"}}]),
        "spec.podTemplate.spec.volumes[0].hostPath",
    ),
    ("capabilities", container(capabilities={"add": ["SYS_ADMIN"]}), f"{C0}.capabilities.add"),
    ("proc-mount", container(procMount="Unmasked"), f"{C0}.procMount"),
    (
        "sysctl",
        template(securityContext={"sysctls": [{"name": "kernel.msgmax", "value": "65536"}]}),
        "spec.podTemplate.spec.securityContext.sysctls[0].name",
    ),
]
RESTRICTED_CLEAN = template(
    securityContext={"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
    containers=[
        {
            "name": "agent",
            "image": "example.invalid/agent:1",
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        }
    ],
)


def _no_pod(core, namespace: str, name: str) -> bool:
    try:
        core.read_namespaced_pod(name, namespace)
    except client.ApiException as err:
        if err.status == 404:
            return True
        raise
    return False


def _refused_by_status(crds, namespace: str, name: str) -> dict:
    body = wait_phase(crds, namespace, name, "Failed", timeout=60)
    return next(c for c in body["status"]["conditions"] if c["type"] == "Ready")


def _label(core, namespace: str, labels: dict[str, str]) -> None:
    core.patch_namespace(namespace, {"metadata": {"labels": labels}})


def test_hostile_templates_fail_before_any_pod_naming_the_field(operator, core, crds, namespace):
    for name, body, _ in HOSTILE:
        make_session(crds, namespace, name, podTemplate=body)
    make_session(crds, namespace, "clean")
    for name, _, field in HOSTILE:
        ready = _refused_by_status(crds, namespace, name)
        assert ready["reason"] == "PodTemplateForbidden", ready
        assert field in ready["message"] and "baseline" in ready["message"], ready["message"]
        assert _no_pod(core, namespace, name), f"a Pod was made for {name}"
        claim = get_session(crds, namespace, name)["status"]["workspaceClaimName"]
        assert not core.list_namespaced_persistent_volume_claim(
            namespace, field_selector=f"metadata.name={claim}"
        ).items
    # A baseline-clean template still runs, as its own account with the token.
    wait_phase(crds, namespace, "clean", "Ready", timeout=90)
    pod = core.read_namespaced_pod("clean", namespace)
    assert pod.spec.service_account_name == sandbox_account("clean")
    assert pod.spec.automount_service_account_token is True


@pytest.mark.parametrize("key", ["serviceAccountName", "serviceAccount"])
def test_a_foreign_service_account_is_refused_by_the_crd(operator, crds, namespace, key):
    with pytest.raises(client.ApiException) as err:
        make_session(crds, namespace, "foreign", podTemplate=template(**{key: "default"}))
    assert err.value.status == 422
    assert f"spec.podTemplate.spec.{key}" in err.value.body and "savepoint-sandbox-" in err.value.body
    # Its own account is no problem (the Pod runs as it anyway).
    make_session(crds, namespace, "own", podTemplate=template(**{key: sandbox_account("own")}))
    wait_phase(crds, namespace, "own", "Ready", timeout=90)


def test_the_webhook_refuses_at_apply_time(operator, webhook, core, crds, namespace):
    _label(core, namespace, {webhook: "true"})

    attempts = iter(range(1000))

    def refused():
        name = f"probe-{next(attempts)}"  # a new name each time: a deleted probe may linger
        try:
            make_session(crds, namespace, name, podTemplate=template(hostNetwork=True))
        except client.ApiException as err:
            return err
        crds.delete_namespaced_custom_object(GROUP, VERSION, namespace, "sessions", name)
        return None

    err = wait_for(refused, timeout=30, what="the webhook to answer for the labelled namespace")
    assert "PodTemplateForbidden" in err.body and "spec.podTemplate.spec.hostNetwork" in err.body, err.body
    make_session(crds, namespace, "clean")
    wait_phase(crds, namespace, "clean", "Ready", timeout=90)
    # Changing an admitted Session's template to a hostile one is refused too.
    with pytest.raises(client.ApiException) as update:
        crds.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, "sessions", "clean", {"spec": {"podTemplate": container(privileged=True)}}
        )
    assert f"{C0}.privileged" in update.value.body


def test_a_namespace_that_asks_for_restricted_gets_it(operator, core, crds, namespace):
    _label(core, namespace, {"pod-security.kubernetes.io/enforce": "restricted"})
    make_session(crds, namespace, "baseline-only")
    make_session(crds, namespace, "restricted", podTemplate=RESTRICTED_CLEAN)
    ready = _refused_by_status(crds, namespace, "baseline-only")
    assert ready["reason"] == "PodTemplateForbidden" and "restricted" in ready["message"]
    assert "spec.podTemplate.spec.containers[0].securityContext.runAsNonRoot" in ready["message"]
    assert _no_pod(core, namespace, "baseline-only")
    # The API server's own Pod Security admission enforces restricted here too, and admits it.
    wait_phase(crds, namespace, "restricted", "Ready", timeout=90)


def test_only_the_namespace_label_loosens_the_level(operator, core, crds, namespace):
    _label(core, namespace, {"savepoint.dev/pod-security": "privileged"})
    make_session(crds, namespace, "privileged", podTemplate=container(privileged=True))
    wait_phase(crds, namespace, "privileged", "Ready", timeout=90)
    assert core.read_namespaced_pod("privileged", namespace).spec.containers[0].security_context.privileged
