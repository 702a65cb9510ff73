"""The reference harness's CLI against the real control plane, as the sandbox's own
ServiceAccount: the token a TokenRequest gives, in a kubeconfig, with the environment the
operator put into the sandbox Pod. (On the kwok nodes the Pod runs no process, so the CLI
runs here; the real-node tests run the same commands inside the Pod.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from kubernetes import client

from savepoint.eventlog import EventLog
from savepoint.sandbox import account_name
from tests.conftest import wait_for
from tests.integration.test_session import get_session, make_session, wait_phase


def sandbox_env(api: client.ApiClient, core: client.CoreV1Api, namespace: str, session: str, tmp: Path) -> dict:
    """The sandbox Pod's SAVEPOINT_* variables plus a kubeconfig holding its account's token."""
    pod = core.read_namespaced_pod(session, namespace)
    env = {e.name: e.value for e in pod.spec.containers[0].env if e.name.startswith("SAVEPOINT_")}
    request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600))
    token = core.create_namespaced_service_account_token(account_name(session), namespace, request).status.token
    cluster = {"server": api.configuration.host, "certificate-authority": api.configuration.ssl_ca_cert}
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "sandbox", "user": {"token": token}}],
        "contexts": [{"name": "sandbox", "context": {"cluster": "c", "user": "sandbox"}}],
        "current-context": "sandbox",
    }
    path = tmp / "sandbox.kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SAVEPOINT_", "KUBERNETES_"))}
    workspace = tmp / "workspace"
    workspace.mkdir()
    return {**base, **env, "KUBECONFIG": str(path), "SAVEPOINT_WORKSPACE": str(workspace)}


def harness(env: dict, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "savepoint.harness", *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_turn_logs_a_run_and_writes_files_as_the_sandbox(operator, api, core, crds, namespace, tmp_path):
    make_session(crds, namespace, "h1")
    wait_phase(crds, namespace, "h1", "Ready", timeout=90)
    env = sandbox_env(api, core, namespace, "h1", tmp_path)

    got = harness(env, "turn", "--message", "plan it", "--write", "notes/plan.md=step 1", "--write", "a.txt=A")
    assert got.returncode == 0, got.stderr
    out = json.loads(got.stdout)
    assert out["files"] == ["notes/plan.md", "a.txt"]
    assert (Path(env["SAVEPOINT_WORKSPACE"]) / "notes" / "plan.md").read_text() == "step 1"

    events = {e.seq: e for e in EventLog(core, namespace, "h1").read()}
    order = ["runStarted", "userMessage", "agentMessage", "runCompleted"]
    seqs = [out[k] for k in order]
    assert seqs == sorted(seqs) and seqs[-1] - seqs[0] == 3
    assert [events[s].type for s in seqs] == ["run.started", "user.message", "agent.message", "run.completed"]
    assert {events[s].data["runId"] for s in seqs} == {out["runId"]}
    assert events[out["userMessage"]].data["text"] == "plan it"
    assert events[out["agentMessage"]].data["text"] == "echo: plan it"
    wait_for(
        lambda: (get_session(crds, namespace, "h1").get("status") or {}).get("usage", {}).get("runs") == 1,
        timeout=30,
        what="the Session counts the completed run",
    )

    appended = harness(env, "append", "tool.call", '{"name": "ls"}', "--subject", "user:1")
    assert appended.returncode == 0, appended.stderr
    event = json.loads(appended.stdout)
    assert (event["type"], event["data"], event["subject"]) == ("tool.call", {"name": "ls"}, "user:1")
    assert event["seq"] == out["runCompleted"] + 1
