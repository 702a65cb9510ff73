"""Reach a PVC's files on this machine, the way a sandbox process would see them.

On the local control plane a PVC of the default class is a directory made by our CSI
hostpath driver (csi/hostpath). There is no kubelet to mount it into a Pod, so tests
read and write that directory directly. How it is found:

1. the PVC's bound PV names the volume: spec.csi.volumeHandle;
2. if SAVEPOINT_CSI_STATE_DIR is set, the data is <that>/volumes/<volumeHandle>
   (for a driver whose state directory is somewhere you know);
3. otherwise the PV's spec.csi.volumeAttributes["path"], which the driver records
   when it creates the volume (<run dir>/csi-hostpath/volumes/<volumeHandle>).

Against a cluster whose driver runs elsewhere (kind, a cloud) there is no such
directory here, and pvc_data_dir says so.
"""

from __future__ import annotations

import os
from pathlib import Path

from kubernetes import client

HOSTPATH_DRIVER = "hostpath.csi.savepoint.dev"
STATE_DIR_ENV = "SAVEPOINT_CSI_STATE_DIR"


class PVCDataError(Exception):
    """The PVC's data cannot be reached from this machine; the message says why."""


def pvc_data_dir(core: client.CoreV1Api, namespace: str, name: str) -> Path:
    """The directory holding the data of the bound PVC namespace/name."""
    pvc = core.read_namespaced_persistent_volume_claim(name, namespace)
    if pvc.status.phase != "Bound" or not pvc.spec.volume_name:
        raise PVCDataError(f"PVC {namespace}/{name} is {pvc.status.phase}, not Bound")
    pv = core.read_persistent_volume(pvc.spec.volume_name)
    csi = pv.spec.csi
    if csi is None or csi.driver != HOSTPATH_DRIVER:
        driver = csi.driver if csi else "no CSI driver"
        raise PVCDataError(f"PV {pv.metadata.name} is from {driver}, not {HOSTPATH_DRIVER}")
    state_dir = os.environ.get(STATE_DIR_ENV)
    if state_dir:
        path = Path(state_dir) / "volumes" / csi.volume_handle
    elif (csi.volume_attributes or {}).get("path"):
        path = Path(csi.volume_attributes["path"])
    else:
        raise PVCDataError(f"PV {pv.metadata.name} records no path; set {STATE_DIR_ENV}")
    if not path.is_dir():
        raise PVCDataError(
            f"{path} (volume {csi.volume_handle}) is not a directory on this machine: "
            f"is the driver running elsewhere? Set {STATE_DIR_ENV} to its state directory"
        )
    return path
