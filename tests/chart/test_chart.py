"""The Helm chart, rendered with the pinned helm (built by the helm_binary fixture): RBAC, security, peering,
webhook. Needs no cluster, but helm, so not a unit test (marker `tools`).

Also checks that the plain manifests in config/ are what the chart renders today.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "savepoint"
RELEASE = "sp"
NAMESPACE = "savepoint-system"


@pytest.fixture(scope="module")
def helm(helm_binary: Path) -> list[str]:
    return [str(helm_binary)]


@pytest.fixture(scope="module", autouse=True)
def _helm_home(tmp_path_factory) -> None:
    # helm keeps caches and repository config under these; none of it belongs in $HOME.
    home = tmp_path_factory.mktemp("helm-home")
    HELM_ENV.update({var: str(home / var.lower()) for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")})


HELM_ENV: dict[str, str] = {}


def run(helm: list[str], *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([*helm, *args], capture_output=True, text=True, cwd=REPO, env={**os.environ, **HELM_ENV})
    if ok and done.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{done.stderr}", pytrace=False)
    return done


def render(helm: list[str], *sets: str) -> list[dict]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for item in sets:
        args += ["--set", item]
    return [doc for doc in yaml.safe_load_all(run(helm, *args).stdout) if doc]


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def kinds(objects: list[dict]) -> set[str]:
    return {o["kind"] for o in objects}


def container(objects: list[dict]) -> dict:
    return one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def env(objects: list[dict]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container(objects)["env"]}


@pytest.fixture(scope="module")
def default(helm) -> list[dict]:
    return render(helm)


def test_lint(helm):
    run(helm, "lint", "--strict", str(CHART))
    run(helm, "lint", "--strict", str(CHART), "--set", "webhook.enabled=true")


def test_default_objects(default):
    assert kinds(default) == {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "Service",
        "ClusterKopfPeering",
        "PodDisruptionBudget",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
    cluster_scoped = ("ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering")
    for obj in default:
        if obj["kind"] not in cluster_scoped + ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
            assert obj["metadata"]["namespace"] == NAMESPACE, obj["kind"]


def test_rbac_is_exactly_what_the_operator_uses(default):
    rules = one(default, "ClusterRole")["rules"]
    for rule in rules:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {field} of {rule}"
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}

    def grant(group: str, resources: list[str], verbs: str) -> set:
        return {(group, r, v) for r in resources for v in verbs.split()}

    expected = (
        grant("savepoint.dev", ["sessions", "checkpoints", "forks"], "get list watch create patch update delete")
        | grant("savepoint.dev", ["sessions/status", "checkpoints/status", "forks/status"], "get patch update")
        | grant("savepoint.dev", ["checkpoints/finalizers"], "update")
        | grant("", ["pods", "persistentvolumeclaims", "configmaps"], "get list watch create update patch delete")
        | grant("", ["persistentvolumes"], "get")
        | grant("", ["serviceaccounts"], "get create")
        | grant("rbac.authorization.k8s.io", ["roles"], "get list create patch")
        | grant("rbac.authorization.k8s.io", ["rolebindings"], "get list create")
        | grant("", ["namespaces"], "get list watch")
        | grant("", ["events"], "create patch list")
        | grant("events.k8s.io", ["events"], "create patch")
        | grant("storage.k8s.io", ["storageclasses"], "get")
        | grant("snapshot.storage.k8s.io", ["volumesnapshots"], "get list watch create patch delete")
        | grant("snapshot.storage.k8s.io", ["volumesnapshotclasses"], "get list")
        | grant("apiextensions.k8s.io", ["customresourcedefinitions"], "get list watch")
        | grant("kopf.dev", ["clusterkopfpeerings", "kopfpeerings"], "get list watch patch")
        # Checkpoint hooks (hooks.enabled, on by default).
        | grant("", ["pods/exec"], "get create")
        | grant("", ["nodes"], "get")
    )
    assert granted == expected
    binding = one(default, "ClusterRoleBinding")
    account = one(default, "ServiceAccount")
    assert binding["roleRef"]["name"] == one(default, "ClusterRole")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    pod = one(default, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]


def test_security_context(default):
    pod = one(default, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container(default)["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    # A read-only root needs a writable /tmp.
    assert {"name": "tmp", "mountPath": "/tmp"} in container(default)["volumeMounts"]


def test_two_replicas_with_peering(default):
    deployment = one(default, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert env(default)["SAVEPOINT_PEERING"] == RELEASE
    assert env(default)["SAVEPOINT_PEERING_LIFETIME"] == "60"
    assert one(default, "ClusterKopfPeering")["metadata"]["name"] == RELEASE
    assert env(default)["SAVEPOINT_NAMESPACES"] == ""


def test_the_chart_sets_only_settings_the_operator_reads(default):
    config = (REPO / "operator" / "savepoint" / "config.py").read_text()
    read = {f"SAVEPOINT_{name}" for name in re.findall(r'_(?:env|bool|int|float|duration|level)\("([A-Z_]+)"', config)}
    assert set(env(default)) <= read, set(env(default)) - read
    assert env(default)["SAVEPOINT_DEFAULT_CHECKPOINT_TTL"] == "30d"
    assert env(default)["SAVEPOINT_WEBHOOK"] == "false"


def test_image_metrics_and_liveness(default):
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    c = container(default)
    assert c["image"].endswith(f":{chart['appVersion']}")
    assert "command" not in c and "args" not in c  # the image's entrypoint: python -m savepoint
    assert c["ports"] == [{"name": "metrics", "containerPort": 8080, "protocol": "TCP"}]
    assert env(default)["SAVEPOINT_METRICS_PORT"] == "8080"
    probe = c["livenessProbe"]["httpGet"]
    assert probe == {"path": "/healthz", "port": "metrics"}
    service = one(default, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert service["spec"]["selector"] == one(default, "Deployment")["spec"]["selector"]["matchLabels"]
    assert c["resources"]["requests"] and c["resources"]["limits"]


def test_values_reach_the_operator(helm):
    objects = render(
        helm,
        "defaultCheckpointTTL=7d",
        "logLevel=DEBUG",
        "image.tag=dev",
        "watchNamespaces={team-a,team-b}",
        "replicaCount=3",
    )
    assert env(objects)["SAVEPOINT_DEFAULT_CHECKPOINT_TTL"] == "7d"
    assert env(objects)["SAVEPOINT_LOG_LEVEL"] == "DEBUG"
    assert env(objects)["SAVEPOINT_NAMESPACES"] == "team-a,team-b"
    assert container(objects)["image"].endswith(":dev")
    assert one(objects, "Deployment")["spec"]["replicas"] == 3
    # A namespaced operator peers through a KopfPeering in each namespace it watches.
    assert "ClusterKopfPeering" not in kinds(objects)
    assert sorted(o["metadata"]["namespace"] for o in objects if o["kind"] == "KopfPeering") == ["team-a", "team-b"]


def test_several_replicas_need_peering(helm):
    done = run(helm, "template", RELEASE, str(CHART), "--set", "peering.enabled=false", ok=False)
    assert done.returncode != 0 and "replicaCount > 1 needs peering.enabled" in done.stderr
    single = render(helm, "peering.enabled=false", "replicaCount=1")
    assert env(single)["SAVEPOINT_PEERING"] == ""
    assert not kinds(single) & {"ClusterKopfPeering", "KopfPeering", "PodDisruptionBudget"}


def test_hooks_off_drops_the_exec_grant_and_tells_the_operator(helm, default):
    assert env(default)["SAVEPOINT_HOOKS"] == "true"
    off = render(helm, "hooks.enabled=false")
    assert env(off)["SAVEPOINT_HOOKS"] == "false"
    resources = {r for rule in one(off, "ClusterRole")["rules"] for r in rule["resources"]}
    assert "pods/exec" not in resources and "nodes" not in resources
    assert "pods" in resources


def test_webhook_objects_only_when_enabled(helm, default):
    assert not kinds(default) & {"ValidatingWebhookConfiguration", "Certificate", "Issuer"}
    assert [o for o in default if o["kind"] == "Service"][0]["metadata"]["name"].endswith("-metrics")

    objects = render(helm, "webhook.enabled=true", "webhook.namespaceSelector.matchLabels.savepoint\\.dev/webhook=on")
    config = one(objects, "ValidatingWebhookConfiguration")
    hook = config["webhooks"][0]
    service = one(objects, "Service", hook["clientConfig"]["service"]["name"])
    assert service["spec"]["ports"][0]["targetPort"] == "webhook"
    assert hook["rules"] == [
        {
            "apiGroups": ["savepoint.dev"],
            "apiVersions": ["v1alpha1"],
            "resources": ["checkpoints"],
            "operations": ["CREATE"],
            "scope": "Namespaced",
        }
    ]
    assert hook["namespaceSelector"] == {"matchLabels": {"savepoint.dev/webhook": "on"}}
    assert hook["sideEffects"] == "None"
    sessions = config["webhooks"][1]
    assert sessions["clientConfig"]["service"]["path"] == "/validate-sessions"  # kopf serves a handler at its id
    assert sessions["rules"][0]["resources"] == ["sessions"]
    assert sessions["rules"][0]["operations"] == ["CREATE", "UPDATE"]
    assert sessions["namespaceSelector"] == hook["namespaceSelector"]
    assert env(objects)["SAVEPOINT_WEBHOOK"] == "true"
    assert any(p["name"] == "webhook" for p in container(objects)["ports"])
    # TLS from cert-manager by default: the Certificate's Secret is mounted, its CA injected.
    certificate = one(objects, "Certificate")
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        f"{NAMESPACE}/{certificate['metadata']['name']}"
    )
    volumes = one(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "webhook-tls", "secret": {"secretName": certificate["spec"]["secretName"]}} in volumes
    rules = one(objects, "ClusterRole")["rules"]
    assert {
        "apiGroups": ["admissionregistration.k8s.io"],
        "resources": ["validatingwebhookconfigurations"],
        "verbs": ["get", "list", "watch", "create", "patch"],
    } in rules


def test_webhook_with_own_certificate(helm):
    sets = ["webhook.enabled=true", "webhook.certManager.enabled=false", "webhook.tls.secretName=my-tls"]
    done = run(helm, "template", RELEASE, str(CHART), *[a for s in sets for a in ("--set", s)], ok=False)
    assert done.returncode != 0 and "webhook.tls.caBundle is required" in done.stderr
    objects = render(helm, *sets, "webhook.tls.caBundle=Q0E=")
    assert not kinds(objects) & {"Certificate", "Issuer"}
    assert one(objects, "ValidatingWebhookConfiguration")["webhooks"][0]["clientConfig"]["caBundle"] == "Q0E="


def test_chart_crds_are_the_generated_ones_plus_kopf_peering():
    ours = {p.name: p.read_text() for p in (REPO / "crds").glob("*.yaml")}
    in_chart = {p.name: p.read_text() for p in (CHART / "crds").glob("*.yaml")}
    assert {k: in_chart.get(k) for k in ours} == ours, "run hack/update-crds"
    peering = list(yaml.safe_load_all(in_chart["kopf-peering.yaml"]))
    assert {(c["spec"]["names"]["kind"], c["spec"]["scope"]) for c in peering} == {
        ("ClusterKopfPeering", "Cluster"),
        ("KopfPeering", "Namespaced"),
    }


def test_plain_manifests_are_in_sync(helm):
    done = subprocess.run(
        [str(REPO / "hack" / "update-manifests"), "--check"], capture_output=True, text=True, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    kustomization = yaml.safe_load((REPO / "config" / "default" / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in (REPO / "config" / "default").glob("*.yaml")} - {"kustomization.yaml"}
    crd_kustomization = yaml.safe_load((REPO / "config" / "crd" / "kustomization.yaml").read_text())
    assert set(crd_kustomization["resources"]) == {p.name for p in (CHART / "crds").glob("*.yaml")}


def test_sandbox_policy_keeps_sandboxes_to_their_own_chunks(helm, default):
    from savepoint.session import SANDBOX_ACCOUNT_PREFIX

    policy = one(default, "ValidatingAdmissionPolicy")
    binding = one(default, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConstraints"]["resourceRules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"], "resources": ["configmaps"]}
    ]
    # The policy finds the session in the account's name after the operator's prefix.
    assert f":{SANDBOX_ACCOUNT_PREFIX}[^:]+$" in spec["matchConditions"][0]["expression"]
    session = next(v for v in spec["variables"] if v["name"] == "session")["expression"]
    assert session.endswith(f".substring({len(SANDBOX_ACCOUNT_PREFIX)})")
    fields = [v["messageExpression"].split(":")[0].strip('"') for v in spec["validations"]]
    assert fields == ["metadata.namespace", "metadata.name", "metadata.labels[savepoint.dev/session]",
                      "metadata.ownerReferences"]  # fmt: skip
    assert all(v["reason"] == "Forbidden" for v in spec["validations"])
    off = render(helm, "sandboxPolicy.enabled=false")
    assert not kinds(off) & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


# What the chart sets on purpose, away from the operator's own defaults.
DEPLOYMENT_CHOICES = {"SAVEPOINT_PEERING", "SAVEPOINT_WEBHOOK", "SAVEPOINT_WEBHOOK_CERT_DIR", "SAVEPOINT_NAMESPACES"}


def test_chart_defaults_are_the_operators_defaults(default, monkeypatch):
    """A setting's default is the same under Helm as in the README (resyncSeconds once was 60
    against the operator's 600: at 2,000 sessions, ten times the resync requests)."""
    from savepoint.config import Settings

    for name in [n for n in os.environ if n.startswith("SAVEPOINT_")]:
        monkeypatch.delenv(name)
    own = Settings()
    differ = []
    for name, value in env(default).items():
        if not name.startswith("SAVEPOINT_") or name in DEPLOYMENT_CHOICES or value is None:
            continue
        monkeypatch.setenv(name, value)
        if Settings() != own:
            differ.append(f"{name}={value}")
        monkeypatch.delenv(name)
    assert not differ, f"the chart's defaults differ from the operator's: {differ}"
