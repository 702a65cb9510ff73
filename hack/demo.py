"""The Savepoint demo on running processes: the operator installed by its Helm chart, a
sandbox running the reference harness, files written and read inside the sandbox
container, a checkpoint, a fork, a rollback, and an expired checkpoint whose fork is refused.

Run through `make demo` (hack/demo), which brings up the local control plane (with its
real node and the images built here) unless KUBECONFIG names a cluster; then set
OPERATOR_IMAGE and HARNESS_IMAGE to images that cluster's nodes have. It prints
`kubectl get sps,ckpt,fork` after every step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "operator")]

from kubernetes import client, config  # noqa: E402

from savepoint.eventlog import EventLog  # noqa: E402
from savepoint.models import GROUP, VERSION  # noqa: E402

NS = f"demo-{uuid.uuid4().hex[:5]}"
OPERATOR_NS = "savepoint-system"
RUN_DIR = Path(os.environ.get("SAVEPOINT_RUN_DIR", REPO / ".run" / "cluster"))
BOLD, DIM, RESET = ("\033[1m", "\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "", "")


def images() -> dict[str, str]:
    found = {k: os.environ[k] for k in ("OPERATOR_IMAGE", "HARNESS_IMAGE") if os.environ.get(k)}
    recorded = RUN_DIR / "node" / "images.env"
    if recorded.exists():
        for line in recorded.read_text().splitlines():
            if "=" in line:
                key, value = line.strip().split("=", 1)
                found.setdefault(key, value)
    missing = {"OPERATOR_IMAGE", "HARNESS_IMAGE"} - set(found)
    if missing:
        raise SystemExit(f"set {', '.join(sorted(missing))} (hack/build-images builds them for the local cluster)")
    return found


def sandbox(image: str) -> dict:
    return {
        "spec": {
            "containers": [{"name": "agent", "image": image, "imagePullPolicy": "IfNotPresent"}],
            "securityContext": {"fsGroup": 10001},
            "terminationGracePeriodSeconds": 2,
        }
    }


def step(text: str) -> None:
    print(f"\n{BOLD}==> {text}{RESET}", flush=True)


def kubectl(*args: str, check: bool = True) -> str:
    out = subprocess.run(["kubectl", *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise SystemExit(f"kubectl {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout + out.stderr


def show() -> None:
    print(DIM + kubectl("-n", NS, "get", "sps,ckpt,fork", check=False).rstrip() + RESET, flush=True)


def wait(what: str, predicate, timeout: float = 120):
    deadline = time.monotonic() + timeout
    dots = 0
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            print(flush=True) if dots else None
            return value
        print(".", end="", flush=True)
        dots += 1
        time.sleep(1)
    raise SystemExit(f"\ntimed out waiting for {what}")


def pod_running(name: str, not_uid: str | None = None) -> bool:
    try:
        pod = client.CoreV1Api().read_namespaced_pod(name, NS)
    except client.ApiException:
        return False
    statuses = pod.status.container_statuses or []
    return (
        pod.metadata.uid != not_uid
        and pod.status.phase == "Running"
        and not pod.metadata.deletion_timestamp
        and bool(statuses)
        and all(c.ready for c in statuses)
    )


def obj(api: client.CustomObjectsApi, plural: str, name: str) -> dict:
    try:
        return api.get_namespaced_custom_object(GROUP, VERSION, NS, plural, name)
    except client.ApiException:
        return {}


def phase(api, plural: str, name: str, *phases: str):
    body = obj(api, plural, name)
    return body if (body.get("status") or {}).get("phase") in phases else None


def create(api, plural: str, kind: str, name: str, spec: dict) -> None:
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": kind, "metadata": {"name": name}, "spec": spec}
    api.create_namespaced_custom_object(GROUP, VERSION, NS, plural, body)


def harness(session: str, *args: str) -> str:
    """The reference harness inside the session's sandbox container."""
    return kubectl("-n", NS, "exec", session, "-c", "agent", "--", "python", "-m", "savepoint.harness", *args).strip()


