"""Two replicas with one kopf peering: exactly one works, and the other takes over when it dies.

Both are `python -m savepoint` watching a namespace of the test's own, with the same
SAVEPOINT_PEERING and a short SAVEPOINT_PEERING_LIFETIME; their priorities are the
default (random per process). Like tests/e2e/test_faults.py this refuses to run once
the cluster-wide `operator` fixture of tests/conftest.py is up: it would act on the
namespace too.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import yaml
from kubernetes import client

from savepoint.eventlog import EventLog
from savepoint.models import GROUP, VERSION
from tests.conftest import REPO, _free_port, wait_for
from tests.e2e.support import delete_namespace, make_namespace, shared_operator_started
from tests.integration.test_checkpoint import _sample, _scrape, get_checkpoint, make_checkpoint, wait_checkpoint
from tests.integration.test_session import make_session, wait_phase
from tests.operator_process import OperatorProcess, namespaced_env

LIFETIME = 10  # seconds; kopf's default is 60
PEERING = "savepoint-ha"
PEERINGS = ("kopf.dev", "v1", "kopfpeerings")

pytestmark = pytest.mark.fault  # it SIGKILLs an operator


@pytest.fixture(scope="module")
def peering_crds(api: client.ApiClient, crds: client.CustomObjectsApi) -> None:
    ext = client.ApiextensionsV1Api(api)
    for body in yaml.safe_load_all((REPO / "charts" / "savepoint" / "crds" / "kopf-peering.yaml").read_text()):
        try:
            ext.create_custom_resource_definition(body)
        except client.ApiException as err:
            if err.status != 409:
                raise

    def established() -> bool:
        crd = ext.read_custom_resource_definition("kopfpeerings.kopf.dev")
        return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])

    wait_for(established, what="the KopfPeering CRD established")


class Replica(OperatorProcess):
    def __init__(self, name: str, kubeconfig: str, namespace: str) -> None:
        self.name, self.port = name, _free_port()
        env = {
            "POD_ID": name,  # the start of its identity in the peering object
            "SAVEPOINT_PEERING": PEERING,
            "SAVEPOINT_PEERING_LIFETIME": str(LIFETIME),
            "SAVEPOINT_EXPIRY_INTERVAL_SECONDS": "1",
            "SAVEPOINT_METRICS_PORT": str(self.port),
            "SAVEPOINT_LOG_LEVEL": "INFO",
        }
        super().__init__(namespaced_env(kubeconfig, namespace, **env), REPO / ".run" / f"operator-ha-{name}.log")

    def active_gauge(self) -> float | None:
        try:
            return _sample(_scrape(f"http://127.0.0.1:{self.port}/metrics"), "savepoint_peering_active")
        except OSError:
            return None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def replicas(request, kubeconfig, crds, peering_crds, core) -> Iterator[tuple[str, list[Replica]]]:
    if shared_operator_started(request):
        pytest.fail("the cluster-wide `operator` fixture is running and would act here; run tests/e2e first")
    namespace = make_namespace(core, "ha")
    # kopf never creates its peering object; the chart does (charts/savepoint/templates/peering.yaml).
    body = {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": PEERING}}
    crds.create_namespaced_custom_object(*PEERINGS[:2], namespace, PEERINGS[2], body)
    made = [Replica(name, kubeconfig, namespace) for name in ("replica-a", "replica-b")]
    for replica in made:
        replica.start()
    yield namespace, made
    patch_peering(crds, namespace, {"freezer": None})  # a failed test may leave everyone frozen
    if not any(r.alive() for r in made):
        made[0].start()  # Checkpoint finalizers need an operator while the namespace goes
    try:
        delete_namespace(core, namespace)
    finally:
        for replica in made:
            replica.stop()


def peers(crds, namespace: str) -> dict[str, dict]:
    body = crds.get_namespaced_custom_object(*PEERINGS[:2], namespace, PEERINGS[2], PEERING)
    return body.get("status") or {}


def patch_peering(crds, namespace: str, status: dict) -> None:
    crds.patch_namespaced_custom_object(*PEERINGS[:2], namespace, PEERINGS[2], PEERING, {"status": status})


def created_events(core, namespace: str, session: str) -> int:
    return sum(e.type == "checkpoint.created" for e in EventLog(core, namespace, session).read())


def handled(replica: Replica, handler: str) -> int:
    return replica.log().count(f"Handler '{handler}' succeeded")


def made_ready(replica: Replica, namespace: str, checkpoint: str) -> int:
    """How many times this replica made the checkpoint Ready (its INFO line)."""
    return replica.log().count(f"checkpoint {namespace}/{checkpoint} is Ready")


def test_one_replica_works_and_the_other_takes_over_when_it_is_killed(replicas, crds, core):
    namespace, (a, b) = replicas
    # Both record themselves with distinct priorities; the higher one is the active one.
    both = wait_for(
        lambda: (p := peers(crds, namespace)) and len(p) == 2 and p, timeout=60, what="both replicas in the peering"
    )
    priority = {peer.split("/")[0]: info["priority"] for peer, info in both.items()}
    assert priority["replica-a"] != priority["replica-b"], priority
    active, standby = (a, b) if priority["replica-a"] > priority["replica-b"] else (b, a)
    wait_for(lambda: active.active_gauge() == 1 and standby.active_gauge() == 0, timeout=30, what="one active replica")
    # (The first to start may have been alone, and active, for a moment: its latest word counts.)
    assert re.findall(r"this replica is (active|standing by)", standby.log())[-1] == "standing by"

    # The active replica does the work, once.
    make_session(crds, namespace, "s1")
    wait_phase(crds, namespace, "s1", "Ready", timeout=90)
    make_checkpoint(crds, namespace, "c1", session="s1")
    assert wait_checkpoint(crds, namespace, "c1", "Ready", "Failed", "Rejected")["status"]["phase"] == "Ready"
    assert created_events(core, namespace, "s1") == 1
    assert made_ready(active, namespace, "c1") == 1 and made_ready(standby, namespace, "c1") == 0
    assert handled(standby, "session_create") == 0

    # The expiry loop follows the peering too: while a higher-priority peer (as `kopf freeze`
    # writes one) holds the peering, nobody expires a checkpoint that falls due. Its new
    # expiresAt is set while the active replica still watches, so it knows the date.
    due = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=10)
    crds.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, "checkpoints", "c1", {"status": {"expiresAt": due.strftime("%Y-%m-%dT%H:%M:%SZ")}}
    )
    time.sleep(1)  # the watch event reaches the active replica
    freezer = {"priority": 2**62, "lifetime": 600, "lastseen": datetime.now(UTC).isoformat()}
    patch_peering(crds, namespace, {"freezer": freezer})
    wait_for(lambda: active.active_gauge() == 0, timeout=8, what="the active replica standing by")
    assert datetime.now(UTC) < due, "the freeze took too long to test anything"
    time.sleep((due - datetime.now(UTC)).total_seconds() + 4)  # four expiry intervals past due
    assert get_checkpoint(crds, namespace, "c1")["status"]["phase"] == "Ready"
    patch_peering(crds, namespace, {"freezer": None})
    wait_checkpoint(crds, namespace, "c1", "Expired", timeout=30)
    assert standby.active_gauge() == 0

    # SIGKILL: no goodbye in the peering, so the standby waits out the dead record's lifetime.
    active.kill()
    killed = time.monotonic()
    make_checkpoint(crds, namespace, "c2", session="s1")
    wait_for(lambda: standby.active_gauge() == 1, timeout=LIFETIME + 20, what="the standby taking over")
    assert wait_checkpoint(crds, namespace, "c2", "Ready", "Failed", "Rejected")["status"]["phase"] == "Ready"
    took = time.monotonic() - killed
    assert took < LIFETIME + 30, f"takeover and a checkpoint took {took:.0f}s"
    assert created_events(core, namespace, "s1") == 2
    assert made_ready(standby, namespace, "c2") == 1
    print(f"\ntakeover: c2 Ready {took:.1f}s after the active replica was killed (lifetime {LIFETIME}s)")
