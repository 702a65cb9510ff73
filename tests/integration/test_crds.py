"""The API server itself refuses invalid Savepoint objects, naming the field."""

from __future__ import annotations

import pytest
from kubernetes import client

from savepoint.models import GROUP, VERSION


def _create(crds: client.CustomObjectsApi, namespace: str, plural: str, kind: str, name: str, spec: dict):
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": kind, "metadata": {"name": name}, "spec": spec}
    return crds.create_namespaced_custom_object(GROUP, VERSION, namespace, plural, body)


def _refused(crds, namespace, plural, kind, name, spec) -> str:
    with pytest.raises(client.ApiException) as caught:
        _create(crds, namespace, plural, kind, name, spec)
    assert caught.value.status == 422, caught.value.body
    return caught.value.body


@pytest.mark.parametrize(
    ("plural", "kind", "spec", "field", "words"),
    [
        ("sessions", "Session", {"operatingMode": "Sleeping"}, "spec.operatingMode", "Unsupported value"),
        ("sessions", "Session", {"workspace": {"size": 10}}, "spec.workspace.size", "must be of type string"),
        ("sessions", "Session", {"checkpointPolicy": {"ttl": "-1h"}}, "spec.checkpointPolicy.ttl", "should match"),
        (
            "sessions",
            "Session",
            {"checkpointPolicy": {"keepLast": 0}},
            "spec.checkpointPolicy.keepLast",
            "greater than or equal to 1",
        ),
        ("checkpoints", "Checkpoint", {"sessionName": "s1", "ttl": "-5m"}, "spec.ttl", "should match"),
        ("checkpoints", "Checkpoint", {}, "spec.sessionName", "Required value"),
        (
            "forks",
            "Fork",
            {"source": {"checkpoint": "c1", "session": "s1"}, "target": {"sessionName": "n"}},
            "spec.source",
            "exactly one of checkpoint or session",
        ),
        (
            "forks",
            "Fork",
            {"source": {"checkpoint": "c1"}, "target": {"sessionName": "n"}, "mode": "Sideways"},
            "spec.mode",
            "Unsupported value",
        ),
        (
            "forks",
            "Fork",
            {"source": {"session": "s1"}, "mode": "Rollback"},
            "spec.source",
            "a Rollback needs source.checkpoint",
        ),
        ("forks", "Fork", {"source": {"checkpoint": "c1"}}, "spec.target", "a Fork needs target.sessionName"),
    ],
)
def test_invalid_objects_are_refused_naming_the_field(crds, namespace, plural, kind, spec, field, words):
    body = _refused(crds, namespace, plural, kind, "bad", spec)
    assert field in body
    assert words in body


def test_session_name_leaves_room_for_derived_names(crds, namespace):
    body = _refused(crds, namespace, "sessions", "Session", "s" * 49, {})
    assert "metadata.name must be at most 48 characters" in body


def test_immutable_fields_refuse_changes(crds, namespace):
    _create(crds, namespace, "checkpoints", "Checkpoint", "c1", {"sessionName": "s1"})
    with pytest.raises(client.ApiException) as caught:
        crds.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, "checkpoints", "c1", {"spec": {"sessionName": "s2"}}
        )
    assert caught.value.status == 422
    assert "spec.sessionName" in caught.value.body and "sessionName is immutable" in caught.value.body
    # A mutable field still changes.
    crds.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, "checkpoints", "c1", {"spec": {"label": "before-refactor"}}
    )

    _create(crds, namespace, "sessions", "Session", "forked", {"source": {"checkpoint": "c1"}})
    with pytest.raises(client.ApiException) as caught:
        crds.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, "sessions", "forked", {"spec": {"source": {"checkpoint": "c2"}}}
        )
    assert "spec.source" in caught.value.body and "source is immutable" in caught.value.body

    _create(crds, namespace, "forks", "Fork", "f1", {"source": {"checkpoint": "c1"}, "target": {"sessionName": "n1"}})
    for patch, field in (
        ({"spec": {"source": {"checkpoint": "c9"}}}, "spec.source"),
        ({"spec": {"mode": "Rollback"}}, "spec.mode"),
        ({"spec": {"target": {"sessionName": "n2"}}}, "spec.target"),
    ):
        with pytest.raises(client.ApiException) as caught:
            crds.patch_namespaced_custom_object(GROUP, VERSION, namespace, "forks", "f1", patch)
        assert caught.value.status == 422
        assert field in caught.value.body and "immutable" in caught.value.body
    stored = crds.get_namespaced_custom_object(GROUP, VERSION, namespace, "forks", "f1")
    assert stored["spec"]["source"] == {"checkpoint": "c1"}


def test_defaults_are_applied_by_the_server(crds, namespace):
    stored = _create(crds, namespace, "sessions", "Session", "defaults", {})
    assert stored["spec"]["operatingMode"] == "Running"
    fork = _create(
        crds, namespace, "forks", "Fork", "fdef", {"source": {"checkpoint": "c1"}, "target": {"sessionName": "x"}}
    )
    assert fork["spec"]["mode"] == "Fork"
