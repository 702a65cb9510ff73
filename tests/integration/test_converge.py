"""Objects applied together converge: a Checkpoint waits for its Session, a Fork for its
Checkpoint, and only what cannot change ends at once (DESIGN 2, docs/checkpoints.md)."""

from __future__ import annotations

import itertools
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from savepoint.models import GROUP, VERSION
from tests.conftest import make_stuck_snapshot, wait_for
from tests.integration.test_checkpoint import get_snapshot, make_checkpoint, wait_checkpoint
from tests.integration.test_fork import make_fork, wait_fork
from tests.integration.test_session import KWOK_POD, make_session, wait_phase

KUBECTL = str(Path(sys.executable).parent / "kubectl")
API = f"{GROUP}/{VERSION}"
OBJECTS = {
    "Session": {
        "apiVersion": API,
        "kind": "Session",
        "metadata": {"name": "s1"},
        "spec": {"podTemplate": KWOK_POD, "workspace": {"size": "64Mi"}, "harness": {"name": "h", "revision": "1"}},
    },
    "Checkpoint": {"apiVersion": API, "kind": "Checkpoint", "metadata": {"name": "c1"}, "spec": {"sessionName": "s1"}},
    "Fork": {
        "apiVersion": API,
        "kind": "Fork",
        "metadata": {"name": "f1"},
        "spec": {"source": {"checkpoint": "c1"}, "target": {"sessionName": "t1"}},
    },
}


