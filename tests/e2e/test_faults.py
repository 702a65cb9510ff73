"""Fault tests: the operator SIGKILLed mid-flight (at random points, and at the one
narrow window of a rollback), the API server and etcd restarted, a VolumeSnapshot that
never becomes ready.

Each test runs its OWN operator (`python -m savepoint` with SAVEPOINT_NAMESPACES set
to a namespace the test creates), so it can kill and restart it. The session-wide
`operator` fixture of tests/conftest.py is cluster-wide and would act on that namespace
too; it starts lazily, on the first test that asks for it, and tests/e2e is collected
before tests/integration, so in a plain `pytest` run it is not running yet. The tests
here check that and refuse to run otherwise.

Knobs (environment): SAVEPOINT_FAULT_OPS (operations per run, default 30),
SAVEPOINT_FAULT_SEED (the random seed; printed on every run, so a failure can be
replayed with the same schedule of operations and kills). docs/reliability.md says
what is guaranteed and how to run these.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import pytest
from kubernetes import client

from savepoint.checkpoint import snapshot_name
from savepoint.models import GROUP, VERSION
from savepoint.session import pod_name
from tests.conftest import REPO, SNAP, make_stuck_snapshot, wait_for
from tests.e2e.support import (
    CHECKPOINT_TERMINAL,
    Workload,
    create,
    delete_namespace,
    make_namespace,
    obj,
    outcome_summary,
    phases,
    pod_uid,
    restart_component,
    retrying,
    run_dir_of,
    seed,
    settle,
    shared_operator_started,
    start_sessions,
)
from tests.integration.test_session import KWOK_POD
from tests.operator_process import OperatorProcess, namespaced_env

pytestmark = pytest.mark.fault

FAULT_OPS = int(os.environ.get("SAVEPOINT_FAULT_OPS", "30"))

# Sandbox Pods that name their Node, for the tests that restart the API server: kube-scheduler
# never schedules them. A Pod it scheduled, deleted and made again under the same name across
# its own reconnect to a restarted API server can corrupt the scheduler's cache, and
# kube-scheduler then exits (a kubelet would restart it; hack/cluster does not), failing
# every later test that needs a Pod scheduled. Forks and rollbacks keep the Node: they copy
# the Session's template.
PINNED_KWOK_POD = {"spec": {**KWOK_POD["spec"], "nodeName": "kwok-node-0"}}


@pytest.fixture
def own_operator(request, kubeconfig, crds, core) -> Iterator[Callable[..., tuple[str, OperatorProcess]]]:
    """A factory: own_operator(label, **env) -> (namespace, OperatorProcess), cleaned up after the test."""
    if shared_operator_started(request):
        pytest.fail(
            "the cluster-wide `operator` fixture is already running and would act on the fault tests' "
            "namespaces; run tests/e2e before the integration tests (plain `pytest` does)",
            pytrace=False,
        )
    made: list[tuple[str, OperatorProcess]] = []

    def make(label: str, **env: str) -> tuple[str, OperatorProcess]:
        namespace = make_namespace(core, f"fault-{label}")
        proc = OperatorProcess(
            namespaced_env(kubeconfig, namespace, **env), REPO / ".run" / f"operator-fault-{label}.log"
        )
        proc.start()
        made.append((namespace, proc))
        return namespace, proc

    yield make
    for namespace, proc in made:
        # Delete while our operator still runs: Checkpoint finalizers need it.
        if not proc.alive():
            proc.start()
        try:
            delete_namespace(core, namespace)
        finally:
            proc.stop()


# --- 1. SIGKILL at random points ---------------------------------------------------------


def test_operator_sigkilled_at_random_points_loses_and_duplicates_nothing(own_operator, core, crds):
    seed_value = seed()
    rng = random.Random(seed_value)
    killer_rng = random.Random(seed_value + 1)
    namespace, proc = own_operator("kill")
    sessions = ["s0", "s1", "s2"]
    start_sessions(core, crds, namespace, sessions)

    work = Workload(core, crds, namespace, rng, sessions)
    min_kills = max(3, FAULT_OPS // 6)
    issuing = True
    restarts: list[float] = []

    def killer() -> None:
        while issuing or proc.kills < min_kills:
            # Start-up (imports, kopf's first listing) takes 2-3 s on two cores; a life of
            # 3-12 s lets each incarnation get through part of the backlog before it dies.
            time.sleep(killer_rng.uniform(3.0, 12.0))
            proc.kill()
            time.sleep(killer_rng.uniform(0.1, 1.5))
            proc.start()
            restarts.append(time.monotonic())

    thread = threading.Thread(target=killer, daemon=True)
    began = time.monotonic()
    thread.start()
    try:
        work.run(FAULT_OPS)
        issued = time.monotonic()
    finally:
        issuing = False
        thread.join(timeout=120)
    assert proc.alive(), f"operator not running after the last restart; see {proc.log_path}"
    settle(core, crds, namespace, work, timeout=240, seed_value=seed_value, proc=proc)
    held = time.monotonic()
    print(
        f"ops {FAULT_OPS} {dict(work.counts)} issued in {issued - began:.0f}s; SIGKILLs {proc.kills}; "
        f"every invariant held {held - restarts[-1]:.0f}s after the last restart "
        f"({held - issued:.0f}s after the last operation); {outcome_summary(crds, namespace)}"
    )


# --- 2. The API server and etcd restart mid-run --------------------------------------


def test_api_server_and_etcd_restarts_mid_run(own_operator, kubeconfig, core, crds):
    run_dir = run_dir_of(kubeconfig)
    if run_dir is None:
        pytest.skip("needs the local control plane of hack/cluster (restarts its processes)")
    seed_value = seed()
    rng = random.Random(seed_value)
    namespace, proc = own_operator("api")
    sessions = ["s0", "s1"]
    start_sessions(core, crds, namespace, sessions, template=PINNED_KWOK_POD)
    work = Workload(core, crds, namespace, rng, sessions)
    n = max(12, FAULT_OPS // 2)
    downtime = {}

    work.run(n // 3)
    downtime["kube-apiserver"] = restart_component(run_dir, "kube-apiserver")
    work.run(n // 3)
    downtime["etcd"] = restart_component(run_dir, "etcd")
    work.run(n - 2 * (n // 3))
    recovery = settle(core, crds, namespace, work, timeout=240, seed_value=seed_value, proc=proc)
    assert proc.alive() and proc.starts == 1, f"the operator exited during the outages; see {proc.log_path}"
    print(
        f"ops {n} {dict(work.counts)}; restarts (SIGKILL, back to /readyz): "
        + ", ".join(f"{k} {v:.1f}s" for k, v in downtime.items())
        + f"; every invariant held {recovery:.0f}s after the last op; {outcome_summary(crds, namespace)}"
    )


def test_a_pod_lost_while_the_api_server_restarts_is_noticed_without_waiting_for_the_resync(
    own_operator, kubeconfig, core, crds
):
    """A restarted API server has an empty watch cache: kopf's watches come back with
    410 Gone and list again, and a listing tells nothing of what vanished meanwhile. The
    operator is frozen (SIGSTOP) across the restart so that the sandbox Pod goes while
    no watch is open; the production resync (10 min) is kept, so only the re-list can
    bring the Session's pass that makes the Pod again."""
    run_dir = run_dir_of(kubeconfig)
    if run_dir is None:
        pytest.skip("needs the local control plane of hack/cluster (restarts its processes)")
    namespace, proc = own_operator("relist", SAVEPOINT_RESYNC_SECONDS="600")
    start_sessions(core, crds, namespace, ["s1"], template=PINNED_KWOK_POD)
    old = core.read_namespaced_pod(pod_name("s1"), namespace).metadata.uid
    # Let the passes the log appends started finish: one still queued when the operator
    # wakes would find the Pod gone by itself, and the re-list would not be what is tested.
    time.sleep(5)
    assert proc.proc is not None
    proc.proc.send_signal(signal.SIGSTOP)
    try:
        # A write the frozen watches miss: the restarted API server's watch cache starts
        # after it, so their resourceVersion is too old (410) and kopf lists again.
        core.create_namespaced_config_map(namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="bump")))
        restart_component(run_dir, "kube-apiserver")
        retrying(lambda: core.delete_namespaced_pod(pod_name("s1"), namespace, grace_period_seconds=0))
        wait_for(lambda: pod_uid(core, namespace, "s1") != old, timeout=60, what="the sandbox Pod gone")
    finally:
        proc.proc.send_signal(signal.SIGCONT)
    started = time.monotonic()
    wait_for(
        lambda: pod_uid(core, namespace, "s1") not in (None, old),
        timeout=90,
        interval=0.5,
        what=f"a new sandbox Pod for s1 (see {proc.log_path})",
    )
    print(f"sandbox Pod made again {time.monotonic() - started:.1f}s after the operator woke")


