"""savepoint.k8s.call, and the in-memory API the controller tests run against: it must
answer as the API server does where the controllers depend on it."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.exceptions import ApiException

from savepoint import k8s
from tests.unit.fake_api import FakeAPI, Request


def refuse(status: int, message: str | None = None):
    def send():
        err = ApiException(status=status, reason="Refused")
        err.body = json.dumps({"kind": "Status", "message": message}) if message else None
        raise err

    return send


@pytest.mark.parametrize(
    ("status", "kwargs", "answer"),
    [
        (404, {"absent": None}, None),
        (404, {"absent": True, "exists": False}, True),
        (409, {"exists": None}, None),
        (409, {"absent": None, "exists": "there"}, "there"),
    ],
)
def test_call_answers_what_each_refusal_means(status, kwargs, answer):
    assert k8s.call(refuse(status), **kwargs) == answer


@pytest.mark.parametrize(
    ("status", "kwargs"),
    [(404, {}), (404, {"exists": None}), (409, {"absent": None}), (500, {"absent": None, "exists": None}), (422, {})],
)
def test_call_raises_what_it_was_not_told_about(status, kwargs):
    with pytest.raises(ApiException) as err:
        k8s.call(refuse(status), **kwargs)
    assert err.value.status == status and not isinstance(err.value, k8s.Refused)


@pytest.mark.parametrize("status", [400, 422])
def test_a_refused_object_raises_refused_with_the_servers_message(status):
    with pytest.raises(k8s.Refused) as err:
        k8s.call(refuse(status, 'Pod "s" is invalid: spec.containers: Required value'), refused=True)
    assert isinstance(err.value, ApiException)  # callers that catch ApiException still do
    assert (err.value.status, err.value.message) == (status, 'Pod "s" is invalid: spec.containers: Required value')


def test_call_answers_the_requests_own_value():
    assert k8s.call(lambda: {"kind": "Pod"}, absent=None) == {"kind": "Pod"}


# --- the fake ------------------------------------------------------------------------------


def test_every_write_bumps_the_resource_version_and_a_stale_one_conflicts():
    api = FakeAPI()
    made = api.create("configmaps", "ns", {"metadata": {"name": "c"}, "data": {"a": "1"}})
    patched = api.patch("configmaps", "ns", "c", {"data": {"b": "2"}})
    assert int(patched["metadata"]["resourceVersion"]) > int(made["metadata"]["resourceVersion"])
    assert patched["data"] == {"a": "1", "b": "2"}
    stale = {"metadata": {"resourceVersion": made["metadata"]["resourceVersion"]}, "data": {"c": "3"}}
    with pytest.raises(ApiException) as err:
        api.patch("configmaps", "ns", "c", stale)
    assert err.value.status == 409
    assert api.get("configmaps", "ns", "c")["data"] == {"a": "1", "b": "2"}


def test_missing_objects_answer_404_and_existing_names_409():
    api = FakeAPI()
    for call in (
        lambda: api.read("pods", "ns", "p"),
        lambda: api.patch("pods", "ns", "p", {}),
        lambda: api.delete("pods", "ns", "p"),
    ):
        with pytest.raises(ApiException) as err:
            call()
        assert err.value.status == 404
    api.create("pods", "ns", {"metadata": {"name": "p"}})
    with pytest.raises(ApiException) as err:
        api.create("pods", "ns", {"metadata": {"name": "p"}})
    assert err.value.status == 409


def test_a_delete_with_another_uid_conflicts():
    api = FakeAPI()
    uid = api.create("pods", "ns", {"metadata": {"name": "p"}})["metadata"]["uid"]
    with pytest.raises(ApiException) as err:
        api.delete("pods", "ns", "p", uid="someone-else")
    assert err.value.status == 409
    api.delete("pods", "ns", "p", uid=uid)
    assert api.names("pods") == []


def test_a_status_patch_writes_status_only_and_a_spec_change_bumps_generation():
    api = FakeAPI()
    api.create("sessions", "ns", {"metadata": {"name": "s"}, "spec": {"a": 1}})
    api.patch("sessions", "ns", "s", {"spec": {"a": 2}, "status": {"phase": "Ready"}}, status=True)
    got = api.get("sessions", "ns", "s")
    assert (got["spec"], got["status"], got["metadata"]["generation"]) == ({"a": 1}, {"phase": "Ready"}, 1)
    api.patch("sessions", "ns", "s", {"spec": {"a": 2}})
    assert api.get("sessions", "ns", "s")["metadata"]["generation"] == 2
    api.patch("sessions", "ns", "s", {"metadata": {"annotations": {"x": "y"}, "labels": None}})
    assert api.get("sessions", "ns", "s")["metadata"]["generation"] == 2


def test_injected_errors_answer_the_next_requests_unapplied_and_every_request_is_recorded():
    api = FakeAPI()
    api.fail("create", "pods", 500, times=2)
    for _ in range(2):
        with pytest.raises(ApiException) as err:
            api.create("pods", "ns", {"metadata": {"name": "p"}})
        assert err.value.status == 500
    assert api.names("pods") == []
    api.create("pods", "ns", {"metadata": {"name": "p"}})
    api.create("configmaps", "ns", {"metadata": {"name": "c"}})  # another kind is not affected
    assert api.requests == [Request("create", "pods", "ns", "p")] * 3 + [Request("create", "configmaps", "ns", "c")]


@pytest.mark.parametrize(
    ("selector", "names"),
    [("", ["a", "b", "c"]), ("app=x", ["a", "b"]), ("app=x,tier!=db", ["a"]), ("tier", ["b"]), ("!tier", ["a", "c"])],
)
def test_label_selectors(selector, names):
    api = FakeAPI()
    for name, labels in (("a", {"app": "x"}), ("b", {"app": "x", "tier": "db"}), ("c", {"app": "y"})):
        api.create("pods", "ns", {"metadata": {"name": name, "labels": labels}})
    api.create("pods", "other", {"metadata": {"name": "z", "labels": {"app": "x"}}})
    assert [p["metadata"]["name"] for p in api.list("pods", "ns", selector)] == names


def test_installed_it_answers_as_savepoint_k8s_does(monkeypatch):
    api = FakeAPI().install(monkeypatch)
    assert k8s.get_pod("ns", "p") is None
    k8s.delete_pod("ns", "p")  # gone already is done
    body = {"metadata": {"name": "p", "namespace": "ns"}}
    made = k8s.ensure_pod(body)
    assert k8s.ensure_pod(body) == made  # the second create finds the first
    assert k8s.create_custom("sessions", "ns", {"metadata": {"name": "s"}}) is not None
    assert k8s.create_custom("sessions", "ns", {"metadata": {"name": "s"}}) is None
    assert k8s.patch_custom("sessions", "ns", "gone", {}) is None
    api.fail("create", "pods", 422)
    with pytest.raises(k8s.Refused):
        k8s.ensure_pod({"metadata": {"name": "q", "namespace": "ns"}})
