"""savepoint.client against the real control plane and the operator (with the CSI stack).

Each error a user can provoke here is provoked for real and must arrive as its own class
with its REST status. The example of docs/python-client.md is run as written.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys

import pytest
import yaml

from savepoint.client import (
    AsyncClient,
    CheckpointExpired,
    CheckpointNotFound,
    Client,
    IdempotencyKeyConflict,
    InvalidRequest,
    QuotaExceeded,
    SessionBusy,
    SessionHistoryUnavailable,
    SessionNotFound,
    SnapshotsUnsupported,
)
from savepoint.client.core import key_name
from savepoint.models import CheckpointPhase, ForkPhase, SessionPhase, SessionSpec, WorkspaceSpec
from tests.conftest import REPO, wait_for
from tests.integration.test_session import KWOK_POD


def session_spec(**workspace) -> SessionSpec:
    return SessionSpec(pod_template=KWOK_POD, workspace=WorkspaceSpec(size="64Mi", **workspace))


@pytest.fixture
def client(kubeconfig, crds, namespace) -> Client:
    with Client(namespace, kubeconfig=kubeconfig) as made:
        yield made


@pytest.fixture
def s1(operator, client):
    return client.sessions.create("s1", session_spec(), timeout=120)


def example_code() -> str:
    text = (REPO / "docs" / "python-client.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return next(b for b in blocks if b.startswith('"""python example.py'))


