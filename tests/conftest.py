"""Shared fixtures: a real cluster for the whole run, a fresh namespace per test.

The cluster is the one named by SAVEPOINT_TEST_KUBECONFIG when that is set (any real
cluster, for example kind); otherwise the local control plane from hack/cluster is
started in its own run folder and stopped at the end of the run.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from tests.operator_process import OperatorProcess

REPO = Path(__file__).resolve().parent.parent
TEST_RUN_DIR = REPO / ".run" / "test-cluster"
# Contexts we are willing to create and delete things in.
TEST_CONTEXT = re.compile(os.environ.get("SAVEPOINT_TEST_CONTEXT_PATTERN", r"^(savepoint-local|kind-.*|.*test.*)$"))


# Fixtures that need more than Python: a cluster (everything cluster-bound asks for
# kubeconfig) or a binary built from Go. `make unit` runs on a machine with only Python.
NOT_FOR_UNIT_TESTS = {"kubeconfig", "helm_binary"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        outside = NOT_FOR_UNIT_TESTS & set(getattr(item, "fixturenames", ()))
        if "unit" in item.path.parts and outside:
            raise pytest.UsageError(f"{item.nodeid} is in tests/unit but needs {sorted(outside)}: move it out")
        if "integration" in item.path.parts or "e2e" in item.path.parts:
            item.add_marker(pytest.mark.cluster)
        if "chart" in item.path.parts or ("integration" in item.path.parts and item.path.name == "test_install.py"):
            item.add_marker(pytest.mark.tools)


def _helm_version() -> str:
    text = (REPO / "hack" / "versions.env").read_text()
    return re.search(r"^HELM_VERSION=(\S+)$", text, flags=re.M)[1]


def helm_path() -> Path:
    """Where hack/build-binaries puts the pinned helm (outside the clone, shared by clones)."""
    cache = os.environ.get("SAVEPOINT_CACHE") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "savepoint"
    )
    return Path(cache) / "bin" / f"helm-{_helm_version()}" / "helm"


@pytest.fixture(scope="session")
def helm_binary() -> Path:
    """The pinned helm, built by `hack/build-binaries helm` when this machine has none yet
    (a no-op once it is cached; a cold build needs Go and takes minutes)."""
    path = helm_path()
    if not os.access(path, os.X_OK):
        done = subprocess.run([str(REPO / "hack" / "build-binaries"), "helm"], capture_output=True, text=True)
        if done.returncode != 0 or not os.access(path, os.X_OK):
            pytest.fail(f"`hack/build-binaries helm` could not build {path}:\n{done.stderr[-4000:]}", pytrace=False)
    return path


@pytest.fixture(scope="session")
def kubeconfig() -> Iterator[str]:
    given = os.environ.get("SAVEPOINT_TEST_KUBECONFIG")
    if given:
        os.environ["KUBECONFIG"] = given  # for code under test that loads the default config
        yield given
        return
    # The fault tests restart etcd; a CSI controller that misses an object in the gap
    # finishes it at its next resync (hack/csi_stack.py), which is 15 min by default.
    env = {**os.environ, "SAVEPOINT_RUN_DIR": str(TEST_RUN_DIR), "SAVEPOINT_CSI_RESYNC": "1m"}
    up = subprocess.run([str(REPO / "hack" / "cluster"), "up"], env=env, capture_output=True, text=True)
    if up.returncode != 0:
        pytest.fail(f"could not start the local control plane:\n{up.stderr}", pytrace=False)
    os.environ["KUBECONFIG"] = str(TEST_RUN_DIR / "kubeconfig")
    try:
        yield str(TEST_RUN_DIR / "kubeconfig")
    finally:
        if os.environ.get("SAVEPOINT_TEST_KEEP_CLUSTER") != "1":
            subprocess.run([str(REPO / "hack" / "cluster"), "down"], env=env, capture_output=True)


@pytest.fixture(scope="session")
def api(kubeconfig: str) -> client.ApiClient:
    _, active = config.list_kube_config_contexts(config_file=kubeconfig)
    if not TEST_CONTEXT.match(active["name"]):
        pytest.exit(
            f"refusing to run cluster tests against context {active['name']!r}: it does not look like a "
            "test cluster (set SAVEPOINT_TEST_CONTEXT_PATTERN to allow it)",
            returncode=3,
        )
    return config.new_client_from_config(config_file=kubeconfig)


@pytest.fixture(scope="session")
def core(api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def namespace(core: client.CoreV1Api, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace with its default ServiceAccount in place; deleted afterwards."""
    base = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    name = unique(f"t-{base}")
    core.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={"savepoint.dev/test": "true"}))
    )
    wait_for(lambda: _has_default_sa(core, name), timeout=30, what=f"default ServiceAccount in {name}")
    yield name
    try:
        core.delete_namespace(name, propagation_policy="Background")
    except client.ApiException as err:
        if err.status != 404:  # a test may delete it itself
            raise


