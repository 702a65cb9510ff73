"""What a Session reports about its use, on the real control plane: status.usage from a
log with runs, approvals, an interrupt and token usage; status.resources from the
sandbox's heartbeat object, written with the sandbox's own token (the harness CLI here,
then `serve` itself in a Pod on the real node), and HeartbeatStale when it stops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import watch as k8s_watch

from savepoint.eventlog import EventLog
from savepoint.models import GROUP, VERSION
from tests.conftest import wait_for
from tests.integration.test_harness import harness, sandbox_env
from tests.integration.test_security import refused, sandbox_core, sandbox_policy  # noqa: F401 (a fixture)
from tests.integration.test_session import get_session, make_session, wait_phase
from tests.operator_process import OperatorProcess

STALE_SECONDS = 8
INTERVAL_SECONDS = 2
KUBECTL = str(Path(sys.executable).parent / "kubectl")


@pytest.fixture(scope="module")
def quick_operator(operator_process: OperatorProcess) -> Iterator[OperatorProcess]:
    """The test operator with a short heartbeat threshold and resources interval."""
    operator_process.stop()
    operator_process.start(
        SAVEPOINT_HEARTBEAT_STALE_SECONDS=str(STALE_SECONDS),
        SAVEPOINT_RESOURCES_INTERVAL_SECONDS=str(INTERVAL_SECONDS),
    )
    yield operator_process
    operator_process.stop()
    operator_process.start()


def condition(body: dict, type_: str) -> dict | None:
    return next((c for c in (body.get("status") or {}).get("conditions") or [] if c["type"] == type_), None)


def test_usage_is_derived_from_the_log(quick_operator, core, crds, namespace):
    make_session(crds, namespace, "u1")
    wait_phase(crds, namespace, "u1", "Ready", timeout=90)
    log = EventLog(core, namespace, "u1")
    log.append("run.started", {"runId": "r1"})
    log.append("agent.message", {"runId": "r1", "usage": {"inputTokens": 1200, "outputTokens": 340}})
    log.append("agent.approval_request", {"requestId": "q1"})
    time.sleep(0.4)
    log.append("user.approval", {"requestId": "q1", "approved": True})
    log.append("run.completed", {"runId": "r1"})
    log.append("run.started", {"runId": "r2"})
    log.append("agent.message", {"runId": "r2", "usage": {"inputTokens": 800, "outputTokens": 60, "llmCalls": 2}})
    log.append("agent.approval_request", {"requestId": "q2"})
    log.append("user.approval", {"requestId": "q2", "approved": False})
    log.append("user.interrupt", {"runId": "r2"})
    log.append("run.completed", {"runId": "r2", "interrupted": True})

    def derived():
        usage = (get_session(crds, namespace, "u1").get("status") or {}).get("usage") or {}
        return usage if usage.get("runs") == 2 else None

    usage = wait_for(derived, timeout=30, what="the Session's usage derived from its log")
    assert usage["interrupts"] == 1
    assert usage["tokens"] == {"input": 2000, "output": 400, "total": 2400}
    assert usage["llmCalls"] == 3
    approvals = usage["approvals"]
    assert (approvals["requested"], approvals["approved"], approvals["denied"]) == (2, 1, 1)
    assert 400 <= approvals["waitMsTotal"] < 30_000
    durations = usage["runDurationMs"]
    assert 400 <= durations["max"] < 60_000 and durations["p50"] <= durations["max"]
    assert usage["pauses"] == 0 and usage["bootMs"] >= 0

    # A pause is counted by the operator, once per transition into Paused.
    patch = {"spec": {"operatingMode": "Paused"}}
    crds.patch_namespaced_custom_object(GROUP, VERSION, namespace, "sessions", "u1", patch)
    paused = wait_phase(crds, namespace, "u1", "Paused", timeout=60)
    assert paused["status"]["usage"]["pauses"] == 1
    assert paused["status"]["usage"]["tokens"]["total"] == 2400


def test_a_heartbeat_becomes_resources_then_goes_stale_without_changing_the_phase(
    quick_operator,
    sandbox_policy,  # noqa: F811 (the fixture imported above)
    api,
    core,
    crds,
    namespace,
    tmp_path,
):
    make_session(crds, namespace, "h1")
    make_session(crds, namespace, "h2")
    wait_phase(crds, namespace, "h1", "Ready", timeout=90)
    wait_phase(crds, namespace, "h2", "Ready", timeout=90)
    env = sandbox_env(api, core, namespace, "h1", tmp_path)
    (Path(env["SAVEPOINT_WORKSPACE"]) / "notes.txt").write_bytes(b"n" * 20000)

    # The harness, as the sandbox's own account, creates its heartbeat object...
    beat = harness(env, "heartbeat")
    assert beat.returncode == 0, beat.stderr
    first = json.loads(beat.stdout)
    assert first["diskBytes"] >= 20000 and first["memBytes"] > 0
    made = core.read_namespaced_config_map("h1-heartbeat", namespace)
    assert made.metadata.labels["savepoint.dev/session"] == "h1"
    assert [r.uid for r in made.metadata.owner_references] == [get_session(crds, namespace, "h1")["metadata"]["uid"]]
    # ...and patches it the next time.
    again = harness(env, "heartbeat")
    assert again.returncode == 0, again.stderr
    second = json.loads(again.stdout)

    def reflected():
        body = get_session(crds, namespace, "h1")
        return body if (body.get("status") or {}).get("resources") == second else None

    body = wait_for(reflected, timeout=30, what="status.resources from the newest heartbeat")
    fresh = condition(body, "HeartbeatStale")
    assert fresh is not None and (fresh["status"], fresh["reason"]) == ("False", "HeartbeatFresh")

    # No heartbeat for longer than the threshold: a condition, and the phase stays.
    def stale():
        body = get_session(crds, namespace, "h1")
        cond = condition(body, "HeartbeatStale")
        return body if cond and cond["status"] == "True" else None

    started = time.monotonic()
    body = wait_for(stale, timeout=STALE_SECONDS + 30, what="HeartbeatStale=True")
    assert time.monotonic() - started >= STALE_SECONDS - 4  # not before the threshold
    assert body["status"]["phase"] == "Ready"
    assert second["sampledAt"] in condition(body, "HeartbeatStale")["message"]
    assert condition(get_session(crds, namespace, "h2"), "HeartbeatStale") is None  # never had a heartbeat

    # A sandbox writes its own heartbeat only.
    sandbox = sandbox_core(api, core, namespace, "h1")
    refused(sandbox.patch_namespaced_config_map, "h2-heartbeat", namespace, {"data": {"sample": "{}"}})
    other = {"apiVersion": "v1", "kind": "ConfigMap", "data": {}}
    other["metadata"] = {"name": "h2-heartbeat", "labels": {"savepoint.dev/session": "h2"}}
    err = refused(sandbox.create_namespaced_config_map, namespace, other)
    assert "metadata.name" in err.body, err.body
    assert "resources" not in (get_session(crds, namespace, "h2").get("status") or {})


# ------------------------------------------------------------- on the real node


def harness_image() -> str:
    from tests.e2e.test_real_node import images

    image = images().get("HARNESS_IMAGE")
    if not image:
        pytest.fail("no HARNESS_IMAGE recorded by hack/cluster (node/images.env)", pytrace=False)
    return image


def real_session(crds, namespace: str, name: str, heartbeat_seconds: str) -> None:
    container = {
        "name": "agent",
        "image": harness_image(),
        "imagePullPolicy": "Never",
        "env": [{"name": "SAVEPOINT_HEARTBEAT_SECONDS", "value": heartbeat_seconds}],
        "resources": {"limits": {"memory": "256Mi"}},
    }
    template = {
        "spec": {
            "containers": [container],
            "nodeSelector": {"type": "real"},
            "securityContext": {"fsGroup": 10001},
            "terminationGracePeriodSeconds": 2,
        }
    }
    make_session(crds, namespace, name, podTemplate=template)


def in_sandbox(namespace: str, pod: str, *args: str, raw: bool = False) -> subprocess.CompletedProcess[str]:
    command = list(args) if raw else ["python", "-m", "savepoint.harness", *args]
    argv = [KUBECTL, "exec", "-n", namespace, pod, "-c", "agent", "--", *command]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=os.environ)
    assert done.returncode == 0, f"{args}: {done.stderr}"
    return done


def count_writes(core, crds, namespace: str, session: str, seconds: float) -> dict[str, int]:
    """MODIFIED events of the Session and of its heartbeat object over `seconds`."""
    counts = {"session": 0, "heartbeat": 0}

    def watch(kind: str, list_fn, **kwargs) -> None:
        end = time.monotonic() + seconds
        stream = k8s_watch.Watch()
        for event in stream.stream(list_fn, namespace, timeout_seconds=int(seconds) + 5, **kwargs):
            if time.monotonic() > end:
                break
            if event["type"] == "MODIFIED":
                counts[kind] += 1
        stream.stop()

    def sessions(ns: str, **kwargs):
        return crds.list_namespaced_custom_object(GROUP, VERSION, ns, "sessions", **kwargs)

    version = crds.list_namespaced_custom_object(GROUP, VERSION, namespace, "sessions")["metadata"]["resourceVersion"]
    threads = [
        threading.Thread(
            target=watch,
            args=("session", sessions),
            kwargs={"resource_version": version, "field_selector": f"metadata.name={session}"},
        ),
        threading.Thread(
            target=watch,
            args=("heartbeat", core.list_namespaced_config_map),
            kwargs={"field_selector": f"metadata.name={session}-heartbeat"},
        ),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return counts


def test_serve_on_the_real_node_fills_resources_and_a_silent_harness_goes_stale(quick_operator, core, crds, namespace):
    nodes = core.list_node(label_selector="type=real").items
    if not any(c.type == "Ready" and c.status == "True" for n in nodes for c in n.status.conditions):
        pytest.fail("no Ready Node labelled type=real (hack/cluster starts one)", pytrace=False)
    real_session(crds, namespace, "beat", "1")
    real_session(crds, namespace, "mute", "0")
    wait_phase(crds, namespace, "beat", "Ready", timeout=120)
    wait_phase(crds, namespace, "mute", "Ready", timeout=120)

    def resources(name: str, check=lambda r: True):
        def got():
            found = (get_session(crds, namespace, name).get("status") or {}).get("resources")
            return found if found and check(found) else None

        return got

    # serve samples its own cgroup (this node is cgroup v1) and the workspace volume.
    first = wait_for(resources("beat"), timeout=60, what="status.resources from serve's heartbeat")
    assert first["memLimitBytes"] == 256 * 1024 * 1024
    assert 0 < first["memBytes"] < first["memLimitBytes"]
    assert first["load1"] >= 0
    script = "import os; open('/workspace/big.bin', 'wb').write(os.urandom(2_000_000))"
    in_sandbox(namespace, "beat", "python", "-c", script, raw=True)
    grown = wait_for(
        resources("beat", lambda r: r["diskBytes"] >= first["diskBytes"] + 2_000_000),
        timeout=60,
        what="diskBytes grown by the file written in the sandbox",
    )
    assert grown["sampledAt"] > first["sampledAt"]
    body = get_session(crds, namespace, "beat")
    assert condition(body, "HeartbeatStale")["status"] == "False"

    # A heartbeat a second, the Session written at most once per interval: no pass per beat.
    window = 12
    writes = count_writes(core, crds, namespace, "beat", window)
    assert writes["heartbeat"] >= 8, writes
    assert writes["session"] <= window / INTERVAL_SECONDS + 1, writes

    # The reference harness puts its token usage on its agent messages.
    turn = json.loads(in_sandbox(namespace, "beat", "turn", "--message", "plan", "--input-tokens", "1200",
                                 "--output-tokens", "340").stdout)  # fmt: skip
    assert turn["agentMessage"] > turn["runStarted"]

    def counted():
        usage = (get_session(crds, namespace, "beat").get("status") or {}).get("usage") or {}
        return usage if usage.get("llmCalls") == 1 else None

    usage = wait_for(counted, timeout=30, what="the turn's token usage in status.usage")
    assert usage["tokens"] == {"input": 1200, "output": 340, "total": 1540} and usage["runs"] == 1

    # A harness whose serve does not heartbeat: one sample by hand, then silence.
    once = json.loads(in_sandbox(namespace, "mute", "heartbeat").stdout)
    wait_for(resources("mute", lambda r: r == once), timeout=30, what="the one sample reflected")

    def stale():
        body = get_session(crds, namespace, "mute")
        cond = condition(body, "HeartbeatStale")
        return body if cond and cond["status"] == "True" else None

    body = wait_for(stale, timeout=STALE_SECONDS + 30, what="HeartbeatStale on the silent sandbox")
    assert body["status"]["phase"] == "Ready"
    # The heartbeating one stays fresh all along.
    assert condition(get_session(crds, namespace, "beat"), "HeartbeatStale")["status"] == "False"
