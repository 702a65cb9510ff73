"""The Helm chart on the real control plane: lint, server-side dry run, install, and the operator
running under the chart's ServiceAccount, which proves the ClusterRole is enough and no more.

The Deployment's Pods have no kwok toleration and stay Pending: only the objects the chart
installs are tested, and the operator runs as a local process with the chart's credentials.
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import yaml
from kubernetes import client, config

from savepoint.models import GROUP, VERSION
from tests.chart.test_chart import CHART
from tests.conftest import REPO, unique, wait_for
from tests.integration.test_checkpoint import make_checkpoint, wait_checkpoint
from tests.integration.test_fork import make_fork, wait_fork
from tests.integration.test_session import make_session, wait_phase

KUBECTL = str(Path(sys.executable).parent / "kubectl")
TTL_DAYS = 29  # not the operator's default, so a Ready checkpoint shows which operator accepted it


@pytest.fixture(scope="module")
def sh(kubeconfig: str, helm_binary: Path, tmp_path_factory) -> Callable[..., str]:
    """Run helm or kubectl against the test cluster; fail with stderr unless it succeeds."""
    home = tmp_path_factory.mktemp("helm-home")
    env = {**os.environ, "KUBECONFIG": kubeconfig}
    env.update({var: str(home / var.lower()) for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")})

    def run(tool: str, *args: str, stdin: str | None = None) -> str:
        argv = [str(helm_binary) if tool == "helm" else KUBECTL, *args, "--kubeconfig", kubeconfig]
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
        if done.returncode != 0:
            pytest.fail(f"{tool} {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}", pytrace=False)
        return done.stdout

    return run


@pytest.fixture(scope="module")
def peering_crds(sh, crds) -> None:
    """kopf's peering CRDs (the chart's crds/ ships them), so the dry run knows KopfPeering."""
    sh("kubectl", "apply", "--server-side", "-f", str(CHART / "crds" / "kopf-peering.yaml"))
    sh("kubectl", "wait", "--for", "condition=Established", "--timeout", "60s", "crd/kopfpeerings.kopf.dev")


def new_namespace(core: client.CoreV1Api, prefix: str) -> str:
    name = unique(prefix)
    meta = client.V1ObjectMeta(name=name, labels={"savepoint.dev/test": "true"})
    core.create_namespace(client.V1Namespace(metadata=meta))

    # Without its default ServiceAccount a Pod create is refused, which would read as an RBAC gap.
    def has_default_sa() -> bool:
        return bool(core.list_namespaced_service_account(name, field_selector="metadata.name=default").items)

    wait_for(has_default_sa, timeout=60, what=f"default ServiceAccount in {name}")
    return name


def test_helm_lint_strict(sh):
    sh("helm", "lint", "--strict", str(CHART))


# cert-manager is not installed here, so the webhook's TLS comes from a Secret and a CA bundle.
WEBHOOK = [
    "webhook.enabled=true",
    "webhook.certManager.enabled=false",
    "webhook.tls.secretName=webhook-tls",
    f"webhook.tls.caBundle={base64.b64encode(b'not a real CA').decode()}",
]


@pytest.mark.parametrize("sets", [[], WEBHOOK], ids=["webhook-off", "webhook-on"])
def test_rendered_chart_passes_server_dry_run(sh, peering_crds, namespace, sets):
    args = ["template", unique("sp"), str(CHART), "--namespace", namespace]
    for item in sets:
        args += ["--set", item]
    out = sh("kubectl", "apply", "--dry-run=server", "-f", "-", stdin=sh("helm", *args))
    assert "deployment.apps/" in out and "clusterrole.rbac.authorization.k8s.io/" in out
    assert ("validatingwebhookconfiguration" in out) == bool(sets)


@pytest.fixture(scope="module")
def release(sh, peering_crds, core) -> Iterator[dict]:
    """The chart installed (a unique release), watching one namespace of its own."""
    name = unique("sp")
    info = {"name": name, "sa": f"{name}-savepoint", "namespace": new_namespace(core, "sp-install")}
    info["watch"] = new_namespace(core, "sp-watch")
    sh(
        "helm", "install", info["name"], str(CHART), "--namespace", info["namespace"],
        "--set", f"watchNamespaces={{{info['watch']}}}", "--timeout", "5m",
    )  # fmt: skip
    yield info
    sh("helm", "uninstall", info["name"], "--namespace", info["namespace"], "--timeout", "5m")
    for name in (info["watch"], info["namespace"]):
        core.delete_namespace(name, propagation_policy="Background")


def test_helm_install_creates_the_operator_objects(release, api):
    name, ns, sa = release["name"], release["namespace"], release["sa"]
    deploy = client.AppsV1Api(api).read_namespaced_deployment(sa, ns)
    assert deploy.spec.replicas == 2 and deploy.spec.template.spec.service_account_name == sa
    env = {e.name: e.value for e in deploy.spec.template.spec.containers[0].env}
    assert env["SAVEPOINT_PEERING"] == name and env["SAVEPOINT_NAMESPACES"] == release["watch"]
    client.CoreV1Api(api).read_namespaced_service_account(sa, ns)
    client.CoreV1Api(api).read_namespaced_service(f"{sa}-metrics", ns)
    binding = client.RbacAuthorizationV1Api(api).read_cluster_role_binding(sa)
    assert [(s.name, s.namespace) for s in binding.subjects] == [(sa, ns)]
    # kopf waits for its peering object and never creates it: the chart does, in the watched namespace.
    client.CustomObjectsApi(api).get_namespaced_custom_object("kopf.dev", "v1", release["watch"], "kopfpeerings", name)


@pytest.fixture(scope="module")
def sa_kubeconfig(release, kubeconfig, core, tmp_path_factory) -> Path:
    """A kubeconfig that authenticates as the chart's ServiceAccount (a TokenRequest token)."""
    request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600))
    token = core.create_namespaced_service_account_token(release["sa"], release["namespace"], request).status.token
    admin = yaml.safe_load(Path(kubeconfig).read_text())
    current = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
    cluster = next(c for c in admin["clusters"] if c["name"] == current["cluster"])
    path = tmp_path_factory.mktemp("sa") / "kubeconfig"
    context = {"name": "savepoint-test-sa", "context": {"cluster": cluster["name"], "user": "sa"}}
    body = {"apiVersion": "v1", "kind": "Config", "clusters": [cluster], "contexts": [context]}
    body.update({"users": [{"name": "sa", "user": {"token": token}}], "current-context": "savepoint-test-sa"})
    path.write_text(yaml.safe_dump(body))
    return path