# --- 3. A snapshot that never becomes ready -------------------------------------------


def test_snapshot_never_ready_fails_the_checkpoint_after_the_timeout(never_ready_class, own_operator, core, crds):
    namespace, proc = own_operator("timeout", SAVEPOINT_SNAPSHOT_TIMEOUT="15s", SAVEPOINT_EXPIRED_GRACE="5s")
    start_sessions(core, crds, namespace, ["s1"])
    make_stuck_snapshot(crds, namespace, "stuck", "s1", never_ready_class)
    create(crds, namespace, "checkpoints", obj("Checkpoint", "stuck", {"sessionName": "s1"}))
    asked = time.monotonic()
    # A healthy checkpoint beside it is not held up.
    create(crds, namespace, "checkpoints", obj("Checkpoint", "fine", {"sessionName": "s1"}))

    def phase_of(name: str) -> dict | None:
        body = crds.get_namespaced_custom_object(GROUP, VERSION, namespace, "checkpoints", name)
        return body if (body.get("status") or {}).get("phase") in CHECKPOINT_TERMINAL else None

    fine = wait_for(lambda: phase_of("fine"), timeout=90, what="checkpoint fine terminal")
    assert fine["status"]["phase"] == "Ready", fine["status"]
    stuck = wait_for(lambda: phase_of("stuck"), timeout=90, interval=0.5, what="checkpoint stuck terminal")
    waited = time.monotonic() - asked
    status = stuck["status"]
    assert status["phase"] == "Failed" and status["reason"] == "SnapshotTimeout", status
    assert snapshot_name("stuck") in status["message"] and "SAVEPOINT_SNAPSHOT_TIMEOUT" in status["message"]
    assert waited >= 14, f"failed after {waited:.0f}s, before the 15s timeout"
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "SnapshotTimeout"
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=stuck").items
    assert any(e.reason == "SnapshotTimeout" and e.type == "Warning" for e in events)
    print(f"stuck checkpoint Failed/SnapshotTimeout {waited:.0f}s after it was asked for (timeout 15s)")

    # The failed checkpoint's snapshot is of no use: it goes at once, not with the checkpoint.
    def snapshot_gone() -> bool:
        try:
            crds.get_namespaced_custom_object(*SNAP, namespace, "volumesnapshots", snapshot_name("stuck"))
        except client.ApiException as err:
            return err.status == 404
        return False

    wait_for(snapshot_gone, timeout=30, what="the failed checkpoint's VolumeSnapshot deleted")
    assert phase_of("stuck")["status"]["phase"] == "Failed"  # the object stays, to say why
    # Once its expiresAt plus the grace period (5s here) has passed, the Failed checkpoint
    # is deleted like an Expired one: failed attempts do not pile up.
    past = (datetime.now(UTC) - timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    crds.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, "checkpoints", "stuck", {"status": {"expiresAt": past}}
    )

    def checkpoint_gone() -> bool:
        try:
            crds.get_namespaced_custom_object(GROUP, VERSION, namespace, "checkpoints", "stuck")
        except client.ApiException as err:
            return err.status == 404
        return False

    wait_for(checkpoint_gone, timeout=30, what="the Failed checkpoint deleted after expiresAt + grace")
    assert phase_of("fine")["status"]["phase"] == "Ready"  # a Ready one is not touched


