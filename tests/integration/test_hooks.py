"""Checkpoint hooks (Session checkpointPolicy.hooks) run for real: the shared operator
process execs into reference-harness sandboxes on the real node through the API server's
pods/exec, and a fork's process reads what the snapshot holds.
"""

from __future__ import annotations

import json
import time

import pytest
from kubernetes import client

from savepoint.models import GROUP, VERSION
from tests.conftest import SNAP, wait_for
from tests.e2e.test_real_node import create, get, harness, harness_template, images, running_pod, wait_phase
from tests.integration.test_session import make_session as make_kwok_session

FLUSH = {"exec": {"command": ["python", "-m", "savepoint.harness", "flush"]}}
# A literal env value of the sandbox: no message may repeat it.
SECRET = "sk-test-5f0c1d2e3a4b"


def python_hook(script: str, **extra) -> dict:
    return {"exec": {"command": ["python", "-c", script]}, **extra}


@pytest.fixture(scope="module")
def harness_image() -> str:
    built = images()
    if "HARNESS_IMAGE" not in built:
        pytest.fail("no HARNESS_IMAGE recorded (hack/cluster up builds and imports it)", pytrace=False)
    return built["HARNESS_IMAGE"]


def real_session(crds, namespace: str, name: str, image: str, hooks: dict | None = None) -> client.V1Pod:
    template = harness_template(image)
    template["spec"]["containers"][0]["env"] = [{"name": "AGENT_API_KEY", "value": SECRET}]
    spec = {
        "podTemplate": template,
        "workspace": {"size": "64Mi"},
        "harness": {"name": "savepoint-harness", "revision": "1"},
    }
    if hooks is not None:
        spec["checkpointPolicy"] = {"hooks": hooks}
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Session", "metadata": {"name": name}, "spec": spec}
    crds.create_namespaced_custom_object(GROUP, VERSION, namespace, "sessions", body)
    wait_phase(crds, namespace, "sessions", name, "Ready")
    return running_pod(client.CoreV1Api(crds.api_client), namespace, name)


def set_hooks(crds, namespace: str, session: str, hooks: dict | None) -> None:
    patch = {"spec": {"checkpointPolicy": {"hooks": hooks}}}
    crds.patch_namespaced_custom_object(GROUP, VERSION, namespace, "sessions", session, patch)


def checkpoint(crds, namespace: str, name: str, session: str, timeout: float = 120) -> dict:
    create(crds, namespace, "checkpoints", "Checkpoint", name, {"sessionName": session})
    return wait_phase(crds, namespace, "checkpoints", name, "Ready", "Failed", "Rejected", timeout=timeout)


def fork_and_read(crds, core, namespace: str, source: str, target: str, path: str):
    create(
        crds,
        namespace,
        "forks",
        "Fork",
        f"f-{target}",
        {"source": {"checkpoint": source}, "target": {"sessionName": target}},
    )
    done = wait_phase(crds, namespace, "forks", f"f-{target}", "Succeeded", "Failed", timeout=180)
    assert done["status"]["phase"] == "Succeeded", done["status"]
    wait_phase(crds, namespace, "sessions", target, "Ready")
    child = running_pod(core, namespace, target)
    return harness(namespace, child.metadata.name, "read", path, check=False)


def snapshot_names(crds, namespace: str) -> list[str]:
    items = crds.list_namespaced_custom_object(*SNAP, namespace, "volumesnapshots")["items"]
    return [s["metadata"]["name"] for s in items]


def events_of(core, namespace: str, name: str) -> list:
    return core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items


def condition(body: dict, type_: str) -> dict:
    return next(c for c in body["status"]["conditions"] if c["type"] == type_)


def test_a_buffered_write_reaches_the_fork_only_through_the_flush_hook(operator, crds, core, namespace, harness_image):
    pod = real_session(crds, namespace, "s1", harness_image).metadata.name
    turn = json.loads(
        harness(namespace, pod, "turn", "--message", "note it", "--write", "note.txt=buffered", "--buffered").stdout
    )
    assert turn["buffered"] is True
    wait_phase(crds, namespace, "sessions", "s1", "Ready")
    plain = checkpoint(crds, namespace, "plain", "s1")
    assert plain["status"]["phase"] == "Ready" and "hooks" not in plain["status"]

    set_hooks(crds, namespace, "s1", {"preCheckpoint": FLUSH})
    hooked = checkpoint(crds, namespace, "hooked", "s1")
    assert hooked["status"]["phase"] == "Ready", hooked["status"]
    run = hooked["status"]["hooks"]["preCheckpoint"]
    assert run["phase"] == "Succeeded" and run["exitCode"] == 0
    assert condition(hooked, "PreCheckpointHook")["status"] == "True"
    print(f"preCheckpoint flush: {run['durationMs']} ms of the checkpoint's path")

    assert fork_and_read(crds, core, namespace, "plain", "without", "note.txt").returncode != 0
    with_hook = fork_and_read(crds, core, namespace, "hooked", "with", "note.txt")
    assert with_hook.returncode == 0 and with_hook.stdout == "buffered"


