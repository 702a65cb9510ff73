"""Security on the real control plane: what a sandbox's own token may do, and that no
secret from a Pod template or a Secret reaches a status, an Event or the event log.

The sandbox's token comes from a TokenRequest for its ServiceAccount, exactly what the
kubelet would mount into its Pod; the chart's ValidatingAdmissionPolicy is applied from
config/default (what hack/update-manifests renders from the chart).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
import yaml
from kubernetes import client

from savepoint.eventlog import EventLog
from savepoint.models import GROUP, VERSION
from savepoint.sandbox import LOOKAHEAD, account_name, chunk_name, granted_window, needs_widening
from tests.conftest import REPO, wait_for
from tests.integration.test_checkpoint import make_checkpoint, wait_checkpoint
from tests.integration.test_fork import make_fork, wait_fork
from tests.integration.test_session import KWOK_POD, make_session, wait_phase

POLICY = REPO / "config" / "default" / "sandbox-policy.yaml"


@pytest.fixture(scope="module")
def sandbox_policy(api: client.ApiClient) -> Iterator[None]:
    """The chart's ValidatingAdmissionPolicy and its binding, in force."""
    reg = client.AdmissionregistrationV1Api(api)
    policy, binding = list(yaml.safe_load_all(POLICY.read_text()))
    for body, create, delete in (
        (policy, reg.create_validating_admission_policy, reg.delete_validating_admission_policy),
        (binding, reg.create_validating_admission_policy_binding, reg.delete_validating_admission_policy_binding),
    ):
        try:
            create(body)
        except client.ApiException as err:
            if err.status != 409:
                raise
            delete(body["metadata"]["name"])
            wait_for(lambda b=body, c=create: _created(c, b), timeout=30, what=f"{body['kind']} re-created")
    # The API server enforces a new policy only once its admission plugin has seen both
    # objects; until then a sandbox's wrong create would pass. Wait for a refusal.
    wait_for(lambda: _policy_refuses(api), timeout=30, what="the sandbox policy in force")
    yield
    reg.delete_validating_admission_policy_binding(binding["metadata"]["name"])
    reg.delete_validating_admission_policy(policy["metadata"]["name"])


def _created(create, body) -> bool:
    try:
        create(body)
        return True
    except client.ApiException as err:
        if err.status == 409:
            return False
        raise


def _policy_refuses(api: client.ApiClient) -> bool:
    """Whether a dry-run create of a name no sandbox may write, as a sandbox account, is
    refused by the policy. The probe is also in system:masters, so RBAC lets it through
    and only admission can refuse it; a dry run stores nothing."""
    probe = client.ApiClient(api.configuration)
    probe.set_default_header("Impersonate-User", "system:serviceaccount:default:savepoint-sandbox-probe")
    probe.set_default_header("Impersonate-Group", "system:masters")
    body = chunk_body("not-a-chunk", "probe")
    try:
        client.CoreV1Api(probe).create_namespaced_config_map("default", body, dry_run="All")
    except client.ApiException as err:
        if err.status == 403 and "writes only its own event-log chunks" in (err.body or ""):
            return True
        raise
    return False


def sandbox_core(api: client.ApiClient, core: client.CoreV1Api, namespace: str, session: str) -> client.CoreV1Api:
    """A CoreV1Api with the session's sandbox token, as its Pod would have it."""
    request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600))
    token = core.create_namespaced_service_account_token(account_name(session), namespace, request).status.token
    conf = client.Configuration()
    conf.host = api.configuration.host
    conf.ssl_ca_cert = api.configuration.ssl_ca_cert
    conf.verify_ssl = api.configuration.verify_ssl
    conf.api_key = {"authorization": f"Bearer {token}"}
    return client.CoreV1Api(client.ApiClient(conf))


def refused(call, *args, **kwargs) -> client.ApiException:
    with pytest.raises(client.ApiException) as err:
        call(*args, **kwargs)
    assert err.value.status == 403, err.value
    return err.value


def chunk_body(name: str, session: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "labels": {"savepoint.dev/session": session},
            "annotations": {"savepoint.dev/first-seq": "1"},
        },
        "data": {},
    }