def helm() -> str:
    pins = dict(
        line.split("=", 1)
        for line in (REPO / "hack" / "versions.env").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    cache = Path(
        os.environ.get("SAVEPOINT_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "savepoint"
    )
    return str(cache / "bin" / f"helm-{pins['HELM_VERSION'].strip()}" / "helm")


def main() -> None:
    config.load_kube_config()
    core, api = client.CoreV1Api(), client.CustomObjectsApi()
    built = images()

    step("Install the operator with its Helm chart (two replicas, one active)")
    repo, tag = built["OPERATOR_IMAGE"].rsplit(":", 1)
    out = subprocess.run(
        [
            helm(),
            "upgrade",
            "--install",
            "savepoint",
            str(REPO / "charts" / "savepoint"),
            "-n",
            OPERATOR_NS,
            "--create-namespace",
            "--wait",
            "--timeout",
            "180s",
            "--set",
            f"image.repository={repo}",
            "--set",
            f"image.tag={tag}",
            "--set",
            "expiryIntervalSeconds=1",
        ],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"helm install failed: {out.stderr.strip()}")
    print(kubectl("-n", OPERATOR_NS, "get", "pods", "-o", "wide").rstrip())
    try:
        story(core, api, built["HARNESS_IMAGE"])
    finally:
        if os.environ.get("SAVEPOINT_DEMO_KEEP") != "1":
            kubectl("delete", "namespace", NS, "--wait=false", check=False)


def story(core: client.CoreV1Api, api: client.CustomObjectsApi, image: str) -> None:
    core.create_namespace({"metadata": {"name": NS}})
    wait("the namespace's default ServiceAccount", lambda: core.list_namespaced_service_account(NS).items)

    step(f"Create Session 'agent' in namespace {NS}: a sandbox running {image}")
    create(
        api,
        "sessions",
        "Session",
        "agent",
        {
            "podTemplate": sandbox(image),
            "workspace": {"size": "256Mi"},
            "harness": {"name": "savepoint-harness", "revision": "1"},
        },
    )
    wait("session Ready", lambda: phase(api, "sessions", "agent", "Ready"))
    print(kubectl("-n", NS, "get", "pod", "agent", "-o", "wide").rstrip())
    show()

    step("The agent takes a turn inside its sandbox: the conversation and the files")
    turn = harness(
        "agent",
        "turn",
        "--message",
        "Write a hello-world service",
        "--write",
        "app/main.py=print('hello, world')",
        "--write",
        "README.md=# hello service",
    )
    print(f"harness: {turn}")
    print(f"/workspace/app/main.py in the sandbox: {harness('agent', 'read', 'app/main.py')}")
    log = EventLog(core, NS, "agent")
    for e in log.read():
        print(f"  {e.seq:>3} {e.type:<16} {json.dumps(e.data)[:60]}")
    wait("session idle", lambda: phase(api, "sessions", "agent", "Ready"))

    step("Checkpoint it")
    create(api, "checkpoints", "Checkpoint", "hello-v1", {"sessionName": "agent", "label": "hello world works"})
    ckpt = wait("checkpoint Ready", lambda: phase(api, "checkpoints", "hello-v1", "Ready", "Rejected", "Failed"))
    status = ckpt["status"]
    print(
        f"{status['phase']}: through event {status['throughSequence']}, snapshot {status['volumeSnapshotName']}, "
        f"expires {status['expiresAt']}"
    )
    show()

    step("Fork it into 'agent-alt': a new sandbox whose own process reads the checkpointed files")
    create(
        api, "forks", "Fork", "try-alt", {"source": {"checkpoint": "hello-v1"}, "target": {"sessionName": "agent-alt"}}
    )
    wait("fork Succeeded", lambda: phase(api, "forks", "try-alt", "Succeeded", "Failed"))
    wait("agent-alt Ready", lambda: phase(api, "sessions", "agent-alt", "Ready"))
    wait("agent-alt's Pod running", lambda: pod_running("agent-alt"))
    print(f"agent-alt reads app/main.py: {harness('agent-alt', 'read', 'app/main.py')}")
    harness("agent-alt", "write", "app/main.py", "print('bonjour')")
    show()

    step("Meanwhile 'agent' breaks its workspace")
    harness("agent", "turn", "--message", "Now break everything", "--write", "app/main.py=oops")
    print(f"agent reads app/main.py: {harness('agent', 'read', 'app/main.py')}")

    step("Roll 'agent' back to hello-v1: a new process on the old disk")
    old_uid = core.read_namespaced_pod("agent", NS).metadata.uid
    create(api, "forks", "Fork", "undo", {"source": {"checkpoint": "hello-v1"}, "mode": "Rollback"})
    wait("rollback Succeeded", lambda: phase(api, "forks", "undo", "Succeeded", "Failed"))
    wait("agent Ready", lambda: phase(api, "sessions", "agent", "Ready"))
    wait("agent's new Pod running", lambda: pod_running("agent", not_uid=old_uid))
    print(f"agent reads app/main.py after the rollback: {harness('agent', 'read', 'app/main.py')}")
    print("the log keeps every event; the effective history skips the undone branch:")
    kept = {e.seq for e in log.effective_history()}
    for e in log.read():
        mark = " " if e.seq in kept else "x"
        print(f"  {mark} {e.seq:>3} {e.type:<16} {json.dumps(e.data)[:60]}")
    show()

    step("A checkpoint with a 5 second TTL expires; forking it is refused")
    create(api, "checkpoints", "Checkpoint", "brief", {"sessionName": "agent", "ttl": "5s"})
    wait("checkpoint Expired", lambda: phase(api, "checkpoints", "brief", "Expired"), timeout=60)
    create(api, "forks", "Fork", "too-late", {"source": {"checkpoint": "brief"}, "target": {"sessionName": "nope"}})
    fork = wait("fork finished", lambda: phase(api, "forks", "too-late", "Succeeded", "Failed"))
    print(f"{fork['status']['phase']}: {fork['status']['reason']}: {fork['status']['message']}")
    show()

    step("Where to look next")
    print(f"""  kubectl -n {NS} describe sps agent      # conditions and Events of every transition
  kubectl -n {NS} get configmaps -l savepoint.dev/session   # the event-log chunks
  docs/checkpoints.md, docs/forks.md, docs/event-log.md
  kubectl -n {OPERATOR_NS} logs deploy/savepoint   # the operator's log
  the demo deletes {NS} at the end (SAVEPOINT_DEMO_KEEP=1 keeps it); make cluster-down stops the cluster""")


if __name__ == "__main__":
    main()
