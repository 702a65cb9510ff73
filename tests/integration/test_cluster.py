"""The local control plane is a real one: the behaviours Savepoint relies on work."""

from __future__ import annotations

import pytest
from kubernetes import client

from tests.conftest import unique, wait_for

GROUP = "clustertest.savepoint.dev"


@pytest.fixture(scope="module")
def widget_crd(api: client.ApiClient):
    """A throwaway CRD whose spec.owner is immutable by a CEL rule."""
    ext = client.ApiextensionsV1Api(api)
    name = f"widgets.{GROUP}"
    body = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": name},
        "spec": {
            "group": GROUP,
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "scope": "Namespaced",
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {
                                        "owner": {
                                            "type": "string",
                                            "x-kubernetes-validations": [
                                                {"rule": "self == oldSelf", "message": "owner is immutable"}
                                            ],
                                        },
                                        "size": {"type": "integer"},
                                    },
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    try:
        ext.create_custom_resource_definition(body)
    except client.ApiException as err:
        if err.status != 409:
            raise

    def established():
        crd = ext.read_custom_resource_definition(name)
        return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])

    wait_for(established, what=f"CRD {name} established")
    return client.CustomObjectsApi(api)


def test_cel_immutability_rule_refuses_update(widget_crd: client.CustomObjectsApi, namespace: str):
    obj = {
        "apiVersion": f"{GROUP}/v1",
        "kind": "Widget",
        "metadata": {"name": "w1"},
        "spec": {"owner": "alice", "size": 1},
    }
    widget_crd.create_namespaced_custom_object(GROUP, "v1", namespace, "widgets", obj)
    # A change to another field is fine.
    widget_crd.patch_namespaced_custom_object(GROUP, "v1", namespace, "widgets", "w1", {"spec": {"size": 2}})
    with pytest.raises(client.ApiException) as caught:
        widget_crd.patch_namespaced_custom_object(GROUP, "v1", namespace, "widgets", "w1", {"spec": {"owner": "bob"}})
    assert caught.value.status == 422
    assert "spec.owner" in caught.value.body
    assert "owner is immutable" in caught.value.body
    stored = widget_crd.get_namespaced_custom_object(GROUP, "v1", namespace, "widgets", "w1")
    assert stored["spec"] == {"owner": "alice", "size": 2}


def test_finalizer_holds_deletion(core: client.CoreV1Api, namespace: str):
    name = unique("held")
    core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name, finalizers=["savepoint.dev/test"]))
    )
    core.delete_namespaced_config_map(name, namespace)
    held = core.read_namespaced_config_map(name, namespace)
    assert held.metadata.deletion_timestamp is not None
    core.patch_namespaced_config_map(name, namespace, {"metadata": {"finalizers": None}})

    def gone():
        try:
            core.read_namespaced_config_map(name, namespace)
            return False
        except client.ApiException as err:
            return err.status == 404

    wait_for(gone, what=f"ConfigMap {name} deleted once its finalizer is removed")


def test_owner_reference_garbage_collection(core: client.CoreV1Api, namespace: str):
    owner = core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name=unique("owner")))
    )
    ref = client.V1OwnerReference(api_version="v1", kind="ConfigMap", name=owner.metadata.name, uid=owner.metadata.uid)
    child = unique("child")
    core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name=child, owner_references=[ref]))
    )
    core.delete_namespaced_config_map(owner.metadata.name, namespace)

    def collected():
        try:
            core.read_namespaced_config_map(child, namespace)
            return False
        except client.ApiException as err:
            return err.status == 404

    wait_for(collected, timeout=60, what=f"garbage collection of {child}")


def test_pod_is_scheduled_to_a_kwok_node_and_runs(core: client.CoreV1Api, namespace: str):
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name=unique("sandbox")),
        spec=client.V1PodSpec(
            containers=[client.V1Container(name="agent", image="example.invalid/agent:1")],
            node_selector={"type": "kwok"},
            tolerations=[client.V1Toleration(key="kwok.x-k8s.io/node", operator="Exists", effect="NoSchedule")],
        ),
    )
    core.create_namespaced_pod(namespace, pod)

    def running():
        p = core.read_namespaced_pod(pod.metadata.name, namespace)
        return p if p.status.phase == "Running" else None

    p = wait_for(running, timeout=60, what=f"pod {pod.metadata.name} Running")
    assert p.spec.node_name.startswith("kwok-node-")


def test_stale_resource_version_conflicts(core: client.CoreV1Api, namespace: str):
    name = unique("cas")
    first = core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name), data={"n": "0"})
    )
    core.replace_namespaced_config_map(name, namespace, client.V1ConfigMap(metadata=first.metadata, data={"n": "1"}))
    with pytest.raises(client.ApiException) as caught:
        # first.metadata still carries the old resourceVersion.
        core.replace_namespaced_config_map(
            name, namespace, client.V1ConfigMap(metadata=first.metadata, data={"n": "2"})
        )
    assert caught.value.status == 409
    assert core.read_namespaced_config_map(name, namespace).data == {"n": "1"}
