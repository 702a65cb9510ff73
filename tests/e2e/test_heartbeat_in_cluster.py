"""The heartbeat through the chart as installed: the reference harness's `serve` in a Pod on
the real node creates its heartbeat object past the chart's ValidatingAdmissionPolicy,
with the sandbox Role the in-cluster operator made, and that operator (its ServiceAccount,
its default settings) reflects the sample into status.resources."""

from __future__ import annotations

from tests.conftest import wait_for
from tests.e2e.test_real_node import (  # noqa: F401 (fixtures)
    get,
    in_cluster_operator,
    make_session,
    ns,
    real_node,
    running_pod,
    wait_phase,
)


def test_serve_heartbeats_into_status_resources(in_cluster_operator, crds, core, ns):  # noqa: F811
    make_session(crds, ns, "hb", in_cluster_operator["harness"])
    wait_phase(crds, ns, "sessions", "hb", "Ready")
    pod = running_pod(core, ns, "hb")

    def resources():
        return (get(crds, ns, "sessions", "hb").get("status") or {}).get("resources")

    found = wait_for(resources, timeout=60, what="status.resources from serve's first heartbeat")
    assert found["memBytes"] > 0 and found["diskBytes"] >= 0 and found["sampledAt"]
    beat = core.read_namespaced_config_map("hb-heartbeat", ns)
    assert [r.uid for r in beat.metadata.owner_references] == [get(crds, ns, "sessions", "hb")["metadata"]["uid"]]
    assert pod.spec.service_account_name == "savepoint-sandbox-hb"
    body = get(crds, ns, "sessions", "hb")
    stale = next(c for c in body["status"]["conditions"] if c["type"] == "HeartbeatStale")
    assert (stale["status"], stale["reason"]) == ("False", "HeartbeatFresh")
