"""Invalid and hostile Sessions, Checkpoints and Forks, from a table.

Each row is either refused when it is written (the CRD schema, a CEL rule or the
webhook answers, and the message names the field), or stored and then given a terminal
phase with a reason by the operator. After the table the operator is still running and
still brings an ordinary Session to Ready. docs/reliability.md lists the rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pytest
from kubernetes import client

from savepoint.checkpoint import CHECKPOINT_LABEL, snapshot_name
from savepoint.errors import MalformedChunk
from savepoint.eventlog import EventLog
from savepoint.models import GROUP, VERSION
from tests.conftest import wait_for
from tests.integration.test_checkpoint import get_snapshot, make_checkpoint, wait_checkpoint
from tests.integration.test_fork import wait_fork
from tests.integration.test_session import KWOK_POD, get_session, make_session, wait_phase

MiB = 1 << 20
PLURAL = {"Session": "sessions", "Checkpoint": "checkpoints", "Fork": "forks"}


def obj(kind: str, name: str, spec: Any) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": kind, "metadata": {"name": name}, "spec": spec}


def session(name: str = "bad-s", **spec: Any) -> dict:
    return obj("Session", name, {"podTemplate": KWOK_POD, "workspace": {"size": "64Mi"}, **spec})


def checkpoint(name: str = "bad-c", **spec: Any) -> dict:
    return obj("Checkpoint", name, {"sessionName": "s1", **spec})


def fork(name: str = "bad-f", **spec: Any) -> dict:
    return obj("Fork", name, {"source": {"checkpoint": "c1"}, "target": {"sessionName": "bad-t"}, **spec})


def with_spec(body: dict, spec: Any) -> dict:
    return {**body, "spec": spec}


@dataclass(frozen=True)
class Refused:
    id: str
    body: dict
    field: str  # must appear in the API server's message
    also: str = ""  # and this, when the message should say more than the field


# --- refused at admission: schema, CEL ------------------------------------------------------

REFUSED = [
    # Sessions
    Refused("session-name-over-48", session("a" * 49), "metadata.name", "at most 48 characters"),
    Refused("session-name-unicode", session("sessión"), "metadata.name"),
    Refused("session-spec-not-object", with_spec(session(), "run me"), "spec"),
    Refused("size-wrong-type", session(workspace={"size": 5}), "spec.workspace.size"),
    Refused("size-negative", session(workspace={"size": "-1Gi"}), "spec.workspace.size"),
    Refused("size-1MiB-digits", session(workspace={"size": "1" * MiB}), "spec.workspace.size"),
    Refused("mount-path-relative", session(workspace={"mountPath": "workspace"}), "spec.workspace.mountPath"),
    Refused("mode-unknown", session(operatingMode="Sleeping"), "spec.operatingMode"),
    Refused("mode-wrong-type", session(operatingMode=True), "spec.operatingMode"),
    Refused("keep-last-zero", session(checkpointPolicy={"keepLast": 0}), "spec.checkpointPolicy.keepLast"),
    Refused("keep-last-negative", session(checkpointPolicy={"keepLast": -3}), "spec.checkpointPolicy.keepLast"),
    Refused("keep-last-string", session(checkpointPolicy={"keepLast": "3"}), "spec.checkpointPolicy.keepLast"),
    Refused("policy-ttl-negative", session(checkpointPolicy={"ttl": "-1h"}), "spec.checkpointPolicy.ttl"),
    Refused("idle-pause-after-zero", session(idle={"pauseAfter": "0s"}), "spec.idle.pauseAfter", "longer than zero"),
    Refused("idle-pause-after-no-unit", session(idle={"pauseAfter": "15"}), "spec.idle.pauseAfter"),
    Refused("idle-pause-after-negative", session(idle={"pauseAfter": "-5m"}), "spec.idle.pauseAfter"),
    Refused("idle-pause-after-missing", session(idle={"wakeOnEvent": True}), "spec.idle.pauseAfter", "Required"),
    Refused(
        "idle-wake-on-no-types",
        session(idle={"pauseAfter": "5m", "wakeOnEvent": True, "wakeOnTypes": []}),
        "spec.idle.wakeOnTypes",
        "at least one event type",
    ),
    Refused("harness-name-1MiB", session(harness={"name": "h" * MiB}), "spec.harness.name"),
    Refused(
        "hook-command-empty",
        session(checkpointPolicy={"hooks": {"preCheckpoint": {"exec": {"command": []}}}}),
        "spec.checkpointPolicy.hooks.preCheckpoint.exec.command",
    ),
    Refused(
        "hook-command-word-empty",
        session(checkpointPolicy={"hooks": {"preCheckpoint": {"exec": {"command": ["sync", ""]}}}}),
        "spec.checkpointPolicy.hooks.preCheckpoint.exec.command[1]",
    ),
    Refused(
        "hook-without-exec",
        session(checkpointPolicy={"hooks": {"postCheckpoint": {"timeoutSeconds": 5}}}),
        "spec.checkpointPolicy.hooks.postCheckpoint.exec",
    ),
    Refused(
        "hook-timeout-zero",
        session(checkpointPolicy={"hooks": {"preCheckpoint": {"exec": {"command": ["sync"]}, "timeoutSeconds": 0}}}),
        "spec.checkpointPolicy.hooks.preCheckpoint.timeoutSeconds",
    ),
    Refused(
        "hook-timeout-over-300",
        session(checkpointPolicy={"hooks": {"postCheckpoint": {"exec": {"command": ["sync"]}, "timeoutSeconds": 301}}}),
        "spec.checkpointPolicy.hooks.postCheckpoint.timeoutSeconds",
    ),
    Refused(
        "hook-container-bad-name",
        session(checkpointPolicy={"hooks": {"preCheckpoint": {"exec": {"command": ["sync"]}, "container": "A_b"}}}),
        "spec.checkpointPolicy.hooks.preCheckpoint.container",
    ),
    Refused("pod-template-list", session(podTemplate=[]), "spec.podTemplate"),
    Refused("source-both", session(source={"checkpoint": "c1", "session": "s1"}), "spec.source", "exactly one"),
    Refused(
        "source-other-namespace", session(source={"checkpoint": "other/c1"}), "spec.source.checkpoint", "namespace"
    ),
    # Checkpoints
    Refused("ckpt-no-session", with_spec(checkpoint(), {}), "spec.sessionName"),
    Refused("ckpt-session-empty", checkpoint(sessionName=""), "spec.sessionName"),
    Refused("ckpt-session-wrong-type", checkpoint(sessionName=42), "spec.sessionName"),
    Refused("ckpt-session-other-namespace", checkpoint(sessionName="other/s1"), "spec.sessionName", "namespace"),
    Refused("ckpt-label-1MiB", checkpoint(label="x" * MiB), "spec.label"),
    Refused("ckpt-label-257-runes", checkpoint(label="ü" * 257), "spec.label"),
    Refused("ckpt-ttl-negative", checkpoint(ttl="-5m"), "spec.ttl"),
    Refused("ckpt-ttl-unknown-unit", checkpoint(ttl="1y"), "spec.ttl"),
    Refused("ckpt-ttl-number", checkpoint(ttl=3600), "spec.ttl"),
    Refused("ckpt-name-invalid", checkpoint("Bad_Name"), "metadata.name"),
    Refused("ckpt-name-254", checkpoint("c" * 254), "metadata.name"),
    # Forks
    Refused("fork-no-source", with_spec(fork(), {"target": {"sessionName": "t"}}), "spec.source"),
    Refused("fork-mode-lowercase", fork(mode="rollback"), "spec.mode"),
    Refused(
        "fork-rollback-without-checkpoint",
        fork(source={"session": "s1"}, mode="Rollback"),
        "spec.source",
        "Rollback needs source.checkpoint",
    ),
    Refused(
        "fork-without-target",
        with_spec(fork(), {"source": {"checkpoint": "c1"}}),
        "spec.target",
        "needs target.sessionName",
    ),
    Refused("fork-target-over-48", fork(target={"sessionName": "t" * 49}), "spec.target.sessionName"),
    Refused("fork-target-invalid-name", fork(target={"sessionName": "Bad_Name"}), "spec.target.sessionName"),
    Refused("fork-at-event-without-session", fork(source={"checkpoint": "c1", "atEvent": "3"}), "spec.source.atEvent"),
    Refused("fork-at-event-huge", fork(source={"session": "s1", "atEvent": "9" * 65}), "spec.source.atEvent"),
    Refused(
        "fork-checkpoint-other-namespace",
        fork(source={"checkpoint": "other/c1"}),
        "spec.source.checkpoint",
        "namespace",
    ),
    Refused(
        "fork-session-other-namespace",
        fork(source={"session": "other/s1", "atEvent": "1"}),
        "spec.source.session",
        "namespace",
    ),
    Refused("fork-overrides-string", fork(target={"sessionName": "t", "overrides": "x"}), "spec.target.overrides"),
]


def test_the_api_server_refuses_malformed_objects_naming_the_field(operator, crds, namespace):
    wrong = []
    for case in REFUSED:
        plural = PLURAL[case.body["kind"]]
        try:
            crds.create_namespaced_custom_object(GROUP, VERSION, namespace, plural, case.body)
        except client.ApiException as err:
            message = err.body if isinstance(err.body, str) else str(err)
            if err.status not in (400, 422) or case.field not in message or case.also not in message:
                wrong.append(f"{case.id}: HTTP {err.status}, wanted {case.field!r} {case.also!r} in: {message[:400]}")
            continue
        wrong.append(f"{case.id}: was accepted")
        crds.delete_namespaced_custom_object(GROUP, VERSION, namespace, plural, case.body["metadata"]["name"])
    assert not wrong, "\n".join(wrong)


# --- stored, then failed or rejected in status with a reason -------------------------------


@dataclass(frozen=True)
class Rejected:
    id: str
    body: dict
    phase: str
    reason: str
    message: str = ""  # must appear in status.message / the Ready condition's message
    checks: dict[str, Any] = field(default_factory=dict)


STATUS_CASES = [
    # Checkpoints
    Rejected(
        "ckpt-session-missing", checkpoint("ghost-c", sessionName="ghost"), "Rejected", "SessionNotFound", "ghost"
    ),
    Rejected("ckpt-ttl-zero", checkpoint("zero-ttl", ttl="0s"), "Expired", "TTLExpired"),
    # Forks
    Rejected(
        "fork-checkpoint-missing",
        fork("f-ghost", source={"checkpoint": "ghost"}),
        "Failed",
        "CheckpointNotFound",
        "ghost",
    ),
    Rejected("fork-session-missing", fork("f-nosession", source={"session": "ghost"}), "Failed", "SessionNotFound"),
    Rejected(
        "fork-at-event-negative",
        fork("f-minus", source={"session": "s1", "atEvent": "-1"}),
        "Failed",
        "EventNotFound",
        "-1",
    ),
    Rejected(
        "fork-at-event-unknown-id",
        fork("f-noid", source={"session": "s1", "atEvent": "000000000099-ffffffffffff"}),
        "Failed",
        "EventNotFound",
    ),
    Rejected("fork-target-exists", fork("f-exists", target={"sessionName": "s1"}), "Failed", "TargetExists"),
    Rejected(
        "fork-overrides-wrong-type",
        fork("f-ovr", target={"sessionName": "t-ovr", "overrides": {"workspace": {"size": 12}}}),
        "Failed",
        "InvalidTarget",
        "workspace",
    ),
    Rejected(
        "fork-overrides-unschedulable-pod",
        fork(
            "f-pod",
            target={
                "sessionName": "t-pod",
                "overrides": {"podTemplate": {"spec": {"containers": [{"name": "Bad Name!", "image": "x"}]}}},
            },
        ),
        "Failed",
        "SessionNotReady",
        "containers",
    ),
    # Sessions (phase Failed, the reason on the Ready condition)
    Rejected(
        "pod-template-no-containers",
        session("bad-pt1", podTemplate={"spec": {"containers": "nope"}}),
        "Failed",
        "InvalidPodTemplate",
        "spec.podTemplate.spec.containers",
    ),
    Rejected(
        "pod-template-mounts-not-list",
        session("bad-pt2", podTemplate={"spec": {"containers": [{"name": "a", "image": "x", "volumeMounts": "bad"}]}}),
        "Failed",
        "InvalidPodTemplate",
        "volumeMounts",
    ),
    Rejected(
        "pod-template-refused-by-api-server",
        session("bad-pt3", podTemplate={"spec": {"containers": [{"name": "UPPER_case", "image": "x"}]}}),
        "Failed",
        "InvalidPodTemplate",
        "containers",
    ),
    Rejected(
        "source-checkpoint-missing",
        session("bad-src", source={"checkpoint": "ghost"}),
        "Failed",
        "CheckpointNotReady",
        "ghost",
    ),
]


def _status(crds, namespace: str, body: dict) -> dict:
    try:
        got = crds.get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL[body["kind"]], body["metadata"]["name"]
        )
    except client.ApiException:
        return {}
    status = got.get("status") or {}
    if body["kind"] == "Session":  # sessions carry their reason on the Ready condition
        ready = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), {})
        return {"phase": status.get("phase"), "reason": ready.get("reason"), "message": ready.get("message", "")}
    return status


@pytest.fixture
def s1_with_c1(operator, crds, namespace):
    make_session(crds, namespace, "s1")
    wait_phase(crds, namespace, "s1", "Ready", timeout=90)
    EventLog(client.CoreV1Api(crds.api_client), namespace, "s1").append("user.message", {"text": "hi"})
    make_checkpoint(crds, namespace, "c1")
    wait_checkpoint(crds, namespace, "c1", "Ready")


def test_hostile_objects_end_in_a_terminal_phase_with_a_reason(s1_with_c1, operator, crds, namespace):
    for case in STATUS_CASES:
        crds.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL[case.body["kind"]], case.body)

    def settled():
        return all(_status(crds, namespace, c.body).get("phase") == c.phase for c in STATUS_CASES)

    try:
        wait_for(settled, timeout=120, interval=1, what="every hostile object in its terminal phase")
    finally:
        wrong = []
        for case in STATUS_CASES:
            got = _status(crds, namespace, case.body)
            if (got.get("phase"), got.get("reason")) != (case.phase, case.reason) or case.message not in (
                got.get("message") or ""
            ):
                wrong.append(f"{case.id}: wanted {case.phase}/{case.reason} {case.message!r}, got {got}")
        assert not wrong, "\n".join(wrong)
    # The zero-ttl checkpoint expired while it was being snapshotted: its snapshot must not outlive that.
    wait_for(
        lambda: get_snapshot(crds, namespace, snapshot_name("zero-ttl")) is None,
        timeout=60,
        what="the snapshot of the checkpoint that expired at once deleted",
    )
    _assert_operator_serves(operator, crds, namespace, "after-status-table")


# --- accepted and working: long names, unicode, absurd numbers ---------------------------------


def test_long_checkpoint_names_hash_into_valid_snapshot_names_end_to_end(s1_with_c1, operator, core, crds, namespace):
    long = "c" * 200
    dotted = "a" * 48 + "." + "b" * 150  # the cut at 52 characters lands right after the dot
    for name in (long, dotted):
        make_checkpoint(crds, namespace, name, label="long name")
    for name in (long, dotted):
        body = wait_checkpoint(crds, namespace, name, "Ready", "Failed", "Rejected")
        status = body["status"]
        assert status["phase"] == "Ready", (name[:60], status)
        vs = status["volumeSnapshotName"]
        assert vs == snapshot_name(name) and vs.startswith("sp-") and len(vs) <= 63
        snapshot = get_snapshot(crds, namespace, vs)
        assert snapshot is not None and snapshot["status"]["readyToUse"]
        assert (snapshot["metadata"].get("annotations") or {}).get(CHECKPOINT_LABEL) == name
        assert len(snapshot["metadata"]["labels"][CHECKPOINT_LABEL]) <= 63
    # The long one restores: a fork from it, and a rollback to it.
    crds.create_namespaced_custom_object(
        GROUP,
        VERSION,
        namespace,
        "forks",
        fork("from-long", source={"checkpoint": long}, target={"sessionName": "t-long"}),
    )
    crds.create_namespaced_custom_object(
        GROUP, VERSION, namespace, "forks", obj("Fork", "rb-long", {"source": {"checkpoint": long}, "mode": "Rollback"})
    )
    for name in ("from-long", "rb-long"):
        done = wait_fork(crds, namespace, name)
        assert done["status"]["phase"] == "Succeeded", (name, done["status"])
    events = EventLog(core, namespace, "s1").read()
    assert [e.data.get("checkpoint") for e in events if e.type == "checkpoint.created"].count(long) == 1
    # Deleting it removes its hashed snapshot (the garbage collector: it owns the snapshot).
    crds.delete_namespaced_custom_object(GROUP, VERSION, namespace, "checkpoints", dotted)
    wait_for(lambda: get_snapshot(crds, namespace, snapshot_name(dotted)) is None, timeout=60, what="snapshot deleted")


def test_longest_session_name_fits_every_derived_name(operator, crds, namespace):
    name = "s" * 48
    make_session(crds, namespace, name)
    wait_phase(crds, namespace, name, "Ready", timeout=90)
    make_checkpoint(crds, namespace, "c-long-session", session=name)
    wait_checkpoint(crds, namespace, "c-long-session", "Ready")
    crds.create_namespaced_custom_object(
        GROUP,
        VERSION,
        namespace,
        "forks",
        obj("Fork", "rb", {"source": {"checkpoint": "c-long-session"}, "mode": "Rollback"}),
    )
    done = wait_fork(crds, namespace, "rb")
    assert done["status"]["phase"] == "Succeeded", done["status"]
    body = wait_phase(crds, namespace, name, "Ready", timeout=90)
    assert body["status"]["workspaceClaimName"].startswith(name + "-ws-")


def test_unicode_and_absurd_numbers_are_kept_or_clamped(s1_with_c1, operator, core, crds, namespace):
    label = "🚀 ünïcödé ‮RTL‬ 日本語 \u0000 nul \U0001f9ea"
    make_checkpoint(crds, namespace, "uni", label=label)
    make_checkpoint(crds, namespace, "forever", ttl="99999999999999999999d")
    uni = wait_checkpoint(crds, namespace, "uni", "Ready", "Failed", "Rejected")
    assert uni["status"]["phase"] == "Ready", uni["status"]
    assert uni["spec"]["label"] == label
    created = [e for e in EventLog(core, namespace, "s1").read() if e.type == "checkpoint.created"]
    assert [e.data["label"] for e in created if e.data["checkpoint"] == "uni"] == [label]
    forever = wait_checkpoint(crds, namespace, "forever", "Ready", "Failed", "Rejected")["status"]
    assert forever["phase"] == "Ready", forever
    created_at, expires_at = (datetime.strptime(forever[k], "%Y-%m-%dT%H:%M:%SZ") for k in ("createdAt", "expiresAt"))
    assert (expires_at - created_at).days == 30  # clamped to the workspace cap, never past it


def test_the_webhook_refuses_hostile_checkpoints_with_the_reason(webhook, s1_with_c1, operator, core, crds, namespace):
    core.patch_namespace(namespace, {"metadata": {"labels": {webhook: "true"}}})
    log = EventLog(core, namespace, "s1")
    log.append("run.started", {"runId": "w"})
    busy = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Checkpoint", "metadata": {"name": "w-busy"}}
    busy["spec"] = {"sessionName": "s1"}

    def refused() -> str | None:
        """The API server's answer once its namespace cache has seen the label (a dry run stores nothing)."""
        try:
            crds.create_namespaced_custom_object(GROUP, VERSION, namespace, "checkpoints", busy, dry_run="All")
        except client.ApiException as err:
            return err.body
        return None

    body = wait_for(refused, timeout=30, what="the webhook to answer for the labelled namespace")
    assert "SessionBusy" in body and "run in flight" in body
    log.append("run.completed", {"runId": "w"})
    # A session that does not exist yet may follow in the same apply: that would converge, so it is let in.
    ghost = {**busy, "metadata": {"name": "w-ghost"}, "spec": {"sessionName": "ghost"}}
    crds.create_namespaced_custom_object(GROUP, VERSION, namespace, "checkpoints", ghost, dry_run="All")
    # Hostile but legal input passes the webhook and works.
    make_checkpoint(crds, namespace, "w" * 200, label="日本語 🚀")
    assert wait_checkpoint(crds, namespace, "w" * 200, "Ready", "Failed", "Rejected")["status"]["phase"] == "Ready"


