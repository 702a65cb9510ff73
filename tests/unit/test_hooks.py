"""Checkpoint hooks' pure decisions: where a hook may run and what its failure may say."""

from __future__ import annotations

from datetime import timedelta

import pytest

from savepoint.checkpoint import Policy, QuotaUse, RejectReason, SessionView, admit
from savepoint.hooks import (
    ExecResult,
    container_of,
    describe,
    env_values,
    hooks_of,
    is_kwok,
    refusal,
    scrub,
    stderr_tail,
)
from savepoint.models import CheckpointHook, CheckpointSpec

HOOK = CheckpointHook.model_validate({"exec": {"command": ["python", "-m", "savepoint.harness", "flush"]}})


def pod(node: str = "savepoint-node", phase: str = "Running", env: list | None = None) -> dict:
    return {
        "metadata": {"name": "s1", "namespace": "ns"},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "agent", "env": env or []}, {"name": "sidecar"}],
        },
        "status": {"phase": phase},
    }


def test_a_session_without_hooks_has_none():
    assert hooks_of({}) is None
    assert hooks_of({"checkpointPolicy": {"ttl": "1d"}}) is None
    assert hooks_of({"checkpointPolicy": {"hooks": {}}}) is None
    hooks = hooks_of({"checkpointPolicy": {"hooks": {"postCheckpoint": {"exec": {"command": ["sync"]}}}}})
    assert hooks is not None and hooks.pre_checkpoint is None
    assert hooks.post_checkpoint is not None and hooks.post_checkpoint.timeout_seconds == 30


def test_the_first_container_is_the_default_and_a_missing_one_is_named():
    assert container_of(HOOK, pod()) == ("agent", None)
    named = HOOK.model_copy(update={"container": "sidecar"})
    assert container_of(named, pod()) == ("sidecar", None)
    missing = HOOK.model_copy(update={"container": "nope"})
    name, why = container_of(missing, pod())
    assert name is None and "'nope'" in (why or "") and "agent, sidecar" in (why or "")


def test_a_kwok_node_is_refused_by_name():
    kwok = {"metadata": {"name": "kwok-node-0", "labels": {"type": "kwok"}}}
    annotated = {"metadata": {"name": "n", "annotations": {"kwok.x-k8s.io/node": "fake"}}}
    real = {"metadata": {"name": "savepoint-node", "labels": {"type": "real"}}}
    assert is_kwok(kwok) and is_kwok(annotated) and not is_kwok(real)
    assert refusal("preCheckpoint", pod("kwok-node-0"), kwok) == "hooks need a real node: kwok-node-0 is a kwok fake"
    assert refusal("preCheckpoint", pod(), real) is None
    assert "Pending" in (refusal("preCheckpoint", pod(phase="Pending"), real) or "")
    assert "no sandbox Pod" in (refusal("preCheckpoint", None, None) or "")


def test_scrub_removes_env_values_credentials_tokens_and_keys():
    secrets = env_values(
        pod(env=[{"name": "DB_URL", "value": "postgres://u:hunter22@db"}, {"name": "N", "value": "1"}])
    )
    assert secrets == ["postgres://u:hunter22@db"]  # "1" is too short to scrub on its own
    jwt = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW0ifQ.c2lnbmF0dXJl"
    text = (
        f"connect postgres://u:hunter22@db failed; API_TOKEN=abc123 password: pw9 token {jwt}\n"
        "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----"
    )
    clean = scrub(text, secrets)
    for leaked in ("hunter22", "abc123", "pw9", jwt, "MIIE"):
        assert leaked not in clean
    assert "API_TOKEN=[redacted]" in clean


def test_the_stderr_tail_is_five_short_scrubbed_lines():
    stderr = "\n".join(f"line {i}" for i in range(20)) + "\n\n" + "x" * 500 + " SECRET_KEY=zzz\n"
    tail = stderr_tail(stderr, [])
    assert len(tail) == 5 and tail[0] == "line 16" and tail[3] == "line 19"
    assert len(tail[4]) == 200 and tail[4].endswith("…")


def test_a_failure_message_has_the_exit_code_and_tail_never_the_env():
    env = [{"name": "OPENAI_API_KEY", "value": "sk-live-0123456789"}]
    result = ExecResult(3, stderr="starting\nflush: sk-live-0123456789 rejected\nboom\n")
    message = describe("preCheckpoint", HOOK, "agent", result, env_values(pod(env=env)))
    assert "exited with code 3" in message and "in container agent" in message
    assert "boom" in message and "sk-live" not in message and "OPENAI_API_KEY" not in message
    timed_out = describe("preCheckpoint", HOOK, "agent", ExecResult(None, timed_out=True), [])
    assert "timed out after 30s" in timed_out
    could_not = describe("postCheckpoint", HOOK, "agent", ExecResult(None, error='exec: "x": not found'), [])
    assert "could not run" in could_not


def test_a_session_with_hooks_is_rejected_when_hooks_are_off():
    policy = Policy(ttl_cap=timedelta(days=30))
    spec = CheckpointSpec(session_name="s1")
    view = SessionView(exists=True, phase="Ready", claim="c", hooks=True)
    refused = admit("c1", spec, policy, view, QuotaUse(0, 0), "class", hooks_enabled=False)
    assert refused is not None and refused.reason == RejectReason.HOOKS_DISABLED
    assert "hooks.enabled" in refused.message
    assert admit("c1", spec, policy, view, QuotaUse(0, 0), "class", hooks_enabled=True) is None
    plain = SessionView(exists=True, phase="Ready", claim="c")
    assert admit("c1", spec, policy, plain, QuotaUse(0, 0), "class", hooks_enabled=False) is None


@pytest.mark.parametrize(
    "hook",
    [
        {"exec": {"command": []}},
        {"exec": {"command": [""]}},
        {"exec": {"command": ["sync"]}, "timeoutSeconds": 0},
        {"exec": {"command": ["sync"]}, "timeoutSeconds": 301},
        {"exec": {"command": ["sync"]}, "container": "Bad_Name"},
    ],
)
def test_the_model_refuses_bad_hooks(hook):
    with pytest.raises(ValueError):
        CheckpointHook.model_validate(hook)