def test_a_failing_pre_hook_fails_the_checkpoint_before_any_snapshot(operator, crds, core, namespace, harness_image):
    noisy = (
        "import os, sys\n"
        "for i in range(8): print(f'step {i}', file=sys.stderr)\n"
        "print('key is ' + os.environ['AGENT_API_KEY'], file=sys.stderr)\n"
        "sys.exit(7)"
    )
    marker = "open('/workspace/post-ran', 'w').write('yes')"
    real_session(
        crds,
        namespace,
        "s1",
        harness_image,
        {"preCheckpoint": python_hook(noisy), "postCheckpoint": python_hook(marker)},
    )
    body = checkpoint(crds, namespace, "c1", "s1")
    status = body["status"]
    assert (status["phase"], status["reason"]) == ("Failed", "HookFailed"), status
    message = status["message"]
    assert "exited with code 7" in message and "step 7" in message and "key is [redacted]" in message
    assert "step 3" not in message  # at most the last 5 lines
    assert SECRET not in json.dumps(status) and SECRET not in json.dumps(
        [e.message for e in events_of(core, namespace, "c1")]
    )
    assert status["hooks"]["preCheckpoint"] == {
        "phase": "Failed",
        "exitCode": 7,
        "durationMs": status["hooks"]["preCheckpoint"]["durationMs"],
    }
    assert status["hooks"]["postCheckpoint"]["phase"] == "Skipped"  # nothing was cut
    assert snapshot_names(crds, namespace) == []
    pod = running_pod(core, namespace, "s1").metadata.name
    assert harness(namespace, pod, "read", "post-ran", check=False).returncode != 0


def test_a_failing_post_hook_is_a_warning_on_a_ready_checkpoint(operator, crds, core, namespace, harness_image):
    failing = "import sys; print('could not resume the agent', file=sys.stderr); sys.exit(4)"
    real_session(crds, namespace, "s1", harness_image, {"postCheckpoint": python_hook(failing, timeoutSeconds=10)})
    body = checkpoint(crds, namespace, "c1", "s1")
    assert body["status"]["phase"] == "Ready", body["status"]
    assert body["status"]["hooks"]["postCheckpoint"]["phase"] == "Failed"
    post = condition(body, "PostCheckpointHook")
    assert (post["status"], post["reason"]) == ("False", "HookFailed")
    assert "exited with code 4" in post["message"] and "could not resume the agent" in post["message"]
    warnings = wait_for(
        lambda: [e for e in events_of(core, namespace, "c1") if e.type == "Warning" and e.reason == "HookFailed"],
        timeout=30,
        what="a Warning Event HookFailed on c1",
    )
    assert "exited with code 4" in warnings[0].message
    assert snapshot_names(crds, namespace) == [body["status"]["volumeSnapshotName"]]


def test_a_pre_hook_that_outlives_its_timeout_fails_the_checkpoint(operator, crds, namespace, harness_image):
    real_session(
        crds,
        namespace,
        "s1",
        harness_image,
        {"preCheckpoint": python_hook("import time; time.sleep(60)", timeoutSeconds=2)},
    )
    started = time.monotonic()
    body = checkpoint(crds, namespace, "c1", "s1")
    assert time.monotonic() - started < 30
    assert (body["status"]["phase"], body["status"]["reason"]) == ("Failed", "HookFailed")
    assert "timed out after 2s" in body["status"]["message"]
    assert snapshot_names(crds, namespace) == []


def test_the_pre_hook_does_not_run_again_after_a_restart_past_the_cut(operator, crds, core, namespace, harness_image):
    count = "open('/workspace/pre-runs', 'a').write('x')"
    pod = real_session(crds, namespace, "s1", harness_image, {"preCheckpoint": python_hook(count)}).metadata.name
    operator.stop()
    operator.start(SAVEPOINT_FAILPOINTS="checkpoint.after_snapshot_created")
    try:
        create(crds, namespace, "checkpoints", "Checkpoint", "crashy", {"sessionName": "s1"})
        assert operator.wait_exit(90, "checkpoint.after_snapshot_created") == -9
        assert get(crds, namespace, "checkpoints", "crashy")["status"]["hooks"]["preCheckpoint"]["phase"] == "Succeeded"
    finally:
        operator.stop()
        operator.start()
    body = wait_phase(crds, namespace, "checkpoints", "crashy", "Ready", "Failed", timeout=120)
    assert body["status"]["phase"] == "Ready", body["status"]
    assert harness(namespace, pod, "read", "pre-runs").stdout == "x"


