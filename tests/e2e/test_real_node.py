"""The product's stories on running processes: the operator installed by its Helm chart as
Pods on the real node, sandboxes running the reference harness (`python -m
savepoint.harness`) with the workspace mounted by our CSI driver at /workspace.

Every file here is written and read by a process inside a sandbox container (through
`kubectl exec`), never on the host. Like the other e2e tests this refuses to run once the
cluster-wide `operator` fixture of tests/conftest.py is up: two operators would act on
the same objects.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from savepoint.eventlog import EventLog
from savepoint.models import GROUP, VERSION
from tests.conftest import REPO, TEST_RUN_DIR, unique, wait_for
from tests.e2e.support import shared_operator_started

KUBECTL = str(Path(sys.executable).parent / "kubectl")
HELM_VERSION = next(
    line.split("=", 1)[1].strip()
    for line in (REPO / "hack" / "versions.env").read_text().splitlines()
    if line.startswith("HELM_VERSION=")
)
REAL_NODE = {"type": "real"}
RELEASE = "savepoint"
LIFETIME = 10  # the chart's peering lifetime here: a killed active replica is replaced within it


def images() -> dict[str, str]:
    """The images hack/cluster built and imported into the node's containerd."""
    found = {k: v for k, v in os.environ.items() if k in ("OPERATOR_IMAGE", "HARNESS_IMAGE")}
    path = TEST_RUN_DIR / "node" / "images.env"
    if path.exists():
        for line in path.read_text().splitlines():
            if "=" in line:
                key, value = line.strip().split("=", 1)
                found.setdefault(key, value)
    return found


def helm_path() -> Path:
    cache = Path(
        os.environ.get("SAVEPOINT_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "savepoint"
    )
    return cache / "bin" / f"helm-{HELM_VERSION}" / "helm"


def run(*argv: str, timeout: float = 120, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=stdin)
    if check and done.returncode != 0:
        pytest.fail(
            f"{' '.join(argv[:6])} ... failed ({done.returncode}):\n{done.stdout}\n{done.stderr}", pytrace=False
        )
    return done


@pytest.fixture(scope="module")
def real_node(core: client.CoreV1Api) -> str:
    nodes = core.list_node(label_selector="type=real").items
    ready = [
        n.metadata.name for n in nodes if any(c.type == "Ready" and c.status == "True" for c in n.status.conditions)
    ]
    if not ready:
        pytest.fail(
            "no Ready Node labelled type=real: hack/cluster starts one (the kubelet's log is in "
            "logs/kubelet.log of the run folder)",
            pytrace=False,
        )
    return ready[0]


@pytest.fixture(scope="module")
def in_cluster_operator(request, kubeconfig, crds, core, real_node) -> Iterator[dict]:
    """`helm install` of charts/savepoint with the image built here: two replicas on the real node."""
    if shared_operator_started(request):
        pytest.fail(
            "the cluster-wide `operator` fixture is running and would act here; run tests/e2e first", pytrace=False
        )
    built = images()
    if "OPERATOR_IMAGE" not in built or "HARNESS_IMAGE" not in built:
        pytest.fail(f"no images recorded in {TEST_RUN_DIR / 'node' / 'images.env'} (hack/build-images)", pytrace=False)
    if not helm_path().exists():
        run(str(REPO / "hack" / "build-binaries"), "helm", timeout=1800)
    namespace = unique("savepoint-system")
    repo, tag = built["OPERATOR_IMAGE"].rsplit(":", 1)
    home = Path(f"/tmp/{namespace}-helm")
    env = {
        **os.environ,
        "KUBECONFIG": kubeconfig,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    install = [
        str(helm_path()),
        "install",
        RELEASE,
        str(REPO / "charts" / "savepoint"),
        "-n",
        namespace,
        "--create-namespace",
        "--wait",
        "--timeout",
        "180s",
        "--set",
        f"image.repository={repo}",
        "--set",
        f"image.tag={tag}",
        "--set",
        "image.pullPolicy=Never",
        "--set",
        "replicaCount=2",
        "--set",
        f"peering.lifetime={LIFETIME}",
        "--set",
        "resyncSeconds=10",
        "--set",
        "expiryIntervalSeconds=1",
        "--set-json",
        f"nodeSelector={json.dumps(REAL_NODE)}",
    ]
    done = subprocess.run(install, capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0:
        pods = run(KUBECTL, "-n", namespace, "describe", "pods", check=False).stdout[-4000:]
        pytest.fail(f"helm install failed:\n{done.stderr}\n{pods}", pytrace=False)
    info = {"namespace": namespace, "harness": built["HARNESS_IMAGE"], "node": real_node}
    try:
        yield info
    finally:
        subprocess.run(
            [str(helm_path()), "uninstall", RELEASE, "-n", namespace, "--wait", "--timeout", "120s"],
            capture_output=True,
            env=env,
            timeout=180,
        )
        # Gone before any later operator starts: two would act on the same objects.
        wait_for(
            lambda: not core.list_namespaced_pod(namespace).items,
            timeout=120,
            what="the in-cluster operator's Pods gone",
        )
        core.delete_namespace(namespace)


@pytest.fixture
def ns(in_cluster_operator, core, request) -> Iterator[str]:
    name = unique("rn")
    core.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={"savepoint.dev/test": "true"}))
    )
    wait_for(
        lambda: core.list_namespaced_service_account(name, field_selector="metadata.name=default").items,
        timeout=60,
        what=f"default ServiceAccount in {name}",
    )
    yield name
    core.delete_namespace(name, propagation_policy="Background")