@pytest.fixture
def shared_operator_stopped(operator_process) -> None:
    """conftest's cluster-wide operator would act on our namespace too and hide RBAC gaps.

    Stop it; the next test that asks for `operator` starts it again.
    """
    operator_process.stop()


@pytest.fixture
def sa_operator(release, sa_kubeconfig, shared_operator_stopped, tmp_path) -> Iterator[Path]:
    """`python -m savepoint` as the ServiceAccount, watching release["watch"]; yields its log."""
    log = tmp_path / "operator.log"
    env = {
        **os.environ,
        "KUBECONFIG": str(sa_kubeconfig),
        "PYTHONPATH": str(REPO / "operator"),
        "SAVEPOINT_NAMESPACES": release["watch"],
        "SAVEPOINT_PEERING": release["name"],
        "SAVEPOINT_METRICS_PORT": "0",
        "SAVEPOINT_WEBHOOK": "false",
        "SAVEPOINT_LOG_LEVEL": "INFO",
        "SAVEPOINT_DEFAULT_CHECKPOINT_TTL": f"{TTL_DAYS}d",
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "savepoint"], env=env, stdout=out, stderr=subprocess.STDOUT)
    time.sleep(2)
    if proc.poll() is not None:
        pytest.fail(f"the operator exited at start:\n{log.read_text()[-3000:]}", pytrace=False)
    yield log
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


# What the client library and kopf log when the API server says no.
REFUSED = re.compile(r"forbidden| 403\b|not enough (rbac )?permissions", re.I)
# What the operator under test must have logged (s2 is the fork's new Session).
HANDLED = {"Handler 'session_create' succeeded": 2, "fork .*/f1 succeeded: session s2 is ready": 1}