def _has_default_sa(core: client.CoreV1Api, namespace: str) -> bool:
    try:
        core.read_namespaced_service_account("default", namespace)
        return True
    except client.ApiException as err:
        if err.status == 404:
            return False
        raise


def wait_for(predicate, timeout: float = 30, interval: float = 0.2, what: str = "condition"):
    """Poll until predicate() is truthy and return its value; fail naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}", pytrace=False)
        time.sleep(interval)


@pytest.fixture
def gone_version(core: client.CoreV1Api, namespace: str) -> str:
    """A ConfigMaps resourceVersion the API server no longer serves: a watch from it is
    answered 410 Gone. The API server's watch cache serves every version it still holds,
    and on a quiet cluster it holds every one since its start; this writes and deletes
    unlabelled ConfigMaps until the cache has let go of the first version."""
    from savepoint import k8s

    def gone() -> bool:
        try:
            for _ in k8s.watch(k8s.CONFIG_MAPS, namespace, "1", "", 1):
                pass
        except k8s.Expired:
            return True
        for i in range(20):
            core.create_namespaced_config_map(namespace, {"metadata": {"name": f"churn-{i}"}})
            core.delete_namespaced_config_map(f"churn-{i}", namespace)
        return False

    wait_for(gone, timeout=300, interval=0, what='the API server to answer a watch from version "1" with 410 Gone')
    return "1"


CRD_DIR = REPO / "crds"


@pytest.fixture(scope="session")
def crds(api: client.ApiClient) -> client.CustomObjectsApi:
    """Savepoint's CRDs, installed from crds/ (what hack/update-crds generated)."""
    import yaml

    ext = client.ApiextensionsV1Api(api)
    names = []
    for path in sorted(CRD_DIR.glob("*.yaml")):
        body = yaml.safe_load(path.read_text())
        names.append(body["metadata"]["name"])
        try:
            ext.create_custom_resource_definition(body)
        except client.ApiException as err:
            if err.status != 409:
                raise
            current = ext.read_custom_resource_definition(body["metadata"]["name"])
            body["metadata"]["resourceVersion"] = current.metadata.resource_version
            ext.replace_custom_resource_definition(body["metadata"]["name"], body)

    def established(name: str) -> bool:
        crd = ext.read_custom_resource_definition(name)
        return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])

    for name in names:
        wait_for(lambda n=name: established(n), what=f"CRD {name} established")
    return client.CustomObjectsApi(api)


@pytest.fixture(scope="session")
def operator_process(kubeconfig: str, crds: client.CustomObjectsApi) -> Iterator[OperatorProcess]:
    log_path = REPO / ".run" / "operator-test.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    webhook = _webhook_certificate(REPO / ".run" / "webhook-test")
    metrics_port = _free_port()
    env = {
        **os.environ,
        "SAVEPOINT_WEBHOOK": "true",
        "SAVEPOINT_WEBHOOK_ADDR": "127.0.0.1",
        "SAVEPOINT_WEBHOOK_PORT": str(webhook["port"]),
        "SAVEPOINT_WEBHOOK_CERT_DIR": str(webhook["cert"].parent),
        "KUBECONFIG": kubeconfig,
        "PYTHONPATH": str(REPO / "operator"),
        "SAVEPOINT_METRICS_PORT": str(metrics_port),
        "SAVEPOINT_RESYNC_SECONDS": "10",
        "SAVEPOINT_EXPIRY_INTERVAL_SECONDS": "1",
        "SAVEPOINT_LOG_LEVEL": "DEBUG",
    }
    env.pop("SAVEPOINT_FAILPOINTS", None)
    operator = OperatorProcess(env, log_path, check_start=1)
    operator.webhook = webhook
    operator.metrics_url = f"http://127.0.0.1:{metrics_port}"
    operator.start()
    yield operator
    operator.stop()


@pytest.fixture
def operator(operator_process: OperatorProcess) -> OperatorProcess:
    """The operator, running (restarted if an earlier test killed it)."""
    operator_process.ensure_running()
    return operator_process


def _webhook_certificate(folder: Path) -> dict:
    """A self-signed serving certificate for the operator's webhook on 127.0.0.1."""
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / "tls.crt", folder / "tls.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return {"cert": cert, "key": key, "port": _free_port()}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


WEBHOOK_LABEL = "savepoint.dev/webhook-test"


