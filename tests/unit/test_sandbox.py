"""A sandbox's credentials (pure builders) and the event log's by-name mode. No cluster."""

from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException

from savepoint import sandbox
from savepoint.eventlog import EventLog
from savepoint.models import SessionSpec
from savepoint.session import build_pod
from tests.unit.test_eventlog_pure import FakeCore
from tests.unit.test_session_logic import BODY, TEMPLATE


def test_window_widens_before_the_sandbox_runs_out():
    assert sandbox.window(0) == sandbox.window(1) == 1 + sandbox.LOOKAHEAD
    granted = sandbox.window(3)
    assert granted == 19
    # Half the lookahead used: widen.
    assert not sandbox.needs_widening(granted, 11)
    assert sandbox.needs_widening(granted, 12)
    assert sandbox.needs_widening(1, 1)


def test_role_names_only_this_sessions_chunks():
    role = sandbox.build_role(BODY, 3)
    assert role["metadata"]["name"] == "savepoint-sandbox-s1"
    assert role["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    named, create, _heartbeat = role["rules"]
    assert named == {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "verbs": ["get", "patch", "update"],
        "resourceNames": ["s1-log-000001", "s1-log-000002", "s1-log-000003"],
    }
    # Never list, watch, delete, nor any other resource: create alone is unnamed (RBAC
    # cannot name it), and the admission policy narrows it.
    assert create == {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]}
    assert sandbox.granted_window(role) == 3
    assert sandbox.granted_window(None) == 0


def test_binding_ties_the_account_to_its_role():
    binding = sandbox.build_role_binding(BODY)
    account = sandbox.build_service_account(BODY)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "savepoint-sandbox-s1",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "ns"}]


def test_the_pod_runs_as_the_sandbox_account_whatever_the_template_says():
    template = {**TEMPLATE, "spec": {**TEMPLATE["spec"], "serviceAccountName": "admin", "serviceAccount": "admin"}}
    pod = build_pod(BODY, SessionSpec.model_validate({"podTemplate": template}), "c", 0)["spec"]
    assert pod["serviceAccountName"] == "savepoint-sandbox-s1"
    assert "serviceAccount" not in pod
    assert pod["automountServiceAccountToken"] is True
    env = pod["containers"][0]["env"]
    assert {"name": "SAVEPOINT_SESSION_UID", "value": "u-1"} in env
    # An explicit "no token" is a choice to keep: less than the sandbox could have.
    template = {**TEMPLATE, "spec": {**TEMPLATE["spec"], "automountServiceAccountToken": False}}
    pod = build_pod(BODY, SessionSpec.model_validate({"podTemplate": template}), "c", 0)["spec"]
    assert pod["automountServiceAccountToken"] is False


class SandboxCore(FakeCore):
    """A sandbox's view: no list at all, and GETs only within a window of names."""

    def __init__(self, session: str, window: int) -> None:
        super().__init__()
        self.allowed = {sandbox.chunk_name(session, i) for i in range(1, window + 1)}
        self.reads = 0

    def list_namespaced_config_map(self, *args, **kwargs):
        raise ApiException(status=403, reason="Forbidden")

    def read_namespaced_config_map(self, name, namespace, **kwargs):
        self.reads += 1
        if name not in self.allowed:
            raise ApiException(status=403, reason="Forbidden")
        return super().read_namespaced_config_map(name, namespace, **kwargs)


def test_by_name_mode_appends_reads_and_rolls_over_without_listing():
    core = SandboxCore("s", 40)
    elog = EventLog(core, "ns", "s", max_chunk_bytes=1024, discovery="names")
    elog.ensure()
    written = [elog.append("msg", {"i": i, "pad": "x" * 100}) for i in range(60)]
    names = elog.chunk_names()
    assert len(names) > 5 and names[0] == "s-log-000001"
    assert [e.id for e in elog.read()] == [e.id for e in written]
    # A second client (a restarted harness) finds the tail by name and goes on.
    again = EventLog(core, "ns", "s", max_chunk_bytes=1024, discovery="names")
    assert again.cursor().seq == 60
    assert again.append("msg", {}).seq == 61
    assert again.newest_chunk() == len(again.chunk_names())


def test_by_name_discovery_is_logarithmic_and_survives_retention():
    core = SandboxCore("s", 200)
    writer = EventLog(core, "ns", "s", max_chunk_bytes=1024, discovery="names")
    for i in range(400):
        writer.append("msg", {"i": i, "pad": "x" * 150})
    newest = writer.newest_chunk()
    assert newest > 60
    core.reads = 0
    assert EventLog(core, "ns", "s", discovery="names").newest_chunk() == newest
    assert core.reads < 20
    # Retention deleted a prefix: found by stepping over the missing names.
    for i in range(1, 11):
        core.objects.pop(sandbox.chunk_name("s", i))
    reader = EventLog(core, "ns", "s", discovery="names")
    assert reader.chunk_names()[0] == "s-log-000011"
    assert reader.read(partial=True)[-1].seq == 400


def test_by_name_mode_says_so_when_the_log_is_forbidden():
    core = SandboxCore("other", 5)
    with pytest.raises(ApiException) as err:
        EventLog(core, "ns", "s", discovery="names").append("msg", {})
    assert err.value.status == 403


def test_from_env_uses_the_operators_variables(monkeypatch):
    monkeypatch.setenv("SAVEPOINT_NAMESPACE", "team-a")
    monkeypatch.setenv("SAVEPOINT_SESSION", "s")
    monkeypatch.setenv("SAVEPOINT_SESSION_UID", "u-9")
    elog = EventLog.from_env(SandboxCore("s", 3))
    assert (elog.namespace, elog.session, elog.discovery) == ("team-a", "s", "names")
    assert elog.owner == {
        "apiVersion": "savepoint.dev/v1alpha1",
        "kind": "Session",
        "name": "s",
        "uid": "u-9",
        "controller": True,
    }
    elog.append("msg", {})
    assert elog.core.objects["s-log-000001"]["metadata"]["ownerReferences"] == [elog.owner]
    with pytest.raises(ValueError):
        EventLog(elog.core, "ns", "s", discovery="guess")