def harness_template(image: str) -> dict:
    return {
        "spec": {
            "containers": [{"name": "agent", "image": image, "imagePullPolicy": "Never"}],
            "nodeSelector": REAL_NODE,
            # The harness runs as 10001; the kubelet gives the workspace to this group.
            "securityContext": {"fsGroup": 10001},
            "terminationGracePeriodSeconds": 2,
        }
    }


def make_session(crds, namespace: str, name: str, image: str, **spec) -> dict:
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Session",
        "metadata": {"name": name},
        "spec": {
            "podTemplate": harness_template(image),
            "workspace": {"size": "64Mi"},
            "harness": {"name": "savepoint-harness", "revision": "1"},
            **spec,
        },
    }
    return crds.create_namespaced_custom_object(GROUP, VERSION, namespace, "sessions", body)


def get(crds, namespace: str, plural: str, name: str) -> dict:
    return crds.get_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)


def wait_phase(crds, namespace: str, plural: str, name: str, *phases: str, timeout: float = 120) -> dict:
    def reached():
        try:
            body = get(crds, namespace, plural, name)
        except client.ApiException as err:
            if err.status == 404:
                return None
            raise
        return body if (body.get("status") or {}).get("phase") in phases else None

    return wait_for(reached, timeout=timeout, what=f"{plural}/{name} in {namespace} to reach {phases}")


def create(crds, namespace: str, plural: str, kind: str, name: str, spec: dict) -> dict:
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": kind, "metadata": {"name": name}, "spec": spec}
    return crds.create_namespaced_custom_object(GROUP, VERSION, namespace, plural, body)