def checkpoint_and_fork(crds, ns: str) -> None:
    make_session(crds, ns, "s1")
    wait_phase(crds, ns, "s1", "Ready", timeout=120)
    make_checkpoint(crds, ns, "c1", session="s1")
    status = wait_checkpoint(crds, ns, "c1", "Ready", "Failed", "Rejected", timeout=180)["status"]
    assert status["phase"] == "Ready", status
    created, expires = (datetime.strptime(status[k], "%Y-%m-%dT%H:%M:%SZ") for k in ("createdAt", "expiresAt"))
    assert expires - created == timedelta(days=TTL_DAYS), "the checkpoint was not accepted by the operator under test"
    make_fork(crds, ns, "f1", {"checkpoint": "c1"}, target="s2")
    fork = wait_fork(crds, ns, "f1", timeout=180)
    assert fork["status"]["phase"] == "Succeeded", fork["status"]
    wait_phase(crds, ns, "s2", "Ready", timeout=120)
    # No finalizer holds it: the garbage collector deletes its VolumeSnapshot after it.
    crds.delete_namespaced_custom_object(GROUP, VERSION, ns, "checkpoints", "c1")
    wait_for(lambda: not crds.list_namespaced_custom_object(GROUP, VERSION, ns, "checkpoints")["items"],
             timeout=120, what="checkpoint c1 deleted")  # fmt: skip


def test_operator_as_the_chart_service_account_checkpoints_and_forks(release, sa_operator, crds):
    try:
        checkpoint_and_fork(crds, release["watch"])
    finally:
        refused = [line for line in sa_operator.read_text().splitlines() if REFUSED.search(line)]
        assert not refused, "the ServiceAccount was refused:\n" + "\n".join(refused[:20])
    log = sa_operator.read_text()
    for line, times in HANDLED.items():
        assert len(re.findall(line, log)) >= times, f"{line!r} is not in its log:\n{log[-3000:]}"


# (verb, group, resource, subresource, namespaced): what the operator calls, and what it must not do.
ALLOWED = [
    ("create", "", "pods", "", True),
    ("delete", "", "persistentvolumeclaims", "", True),
    ("patch", GROUP, "sessions", "status", True),
    ("create", "snapshot.storage.k8s.io", "volumesnapshots", "", True),
    ("patch", "kopf.dev", "kopfpeerings", "", True),
    ("get", "kopf.dev", "kopfpeerings", "", True),  # peering.is_active()
    # Checkpoint hooks (chart value hooks.enabled, on by default): an exec is a GET, then
    # its upgrade is authorized as create.
    ("get", "", "pods", "exec", True),
    ("create", "", "pods", "exec", True),
    ("watch", "apiextensions.k8s.io", "customresourcedefinitions", "", False),
]
DENIED = [
    ("get", "", "secrets", "", True),
    ("delete", "", "namespaces", "", False),
    ("create", "", "serviceaccounts", "token", True),
    ("update", "apiextensions.k8s.io", "customresourcedefinitions", "", False),
    ("bind", "rbac.authorization.k8s.io", "clusterroles", "", False),
    ("delete", "snapshot.storage.k8s.io", "volumesnapshotcontents", "", False),
]


def test_requests_outside_the_role_are_forbidden(release, sa_kubeconfig):
    sa = config.new_client_from_config(config_file=str(sa_kubeconfig))
    ns = release["watch"]
    for call in (
        lambda: client.CoreV1Api(sa).list_namespaced_secret(ns),
        lambda: client.CoreV1Api(sa).delete_namespace(unique("no-such-namespace")),
        lambda: client.RbacAuthorizationV1Api(sa).list_cluster_role(),
    ):
        with pytest.raises(client.ApiException) as refused:
            call()
        assert refused.value.status == 403

    def can(verb: str, group: str, resource: str, sub: str, namespaced: bool) -> bool:
        attrs = client.V1ResourceAttributes(
            verb=verb, group=group, resource=resource, subresource=sub or None, namespace=ns if namespaced else None
        )
        review = client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=attrs))
        return client.AuthorizationV1Api(sa).create_self_subject_access_review(review).status.allowed

    assert [rule for rule in ALLOWED if not can(*rule)] == []
    assert [rule for rule in DENIED if can(*rule)] == []
