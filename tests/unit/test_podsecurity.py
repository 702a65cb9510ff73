"""The Pod Security Standards checks of a Session's podTemplate (savepoint.podsecurity)."""

from __future__ import annotations

import copy

import pytest

from savepoint.podsecurity import check, check_account, level_for, refusal

OWN = "savepoint-sandbox-s1"
CLEAN = {"spec": {"containers": [{"name": "agent", "image": "agent:1"}]}}
RESTRICTED_CLEAN = {
    "spec": {
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [
            {
                "name": "agent",
                "image": "agent:1",
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
                },
            }
        ],
        "volumes": [{"name": "scratch", "emptyDir": {}}],
    }
}


def template(**spec) -> dict:
    body = copy.deepcopy(CLEAN)
    body["spec"].update(spec)
    return body


def container(**security) -> dict:
    return template(containers=[{"name": "agent", "image": "agent:1", "securityContext": security}])


C0 = "spec.podTemplate.spec.containers[0].securityContext"

# (id, template, the field each problem must name) at baseline.
BASELINE_REFUSED = [
    ("privileged", container(privileged=True), f"{C0}.privileged"),
    ("hostPID", template(hostPID=True), "spec.podTemplate.spec.hostPID"),
    ("hostIPC", template(hostIPC=True), "spec.podTemplate.spec.hostIPC"),
    ("hostNetwork", template(hostNetwork=True), "spec.podTemplate.spec.hostNetwork"),
    (
        "hostPath",
        template(volumes=[{"name": "root", "hostPath": {"path": "/"}}]),
        "spec.podTemplate.spec.volumes[0].hostPath",
    ),
    ("capabilities", container(capabilities={"add": ["CHOWN", "SYS_ADMIN"]}), f"{C0}.capabilities.add"),
    ("procMount", container(procMount="Unmasked"), f"{C0}.procMount"),
    (
        "sysctl",
        template(securityContext={"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}),
        "spec.podTemplate.spec.securityContext.sysctls[0].name",
    ),
    (
        "hostPort",
        template(containers=[{"name": "a", "image": "i", "ports": [{"containerPort": 80, "hostPort": 80}]}]),
        "spec.podTemplate.spec.containers[0].ports[0].hostPort",
    ),
    (
        "initContainer",
        template(initContainers=[{"name": "i", "image": "i", "securityContext": {"privileged": True}}]),
        "spec.podTemplate.spec.initContainers[0].securityContext.privileged",
    ),
    ("seccomp", container(seccompProfile={"type": "Unconfined"}), f"{C0}.seccompProfile.type"),
    ("selinux", container(seLinuxOptions={"type": "spc_t"}), f"{C0}.seLinuxOptions.type"),
    ("hostProcess", container(windowsOptions={"hostProcess": True}), f"{C0}.windowsOptions.hostProcess"),
    ("apparmor", container(appArmorProfile={"type": "Unconfined"}), f"{C0}.appArmorProfile.type"),
]


@pytest.mark.parametrize(
    "template_, field", [row[1:] for row in BASELINE_REFUSED], ids=[r[0] for r in BASELINE_REFUSED]
)
def test_baseline_refuses_each_hostile_field_naming_it(template_, field):
    problems = check(template_, "baseline")
    assert [p.field for p in problems] == [field]
    assert check(template_, "privileged") == []
    assert field in refusal(template_, "baseline", OWN) and "baseline" in refusal(template_, "baseline", OWN)


def test_allowed_values_pass_baseline():
    assert check(CLEAN, "baseline") == []
    allowed = container(
        privileged=False,
        capabilities={"add": ["NET_BIND_SERVICE", "CHOWN"]},
        procMount="Default",
        seccompProfile={"type": "RuntimeDefault"},
        seLinuxOptions={"type": "container_t"},
    )
    allowed["spec"].update(
        hostNetwork=False,
        runtimeClassName="gvisor",
        securityContext={"sysctls": [{"name": "net.ipv4.ip_local_port_range", "value": "1024 65535"}]},
        volumes=[{"name": "scratch", "emptyDir": {}}],
    )
    assert check(allowed, "baseline") == []
    assert refusal(allowed, "baseline", OWN) is None


def test_restricted_wants_non_root_no_escalation_seccomp_and_dropped_capabilities():
    assert check(RESTRICTED_CLEAN, "restricted") == []
    fields = {p.field for p in check(CLEAN, "restricted")}
    assert fields == {
        f"{C0}.allowPrivilegeEscalation",
        f"{C0}.runAsNonRoot",
        f"{C0}.seccompProfile.type",
        f"{C0}.capabilities.drop",
    }
    hostile = copy.deepcopy(RESTRICTED_CLEAN)
    hostile["spec"]["volumes"].append({"name": "nfs", "nfs": {"server": "x", "path": "/"}})
    hostile["spec"]["containers"][0]["securityContext"]["capabilities"]["add"].append("CHOWN")
    hostile["spec"]["containers"][0]["securityContext"]["runAsUser"] = 0
    assert {p.field for p in check(hostile, "restricted")} == {
        "spec.podTemplate.spec.volumes[1].nfs",
        f"{C0}.capabilities.add",
        f"{C0}.runAsUser",
    }
    assert check(hostile, "baseline") == []


def test_a_foreign_service_account_is_refused_at_every_level():
    for key in ("serviceAccountName", "serviceAccount"):
        foreign = template(**{key: "default"})
        [problem] = check_account(foreign, OWN)
        assert problem.field == f"spec.podTemplate.spec.{key}" and OWN in problem.rule
        assert refusal(foreign, "privileged", OWN) is not None
        assert check_account(template(**{key: OWN}), OWN) == []


@pytest.mark.parametrize(
    "labels, level",
    [
        ({}, "baseline"),
        ({"savepoint.dev/pod-security": "restricted"}, "restricted"),
        ({"savepoint.dev/pod-security": "privileged"}, "privileged"),
        ({"pod-security.kubernetes.io/enforce": "restricted"}, "restricted"),
        ({"pod-security.kubernetes.io/enforce": "privileged"}, "baseline"),  # PSA's label never loosens ours
        ({"savepoint.dev/pod-security": "privileged", "pod-security.kubernetes.io/enforce": "baseline"}, "baseline"),
        ({"savepoint.dev/pod-security": "Privileged"}, "restricted"),  # a typo never loosens
    ],
)
def test_the_namespace_level(labels, level):
    assert level_for(labels) == level


def test_a_fork_does_not_carry_the_source_sandbox_account_over():
    from savepoint.fork import Plan, build_target_session
    from savepoint.models import ForkMode, RestoreMode

    source = {"metadata": {"name": "s1"}, "spec": {"podTemplate": template(serviceAccountName=OWN)}}
    fork = {
        "metadata": {"name": "f", "namespace": "ns", "uid": "u"},
        "spec": {"source": {"checkpoint": "c1"}, "target": {"sessionName": "s2"}},
    }
    plan = Plan(ForkMode.FORK, RestoreMode.SNAPSHOT, "s1", "c1", "sp-c1", 3, "x")
    target = build_target_session(fork, source, plan, None)
    assert "serviceAccountName" not in target["spec"]["podTemplate"]["spec"]
    assert source["spec"]["podTemplate"]["spec"]["serviceAccountName"] == OWN  # the source is left alone


def test_runtime_class_passes_through_to_the_pod():
    from savepoint.models import SessionSpec
    from savepoint.session import build_pod

    body = {"metadata": {"name": "s1", "namespace": "ns", "uid": "u"}}
    spec = SessionSpec.model_validate({"podTemplate": template(runtimeClassName="gvisor")})
    assert check(spec.pod_template, "restricted") == check(CLEAN, "restricted")  # no rule is about it
    pod = build_pod(body, spec, "s1-workspace", 0)["spec"]
    assert pod["runtimeClassName"] == "gvisor"
    assert (pod["serviceAccountName"], pod["automountServiceAccountToken"]) == (OWN, True)
