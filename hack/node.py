"""The real node of the local control plane, for hack/cluster to start and stop.

One Node, `savepoint-node` (label `type=real`), that runs real containers:

    containerd   built by `hack/build-binaries containerd`; runc from Debian's package
    kubelet      built at the pinned Kubernetes version; CNI bridge + host-local IPAM
                 from Debian's containernetworking-plugins

Everything the two write lives under <run dir>/node, except what the programs fix
(containerd's shim sockets under /run/containerd/s, CNI results under /var/lib/cni):
`down` stops containers by containerd's own task list, then unmounts by path every
mount under the run folder, then removes the bridge and the NAT rule.

Networking: each cluster takes a free slot N and gets a bridge `spbr<N>` whose gateway
10.201.N.1 is the node's IP, Pods in 10.201.N.0/24, and Services in 10.202.N.0/24.
There is no kube-proxy; one DNAT rule sends the `kubernetes` Service (10.202.N.1:443)
to the API server on loopback (route_localnet on this bridge only), so in-cluster
clients (the operator, sandboxes) work unchanged.
Other Services are reachable through the API server's service proxy.

Standard library only, like hack/cluster. See docs/development.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

NODE_NAME = "savepoint-node"
NODE_LABELS = {"type": "real"}
PAUSE_IMAGE = "savepoint.local/pause:v1"
CNI_BIN_DIRS = ("/usr/lib/cni", "/opt/cni/bin")
BRIDGE_PREFIX = "spbr"
SOCKET_ROOT = Path("/run/savepoint")
NAT_CHAIN_PREFIX = "SAVEPOINT-"


class NodeError(Exception):
    """The real node could not be set up; the message says what is missing."""


def node_dir(run_dir: Path) -> Path:
    return run_dir / "node"


def socket_dir(run_dir: Path) -> Path:
    """A short folder for the node's unix sockets and the kubelet's root (whose
    plugins_registry holds the CSI driver's registration socket): a socket path may be at
    most 107 bytes, and a clone can live at any depth. One per run folder, keyed by its
    path; `down` unmounts and removes it."""
    key = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return SOCKET_ROOT / key


def kubelet_root(run_dir: Path) -> Path:
    """The kubelet's --root-dir; the CSI driver registers under its plugins_registry/."""
    return socket_dir(run_dir) / "kubelet"


def containerd_socket(run_dir: Path) -> Path:
    return socket_dir(run_dir) / "containerd.sock"


def cache_dir() -> Path:
    return Path(
        os.environ.get("SAVEPOINT_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "savepoint"
    )


def containerd_root(run_dir: Path) -> Path:
    """containerd's image store, kept across `up`s of one run folder, so the images are
    imported once (about 20 s of unpacking) and not at every start. `down` empties it of
    containers; what a run folder that no longer exists left behind is removed at `up`."""
    key = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    home = cache_dir() / "node" / key
    home.mkdir(parents=True, exist_ok=True)
    (home / "run-dir").write_text(str(run_dir.resolve()))
    return home / "containerd-root"


def prune_roots(log) -> None:
    """Remove the image stores of run folders whose parent is gone (a deleted clone; `down`
    removes the run folder itself, so that alone is no sign)."""
    for home in (cache_dir() / "node").glob("*"):
        try:
            owner = Path((home / "run-dir").read_text())
        except OSError:  # being made, or removed by another cluster's prune
            continue
        if not owner.parent.exists():
            unmount_all(home, log)
            shutil.rmtree(home, ignore_errors=True)
            log(f"removed the node image store of {owner} (its folder is gone)")


# --- network --------------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _bridges() -> set[str]:
    out = _ip("-o", "link", "show", "type", "bridge", check=False).stdout
    return {m[1] for m in re.finditer(r"^\d+: ([^:@]+)", out, re.M)}


def free_slot() -> int:
    """The lowest slot whose bridge no other cluster on this machine has made."""
    taken = {int(b[len(BRIDGE_PREFIX) :]) for b in _bridges() if b[len(BRIDGE_PREFIX) :].isdigit()}
    for slot in range(1, 250):
        if slot not in taken:
            return slot
    raise NodeError("no free network slot: 249 local clusters have bridges")


def network(slot: int) -> dict[str, str]:
    return {
        "slot": str(slot),
        "bridge": f"{BRIDGE_PREFIX}{slot}",
        "node_ip": f"10.201.{slot}.1",
        "pod_cidr": f"10.201.{slot}.0/24",
        "service_cidr": f"10.202.{slot}.0/24",
        "service_ip": f"10.202.{slot}.1",  # the `kubernetes` Service: the range's first address
        "nat_chain": f"{NAT_CHAIN_PREFIX}{slot}",
    }


def setup_network(net: dict[str, str], apiserver_port: int) -> None:
    """Create the bridge (so the kubelet has its node IP before the first Pod) and the DNAT."""
    bridge = net["bridge"]
    if bridge not in _bridges():
        _ip("link", "add", bridge, "type", "bridge")
    _ip("addr", "replace", f"{net['node_ip']}/24", "dev", bridge)
    _ip("link", "set", bridge, "up")
    # The API server listens on loopback only; this bridge alone may route to it.
    Path(f"/proc/sys/net/ipv4/conf/{bridge}/route_localnet").write_text("1\n")
    chain = net["nat_chain"]
    ipt = shutil.which("iptables")
    if ipt is None:
        raise NodeError("iptables not found: hack/install-packages installs it")
    subprocess.run([ipt, "-t", "nat", "-N", chain], capture_output=True)  # exists after a crash: fine
    subprocess.run([ipt, "-t", "nat", "-F", chain], check=True, capture_output=True)
    subprocess.run(
        [
            ipt,
            "-t",
            "nat",
            "-A",
            chain,
            "-d",
            net["service_ip"],
            "-p",
            "tcp",
            "--dport",
            "443",
            "-j",
            "DNAT",
            "--to-destination",
            f"127.0.0.1:{apiserver_port}",
        ],
        check=True,
        capture_output=True,
    )
    for hook in ("PREROUTING", "OUTPUT"):
        if subprocess.run([ipt, "-t", "nat", "-C", hook, "-j", chain], capture_output=True).returncode != 0:
            subprocess.run([ipt, "-t", "nat", "-A", hook, "-j", chain], check=True, capture_output=True)


def teardown_network(net: dict[str, str]) -> None:
    ipt = shutil.which("iptables")
    chain = net.get("nat_chain")
    if ipt and chain:
        for hook in ("PREROUTING", "OUTPUT"):
            while subprocess.run([ipt, "-t", "nat", "-D", hook, "-j", chain], capture_output=True).returncode == 0:
                pass
        subprocess.run([ipt, "-t", "nat", "-F", chain], capture_output=True)
        subprocess.run([ipt, "-t", "nat", "-X", chain], capture_output=True)
    if net.get("bridge") in _bridges():
        _ip("link", "delete", net["bridge"], check=False)


# --- configuration --------------------------------------------------------------------


def runc_path() -> str:
    path = shutil.which("runc") or next((p for p in ("/usr/sbin/runc", "/usr/bin/runc") if Path(p).exists()), None)
    if path is None:
        raise NodeError("runc not found: hack/install-packages installs it from Debian's package")
    return path


def cni_bin_dir() -> str:
    for d in CNI_BIN_DIRS:
        if (Path(d) / "bridge").exists() and (Path(d) / "host-local").exists():
            return d
    raise NodeError("CNI plugins (bridge, host-local) not found: hack/install-packages installs them")


def write_cni_config(run_dir: Path, net: dict[str, str]) -> Path:
    conf_dir = node_dir(run_dir) / "cni"
    conf_dir.mkdir(parents=True, exist_ok=True)
    conf = {
        "cniVersion": "1.0.0",
        "name": f"savepoint-{net['slot']}",
        "plugins": [
            {
                "type": "bridge",
                "bridge": net["bridge"],
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": net["pod_cidr"], "gateway": net["node_ip"]}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(node_dir(run_dir) / "ipam"),
                },
            },
            {"type": "loopback"},
        ],
    }
    (conf_dir / "10-savepoint.conflist").write_text(json.dumps(conf, indent=2))
    return conf_dir


def write_containerd_config(run_dir: Path) -> Path:
    nd = node_dir(run_dir)
    conf_dir = write_cni_config(run_dir, read_net(run_dir))
    path = nd / "containerd.toml"
    # restrict_oom_score_adj: this machine lacks CAP_SYS_RESOURCE, so runc cannot lower
    # oom_score_adj and every sandbox would fail to start without it.
    path.write_text(
        f"""version = 4
root = "{containerd_root(run_dir)}"
state = "{nd / "containerd-state"}"

[plugins.'io.containerd.server.v1.grpc']
  address = "{containerd_socket(run_dir)}"

[plugins.'io.containerd.server.v1.ttrpc']
  address = "{socket_dir(run_dir) / "containerd.sock.ttrpc"}"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"

[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{runc_path()}"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{cni_bin_dir()}"]
    conf_dir = "{conf_dir}"

[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""
    )
    return path


def write_kubelet_config(run_dir: Path, net: dict[str, str], ports: dict[str, int], ca: Path) -> Path:
    nd = node_dir(run_dir)
    path = nd / "kubelet.yaml"
    # cgroupsPerQOS off: the kubelet then neither makes a /kubepods tree nor removes
    # pod cgroups it does not know, so two local clusters on one machine cannot disturb
    # each other; container limits are still set by runc.
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": False,
        "enforceNodeAllocatable": [],
        "containerRuntimeEndpoint": f"unix://{containerd_socket(run_dir)}",
        "address": net["node_ip"],
        "port": ports["kubelet"],
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": ports["kubelet_healthz"],
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca)},
        },
        "authorization": {"mode": "Webhook"},
        "podLogsDir": str(nd / "pod-logs"),
        "failSwapOn": False,
        "resolvConf": "/etc/resolv.conf",
        "clusterDomain": "cluster.local",
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        # Images are imported, never pulled: never collect them.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "registerNode": True,
        "nodeStatusUpdateFrequency": "5s",
        "syncFrequency": "20s",
        "fileCheckFrequency": "20s",
        "volumeStatsAggPeriod": "0s",
    }
    path.write_text(json.dumps(config, indent=2))
    return path


def write_kubelet_kubeconfig(run_dir: Path, server: str, pki: Path) -> Path:
    path = node_dir(run_dir) / "kubelet.kubeconfig"
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: local
  cluster: {{server: "{server}", certificate-authority: "{pki / "ca.crt"}"}}
users:
- name: {NODE_NAME}
  user: {{client-certificate: "{pki / "kubelet.crt"}", client-key: "{pki / "kubelet.key"}"}}
contexts:
- name: local
  context: {{cluster: local, user: {NODE_NAME}}}
current-context: local
"""
    )
    path.chmod(0o600)
    return path


def write_net(run_dir: Path, net: dict[str, str]) -> None:
    node_dir(run_dir).mkdir(parents=True, exist_ok=True)
    (node_dir(run_dir) / "network.json").write_text(json.dumps(net))


def read_net(run_dir: Path) -> dict[str, str]:
    path = node_dir(run_dir) / "network.json"
    return json.loads(path.read_text()) if path.exists() else {}


def components(
    run_dir: Path, pins: dict[str, str], binary, ports: dict[str, int], server: str, pki: Path
) -> list[dict]:
    """containerd and the kubelet, as dicts of name, argv, health_url and health_socket."""
    nd = node_dir(run_dir)
    net = read_net(run_dir)
    for sub in ("pod-logs", "kubelet-pki", "ipam"):
        (nd / sub).mkdir(parents=True, exist_ok=True)
    kubelet_root(run_dir).mkdir(parents=True, exist_ok=True)
    containerd_conf = write_containerd_config(run_dir)
    kubelet_conf = write_kubelet_config(run_dir, net, ports, pki / "ca.crt")
    kubeconfig = write_kubelet_kubeconfig(run_dir, server, pki)
    cv = pins["CONTAINERD_VERSION"]
    shim_dir = str(binary("containerd-shim-runc-v2", cv).parent)
    return [
        {
            "name": "containerd",
            "argv": [str(binary("containerd", cv)), f"--config={containerd_conf}", "--log-level=warn"],
            # containerd finds its shim on PATH.
            "env": {"PATH": f"{shim_dir}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"},
            "health_socket": str(containerd_socket(run_dir)),
        },
        {
            "name": "kubelet",
            "argv": [
                str(binary("kubelet", pins["KUBERNETES_VERSION"])),
                f"--config={kubelet_conf}",
                f"--kubeconfig={kubeconfig}",
                f"--root-dir={kubelet_root(run_dir)}",
                f"--cert-dir={nd / 'kubelet-pki'}",
                f"--node-ip={net['node_ip']}",
                f"--hostname-override={NODE_NAME}",
                "--node-labels=" + ",".join(f"{k}={v}" for k, v in NODE_LABELS.items()),
                "--v=1",
            ],
            "health_url": f"http://127.0.0.1:{ports['kubelet_healthz']}/healthz",
        },
    ]


# --- images ---------------------------------------------------------------------------


def import_images(run_dir: Path, pins: dict[str, str], binary, hack: Path, log) -> dict[str, str]:
    """Build (cached) and import the pause, operator and harness images into containerd."""
    ctr = binary("ctr", pins["CONTAINERD_VERSION"])
    out = subprocess.run(
        [str(hack / "build-images"), "import", "--address", str(containerd_socket(run_dir)), "--ctr", str(ctr)],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise NodeError(f"hack/build-images failed:\n{out.stderr[-3000:]}")
    images = {}
    for line in out.stdout.splitlines():
        if "=" in line:
            key, value = line.strip().split("=", 1)
            images[key] = value
    (node_dir(run_dir) / "images.env").write_text(out.stdout)
    return images


# --- teardown -------------------------------------------------------------------------


def stop_containers(run_dir: Path, pins: dict[str, str], binary, log) -> None:
    """Kill every task containerd runs for this node, then the shims that served them."""
    sock = containerd_socket(run_dir)
    ctr = binary("ctr", pins.get("CONTAINERD_VERSION", ""))
    if sock.exists() and ctr.exists():
        base = [str(ctr), "--address", str(sock), "--timeout", "5s", "-n", "k8s.io"]
        tasks = subprocess.run([*base, "tasks", "ls", "-q"], capture_output=True, text=True).stdout.split()
        for task in tasks:
            subprocess.run([*base, "tasks", "kill", "--all", "--signal", "SIGKILL", task], capture_output=True)
        deadline = time.monotonic() + 10
        for task in tasks:
            while time.monotonic() < deadline:
                if subprocess.run([*base, "tasks", "delete", task], capture_output=True).returncode == 0:
                    break
                time.sleep(0.2)
        if tasks:
            log(f"stopped {len(tasks)} container tasks")
        # The image store outlives this cluster: leave it no container or sandbox.
        for kind in ("containers", "sandboxes"):
            ids = subprocess.run([*base, kind, "ls", "-q"], capture_output=True, text=True).stdout.split()
            if ids:
                subprocess.run([*base, kind, "rm", *ids], capture_output=True)
    # Shims serving our containerd carry its socket path on their command line.
    for pid in shim_pids(sock):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def shim_pids(sock: Path) -> list[int]:
    pids = []
    needle = str(sock).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"containerd-shim" in cmdline and needle in cmdline:
            pids.append(int(proc.name))
    return pids


def mounts_under(root: Path) -> list[str]:
    """Mount points at or below root, deepest first (mountinfo escapes spaces as \\040)."""
    prefix = str(root.resolve())
    points = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(set(points), key=lambda p: p.count("/"), reverse=True)


def unmount_all(root: Path, log) -> None:
    for _ in range(3):
        points = mounts_under(root)
        if not points:
            return
        for point in points:
            subprocess.run(["umount", "-l", point], capture_output=True)
        log(f"unmounted {len(points)} mounts under {root}")
