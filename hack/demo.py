"""The Savepoint demo: a session, a conversation, files, checkpoint, fork, rollback, expiry.

Run through `make demo` (hack/demo), which brings up the local control plane unless
KUBECONFIG names a cluster. It installs the CRDs, runs the operator in the background
for the duration, and prints `kubectl get sps,ckpt,fork` after every step.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "operator")]

from kubernetes import client, config  # noqa: E402
from tests.csi_data import pvc_data_dir  # noqa: E402

from savepoint.eventlog import EventLog  # noqa: E402
from savepoint.models import GROUP, VERSION  # noqa: E402

NS = f"demo-{uuid.uuid4().hex[:5]}"
BOLD, DIM, RESET = ("\033[1m", "\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "", "")
KWOK_POD = {
    "spec": {
        "containers": [{"name": "agent", "image": "ghcr.io/example/agent:1"}],
        "nodeSelector": {"type": "kwok"},
        "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
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


def files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()[:12]
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def main() -> None:
    config.load_kube_config()
    core, api = client.CoreV1Api(), client.CustomObjectsApi()

    step("Install the CRDs and start the operator")
    print(kubectl("apply", "--server-side", "-f", str(REPO / "crds")).rstrip())
    log_path = REPO / ".run" / "demo-operator.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO / "operator"), "SAVEPOINT_METRICS_PORT": "0"}
    with open(log_path, "wb") as out:
        operator = subprocess.Popen([sys.executable, "-m", "savepoint"], env=env, stdout=out, stderr=out)
    print(f"operator pid {operator.pid}, log {log_path}")
    try:
        story(core, api)
    finally:
        operator.terminate()
        operator.wait(timeout=15)


def story(core: client.CoreV1Api, api: client.CustomObjectsApi) -> None:
    core.create_namespace({"metadata": {"name": NS}})
    wait("the namespace's default ServiceAccount", lambda: core.list_namespaced_service_account(NS).items)

    step(f"Create Session 'agent' in namespace {NS}")
    create(
        api,
        "sessions",
        "Session",
        "agent",
        {
            "podTemplate": KWOK_POD,
            "workspace": {"size": "256Mi"},
            "harness": {"name": "demo-harness", "revision": "1"},
        },
    )
    agent = wait("session Ready", lambda: phase(api, "sessions", "agent", "Ready"))
    show()

    step("The agent talks and writes files")
    log = EventLog(core, NS, "agent")
    log.append("user.message", {"text": "Write a hello-world service"})
    log.append("run.started", {"runId": "r1"})
    log.append("tool.call", {"tool": "write_file", "path": "app/main.py"})
    workspace = pvc_data_dir(core, NS, agent["status"]["workspaceClaimName"])
    (workspace / "app").mkdir(exist_ok=True)
    (workspace / "app" / "main.py").write_text("print('hello, world')\n")
    (workspace / "README.md").write_text("# hello service\n")
    log.append("run.completed", {"runId": "r1"})
    print(f"workspace files: {files(workspace)}")
    for e in log.read():
        print(f"  {e.seq:>3} {e.type:<16} {e.data}")
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

    step("Fork it into 'agent-alt' and try something else there")
    create(
        api, "forks", "Fork", "try-alt", {"source": {"checkpoint": "hello-v1"}, "target": {"sessionName": "agent-alt"}}
    )
    wait("fork Succeeded", lambda: phase(api, "forks", "try-alt", "Succeeded", "Failed"))
    alt = wait("agent-alt Ready", lambda: phase(api, "sessions", "agent-alt", "Ready"))
    alt_ws = pvc_data_dir(core, NS, alt["status"]["workspaceClaimName"])
    print(f"agent-alt files: {files(alt_ws)}")
    (alt_ws / "app" / "main.py").write_text("print('bonjour')\n")
    show()

    step("Meanwhile 'agent' breaks its workspace")
    log.append("user.message", {"text": "Now delete everything"})
    (workspace / "app" / "main.py").unlink()
    (workspace / "README.md").write_text("oops\n")
    print(f"agent files: {files(workspace)}")

    step("Roll 'agent' back to hello-v1")
    create(api, "forks", "Fork", "undo", {"source": {"checkpoint": "hello-v1"}, "mode": "Rollback"})
    wait("rollback Succeeded", lambda: phase(api, "forks", "undo", "Succeeded", "Failed"))
    agent = wait("agent Ready", lambda: phase(api, "sessions", "agent", "Ready"))
    restored = pvc_data_dir(core, NS, agent["status"]["workspaceClaimName"])
    print(f"agent files after rollback: {files(restored)}")
    print("the log keeps every event; the effective history skips the undone branch:")
    kept = {e.seq for e in log.effective_history()}
    for e in log.read():
        mark = " " if e.seq in kept else "x"
        print(f"  {mark} {e.seq:>3} {e.type:<16} {e.data}")
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
  kubectl delete namespace {NS}            # clean up (the cluster: make cluster-down)""")


if __name__ == "__main__":
    main()