# --- after all that --------------------------------------------------------------------------


def _assert_operator_serves(operator, crds, namespace: str, name: str) -> None:
    proc = getattr(operator, "proc", operator)
    assert proc.poll() is None, "the operator exited"
    make_session(crds, namespace, name)
    wait_phase(crds, namespace, name, "Ready", timeout=90)
    assert get_session(crds, namespace, name)["status"]["restore"] == {"mode": "fresh"}


def test_the_operator_survives_the_table_and_serves_a_normal_session(operator, crds, namespace):
    _assert_operator_serves(operator, crds, namespace, "normal")
    make_checkpoint(crds, namespace, "normal-c", session="normal")
    assert wait_checkpoint(crds, namespace, "normal-c", "Ready")["status"]["phase"] == "Ready"


def test_a_hand_corrupted_chunk_loses_no_events_and_recovers_when_repaired(operator, core, crds, namespace):
    make_session(crds, namespace, "s1")
    wait_phase(crds, namespace, "s1", "Ready", timeout=90)
    log = EventLog(core, namespace, "s1")
    written = [log.append("note", {"n": n}) for n in (1, 2, 3)]
    chunk = "s1-log-000001"
    key = f"{written[1].seq:012d}"
    original = core.read_namespaced_config_map(chunk, namespace).data[key]
    core.patch_namespaced_config_map(chunk, namespace, {"data": {key: '{"seq": "two"'}})

    def readable(state: str):
        conds = {c["type"]: c for c in (get_session(crds, namespace, "s1").get("status") or {}).get("conditions", [])}
        cond = conds.get("EventLogReadable")
        return cond if cond and cond["status"] == state else None

    cond = wait_for(lambda: readable("False"), timeout=60, what="EventLogReadable=False")
    assert chunk in cond["message"] and key in cond["message"]
    # A writer is refused rather than writing around the damage (which would hide it),
    # and the refusal names the chunk and the key.
    with pytest.raises(MalformedChunk) as err:
        log.append("note", {"n": 4})
    assert err.value.chunk == chunk and err.value.key == key, err.value
    assert sorted(core.read_namespaced_config_map(chunk, namespace).data) == [f"{e.seq:012d}" for e in written]
    core.patch_namespaced_config_map(chunk, namespace, {"data": {key: original}})
    wait_for(lambda: readable("True"), timeout=60, what="EventLogReadable=True after the repair")
    wait_phase(crds, namespace, "s1", "Ready")
    after = log.append("note", {"n": 5})
    events = log.read()
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert [e.id for e in events[:3]] == [e.id for e in written]  # nothing lost, nothing rewritten
    assert [e.data["n"] for e in events if e.type == "note"] == [1, 2, 3, 5]
    assert events[-1].id == after.id
