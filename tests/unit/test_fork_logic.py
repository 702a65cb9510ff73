"""The pure Fork decisions: merge, the plans, the names, the target Session."""

from __future__ import annotations

import pytest

from savepoint.constants import API_VERSION, FORK_ANNOTATION, PARENT_SESSION_LABEL
from savepoint.fork import Plan, build_target_session, merge, newest_live, plan_from_checkpoint, target_claim_name
from savepoint.models import ForkMode, ForkSpec, RestoreMode


@pytest.mark.parametrize(
    ("base", "override", "merged"),
    [
        ({"a": 1}, {"b": 2}, {"a": 1, "b": 2}),
        ({"a": {"x": 1, "y": 2}}, {"a": {"y": 3}}, {"a": {"x": 1, "y": 3}}),
        ({"a": 1, "b": 2}, {"b": None}, {"a": 1}),
        ({"a": [1, 2]}, {"a": [3]}, {"a": [3]}),  # lists replace, as in a JSON merge patch
        ({"a": {"x": 1}}, {"a": "flat"}, {"a": "flat"}),
        ("scalar", {"a": 1}, {"a": 1}),
        ({}, {}, {}),
    ],
)
def test_merge(base, override, merged):
    assert merge(base, override) == merged


def test_merge_copies_and_leaves_its_inputs_alone():
    base, override = {"a": {"x": [1]}}, {"a": {"y": {"z": 1}}}
    merged = merge(base, override)
    merged["a"]["x"].append(2)
    merged["a"]["y"]["z"] = 9
    assert base == {"a": {"x": [1]}} and override == {"a": {"y": {"z": 1}}}


def ckpt(name: str, through: int, phase: str = "Ready", ready_at: str = "2026-01-01T00:00:00Z") -> dict:
    return {
        "metadata": {"name": name},
        "spec": {"sessionName": "s"},
        "status": {
            "phase": phase,
            "throughSequence": through,
            "throughEventId": f"e{through}",
            "volumeSnapshotName": f"sp-{name}",
            "readyAt": ready_at,
        },
    }


def test_plan_from_checkpoint_restores_its_snapshot_through_its_cut():
    spec = ForkSpec.model_validate({"source": {"checkpoint": "c"}, "target": {"sessionName": "t"}})
    assert plan_from_checkpoint(spec, ckpt("c", 4)) == Plan(
        ForkMode.FORK, RestoreMode.SNAPSHOT, "s", "c", "sp-c", 4, "e4"
    )
    rollback = ForkSpec.model_validate({"source": {"checkpoint": "c"}, "mode": "Rollback"})
    assert plan_from_checkpoint(rollback, ckpt("c", 0)).mode == ForkMode.ROLLBACK


def test_newest_live_is_the_ready_one_with_the_latest_cut():
    assert newest_live([]) is None
    assert newest_live([ckpt("a", 9, phase="Failed"), ckpt("b", 9, phase="Expired")]) is None
    picked = newest_live([ckpt("a", 2), ckpt("b", 5), ckpt("c", 7, phase="Pending")])
    assert picked["metadata"]["name"] == "b"
    # The same cut: the one made later.
    later = newest_live([ckpt("a", 5, ready_at="2026-01-02T00:00:00Z"), ckpt("b", 5)])
    assert later["metadata"]["name"] == "a"


def test_target_claim_name_is_derived_from_the_fork():
    assert target_claim_name("s", "f") == target_claim_name("s", "f")
    assert target_claim_name("s", "f") != target_claim_name("s", "g")
    assert target_claim_name("s", "f").startswith("s-ws-")


SOURCE = {
    "metadata": {"name": "s", "namespace": "team"},
    "spec": {
        "harness": {"name": "agent", "revision": "r1"},
        "source": {"checkpoint": "older"},
        "operatingMode": "Paused",
        "podTemplate": {"spec": {"serviceAccountName": "savepoint-sandbox-s", "containers": [{"name": "a"}]}},
    },
}


def fork(overrides: dict | None = None) -> dict:
    target = {"sessionName": "t", **({"overrides": overrides} if overrides else {})}
    return {
        "metadata": {"name": "f", "namespace": "team", "uid": "uid-f"},
        "spec": {"source": {"session": "s"}, "target": target},
    }


def test_the_target_session_copies_the_source_runs_and_names_its_origin():
    plan = Plan(ForkMode.FORK, RestoreMode.SNAPSHOT, "s", "c", "sp-c", 3, "e3")
    target = build_target_session(fork(), SOURCE, plan, None)
    assert target["apiVersion"] == API_VERSION and target["kind"] == "Session"
    assert target["metadata"] == {
        "name": "t",
        "namespace": "team",
        "annotations": {FORK_ANNOTATION: "uid-f"},
        "labels": {PARENT_SESSION_LABEL: "s"},
    }
    spec = target["spec"]
    assert spec["operatingMode"] == "Running"
    assert spec["source"] == {"checkpoint": "c"}
    # The source's own sandbox account is not the target's.
    assert "serviceAccountName" not in spec["podTemplate"]["spec"]
    assert SOURCE["spec"]["podTemplate"]["spec"]["serviceAccountName"] == "savepoint-sandbox-s"


def test_the_target_from_the_log_names_the_event_and_takes_overrides_but_not_a_source():
    plan = Plan(ForkMode.FORK, RestoreMode.EVENT_LOG_REBUILD, "s", None, None, 2, "e2")
    overrides = {"harness": {"revision": "r2"}, "source": {"checkpoint": "sneaky"}, "operatingMode": None}
    spec = build_target_session(fork(overrides), SOURCE, plan, "2")["spec"]
    assert spec["source"] == {"session": "s", "atEvent": "2"}
    assert spec["harness"] == {"name": "agent", "revision": "r2"}
    assert "operatingMode" not in spec