def kubectl(kubeconfig: str, *args: str, stdin: str | None = None, timeout: float = 300) -> str:
    done = subprocess.run(
        [KUBECTL, "--kubeconfig", kubeconfig, *args], input=stdin, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"kubectl {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def serving(operator) -> None:
    """Wait until the operator's webhook listens: the API server refuses a create it cannot send there."""

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", operator.webhook["port"]), timeout=1).close()
            return True
        except OSError:
            return False

    wait_for(listening, timeout=30, what="the operator's webhook to listen")


def reasons(core: client.CoreV1Api, namespace: str, name: str) -> set[str]:
    """The reasons of the Kubernetes Events posted on one object."""
    events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
    return {e.reason for e in events}


@pytest.mark.parametrize("order", list(itertools.permutations(OBJECTS)), ids="-".join)
def test_one_apply_of_session_checkpoint_and_fork_converges_in_any_order(
    order, operator, webhook, core, crds, kubeconfig, namespace
):
    # The webhook answers these creates too: it must not refuse what would converge.
    core.patch_namespace(namespace, {"metadata": {"labels": {webhook: "true"}}})
    serving(operator)
    manifest = yaml.safe_dump_all([OBJECTS[kind] for kind in order])
    kubectl(kubeconfig, "apply", "-n", namespace, "-f", "-", stdin=manifest)

    kubectl(
        kubeconfig, "wait", "-n", namespace, "--for=condition=Ready", "--timeout=240s",
        "session/s1", "checkpoint/c1", "fork/f1",
    )  # fmt: skip
    kubectl(kubeconfig, "wait", "-n", namespace, "--for=jsonpath={.status.phase}=Succeeded", "fork/f1")
    kubectl(kubeconfig, "wait", "-n", namespace, "--for=jsonpath={.status.phase}=Ready", "checkpoint/c1")
    kubectl(kubeconfig, "wait", "-n", namespace, "--for=jsonpath={.status.phase}=Ready", "--timeout=120s", "session/t1")
    kubectl(kubeconfig, "wait", "-n", namespace, "--for=condition=Ready", "--timeout=120s", "session/t1")
    # The Session was never Ready when the Checkpoint arrived, nor the Checkpoint when the
    # Fork did: each waited, and said so.
    assert "WaitingForSession" in reasons(core, namespace, "c1")
    assert "WaitingForCheckpoint" in reasons(core, namespace, "f1")
    target = crds.get_namespaced_custom_object(GROUP, VERSION, namespace, "sessions", "t1")
    assert target["status"]["forkedFromCheckpoint"] == "c1"


@pytest.fixture
def short_waits(operator):
    """The operator with a 15 s wait bound and a 6 s snapshot timeout. A stuck snapshot's
    checkpoint fails at its first Pending poll (every 5 s) after 6 s, so 6-11 s after it
    was made: before a Fork made with it reaches the wait bound, as the test of a fork of
    a failing checkpoint needs (with both at 15 s the Fork's bound could come first)."""
    operator.stop()
    operator.start(SAVEPOINT_WAIT_TIMEOUT="15s", SAVEPOINT_SNAPSHOT_TIMEOUT="6s")
    yield operator
    operator.stop()
    operator.start()


def ready_condition(body: dict) -> dict:
    return next(c for c in body["status"]["conditions"] if c["type"] == "Ready")


def test_a_checkpoint_of_a_session_that_never_gets_ready_is_rejected_after_the_bound(
    short_waits, core, crds, namespace
):
    # No toleration for the kwok taint: the Pod never schedules, the session stays Provisioning.
    make_session(crds, namespace, "stuck", podTemplate={"spec": {"containers": [{"name": "a", "image": "x"}]}})
    made = make_checkpoint(crds, namespace, "early", session="stuck")
    waiting = wait_checkpoint(crds, namespace, "early", "Pending", "Rejected", "Ready")
    assert (waiting["status"]["phase"], waiting["status"]["reason"]) == ("Pending", "WaitingForSession")
    assert ready_condition(waiting)["reason"] == "WaitingForSession"
    assert ready_condition(waiting)["status"] == "False"

    rejected = wait_checkpoint(crds, namespace, "early", "Rejected", "Ready", timeout=120)
    status = rejected["status"]
    assert (status["phase"], status["reason"]) == ("Rejected", "SessionNotReady"), status
    assert "SAVEPOINT_WAIT_TIMEOUT" in status["message"] and "Provisioning" in status["message"]
    created = datetime.strptime(made["metadata"]["creationTimestamp"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert (datetime.now(UTC) - created).total_seconds() >= 15
    assert get_snapshot(crds, namespace, "sp-early") is None
    assert {"WaitingForSession", "SessionNotReady"} <= reasons(core, namespace, "early")


def test_a_fork_of_a_checkpoint_that_fails_fails_with_its_reason(never_ready_class, short_waits, core, crds, namespace):
    make_session(crds, namespace, "s1")
    wait_phase(crds, namespace, "s1", "Ready", timeout=90)
    make_stuck_snapshot(crds, namespace, "stuck", "s1", never_ready_class)
    make_checkpoint(crds, namespace, "stuck")
    make_fork(crds, namespace, "f1", {"checkpoint": "stuck"}, target="t1")

    def waiting():
        body = crds.get_namespaced_custom_object(GROUP, VERSION, namespace, "forks", "f1")
        return body if (body.get("status") or {}).get("reason") == "WaitingForCheckpoint" else None

    body = wait_for(waiting, timeout=30, what="fork f1 waiting for its checkpoint")
    assert body["status"]["phase"] == "Pending"
    assert ready_condition(body)["reason"] == "WaitingForCheckpoint"

    failed = wait_fork(crds, namespace, "f1", timeout=120)["status"]
    ckpt = wait_checkpoint(crds, namespace, "stuck", "Failed")["status"]
    assert ckpt["reason"] == "SnapshotTimeout"
    assert (failed["phase"], failed["reason"]) == ("Failed", "CheckpointNotReady"), failed
    assert "ended Failed (SnapshotTimeout" in failed["message"]
    ready = next(c for c in failed["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "CheckpointNotReady")
    with pytest.raises(client.ApiException) as gone:
        crds.get_namespaced_custom_object(GROUP, VERSION, namespace, "sessions", "t1")
    assert gone.value.status == 404  # nothing made for a fork that could not be done


def test_the_webhook_refuses_only_what_cannot_change(webhook, operator, core, crds, namespace):
    core.patch_namespace(namespace, {"metadata": {"labels": {webhook: "true"}}})
    serving(operator)
    make_session(crds, namespace, "s1")
    started = time.monotonic()
    make_checkpoint(crds, namespace, "early")  # s1 is Provisioning: let in, it waits
    make_checkpoint(crds, namespace, "ghost", session="ghost")  # may come in the same apply: let in
    assert wait_checkpoint(crds, namespace, "early", "Ready", "Rejected", "Failed")["status"]["phase"] == "Ready"
    ghost = wait_checkpoint(crds, namespace, "ghost", "Rejected", "Ready")["status"]
    assert ghost["reason"] == "SessionNotFound"
    assert time.monotonic() - started < 60

    make_session(crds, namespace, "bad", podTemplate={"spec": {"containers": []}})
    wait_phase(crds, namespace, "bad", "Failed")
    with pytest.raises(client.ApiException) as refused:
        make_checkpoint(crds, namespace, "of-failed", session="bad")
    assert refused.value.status == 409 and "SessionNotReady: session bad is Failed" in refused.value.body
