"""The CSI storage stack of the local control plane, for hack/cluster to start.

Four processes on loopback, built by `hack/build-binaries csi`:

    csi-hostpath         our driver (csi/hostpath): volumes are directories, snapshots
                         tar.gz archives, under <run dir>/csi-hostpath; with a real node
                         it also registers with that node's kubelet, which then calls it
                         to bind-mount volumes into Pods
    csi-provisioner      PVC -> CreateVolume (including dataSource: snapshot or PVC)
    csi-snapshotter      VolumeSnapshotContent -> CreateSnapshot / DeleteSnapshot
    snapshot-controller  VolumeSnapshot <-> VolumeSnapshotContent

`post_start` applies the VolumeSnapshot CRDs from the downloaded external-snapshotter
client module (never copied into git), the driver's CSIDriver object, a default
StorageClass and a default VolumeSnapshotClass. It needs only the API server, so it can run before the four
processes start; snapshot-controller waits for the CRDs at start-up.

Standard library only, like hack/cluster. See docs/csi.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import node  # beside this script: the node's socket folder and the kubelet's root

HACK = Path(__file__).resolve().parent
REPO = HACK.parent
DRIVER_SRC = REPO / "csi" / "hostpath"
DRIVER_NAME = "hostpath.csi.savepoint.dev"
# The real node's name, which the driver reports from NodeGetInfo: the kubelet records
# it on the Node and its CSINode.
NODE_NAME = "savepoint-node"
STORAGE_CLASS = "savepoint-hostpath"
SNAPSHOT_CLASS = "savepoint-hostpath"
SNAPSHOT_CLIENT_MODULE = "github.com/kubernetes-csi/external-snapshotter/client/v8"
# The sidecars' RPC timeout. Restoring or archiving a large workspace takes longer than
# the provisioner's 10s default; a timed-out call is retried and waits for the first.
CSI_TIMEOUT = "120s"
# How often csi-snapshotter and snapshot-controller go over every object again
# (SAVEPOINT_CSI_RESYNC, e.g. "1m"; their own default, 15 min, when unset). After an
# etcd restart either may miss a VolumeSnapshot or content made in the gap and leave it
# unfinished until the next resync; the tests, which restart etcd, set 1m
# (tests/conftest.py). The benches keep the default: a resync of thousands of objects
# every minute would cost them CPU.
CSI_RESYNC = os.environ.get("SAVEPOINT_CSI_RESYNC", "")


def cache_dir() -> Path:
    """Where hack/build-binaries puts binaries (same rule as hack/lib.sh)."""
    return Path(
        os.environ.get("SAVEPOINT_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "savepoint"
    )


def binary(name: str, version: str) -> Path:
    return cache_dir() / "bin" / f"{name}-{version}" / name


def driver_version() -> str:
    """The cache key hack/build-binaries gives our driver: a hash of its sources.

    Equal to `sha256sum go.mod go.sum <non-test *.go, C-sorted> | sha256sum`.
    """
    names = sorted(
        p.name
        for p in DRIVER_SRC.iterdir()
        if p.is_file() and (p.name in ("go.mod", "go.sum") or p.suffix == ".go") and not p.name.endswith("_test.go")
    )
    listing = "".join(f"{hashlib.sha256((DRIVER_SRC / n).read_bytes()).hexdigest()}  {n}\n" for n in names)
    return "src-" + hashlib.sha256(listing.encode()).hexdigest()[:12]


def state_dir(run_dir: Path) -> Path:
    """The driver's state: volumes/<volume-id>/, snapshots/<id>.tgz, meta/."""
    return run_dir / "csi-hostpath"


def socket_path(run_dir: Path) -> Path:
    # Unix socket paths are limited to 107 bytes: in the node's short socket folder.
    return node.socket_dir(run_dir) / "csi.sock"


def kubelet_root_dir(run_dir: Path) -> Path:
    """The real node's kubelet --root-dir (hack/cluster starts the kubelet with it)."""
    return node.kubelet_root(run_dir)