@pytest.fixture(scope="session")
def webhook(api: client.ApiClient, operator_process: OperatorProcess) -> Iterator[str]:
    """Route Checkpoint creates and Session writes in namespaces labelled WEBHOOK_LABEL=true
    to the operator's webhook."""
    import base64

    info = operator_process.webhook
    reg = client.AdmissionregistrationV1Api(api)
    name = "savepoint-test-webhook"
    body = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": "checkpoints.savepoint.dev",
                "clientConfig": {
                    "url": f"https://127.0.0.1:{info['port']}/validate-checkpoints",
                    "caBundle": base64.b64encode(info["cert"].read_bytes()).decode(),
                },
                "rules": [
                    {
                        "apiGroups": ["savepoint.dev"],
                        "apiVersions": ["v1alpha1"],
                        "operations": ["CREATE"],
                        "resources": ["checkpoints"],
                    }
                ],
                "namespaceSelector": {"matchLabels": {WEBHOOK_LABEL: "true"}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 10,
            },
            {
                "name": "sessions.savepoint.dev",
                "clientConfig": {
                    "url": f"https://127.0.0.1:{info['port']}/validate-sessions",
                    "caBundle": base64.b64encode(info["cert"].read_bytes()).decode(),
                },
                "rules": [
                    {
                        "apiGroups": ["savepoint.dev"],
                        "apiVersions": ["v1alpha1"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": ["sessions"],
                    }
                ],
                "namespaceSelector": {"matchLabels": {WEBHOOK_LABEL: "true"}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 10,
            },
        ],
    }
    try:
        reg.create_validating_webhook_configuration(body)
    except client.ApiException as err:
        if err.status != 409:
            raise
        reg.delete_validating_webhook_configuration(name)
        reg.create_validating_webhook_configuration(body)
    yield WEBHOOK_LABEL
    reg.delete_validating_webhook_configuration(name)


# --- a snapshot that never becomes ready ---------------------------------------------

SNAP = ("snapshot.storage.k8s.io", "v1")


@pytest.fixture
def never_ready_class(api) -> Iterator[str]:
    """A VolumeSnapshotClass of a CSI driver nobody runs: its snapshots never become ready.

    deletionPolicy Retain, so deleting such a VolumeSnapshot does not wait for the absent
    driver; the orphaned VolumeSnapshotContents are removed here by hand.
    """
    objects = client.CustomObjectsApi(api)
    name = unique("never-ready")
    objects.create_cluster_custom_object(
        *SNAP,
        "volumesnapshotclasses",
        {
            "apiVersion": "/".join(SNAP),
            "kind": "VolumeSnapshotClass",
            "metadata": {"name": name},
            "driver": "never-ready.savepoint.dev",
            "deletionPolicy": "Retain",
        },
    )
    yield name
    # Ask for it before `namespace` (or own_operator): by its teardown, theirs has deleted
    # the namespace and with it the snapshots.
    for content in objects.list_cluster_custom_object(*SNAP, "volumesnapshotcontents")["items"]:
        if content["spec"].get("volumeSnapshotClassName") == name:
            cname = content["metadata"]["name"]
            wait_for(lambda c=cname: _force_delete_content(objects, c), timeout=30, what=f"{cname} deleted")
    objects.delete_cluster_custom_object(*SNAP, "volumesnapshotclasses", name)


def make_stuck_snapshot(crds, namespace: str, checkpoint: str, session: str, class_name: str) -> None:
    """The VolumeSnapshot the controller would make for `checkpoint`, already there and stuck
    at `class_name`'s driver, which never answers: what a hung CSI driver looks like."""
    from savepoint.checkpoint import CHECKPOINT_LABEL, snapshot_name
    from savepoint.models import GROUP, VERSION
    from savepoint.session import SESSION_LABEL

    claim = crds.get_namespaced_custom_object(GROUP, VERSION, namespace, "sessions", session)["status"][
        "workspaceClaimName"
    ]
    crds.create_namespaced_custom_object(
        *SNAP,
        namespace,
        "volumesnapshots",
        {
            "apiVersion": "/".join(SNAP),
            "kind": "VolumeSnapshot",
            "metadata": {
                "name": snapshot_name(checkpoint),
                "labels": {CHECKPOINT_LABEL: checkpoint, SESSION_LABEL: session},
            },
            "spec": {"volumeSnapshotClassName": class_name, "source": {"persistentVolumeClaimName": claim}},
        },
    )


def _force_delete_content(objects, name: str) -> bool:
    """Delete a VolumeSnapshotContent no driver will ever release; True once gone."""
    try:
        objects.delete_cluster_custom_object(*SNAP, "volumesnapshotcontents", name)
        objects.patch_cluster_custom_object(*SNAP, "volumesnapshotcontents", name, {"metadata": {"finalizers": None}})
        objects.get_cluster_custom_object(*SNAP, "volumesnapshotcontents", name)
    except client.ApiException as err:
        if err.status == 404:
            return True
        raise
    return False