def test_hooks_on_a_kwok_session_are_refused_at_once(operator, crds, namespace):
    make_kwok_session(crds, namespace, "k1", checkpointPolicy={"hooks": {"preCheckpoint": FLUSH}})
    wait_phase(crds, namespace, "sessions", "k1", "Ready", timeout=90)
    started = time.monotonic()
    body = checkpoint(crds, namespace, "c1", "k1", timeout=60)
    assert time.monotonic() - started < 20
    status = body["status"]
    assert (status["phase"], status["reason"]) == ("Failed", "HookFailed"), status
    node = client.CoreV1Api(crds.api_client).read_namespaced_pod("k1", namespace).spec.node_name
    assert status["message"] == f"hooks need a real node: {node} is a kwok fake"
    assert snapshot_names(crds, namespace) == []


def test_an_operator_with_hooks_off_rejects_checkpoints_of_sessions_with_hooks(operator, crds, namespace):
    make_kwok_session(crds, namespace, "k1", checkpointPolicy={"hooks": {"postCheckpoint": FLUSH}})
    make_kwok_session(crds, namespace, "plain")
    wait_phase(crds, namespace, "sessions", "k1", "Ready", timeout=90)
    wait_phase(crds, namespace, "sessions", "plain", "Ready", timeout=90)
    operator.stop()
    operator.start(SAVEPOINT_HOOKS="false")
    try:
        body = checkpoint(crds, namespace, "c1", "k1", timeout=60)
        assert (body["status"]["phase"], body["status"]["reason"]) == ("Rejected", "HooksDisabled")
        assert "hooks.enabled" in body["status"]["message"]
        assert checkpoint(crds, namespace, "c2", "plain", timeout=60)["status"]["phase"] == "Ready"
    finally:
        operator.stop()
        operator.start()


def _exec_as(api: client.ApiClient, core, namespace: str, account: str, pod: str) -> int | str:
    """Exit code of `true` in the pod, exec'd with the account's own token; or the refusal."""
    from kubernetes.stream import stream

    request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=600))
    token = core.create_namespaced_service_account_token(account, namespace, request).status.token
    configuration = client.Configuration()
    configuration.host = api.configuration.host
    configuration.ssl_ca_cert = api.configuration.ssl_ca_cert
    configuration.api_key = {"authorization": f"Bearer {token}"}
    own = client.ApiClient(configuration)
    try:
        ws = stream(
            client.CoreV1Api(own).connect_get_namespaced_pod_exec,
            pod,
            namespace,
            command=["true"],
            stderr=True,
            stdin=False,
            stdout=True,
            tty=False,
            _preload_content=False,
        )
        ws.run_forever(timeout=30)
        return ws.returncode
    except client.ApiException as err:
        return str(err.reason)
    finally:
        own.close()


def test_pods_exec_get_and_create_are_the_grant_the_hooks_need(operator, api, crds, core, namespace, harness_image):
    """The chart grants get and create on pods/exec: a websocket exec is a GET, which the API
    server authorizes as `get` and then, for the upgrade, as `create`."""
    pod = real_session(crds, namespace, "s1", harness_image).metadata.name
    rbac = client.RbacAuthorizationV1Api(api)
    outcomes = {}
    for verbs in (["get", "create"], ["create"], ["get"]):
        account = "exec-" + "-".join(verbs)
        core.create_namespaced_service_account(namespace, {"metadata": {"name": account}})
        rule = {"apiGroups": [""], "resources": ["pods/exec"], "verbs": verbs}
        rbac.create_namespaced_role(namespace, {"metadata": {"name": account}, "rules": [rule]})
        rbac.create_namespaced_role_binding(
            namespace,
            {
                "metadata": {"name": account},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
                "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
            },
        )
        outcome = _exec_as(api, core, namespace, account, pod)
        outcomes[account] = outcome if outcome == 0 else ("403" if "403" in str(outcome) else outcome)
    assert outcomes == {"exec-get-create": 0, "exec-create": "403", "exec-get": "403"}