def registration_dir(run_dir: Path) -> Path:
    """The kubelet's plugins_registry: the driver's registration socket goes here."""
    return kubelet_root_dir(run_dir) / "plugins_registry"


def registration_socket(run_dir: Path) -> Path:
    """Where the driver listens for the kubelet (its rule: <dir>/<driver name>-reg.sock)."""
    return registration_dir(run_dir) / f"{DRIVER_NAME}-reg.sock"


def components(
    run_dir: Path,
    kubeconfig: Path,
    pins: dict[str, str],
    ports_fn: Callable[[], int],
    real_node: bool | None = None,
) -> list[dict]:
    """The four processes, in start order, as dicts of name, argv and health_url.

    ports_fn() returns a free loopback port. The sidecars' health URL is their metrics
    endpoint: it answers once the process runs (they wait for the driver's socket by
    themselves and log while they do).

    real_node: whether the run folder has a real node (kubelet), so the driver serves the
    kubelet's plugin registration in registration_dir(run_dir); None means "if
    <run dir>/node exists". The folder is made here, so the driver listens before the
    kubelet starts: the kubelet walks it at start and watches it after.
    """
    snapshotter = pins["EXTERNAL_SNAPSHOTTER_VERSION"]
    sock = socket_path(run_dir)
    if real_node is None:
        real_node = (run_dir / "node").is_dir()
    registration = []
    if real_node:
        registration_dir(run_dir).mkdir(parents=True, exist_ok=True)
        registration = [f"--kubelet-registration-dir={registration_dir(run_dir)}"]
    driver_port, prov_port, snap_port, ctrl_port = (ports_fn() for _ in range(4))
    # client-go's default of 5 requests/s capped the whole stack near 0.5 snapshots/s, and
    # 10 workers at 50/s near 5/s; at these it keeps up with 20 requested per second
    # (docs/performance.md).
    common = [
        f"--kubeconfig={kubeconfig}",
        "--leader-election=false",
        "--v=2",
        "--kube-api-qps=200",
        "--kube-api-burst=400",
        "--worker-threads=50",
    ]
    resync = [f"--resync-period={CSI_RESYNC}"] if CSI_RESYNC else []
    return [
        {
            "name": "csi-hostpath",
            "argv": [
                str(binary("csi-hostpath", driver_version())),
                f"--endpoint=unix://{sock}",
                f"--nodeid={NODE_NAME}",
                f"--statedir={state_dir(run_dir)}",
                f"--drivername={DRIVER_NAME}",
                f"--health-address=127.0.0.1:{driver_port}",
                *registration,
            ],
            "health_url": f"http://127.0.0.1:{driver_port}/healthz",
        },
        {
            "name": "csi-provisioner",
            "argv": [
                str(binary("csi-provisioner", pins["EXTERNAL_PROVISIONER_VERSION"])),
                f"--csi-address={sock}",
                *common,
                f"--http-endpoint=127.0.0.1:{prov_port}",
                f"--timeout={CSI_TIMEOUT}",
            ],
            "health_url": f"http://127.0.0.1:{prov_port}/metrics",
        },
        {
            "name": "csi-snapshotter",
            "argv": [
                str(binary("csi-snapshotter", snapshotter)),
                f"--csi-address={sock}",
                *common,
                *resync,
                f"--http-endpoint=127.0.0.1:{snap_port}",
                f"--timeout={CSI_TIMEOUT}",
            ],
            "health_url": f"http://127.0.0.1:{snap_port}/metrics",
        },
        {
            "name": "snapshot-controller",
            "argv": [
                str(binary("snapshot-controller", snapshotter)),
                *common,
                *resync,
                f"--http-endpoint=127.0.0.1:{ctrl_port}",
            ],
            "health_url": f"http://127.0.0.1:{ctrl_port}/metrics",
        },
    ]