def test_sandbox_appends_to_its_own_log_and_nothing_else(
    operator, sandbox_policy, api, core, crds, namespace, monkeypatch
):
    for name in ("s1", "s2"):
        make_session(crds, namespace, name)
    s1 = wait_phase(crds, namespace, "s1", "Ready", timeout=90)
    wait_phase(crds, namespace, "s2", "Ready", timeout=90)
    pod = core.read_namespaced_pod("s1", namespace)
    assert pod.spec.service_account_name == account_name("s1")
    assert pod.spec.automount_service_account_token is True
    sandbox = sandbox_core(api, core, namespace, "s1")

    # What a harness does inside the Pod: everything from the operator's env variables.
    env = {e.name: e.value for e in pod.spec.containers[0].env}
    for var in ("SAVEPOINT_NAMESPACE", "SAVEPOINT_SESSION", "SAVEPOINT_SESSION_UID"):
        monkeypatch.setenv(var, env[var])
    log = EventLog.from_env(sandbox, max_chunk_bytes=1024)
    written = [log.append("tool.call", {"i": i, "pad": "x" * 300}) for i in range(12)]
    assert len(log.chunk_names()) >= 4  # rolled over, by create, as the sandbox
    admin = EventLog(core, namespace, "s1")
    assert [e.id for e in admin.read()] == [e.id for e in written]
    made = core.read_namespaced_config_map(log.chunk_names()[-1], namespace)
    assert [r.uid for r in made.metadata.owner_references] == [s1["metadata"]["uid"]]

    # The operator widens the Role's window as the log grows.
    role = client.RbacAuthorizationV1Api(api)

    def window() -> int:
        body = role.read_namespaced_role(account_name("s1"), namespace, _preload_content=False)
        return granted_window(json.loads(body.data))

    newest = EventLog(core, namespace, "s1", max_chunk_bytes=1024)
    while not needs_widening(window(), len(newest.chunk_names())):
        newest.append("filler", {"pad": "y" * 700})
    grown = len(newest.chunk_names())
    wait_for(lambda: window() >= grown + LOOKAHEAD, timeout=30, what="the sandbox's Role widened")
    assert log.append("tool.call", {"after": "widening", "pad": "z" * 700}).seq == admin.cursor().seq

    # Another session's log: neither read, written, nor created under its name.
    other = chunk_name("s2", 1)
    refused(sandbox.read_namespaced_config_map, other, namespace)
    refused(sandbox.patch_namespaced_config_map, other, namespace, {"data": {"x": "y"}})
    refused(EventLog(sandbox, namespace, "s2", discovery="names").append, "msg", {})
    err = refused(sandbox.create_namespaced_config_map, namespace, chunk_body(chunk_name("s2", 2), "s2"))
    assert "metadata.name" in err.body, err.body
    # Its own name, someone else's label; its own chunk, someone else's owner.
    err = refused(sandbox.create_namespaced_config_map, namespace, chunk_body(chunk_name("s1", 99), "s2"))
    assert "metadata.labels[savepoint.dev/session]" in err.body, err.body
    body = chunk_body(chunk_name("s1", 98), "s1")
    body["metadata"]["ownerReferences"] = [
        {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Session", "name": "s2", "uid": "0" * 8}
    ]
    err = refused(sandbox.create_namespaced_config_map, namespace, body)
    assert "metadata.ownerReferences" in err.body, err.body
    refused(sandbox.create_namespaced_config_map, namespace, chunk_body("anything", "s1"))

    # No list, no Secrets, nothing else in the namespace.
    refused(sandbox.list_namespaced_config_map, namespace)
    refused(sandbox.list_namespaced_secret, namespace)
    refused(sandbox.read_namespaced_secret, "planted", namespace)
    refused(sandbox.list_namespaced_pod, namespace)
    refused(sandbox.delete_namespaced_config_map, chunk_name("s1", 1), namespace)
    refused(
        client.CustomObjectsApi(sandbox.api_client).list_namespaced_custom_object,
        GROUP, VERSION, namespace, "sessions",
    )  # fmt: skip


PLANTED = {
    "env": "sk-live-PLANTEDENVVALUE0123456789",
    "secret": "ghp_PLANTEDSECRETVALUE9876543210",
    "annotation": "PLANTEDTEMPLATEANNOTATION42",
}


def test_no_secret_reaches_a_status_an_event_or_the_log(operator, sandbox_policy, core, crds, namespace):
    core.create_namespaced_secret(
        namespace,
        client.V1Secret(metadata=client.V1ObjectMeta(name="planted"), string_data={"token": PLANTED["secret"]}),
    )
    template = json.loads(json.dumps(KWOK_POD))
    template["metadata"] = {"annotations": {"note": PLANTED["annotation"]}}
    template["spec"]["containers"][0]["env"] = [
        {"name": "API_KEY", "value": PLANTED["env"]},
        {"name": "GH_TOKEN", "valueFrom": {"secretKeyRef": {"name": "planted", "key": "token"}}},
    ]
    make_session(crds, namespace, "s1", podTemplate=template)
    wait_phase(crds, namespace, "s1", "Ready", timeout=90)
    log = EventLog(core, namespace, "s1")
    log.append("run.started", {"runId": "r1"})
    log.append("run.completed", {"runId": "r1"})
    wait_phase(crds, namespace, "s1", "Ready")

    make_checkpoint(crds, namespace, "c1")
    assert wait_checkpoint(crds, namespace, "c1", "Ready", "Failed")["status"]["phase"] == "Ready"
    make_fork(crds, namespace, "f1", {"checkpoint": "c1"}, target="s1-fork")
    assert wait_fork(crds, namespace, "f1")["status"]["phase"] == "Succeeded"
    make_fork(crds, namespace, "rb1", {"checkpoint": "c1"}, mode="Rollback")
    assert wait_fork(crds, namespace, "rb1")["status"]["phase"] == "Succeeded"
    wait_phase(crds, namespace, "s1", "Ready", timeout=90)
    wait_phase(crds, namespace, "s1-fork", "Ready", timeout=90)

    written: list[tuple[str, str]] = []
    for plural in ("sessions", "checkpoints", "forks"):
        for obj in crds.list_namespaced_custom_object(GROUP, VERSION, namespace, plural)["items"]:
            written.append((f"{plural}/{obj['metadata']['name']} status", json.dumps(obj.get("status") or {})))
    events = core.list_namespaced_event(namespace, _preload_content=False)
    for event in json.loads(events.data)["items"]:
        written.append((f"Event {event['metadata']['name']}", json.dumps(event)))
    for session in ("s1", "s1-fork"):
        for ev in EventLog(core, namespace, session).read(partial=True):
            written.append((f"{session} log seq {ev.seq}", ev.to_json()))
    assert sum(1 for what, _ in written if what.startswith("Event ")) > 5
    assert any("log seq" in what for what, _ in written)
    for what, text in written:
        for kind, value in PLANTED.items():
            assert value not in text, f"the {kind} value was written into {what}"


def test_after_a_restart_sandbox_roles_are_learned_per_namespace_not_per_session(operator, api, crds, namespace):
    """The first Session pass in a namespace lists the sandbox Roles and RoleBindings once;
    the thousands of resume passes after a restart then read none of them one by one. A
    Role whose RoleBinding is gone is not trusted: that Session's pass reads and mends it."""
    from prometheus_client import REGISTRY

    from savepoint.controllers import sandbox as access

    rbac_api = client.RbacAuthorizationV1Api(api)
    bodies = [make_session(crds, namespace, name) for name in ("r1", "r2", "r3")]
    for body in bodies:
        wait_phase(crds, namespace, body["metadata"]["name"], "Ready", timeout=90)
    rbac_api.delete_namespaced_role_binding(account_name("r3"), namespace)

    def sent(verb: str) -> float:  # the verb is the HTTP method: a LIST is a GET
        return sum(
            REGISTRY.get_sample_value("savepoint_api_requests_total", {"client": "operator", "verb": verb, "code": c})
            or 0
            for c in ("200", "201", "404")
        )

    # This test's process plays the restarted operator: nothing remembered yet.
    assert namespace not in access._listed and not any(b["metadata"]["uid"] in access._granted for b in bodies)
    gets = sent("GET")
    for body in bodies[:2]:
        assert access.ensure_sandbox_access(body, newest=1) == account_name(body["metadata"]["name"])
    assert sent("GET") - gets == 2, "not one listing of Roles and one of RoleBindings for the namespace"
    for body in bodies[:2]:
        role = rbac_api.read_namespaced_role(account_name(body["metadata"]["name"]), namespace)
        names = [n for rule in role.rules for n in rule.resource_names or [] if "-log-" in n]
        assert access._granted[body["metadata"]["uid"]] == max(int(n.rsplit("-", 1)[1]) for n in names)

    # A Session the listing did not show (one made since, to the operator's process): its
    # three objects are made without a read first, each create answered 201. (A body with
    # no Session behind it, so that the operator under test does not make them meanwhile;
    # the garbage collector takes them soon after.)
    unseen = {"metadata": {"namespace": namespace, "name": "r9", "uid": str(uuid.uuid4())}}
    gets, posts = sent("GET"), sent("POST")
    assert access.ensure_sandbox_access(unseen, newest=1) == account_name("r9")
    assert (sent("GET") - gets, sent("POST") - posts) == (0, 3)

    gets = sent("GET")
    assert bodies[2]["metadata"]["uid"] not in access._granted  # its RoleBinding is gone
    access.ensure_sandbox_access(bodies[2], newest=1)
    assert sent("GET") > gets
    wait_for(
        lambda: rbac_api.read_namespaced_role_binding(account_name("r3"), namespace),
        timeout=10,
        what="the missing RoleBinding made again",
    )
