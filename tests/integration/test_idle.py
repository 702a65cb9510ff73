"""spec.idle on the real control plane: an idle Session pauses, the conversation wakes it.

The pause and the run-in-flight tests run their sandboxes on the fake (kwok) nodes; the
wake test runs the reference harness on the real node, with files written and read back
inside the sandbox (kubectl exec of `python -m savepoint.harness`). docs/idle.md.
"""

from __future__ import annotations

import re
import time

import pytest
from kubernetes import client

from savepoint.eventlog import EventLog
from savepoint.models import GROUP, VERSION
from tests.conftest import wait_for
from tests.csi_data import pvc_data_dir
from tests.e2e.test_real_node import harness, harness_template, images
from tests.integration.test_checkpoint import _sample, _scrape, checksums, wait_checkpoint, write_files
from tests.integration.test_session import get_session, make_session, wait_phase


def condition(body: dict, type_: str) -> dict:
    return next((c for c in (body.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def session_events(core, namespace: str, name: str) -> list[str]:
    selector = f"involvedObject.name={name},involvedObject.kind=Session"
    found = core.list_namespaced_event(namespace, field_selector=selector)
    return [e.reason for e in found.items]


def pod_gone(core, namespace: str, name: str) -> bool:
    try:
        core.read_namespaced_pod(name, namespace)
    except client.ApiException as err:
        return err.status == 404
    return False


def test_an_idle_session_pauses_and_says_why(operator, core, crds, namespace):
    before = _sample(_scrape(f"{operator.metrics_url}/metrics"), "savepoint_session_idle_pauses_total")
    make_session(crds, namespace, "quiet", idle={"pauseAfter": "3s"})
    wait_phase(crds, namespace, "quiet", "Ready")
    EventLog(core, namespace, "quiet").append("user.message", {"text": "hello"})
    started = time.monotonic()
    body = wait_phase(crds, namespace, "quiet", "Paused", timeout=60)
    assert time.monotonic() - started >= 2.5  # not before the window, counted from the newest event
    assert body["spec"]["operatingMode"] == "Running"  # the user's spec is left alone
    idle = body["status"]["idle"]
    assert idle["paused"] is True and idle["throughSequence"] == 1
    assert idle["generation"] == body["metadata"]["generation"]
    assert condition(body, "Idle")["status"] == "True" and condition(body, "Idle")["reason"] == "IdlePaused"
    assert condition(body, "Ready")["reason"] == "IdlePaused"
    wait_for(lambda: pod_gone(core, namespace, "quiet"), timeout=30, what="the idle session's Pod gone")
    assert "IdlePaused" in session_events(core, namespace, "quiet")
    after = _sample(_scrape(f"{operator.metrics_url}/metrics"), "savepoint_session_idle_pauses_total")
    assert after == before + 1

    # An event not of a waking type (wakeOnEvent is off) leaves it asleep; the user's spec wins.
    EventLog(core, namespace, "quiet").append("user.message", {"text": "anyone?"})
    time.sleep(3)
    assert get_session(crds, namespace, "quiet")["status"]["phase"] == "Paused"
    # The user pausing it themselves takes the session over: their pause, not the operator's.
    patch = {"spec": {"operatingMode": "Paused"}}
    crds.patch_namespaced_custom_object(GROUP, VERSION, namespace, "sessions", "quiet", patch)
    body = wait_for(
        lambda: (b := get_session(crds, namespace, "quiet"))["status"]["idle"]["paused"] is False and b,
        timeout=60,
        what="the idle pause handed over to the user's",
    )
    assert body["status"]["phase"] == "Paused" and condition(body, "Ready")["reason"] == "Paused"
    assert condition(body, "Idle")["status"] == "False"
    assert "SpecChanged" in session_events(core, namespace, "quiet")
    patch = {"spec": {"operatingMode": "Running", "idle": None}}
    crds.patch_namespaced_custom_object(GROUP, VERSION, namespace, "sessions", "quiet", patch)
    body = wait_phase(crds, namespace, "quiet", "Ready", timeout=60)
    assert not body["status"]["idle"]["paused"]


def test_a_run_in_flight_is_never_paused(operator, core, crds, namespace):
    make_session(crds, namespace, "busy", idle={"pauseAfter": "2s", "wakeOnEvent": True})
    wait_phase(crds, namespace, "busy", "Ready")
    log = EventLog(core, namespace, "busy")
    log.append("run.started", {"runId": "r1"})
    wait_phase(crds, namespace, "busy", "Running")
    time.sleep(8)  # four windows, two resyncs of the test's operator
    body = get_session(crds, namespace, "busy")
    assert body["status"]["phase"] == "Running"
    assert not (body["status"].get("idle") or {}).get("paused")
    assert not pod_gone(core, namespace, "busy")
    log.append("run.completed", {"runId": "r1"})
    wait_phase(crds, namespace, "busy", "Paused", timeout=60)  # once the run is over, the window runs


def test_idle_checkpoint_frees_the_disk_and_the_wake_restores_it(operator, core, crds, namespace):
    make_session(crds, namespace, "saved", idle={"pauseAfter": "4s", "checkpoint": True, "wakeOnEvent": True})
    ready = wait_phase(crds, namespace, "saved", "Ready")
    claim = ready["status"]["workspaceClaimName"]
    workspace = pvc_data_dir(core, namespace, claim)
    write_files(workspace)
    files = checksums(workspace)
    body = wait_for(
        lambda: (b := get_session(crds, namespace, "saved"))["status"].get("reclaimedCheckpoint") and b,
        timeout=120,
        what="the idle pause's checkpoint taken and the claim freed",
    )
    kept = body["status"]["reclaimedCheckpoint"]
    assert re.fullmatch(r"saved-idle-\d+-\d+", kept), kept
    wait_for(lambda: not core.list_namespaced_persistent_volume_claim(namespace).items, timeout=60, what="claim gone")
    EventLog(core, namespace, "saved").append("user.message", {"text": "back"})
    body = wait_phase(crds, namespace, "saved", "Ready", timeout=120)
    assert body["status"]["restore"]["mode"] == "snapshot"
    assert body["status"]["restore"]["checkpoint"] == kept
    assert body["status"]["workspaceClaimName"] != claim
    assert checksums(pvc_data_dir(core, namespace, body["status"]["workspaceClaimName"])) == files


def test_a_wake_after_the_idle_checkpoint_expired_rebuilds_from_the_log(operator, core, crds, namespace):
    core.patch_namespace(namespace, {"metadata": {"annotations": {"savepoint.dev/checkpoint-ttl": "3s"}}})
    make_session(crds, namespace, "gone", idle={"pauseAfter": "2s", "checkpoint": True, "wakeOnEvent": True})
    wait_phase(crds, namespace, "gone", "Ready")
    log = EventLog(core, namespace, "gone")
    log.append("user.message", {"text": "remember me"})
    body = wait_for(
        lambda: (b := get_session(crds, namespace, "gone"))["status"].get("reclaimedCheckpoint") and b,
        timeout=120,
        what="the idle pause's checkpoint taken",
    )
    wait_checkpoint(crds, namespace, body["status"]["reclaimedCheckpoint"], "Expired", timeout=60)
    log.append("user.message", {"text": "still there?"})
    body = wait_phase(crds, namespace, "gone", "Ready", timeout=120)
    assert body["status"]["restore"]["mode"] == "event_log_rebuild"
    assert body["status"]["restore"]["reason"] == "checkpoint_expired"
    assert [e.type for e in log.read()][-1] == "session.rebuilt"


@pytest.fixture
def harness_image() -> str:
    image = images().get("HARNESS_IMAGE")
    if not image:
        pytest.fail("no harness image recorded (hack/cluster up builds it)", pytrace=False)
    return image


def test_an_appended_user_message_wakes_it_with_its_files_on_the_real_node(
    operator, core, crds, namespace, harness_image
):
    before = _scrape(f"{operator.metrics_url}/metrics")
    make_session(
        crds,
        namespace,
        "talk",
        podTemplate=harness_template(harness_image),
        idle={"pauseAfter": "10s", "wakeOnEvent": True},
    )
    wait_phase(crds, namespace, "talk", "Ready", timeout=180)
    harness(namespace, "talk", "write", "notes/plan.txt", "step 1: sleep; step 2: wake")
    wait_phase(crds, namespace, "talk", "Paused", timeout=60)
    wait_for(lambda: pod_gone(core, namespace, "talk"), timeout=60, what="the sandbox Pod gone")

    EventLog(core, namespace, "talk").append("user.message", {"text": "are you there?"})
    body = wait_phase(crds, namespace, "talk", "Ready", timeout=180)
    idle = body["status"]["idle"]
    assert idle["paused"] is False and idle["lastWakeMs"] > 0
    assert "wokenAt" not in idle or idle["wokenAt"] is None
    assert condition(body, "Idle")["status"] == "False"
    assert "Woken" in session_events(core, namespace, "talk")
    assert harness(namespace, "talk", "read", "notes/plan.txt").stdout == "step 1: sleep; step 2: wake"
    after = _scrape(f"{operator.metrics_url}/metrics")
    assert _sample(after, "savepoint_session_wakes_total", trigger="event") == (
        _sample(before, "savepoint_session_wakes_total", trigger="event") + 1
    )
    assert (
        _sample(after, "savepoint_session_wake_seconds_count")
        == _sample(before, "savepoint_session_wake_seconds_count") + 1
    )