def snapshot_crd_files(version: str) -> list[Path]:
    """The CRD manifests in the external-snapshotter client module, from the module cache."""
    out = subprocess.run(
        ["go", "mod", "download", "-json", f"{SNAPSHOT_CLIENT_MODULE}@{version}"],
        cwd=tempfile.gettempdir(),  # outside any module, so no go.mod is consulted
        env={**os.environ, "GOWORK": "off", "GOFLAGS": "-mod=mod"},
        capture_output=True,
        text=True,
    )
    info = json.loads(out.stdout or "{}")
    if out.returncode != 0 or "Dir" not in info:
        raise RuntimeError(
            f"could not download {SNAPSHOT_CLIENT_MODULE}@{version}: {info.get('Error') or out.stderr.strip()}"
        )
    # All of them, group snapshots included: without those CRDs snapshot-controller
    # spends its start-up waiting for them before it carries on.
    files = sorted((Path(info["Dir"]) / "config" / "crd").glob("*.storage.k8s.io_*.yaml"))
    if not files:
        raise RuntimeError(f"no CRDs under {info['Dir']}/config/crd")
    return files


def crd_name(path: Path) -> str:
    """snapshot.storage.k8s.io_volumesnapshots.yaml -> crd/volumesnapshots.snapshot.storage.k8s.io"""
    group, plural = path.stem.split("_", 1)
    return f"crd/{plural}.{group}"


def classes_manifest() -> str:
    """The CSIDriver object, the default StorageClass and the default VolumeSnapshotClass."""
    csi_driver = {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "CSIDriver",
        "metadata": {"name": DRIVER_NAME},
        "spec": {
            # No ControllerPublish: without this the kubelet would wait for a
            # VolumeAttachment that no external-attacher ever marks attached.
            "attachRequired": False,
            "podInfoOnMount": False,
            "volumeLifecycleModes": ["Persistent"],
            # The kubelet gives each mounted volume to the Pod's fsGroup, so a sandbox that
            # runs as non-root (the reference harness is uid 10001) can write its workspace,
            # restored ones included (snapshots do not keep ownership).
            "fsGroupPolicy": "File",
        },
    }
    storage_class = {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {
            "name": STORAGE_CLASS,
            "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
        },
        "provisioner": DRIVER_NAME,
        "reclaimPolicy": "Delete",
        # Immediate: the driver has no topology, so a volume fits every node and
        # there is nothing to wait for a Pod's scheduling to decide.
        "volumeBindingMode": "Immediate",
    }
    snapshot_class = {
        "apiVersion": "snapshot.storage.k8s.io/v1",
        "kind": "VolumeSnapshotClass",
        "metadata": {
            "name": SNAPSHOT_CLASS,
            "annotations": {"snapshot.storage.kubernetes.io/is-default-class": "true"},
        },
        "driver": DRIVER_NAME,
        "deletionPolicy": "Delete",
    }
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [csi_driver, storage_class, snapshot_class]})


def post_start(kubectl_fn: Callable[..., str], pins: dict[str, str] | None = None) -> None:
    """Apply the snapshot CRDs, then the CSIDriver, StorageClass and VolumeSnapshotClass.

    kubectl_fn(*args, stdin=None) runs kubectl against the cluster and raises on failure
    (hack/cluster's `kubectl`). Safe to repeat.
    """
    if pins is None:
        pins = read_pins()
    files = snapshot_crd_files(pins["EXTERNAL_SNAPSHOTTER_VERSION"])
    # Server-side: the CRDs are too large for client-side apply's annotation.
    args = ["apply", "--server-side", "--force-conflicts"]
    for path in files:
        args += ["-f", str(path)]
    kubectl_fn(*args)
    kubectl_fn("wait", "--for=condition=Established", "--timeout=60s", *(crd_name(p) for p in files))
    kubectl_fn("apply", "-f", "-", stdin=classes_manifest())


def read_pins() -> dict[str, str]:
    pins = {}
    for line in (HACK / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            pins[key] = value
    return pins