def test_the_docs_example_runs(operator, kubeconfig, crds, namespace, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(example_code())
    pod = tmp_path / "sandbox-pod.yaml"
    pod.write_text(yaml.safe_dump(KWOK_POD))
    env = {**os.environ, "KUBECONFIG": kubeconfig, "PYTHONPATH": str(REPO / "operator")}
    done = subprocess.run(
        [sys.executable, str(script), str(pod), namespace], env=env, capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "session demo is Ready" in out
    assert f"checkpoint {key_name('ckpt', 'demo-1')} is Ready through event 1" in out
    assert "refused: SessionBusy (HTTP 409): Rejected: SessionBusy: session demo has a run in flight" in out
    assert "rolled back (snapshot)" in out and "session.rollback" in out
    assert "forked demo-fork: Ready, from " + key_name("ckpt", "demo-1") in out
    assert f"Checkpoint {key_name('ckpt', 'demo-1')}: created" in out  # progress was reported
    assert "Session demo: Ready" in out


def test_create_waits_by_watch_and_returns_the_ready_checkpoint(client, s1):
    assert s1.status.phase is SessionPhase.READY and s1.status.workspace_claim_name
    client.log(s1).append("user.message", {"text": "hello"})
    seen = []
    ckpt = client.checkpoints.create(s1, label="first", ttl="2h", on_progress=seen.append)
    assert ckpt.status.phase is CheckpointPhase.READY
    assert (ckpt.spec.session_name, ckpt.spec.label, ckpt.status.through_sequence) == ("s1", "first", 1)
    assert ckpt.status.volume_snapshot_name and ckpt.status.expires_at
    assert seen[0].step == "created" and seen[0].name == ckpt.name
    assert [p.state for p in seen if p.step == "state"][-1] == "Ready"
    assert seen[-1].object.status.phase is CheckpointPhase.READY
    listed = client.checkpoints.list("s1")
    assert [c.name for c in listed] == [ckpt.name] and client.checkpoints.list("other") == []
    assert client.checkpoints.get(ckpt.name).status.ready_at == ckpt.status.ready_at


def test_an_idempotency_key_returns_the_same_checkpoint(client, s1, core, namespace):
    first = client.checkpoints.create("s1", label="retry", idempotency_key="req-1")
    steps = []
    again = client.checkpoints.create("s1", label="retry", idempotency_key="req-1", on_progress=steps.append)
    assert again.name == first.name == key_name("ckpt", "req-1")
    assert again.metadata.uid == first.metadata.uid and steps[0].step == "reused"
    assert again.metadata.annotations["savepoint.dev/idempotency-key"] == "req-1"
    assert len(client.checkpoints.list()) == 1
    with pytest.raises(IdempotencyKeyConflict) as caught:
        client.checkpoints.create("s1", label="another", idempotency_key="req-1")
    assert caught.value.http_status == 422
    assert len(client.checkpoints.list()) == 1

    core.patch_namespace(namespace, {"metadata": {"annotations": {"savepoint.dev/max-checkpoints": "1"}}})
    with pytest.raises(QuotaExceeded) as caught:
        client.checkpoints.create("s1", timeout=60)
    assert (caught.value.http_status, caught.value.reason) == (409, "QuotaExceeded")
    assert "max-checkpoints=1" in str(caught.value)


def test_not_found_maps_to_404(operator, client):
    with pytest.raises(SessionNotFound) as caught:
        client.checkpoints.create("ghost", timeout=60)
    err = caught.value
    assert (err.reason, err.http_status) == ("SessionNotFound", 404)
    assert str(err) == "Rejected: SessionNotFound: session ghost not found"
    assert err.object.status.phase is CheckpointPhase.REJECTED  # the stored, rejected Checkpoint
    with pytest.raises(SessionNotFound):
        client.sessions.get("ghost")
    with pytest.raises(CheckpointNotFound) as caught:
        client.forks.create("s2", checkpoint="nope", timeout=60)
    assert caught.value.http_status == 404 and caught.value.object.status.phase is ForkPhase.FAILED
    with pytest.raises(SessionNotFound):
        list(client.log("ghost").tail())


def test_busy_expired_and_history_unavailable(webhook, client, s1, core, namespace):
    log = client.log(s1)
    log.append("user.message", {"text": "hi"}, subject="alice")
    brief = client.checkpoints.create(s1, ttl="2s")
    log.append("run.started", {"runId": "r1"})
    client.sessions.wait(s1, "Running", timeout=60)
    with pytest.raises(SessionBusy) as caught:
        client.checkpoints.create(s1, timeout=60)
    assert (caught.value.http_status, caught.value.reason) == (409, "SessionBusy")
    assert "run in flight" in str(caught.value)
    # With the admission webhook, the same refusal comes from the create itself, as the same class.
    core.patch_namespace(namespace, {"metadata": {"labels": {webhook: "true"}}})
    with pytest.raises(SessionBusy) as caught:
        client.checkpoints.create(s1, timeout=60)
    assert caught.value.http_status == 409 and caught.value.object is None
    assert "denied the request: SessionBusy: session s1 has a run in flight" in str(caught.value)
    log.append("run.completed", {"runId": "r1"})

    wait_for(
        lambda: client.checkpoints.get(brief.name).status.phase is CheckpointPhase.EXPIRED,
        timeout=60,
        what="the 2s checkpoint to expire",
    )
    with pytest.raises(CheckpointExpired) as caught:
        client.checkpoints.wait(brief, timeout=10)
    assert caught.value.reason == "CheckpointExpired" and caught.value.object.status.reason == "TTLExpired"
    with pytest.raises(CheckpointExpired) as caught:
        client.forks.create("never", checkpoint=brief, timeout=60)
    assert caught.value.http_status == 409

    log.erase("alice")
    with pytest.raises(SessionHistoryUnavailable) as caught:
        client.forks.create("x2", session=s1, at_event=str(log.cursor().seq), timeout=60)
    assert caught.value.http_status == 409


def test_snapshots_unsupported_maps_to_501(operator, client):
    client.sessions.create("noclass", session_spec(volume_snapshot_class_name="missing"), timeout=120)
    with pytest.raises(SnapshotsUnsupported) as caught:
        client.checkpoints.create("noclass", timeout=60)
    assert (caught.value.reason, caught.value.http_status) == ("SnapshotsUnsupported", 501)


def test_bad_input_is_refused_before_anything_is_stored(client, crds):
    with pytest.raises(InvalidRequest) as caught:
        client.checkpoints.create("s1", ttl="soon")
    assert caught.value.field == "spec.ttl"
    with pytest.raises(InvalidRequest) as caught:  # the server's own refusal: a name too long for a Session
        client.sessions.create("s" * 60, session_spec(), wait=False)
    assert caught.value.http_status == 422
    assert client.checkpoints.list() == [] and client.sessions.list() == []


def test_rollback_pause_and_resume(client, s1):
    log = client.log(s1)
    log.append("user.message", {"text": "one"})
    ckpt = client.checkpoints.create(s1)
    log.append("user.message", {"text": "two"})
    fork = client.sessions.rollback(s1, to=ckpt, idempotency_key="rb-1", timeout=180)
    assert fork.status.phase is ForkPhase.SUCCEEDED and fork.status.target_session == "s1"
    assert fork.name == key_name("rollback", "rb-1")
    events = log.read()
    assert events[-1].type == "session.rollback" and events[-1].data["toSequence"] == 1
    assert client.sessions.wait(s1, "Ready").status.restore.mode == "snapshot"

    paused = client.sessions.pause(s1, timeout=120)
    assert paused.status.phase is SessionPhase.PAUSED
    resumed = client.sessions.resume(s1, timeout=120)
    assert resumed.status.phase is SessionPhase.READY
    client.sessions.delete(s1, wait=True, timeout=120)
    assert client.sessions.list() == []


def test_the_async_client_shares_the_operations(operator, kubeconfig, client, namespace):
    async def story() -> tuple:
        async with AsyncClient(namespace, kubeconfig=kubeconfig) as aclient:
            states: list[str] = []

            async def note(progress) -> None:
                states.append(progress.state)

            session = await aclient.sessions.create("a1", session_spec(), timeout=120)
            log = aclient.log(session)
            await log.append("user.message", {"text": "async"})
            ckpt = await aclient.checkpoints.create(session, idempotency_key="a-1", on_progress=note)
            again = await aclient.checkpoints.create(session, idempotency_key="a-1")
            await log.append("run.started", {"runId": "r1"})
            await aclient.sessions.wait(session, "Running", timeout=60)
            try:
                await aclient.checkpoints.create(session, timeout=60)
            except SessionBusy as err:
                busy = err
            tail = [e.type async for e in log.tail(2)]
            return ckpt, again, states, busy, tail

    ckpt, again, states, busy, tail = asyncio.run(story())
    assert ckpt.status.phase is CheckpointPhase.READY and again.name == ckpt.name == key_name("ckpt", "a-1")
    assert states[-1] == "Ready"
    assert busy.http_status == 409
    assert tail == ["checkpoint.created", "run.started"]  # the operator records each checkpoint in the log
    assert client.checkpoints.get(ckpt.name).status.through_sequence == 1  # the sync client sees the same