def harness(namespace: str, pod: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`python -m savepoint.harness ARGS` inside the sandbox container, as the sandbox's own user."""
    return run(
        KUBECTL,
        "exec",
        "-n",
        namespace,
        pod,
        "-c",
        "agent",
        "--",
        "python",
        "-m",
        "savepoint.harness",
        *args,
        check=check,
        timeout=60,
    )


def in_pod(namespace: str, pod: str, script: str) -> subprocess.CompletedProcess:
    return run(
        KUBECTL, "exec", "-n", namespace, pod, "-c", "agent", "--", "python", "-c", script, check=False, timeout=60
    )


def running_pod(core, namespace: str, session: str, not_uid: str | None = None) -> client.V1Pod:
    def ready():
        try:
            pod = core.read_namespaced_pod(session, namespace)
        except client.ApiException as err:
            if err.status == 404:
                return None
            raise
        if pod.metadata.uid == not_uid or pod.status.phase != "Running" or pod.metadata.deletion_timestamp:
            return None
        return pod if all(c.ready for c in pod.status.container_statuses or []) else None

    return wait_for(ready, timeout=120, what=f"pod {session} running in {namespace}")


@pytest.fixture
def s1(in_cluster_operator, crds, core, ns) -> client.V1Pod:
    make_session(crds, ns, "s1", in_cluster_operator["harness"])
    wait_phase(crds, ns, "sessions", "s1", "Ready")
    return running_pod(core, ns, "s1")


def test_the_operator_runs_in_cluster_under_the_charts_service_account(in_cluster_operator, core, api):
    namespace = in_cluster_operator["namespace"]
    pods = core.list_namespaced_pod(namespace, label_selector="app.kubernetes.io/name=savepoint").items
    assert len(pods) == 2
    for pod in pods:
        assert pod.status.phase == "Running"
        assert pod.spec.node_name == in_cluster_operator["node"]
        assert pod.spec.service_account_name == RELEASE
        assert pod.status.pod_ip and not pod.status.pod_ip.startswith("127.")
    # /metrics through the chart's Service (the API server's service proxy picks an endpoint).
    service = core.list_namespaced_service(namespace, label_selector="app.kubernetes.io/component=metrics").items[0]
    text = core.connect_get_namespaced_service_proxy_with_path(f"{service.metadata.name}:metrics", namespace, "metrics")
    assert "savepoint_peering_active" in text


def test_a_fork_process_reads_the_checkpointed_files_and_the_parent_keeps_its_own(
    in_cluster_operator, s1, crds, core, ns
):
    pod = s1.metadata.name
    mounts = run(KUBECTL, "exec", "-n", ns, pod, "-c", "agent", "--", "cat", "/proc/self/mounts").stdout
    assert " /workspace " in mounts
    turn = json.loads(harness(ns, pod, "turn", "--message", "write the plan", "--write", "plan.md=v1").stdout)
    assert turn
    create(crds, ns, "checkpoints", "Checkpoint", "c1", {"sessionName": "s1", "label": "plan v1"})
    ready = wait_phase(crds, ns, "checkpoints", "c1", "Ready", "Failed", "Rejected")
    assert ready["status"]["phase"] == "Ready", ready["status"]
    harness(ns, pod, "write", "plan.md", "v2")

    create(crds, ns, "forks", "Fork", "f1", {"source": {"checkpoint": "c1"}, "target": {"sessionName": "s2"}})
    assert wait_phase(crds, ns, "forks", "f1", "Succeeded", "Failed")["status"]["phase"] == "Succeeded"
    wait_phase(crds, ns, "sessions", "s2", "Ready")
    child = running_pod(core, ns, "s2")
    assert harness(ns, child.metadata.name, "read", "plan.md").stdout.strip() == "v1"
    assert harness(ns, pod, "read", "plan.md").stdout.strip() == "v2"
    # The child's conversation is the checkpoint's prefix.
    events = [e.type for e in EventLog(core, ns, "s2").read()]
    assert "user.message" in events and "run.completed" in events


def test_a_rollback_replaces_the_running_process_with_one_on_the_old_disk(in_cluster_operator, s1, crds, core, ns):
    pod = s1.metadata.name
    harness(ns, pod, "write", "state.txt", "before")
    create(crds, ns, "checkpoints", "Checkpoint", "c1", {"sessionName": "s1"})
    assert wait_phase(crds, ns, "checkpoints", "c1", "Ready", "Failed")["status"]["phase"] == "Ready"
    harness(ns, pod, "write", "state.txt", "after")

    create(crds, ns, "forks", "Fork", "undo", {"source": {"checkpoint": "c1"}, "mode": "Rollback"})
    assert wait_phase(crds, ns, "forks", "undo", "Succeeded", "Failed")["status"]["phase"] == "Succeeded"
    wait_phase(crds, ns, "sessions", "s1", "Ready")
    new = running_pod(core, ns, "s1", not_uid=s1.metadata.uid)
    assert harness(ns, new.metadata.name, "read", "state.txt").stdout.strip() == "before"
    assert any(e.type == "session.rollback" for e in EventLog(core, ns, "s1").read())


def test_pause_and_resume_keep_the_files_and_a_fork_at_an_event_starts_empty(in_cluster_operator, s1, crds, core, ns):
    harness(ns, s1.metadata.name, "turn", "--message", "hello", "--write", "kept.txt=yes")
    crds.patch_namespaced_custom_object(GROUP, VERSION, ns, "sessions", "s1", {"spec": {"operatingMode": "Paused"}})
    wait_phase(crds, ns, "sessions", "s1", "Paused")
    wait_for(
        lambda: not core.list_namespaced_pod(ns, field_selector="metadata.name=s1").items,
        timeout=60,
        what="the paused session's Pod gone",
    )
    crds.patch_namespaced_custom_object(GROUP, VERSION, ns, "sessions", "s1", {"spec": {"operatingMode": "Running"}})
    wait_phase(crds, ns, "sessions", "s1", "Ready")
    resumed = running_pod(core, ns, "s1", not_uid=s1.metadata.uid)
    assert harness(ns, resumed.metadata.name, "read", "kept.txt").stdout.strip() == "yes"

    message = next(e for e in EventLog(core, ns, "s1").read() if e.type == "user.message")
    create(
        crds,
        ns,
        "forks",
        "Fork",
        "at",
        {"source": {"session": "s1", "atEvent": message.id}, "target": {"sessionName": "s3"}},
    )
    assert wait_phase(crds, ns, "forks", "at", "Succeeded", "Failed")["status"]["phase"] == "Succeeded"
    # Forked inside the run (after its user.message): the run is still in flight there.
    wait_phase(crds, ns, "sessions", "s3", "Running")
    child = running_pod(core, ns, "s3")
    absent = harness(ns, child.metadata.name, "read", "kept.txt", check=False)
    assert absent.returncode != 0
    assert [e.seq for e in EventLog(core, ns, "s3").read()][: message.seq] == list(range(1, message.seq + 1))


def test_a_sandbox_token_appends_to_its_own_log_and_reads_nothing_else(in_cluster_operator, s1, crds, core, ns):
    make_session(crds, ns, "other", in_cluster_operator["harness"])
    wait_phase(crds, ns, "sessions", "other", "Ready")
    script = """
import json, sys
from kubernetes import client, config
from savepoint.eventlog import EventLog
config.load_incluster_config()
core = client.CoreV1Api()
out = {"seq": EventLog.from_env(core).append("agent.message", {"text": "from inside"}).seq}
for what, call in (("other", lambda: core.read_namespaced_config_map("other-log-000001", sys.argv[1])),
                   ("secrets", lambda: core.list_namespaced_secret(sys.argv[1]))):
    try:
        call()
        out[what] = 200
    except client.ApiException as err:
        out[what] = err.status
print(json.dumps(out))
""".replace("sys.argv[1]", repr(ns))
    done = in_pod(ns, s1.metadata.name, script)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["other"] == 403 and result["secrets"] == 403
    assert EventLog(core, ns, "s1").read()[-1].seq == result["seq"]


def test_a_checkpoint_taken_during_writes_restores_a_whole_file(in_cluster_operator, s1, crds, core, ns):
    pod = s1.metadata.name
    # The harness rewrites the file (temp file, then rename) for 30 s while the cut is taken.
    writer = subprocess.Popen(
        [
            KUBECTL,
            "exec",
            "-n",
            ns,
            pod,
            "-c",
            "agent",
            "--",
            "python",
            "-m",
            "savepoint.harness",
            "churn",
            "busy.dat",
            "--seconds",
            "30",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(
            lambda: harness(ns, pod, "verify", "busy.dat", check=False).returncode == 0,
            timeout=30,
            what="the writer's first file",
        )
        for name in ("w1", "w2"):
            create(crds, ns, "checkpoints", "Checkpoint", name, {"sessionName": "s1"})
            assert wait_phase(crds, ns, "checkpoints", name, "Ready", "Failed")["status"]["phase"] == "Ready"
    finally:
        writer.terminate()
        writer.wait(timeout=30)
    create(crds, ns, "forks", "Fork", "fw", {"source": {"checkpoint": "w2"}, "target": {"sessionName": "sw"}})
    assert wait_phase(crds, ns, "forks", "fw", "Succeeded", "Failed")["status"]["phase"] == "Succeeded"
    wait_phase(crds, ns, "sessions", "sw", "Ready")
    child = running_pod(core, ns, "sw")
    verify = harness(ns, child.metadata.name, "verify", "busy.dat", check=False)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_the_in_cluster_operator_expires_a_checkpoint(in_cluster_operator, s1, crds, ns):
    create(crds, ns, "checkpoints", "Checkpoint", "brief", {"sessionName": "s1", "ttl": "3s"})
    expired = wait_phase(crds, ns, "checkpoints", "brief", "Expired", timeout=60)
    snapshot = expired["status"].get("volumeSnapshotName") or "sp-brief"
    objects = client.CustomObjectsApi(crds.api_client)
    wait_for(
        lambda: (
            not [
                s
                for s in objects.list_namespaced_custom_object("snapshot.storage.k8s.io", "v1", ns, "volumesnapshots")[
                    "items"
                ]
                if s["metadata"]["name"] == snapshot
            ]
        ),
        timeout=60,
        what=f"VolumeSnapshot {snapshot} deleted at expiry",
    )


def _active_replicas(core, namespace: str) -> list[str]:
    active = []
    for pod in core.list_namespaced_pod(namespace, label_selector="app.kubernetes.io/name=savepoint").items:
        if pod.status.phase != "Running" or pod.metadata.deletion_timestamp:
            continue
        try:
            text = core.connect_get_namespaced_pod_proxy_with_path(f"{pod.metadata.name}:8080", namespace, "metrics")
        except client.ApiException:
            continue
        if any(
            line.startswith("savepoint_peering_active ") and float(line.split()[1]) == 1.0 for line in text.splitlines()
        ):
            active.append(pod.metadata.name)
    return active


def test_the_standby_replica_takes_over_when_the_active_pod_dies(in_cluster_operator, s1, crds, core, ns):
    namespace = in_cluster_operator["namespace"]
    active = wait_for(lambda: _active_replicas(core, namespace) or None, timeout=60, what="an active replica")
    assert len(active) == 1
    core.delete_namespaced_pod(active[0], namespace, grace_period_seconds=0)
    started = time.monotonic()
    create(crds, ns, "checkpoints", "Checkpoint", "after-failover", {"sessionName": "s1"})
    done = wait_phase(crds, ns, "checkpoints", "after-failover", "Ready", "Failed", timeout=LIFETIME * 6)
    assert done["status"]["phase"] == "Ready"
    took = time.monotonic() - started
    print(f"failover: checkpoint Ready {took:.1f}s after the active replica was killed")
    new_active = wait_for(lambda: _active_replicas(core, namespace) or None, timeout=60, what="an active replica")
    assert active[0] not in new_active


def test_a_session_whose_image_is_not_on_the_node_says_so(in_cluster_operator, crds, ns):
    missing = "savepoint.local/not-built:1"
    make_session(crds, ns, "noimage", missing)
    body = wait_phase(crds, ns, "sessions", "noimage", "Failed", timeout=90)
    text = json.dumps(body["status"].get("conditions"))
    assert "ErrImageNeverPull" in text and missing in text


@pytest.mark.skipif(bool(os.environ.get("SAVEPOINT_TEST_KUBECONFIG")), reason="restarts the local node's processes")
def test_sandboxes_keep_running_across_kubelet_and_containerd_restarts(in_cluster_operator, s1, core, ns):
    pod = s1.metadata.name
    harness(ns, pod, "write", "alive.txt", "1")
    started = core.read_namespaced_pod(pod, ns).status.container_statuses[0].state.running.started_at
    env = {**os.environ, "SAVEPOINT_RUN_DIR": str(TEST_RUN_DIR)}
    for component in ("containerd", "kubelet"):
        done = subprocess.run(
            [str(REPO / "hack" / "cluster"), "restart", component], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
    wait_for(
        lambda: harness(ns, pod, "read", "alive.txt", check=False).returncode == 0,
        timeout=60,
        what="exec into the sandbox after the restarts",
    )
    status = core.read_namespaced_pod(pod, ns).status.container_statuses[0]
    assert status.restart_count == 0
    assert status.state.running.started_at == started


def test_a_workspace_the_node_plugin_cannot_publish_shows_on_the_session(in_cluster_operator, s1, crds, core, ns):
    from tests.csi_data import pvc_data_dir

    claim = get(crds, ns, "sessions", "s1")["status"]["workspaceClaimName"]
    crds.patch_namespaced_custom_object(GROUP, VERSION, ns, "sessions", "s1", {"spec": {"operatingMode": "Paused"}})
    wait_phase(crds, ns, "sessions", "s1", "Paused")
    # The volume's folder disappears from the node: NodePublishVolume can only fail now.
    folder = pvc_data_dir(core, ns, claim)
    folder.rename(folder.with_name(folder.name + ".gone"))
    try:
        crds.patch_namespaced_custom_object(
            GROUP, VERSION, ns, "sessions", "s1", {"spec": {"operatingMode": "Running"}}
        )

        def failed_mount():
            ready = next(
                (
                    c
                    for c in (get(crds, ns, "sessions", "s1").get("status") or {}).get("conditions", [])
                    if c["type"] == "Ready"
                ),
                {},
            )
            return ready if ready.get("reason") == "VolumeMountFailed" else None

        ready = wait_for(failed_mount, timeout=90, what="the Session's Ready condition naming the FailedMount")
        assert "MountVolume.SetUp failed" in ready["message"] and ready["status"] == "False"
    finally:
        folder.with_name(folder.name + ".gone").rename(folder)
    running_pod(core, ns, "s1", not_uid=s1.metadata.uid)  # the kubelet retries and the mount succeeds


def test_the_chart_lets_the_operator_run_checkpoint_hooks(in_cluster_operator, crds, core, ns):
    """The chart's RBAC (pods/exec get and create, nodes get) is enough for both hooks."""
    flush = {"exec": {"command": ["python", "-m", "savepoint.harness", "flush"]}}
    hooks = {"preCheckpoint": flush, "postCheckpoint": {"exec": {"command": ["true"]}}}
    make_session(crds, ns, "hk", in_cluster_operator["harness"], checkpointPolicy={"hooks": hooks})
    wait_phase(crds, ns, "sessions", "hk", "Ready")
    pod = running_pod(core, ns, "hk").metadata.name
    harness(ns, pod, "turn", "--message", "later", "--write", "kept.txt=flushed", "--buffered")
    wait_phase(crds, ns, "sessions", "hk", "Ready")
    create(crds, ns, "checkpoints", "Checkpoint", "c1", {"sessionName": "hk"})
    body = wait_phase(crds, ns, "checkpoints", "c1", "Ready", "Failed", "Rejected")
    assert body["status"]["phase"] == "Ready", body["status"]
    runs = body["status"]["hooks"]
    assert runs["preCheckpoint"]["phase"] == "Succeeded" and runs["postCheckpoint"]["phase"] == "Succeeded", runs
    assert harness(ns, pod, "read", "kept.txt").stdout == "flushed"