# --- 4. A kill at the one line between the claim swap and the release --------------------


def test_rollback_killed_right_after_the_claim_swap_leaves_no_orphan_claim(own_operator, core, crds):
    """A random kill rarely lands here (a few milliseconds); a failpoint makes it certain."""
    namespace, proc = own_operator("swap", SAVEPOINT_FAILPOINTS="rollback.after_swap")
    start_sessions(core, crds, namespace, ["s1"])
    work = Workload(core, crds, namespace, random.Random(0), ["s1"])
    work.checkpoints.append("c1")
    create(crds, namespace, "checkpoints", obj("Checkpoint", "c1", {"sessionName": "s1"}))
    wait_for(lambda: phases(crds, namespace, "checkpoints").get("c1") == "Ready", timeout=90, what="c1 Ready")
    work.forks.append("rb")
    create(crds, namespace, "forks", obj("Fork", "rb", {"source": {"checkpoint": "c1"}, "mode": "Rollback"}))
    assert proc.proc is not None and proc.proc.wait(timeout=120) == -signal.SIGKILL
    proc.env.pop("SAVEPOINT_FAILPOINTS")
    proc.start()
    settle(core, crds, namespace, work, timeout=120, seed_value=0, proc=proc)
    assert phases(crds, namespace, "forks")["rb"] == "Succeeded"
