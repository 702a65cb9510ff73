"""`kubectl savepoint` against the real control plane, run as a user runs it: a subprocess.

The tests that need a Ready session (checkpoint, fork, rollback with --wait) need the
local CSI stack as well, like tests/integration/test_checkpoint.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from savepoint import cli
from savepoint.eventlog import TOMBSTONE_KEY, EventLog
from savepoint.models import GROUP, VERSION
from tests.conftest import REPO, wait_for
from tests.integration.test_session import make_session, wait_phase


def plugin_env(kubeconfig: str) -> dict[str, str]:
    return {**os.environ, "KUBECONFIG": kubeconfig, "PYTHONPATH": str(REPO / "operator")}


def plugin(kubeconfig: str, namespace: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "savepoint.cli", "-n", namespace, *args],
        env=plugin_env(kubeconfig),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def checkpoints(crds, namespace: str) -> list[dict]:
    return crds.list_namespaced_custom_object(GROUP, VERSION, namespace, "checkpoints")["items"]


# ---------------------------------------------------------- no operator needed


def test_list_in_an_empty_namespace(kubeconfig, crds, namespace):
    done = plugin(kubeconfig, namespace, "checkpoint", "list")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert f"No checkpoints in namespace {namespace}." in done.stderr


def test_kubectl_finds_the_plugin(kubeconfig, crds, namespace, tmp_path: Path):
    kubectl = Path(sys.executable).parent / "kubectl"
    if not kubectl.exists():
        pytest.fail(f"kubectl is not in the venv ({kubectl}): run hack/venv", pytrace=False)
    # What the console script `kubectl-savepoint` does, on a PATH of its own.
    shim = tmp_path / "kubectl-savepoint"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m savepoint.cli "$@"\n')
    shim.chmod(0o755)
    env = {**plugin_env(kubeconfig), "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    done = subprocess.run(
        [str(kubectl), "savepoint", "-n", namespace, "checkpoint", "list"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "No checkpoints" in done.stderr


def test_idempotency_key_creates_one_object(kubeconfig, crds, namespace):
    first = plugin(kubeconfig, namespace, "checkpoint", "create", "s1", "--label", "retry", "--idempotency-key", "k1")
    assert first.returncode == 0, first.stderr
    again = plugin(kubeconfig, namespace, "checkpoint", "create", "s1", "--label", "retry", "--idempotency-key", "k1")
    assert again.returncode == 0, again.stderr
    assert "already exists (same idempotency key)" in again.stdout
    items = checkpoints(crds, namespace)
    assert [c["metadata"]["name"] for c in items] == [cli.key_name("ckpt", "k1")]
    assert items[0]["spec"] == {"sessionName": "s1", "label": "retry"}
    # The same key for a different request is a mistake, not a retry.
    other = plugin(kubeconfig, namespace, "checkpoint", "create", "s2", "--idempotency-key", "k1")
    assert other.returncode == cli.EXIT_USAGE
    assert "already names checkpoint" in other.stderr
    assert len(checkpoints(crds, namespace)) == 1


def test_without_a_key_each_run_creates_a_checkpoint(kubeconfig, crds, namespace):
    for _ in range(2):
        assert plugin(kubeconfig, namespace, "checkpoint", "create", "s1").returncode == 0
    names = [c["metadata"]["name"] for c in checkpoints(crds, namespace)]
    assert len(set(names)) == 2 and all(n.startswith("s1-ckpt-") for n in names)


def test_rollback_refuses_another_sessions_checkpoint(kubeconfig, crds, namespace):
    crds.create_namespaced_custom_object(
        GROUP,
        VERSION,
        namespace,
        "checkpoints",
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "Checkpoint",
            "metadata": {"name": "c-other"},
            "spec": {"sessionName": "other"},
        },
    )
    done = plugin(kubeconfig, namespace, "rollback", "s1", "--to", "c-other")
    assert done.returncode == cli.EXIT_USAGE
    assert "belongs to session other" in done.stderr
    missing = plugin(kubeconfig, namespace, "rollback", "s1", "--to", "nope")
    assert missing.returncode == cli.EXIT_FAILED
    assert "CheckpointNotFound" in missing.stderr


# The log tests write a log with no Session object, so no operator appends to it meanwhile.


def test_log_tail_prints_appended_events(kubeconfig, core, crds, namespace):
    log = EventLog(core, namespace, "s1")
    log.append("user.message", {"text": "first"})
    log.append("user.message", {"text": "second"})
    log.append("agent.message", {"text": "third"})

    done = plugin(kubeconfig, namespace, "log", "tail", "s1", "-n", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["2", "3"]
    assert '"text":"third"' in lines[-1] and "agent.message" in lines[-1]

    follow = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "savepoint.cli",
            "-n",
            namespace,
            "log",
            "tail",
            "s1",
            "-f",
            "-n",
            "1",
            "--interval",
            "0.2",
            "-o",
            "json",
        ],
        env=plugin_env(kubeconfig),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(follow.stdout), daemon=True)
    reader.start()
    try:
        wait_for(lambda: len(seen) >= 1, timeout=30, what="log tail -f to print the last event")
        log.append("user.message", {"text": "live"})
        wait_for(lambda: any('"live"' in line for line in seen), timeout=30, what="log tail -f to print a new event")
    finally:
        follow.terminate()
        follow.wait(timeout=10)
    assert '"seq":3' in seen[0] and '"seq":4' in seen[-1]


def test_log_tail_of_a_missing_session(kubeconfig, crds, namespace):
    done = plugin(kubeconfig, namespace, "log", "tail", "ghost")
    assert done.returncode == cli.EXIT_FAILED
    assert "SessionNotFound" in done.stderr


def test_erase_tombstones_a_subject(kubeconfig, core, crds, namespace):
    log = EventLog(core, namespace, "s1")
    log.append("user.message", {"text": "my address"}, subject="user-1")
    log.append("agent.message", {"text": "noted"})
    log.append("user.message", {"text": "my phone"}, subject="user-1")

    done = plugin(kubeconfig, namespace, "erase", "s1", "--subject", "user-1")
    assert done.returncode == 0, done.stderr
    assert "erased 2 events with subject 'user-1'" in done.stdout
    events = log.read(partial=True)
    assert [e.data for e in events] == [{TOMBSTONE_KEY: True}, {"text": "noted"}, {TOMBSTONE_KEY: True}]
    assert [e.subject for e in events] == ["user-1", None, "user-1"]
    again = plugin(kubeconfig, namespace, "erase", "s1", "--subject", "user-1")
    assert "erased 0 events" in again.stdout
    tail = plugin(kubeconfig, namespace, "log", "tail", "s1")
    assert tail.stdout.count("(erased)") == 2


# ------------------------------------------------------------- with the operator


def test_create_wait_for_a_missing_session_fails_with_the_reason(kubeconfig, operator, crds, namespace):
    done = plugin(kubeconfig, namespace, "checkpoint", "create", "ghost", "--wait", "--timeout", "60")
    assert done.returncode == cli.EXIT_FAILED, done.stdout + done.stderr
    assert "error: Rejected: SessionNotFound: session ghost not found" in done.stderr
    assert "created in namespace" in done.stdout
    listed = plugin(kubeconfig, namespace, "checkpoint", "list")
    assert listed.stdout.splitlines()[1].split()[:3] == [
        checkpoints(crds, namespace)[0]["metadata"]["name"],
        "ghost",
        "Rejected",
    ]


def test_fork_wait_of_a_missing_checkpoint_fails_with_the_reason(kubeconfig, operator, crds, namespace):
    done = plugin(kubeconfig, namespace, "fork", "nope", "--name", "s2", "--wait", "--timeout", "60")
    assert done.returncode == cli.EXIT_FAILED, done.stdout + done.stderr
    assert "CheckpointNotFound" in done.stderr


# ------------------------------------------------- with the operator and the CSI stack


@pytest.fixture
def ready_s1(operator, crds, namespace):
    make_session(crds, namespace, "s1")
    return wait_phase(crds, namespace, "s1", "Ready", timeout=120)


def test_checkpoint_create_wait_list_fork_and_rollback(kubeconfig, core, crds, namespace, ready_s1):
    EventLog(core, namespace, "s1").append("user.message", {"text": "hello"})
    done = plugin(
        kubeconfig,
        namespace,
        "checkpoint",
        "create",
        "s1",
        "--label",
        "first",
        "--ttl",
        "2h",
        "--wait",
        "--idempotency-key",
        "first",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    name = cli.key_name("ckpt", "first")
    assert f"checkpoint {name} is Ready through event 1" in done.stdout
    assert "Pending" in done.stdout or "Waiting for the operator" in done.stdout  # progress was shown

    listed = plugin(kubeconfig, namespace, "checkpoint", "list", "s1")
    header, row = listed.stdout.splitlines()
    assert header.split() == list(cli.CHECKPOINT_COLUMNS)
    assert row.split()[:6] == [name, "s1", "Ready", "1", "first", "in"]  # expires in 119m

    fork = plugin(kubeconfig, namespace, "fork", name, "--name", "s2", "--wait")
    assert fork.returncode == 0, fork.stdout + fork.stderr
    assert "session s2 is Ready" in fork.stdout

    event_id = EventLog(core, namespace, "s1").read()[0].id
    at_event = plugin(kubeconfig, namespace, "fork", "s1", "--at-event", event_id, "--name", "s3", "--wait")
    assert at_event.returncode == 0, at_event.stdout + at_event.stderr

    EventLog(core, namespace, "s1").append("user.message", {"text": "after the checkpoint"})
    rollback = plugin(kubeconfig, namespace, "rollback", "s1", "--to", name, "--wait")
    assert rollback.returncode == 0, rollback.stdout + rollback.stderr
    assert "session s1 rolled back" in rollback.stdout
    assert any(e.type == "session.rollback" for e in EventLog(core, namespace, "s1").read())


def test_checkpoint_of_a_busy_session_exits_non_zero_with_the_reason(kubeconfig, core, crds, namespace, ready_s1):
    EventLog(core, namespace, "s1").append("run.started", {"runId": "r1"})
    wait_phase(crds, namespace, "s1", "Running")
    started = time.monotonic()
    done = plugin(kubeconfig, namespace, "checkpoint", "create", "s1", "--wait")
    assert done.returncode == cli.EXIT_FAILED
    assert "error: Rejected: SessionBusy: session s1 has a run in flight" in done.stderr
    assert time.monotonic() - started < 60
