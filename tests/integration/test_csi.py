"""Volume snapshots copy real files and restores bring them back (the CSI stack).

Uses the default StorageClass and VolumeSnapshotClass of our hostpath driver and reads
and writes volume data through tests/csi_data.py; see docs/csi.md.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from kubernetes import client

from tests.conftest import unique, wait_for
from tests.csi_data import HOSTPATH_DRIVER, pvc_data_dir

SNAP_GROUP, SNAP_VERSION = "snapshot.storage.k8s.io", "v1"
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def snapshots(api: client.ApiClient, core: client.CoreV1Api) -> client.CustomObjectsApi:
    """The snapshot API, once the cluster has our driver's default classes."""
    classes = client.StorageV1Api(api).list_storage_class().items
    if not any(c.provisioner == HOSTPATH_DRIVER for c in classes):
        message = (
            f"no StorageClass for {HOSTPATH_DRIVER}: the CSI stack is not running "
            "(hack/cluster up starts it; see docs/csi.md)"
        )
        if os.environ.get("SAVEPOINT_TEST_KUBECONFIG"):
            pytest.skip(message)  # a foreign cluster: these tests need our driver's files
        pytest.fail(message, pytrace=False)
    return client.CustomObjectsApi(api)


def create_pvc(core: client.CoreV1Api, namespace: str, name: str, **spec) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}, **spec},
    }
    core.create_namespaced_persistent_volume_claim(namespace, body)


def wait_bound(core: client.CoreV1Api, namespace: str, name: str, timeout: float = 120) -> None:
    wait_for(
        lambda: core.read_namespaced_persistent_volume_claim(name, namespace).status.phase == "Bound",
        timeout=timeout,
        what=f"PVC {namespace}/{name} Bound",
    )


def create_snapshot(snapshots: client.CustomObjectsApi, namespace: str, name: str, pvc: str) -> None:
    body = {
        "apiVersion": f"{SNAP_GROUP}/{SNAP_VERSION}",
        "kind": "VolumeSnapshot",
        "metadata": {"name": name},
        "spec": {"source": {"persistentVolumeClaimName": pvc}},  # the default class
    }
    snapshots.create_namespaced_custom_object(SNAP_GROUP, SNAP_VERSION, namespace, "volumesnapshots", body)


def snapshot_status(snapshots: client.CustomObjectsApi, namespace: str, name: str) -> dict:
    obj = snapshots.get_namespaced_custom_object(SNAP_GROUP, SNAP_VERSION, namespace, "volumesnapshots", name)
    return obj.get("status") or {}


def checksums(root: Path) -> dict[str, str]:
    """Every file under root by relative path, with its SHA-256; directories as 'dir'."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def gone(read) -> bool:
    try:
        read()
        return False
    except client.ApiException as err:
        if err.status == 404:
            return True
        raise


def test_snapshot_and_restore_bring_back_the_files(
    core: client.CoreV1Api, snapshots: client.CustomObjectsApi, namespace: str
):
    work, snap, restored = unique("work"), unique("snap"), unique("restored")
    create_pvc(core, namespace, work)
    wait_bound(core, namespace, work)
    data = pvc_data_dir(core, namespace, work)
    (data / "notes.txt").write_text("first draft\n")
    (data / "src" / "pkg").mkdir(parents=True)
    (data / "src" / "pkg" / "main.py").write_text("print('hello')\n")
    (data / "model.bin").write_bytes(os.urandom(10 * MiB))
    original = checksums(data)

    create_snapshot(snapshots, namespace, snap, work)
    status = wait_for(
        lambda: (s := snapshot_status(snapshots, namespace, snap)).get("readyToUse") and s,
        timeout=120,
        what=f"VolumeSnapshot {snap} readyToUse",
    )
    content_name = status["boundVolumeSnapshotContentName"]
    content = snapshots.get_cluster_custom_object(SNAP_GROUP, SNAP_VERSION, "volumesnapshotcontents", content_name)
    archive = data.parent.parent / "snapshots" / f"{content['status']['snapshotHandle']}.tgz"
    assert archive.is_file()

    # The workspace moves on after the snapshot.
    (data / "notes.txt").write_text("second draft\n")
    (data / "src" / "pkg" / "main.py").unlink()
    (data / "model.bin").write_bytes(b"truncated")
    (data / "scratch.tmp").write_text("new file\n")
    assert checksums(data) != original

    create_pvc(
        core,
        namespace,
        restored,
        dataSource={"apiGroup": SNAP_GROUP, "kind": "VolumeSnapshot", "name": snap},
    )
    wait_bound(core, namespace, restored)
    assert checksums(pvc_data_dir(core, namespace, restored)) == original

    snapshots.delete_namespaced_custom_object(SNAP_GROUP, SNAP_VERSION, namespace, "volumesnapshots", snap)
    wait_for(
        lambda: gone(
            lambda: snapshots.get_cluster_custom_object(
                SNAP_GROUP, SNAP_VERSION, "volumesnapshotcontents", content_name
            )
        ),
        timeout=60,
        what=f"VolumeSnapshotContent {content_name} deleted",
    )
    wait_for(lambda: not archive.exists(), timeout=30, what=f"snapshot archive {archive} removed")


def test_snapshot_of_a_volume_whose_driver_does_not_exist_reports_an_error(
    api: client.ApiClient, core: client.CoreV1Api, snapshots: client.CustomObjectsApi, namespace: str
):
    storage = client.StorageV1Api(api)
    missing_driver = "missing.csi.savepoint.dev"
    class_name, pv_name, pvc, snap = unique("missing-driver"), unique("pv-missing"), unique("orphan"), unique("snap")
    storage.create_storage_class(
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {"name": class_name},
            "provisioner": missing_driver,
            "volumeBindingMode": "Immediate",
        }
    )
    # No provisioner exists for that driver, so the volume is pre-made by hand (Retain:
    # nothing could delete it) and the PVC binds to it.
    core.create_persistent_volume(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv_name},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": class_name,
                "csi": {"driver": missing_driver, "volumeHandle": "nowhere"},
                "claimRef": {"namespace": namespace, "name": pvc},
            },
        }
    )
    try:
        create_pvc(core, namespace, pvc, storageClassName=class_name, volumeName=pv_name)
        wait_bound(core, namespace, pvc)
        create_snapshot(snapshots, namespace, snap, pvc)
        status = wait_for(
            lambda: (s := snapshot_status(snapshots, namespace, snap)).get("error") and s,
            timeout=60,
            what=f"an error on VolumeSnapshot {snap}",
        )
        assert not status.get("readyToUse")
        assert "boundVolumeSnapshotContentName" not in status
        # No VolumeSnapshotClass serves that driver; the message says so.
        assert "snapshot class" in status["error"]["message"]
    finally:
        core.delete_namespaced_persistent_volume_claim(pvc, namespace)
        core.delete_persistent_volume(pv_name)
        storage.delete_storage_class(class_name)
