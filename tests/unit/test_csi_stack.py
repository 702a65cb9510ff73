"""hack/csi_stack.py's plan for the driver: the flags that make it serve the real node's kubelet."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
import csi_stack  # noqa: E402
import node  # noqa: E402

PINS = csi_stack.read_pins()


@pytest.fixture(autouse=True)
def socket_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The node's short socket folder under the test's own folder, not /run."""
    monkeypatch.setattr(node, "SOCKET_ROOT", tmp_path / "run")
    return tmp_path / "run"


def driver_argv(run_dir: Path, real_node: bool | None = None) -> list[str]:
    plan = csi_stack.components(run_dir, run_dir / "kubeconfig", PINS, lambda: 12345, real_node=real_node)
    assert plan[0]["name"] == "csi-hostpath"
    return plan[0]["argv"]


def test_driver_registers_with_the_kubelet_only_when_the_run_folder_has_a_node(tmp_path: Path) -> None:
    assert not any(a.startswith("--kubelet-registration-dir") for a in driver_argv(tmp_path))
    assert not (tmp_path / "node").exists()

    (tmp_path / "node").mkdir()
    argv = driver_argv(tmp_path)
    registry = node.kubelet_root(tmp_path) / "plugins_registry"
    assert f"--kubelet-registration-dir={registry}" in argv
    assert registry.is_dir(), "made before the driver starts, so it can listen before the kubelet walks it"
    assert "--nodeid=savepoint-node" in argv
    assert csi_stack.registration_socket(tmp_path) == registry / "hostpath.csi.savepoint.dev-reg.sock"


def test_real_node_argument_overrides_the_folder_check(tmp_path: Path) -> None:
    assert any(a.startswith("--kubelet-registration-dir=") for a in driver_argv(tmp_path / "a", real_node=True))
    (tmp_path / "b" / "node").mkdir(parents=True)
    assert not any(a.startswith("--kubelet-registration-dir") for a in driver_argv(tmp_path / "b", real_node=False))


@pytest.mark.parametrize("run", [".run/cluster", ".run/test-cluster", "/tmp/" + "deep/" * 30 + ".run/test-cluster"])
def test_sockets_fit_a_unix_socket_path_wherever_the_run_folder_is(run: str, monkeypatch) -> None:
    # The driver refuses a path over 107 bytes; the registration socket is the long one.
    monkeypatch.setattr(node, "SOCKET_ROOT", node.Path("/run/savepoint"))
    for path in (
        csi_stack.registration_socket(REPO / run),
        csi_stack.socket_path(REPO / run),
        node.containerd_socket(REPO / run),
    ):
        assert len(str(path).encode()) <= 107, f"{path} is {len(str(path))} bytes"


def test_csidriver_needs_no_attach_and_no_pod_info() -> None:
    items = json.loads(csi_stack.classes_manifest())["items"]
    (driver,) = [i for i in items if i["kind"] == "CSIDriver"]
    assert driver["apiVersion"] == "storage.k8s.io/v1"
    assert driver["metadata"]["name"] == csi_stack.DRIVER_NAME
    assert driver["spec"]["attachRequired"] is False
    assert driver["spec"]["podInfoOnMount"] is False
