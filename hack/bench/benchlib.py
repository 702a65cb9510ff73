"""What the benches in hack/bench share: the venv, printing, the cluster, the operator process.

A bench script (no extension) imports it from its own folder:

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import benchlib  # re-executes the script with the project's venv if `kubernetes` is missing
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
try:
    from kubernetes import client, config
except ImportError:  # run with the project's venv, which has the kubernetes client
    if VENV_PYTHON.exists() and Path(sys.executable) != VENV_PYTHON:
        os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), *sys.argv])
    raise

GROUP, VERSION = "savepoint.dev", "v1alpha1"
SNAP = ("snapshot.storage.k8s.io", "v1")
KWOK_POD = {
    "spec": {
        "containers": [{"name": "agent", "image": "example.invalid/agent:1"}],
        "nodeSelector": {"type": "kwok"},
        "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
    }
}


# ---------------------------------------------------------------- printing


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def mib(kib: float) -> str:
    return f"{kib / 1024:.0f} MiB"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_bench(name: str) -> ModuleType:
    """Another bench script of this folder as a module (its main() does not run)."""
    path = Path(__file__).resolve().parent / name
    loader = importlib.machinery.SourceFileLoader(f"bench_{name}", str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = module  # dataclasses and the like look themselves up here
    loader.exec_module(module)
    return module


# ---------------------------------------------------------------- the cluster


def run_dir() -> Path:
    """The local control plane `hack/cluster up` started ($SAVEPOINT_RUN_DIR, default .run/cluster)."""
    return Path(os.environ.get("SAVEPOINT_RUN_DIR", REPO / ".run" / "cluster"))


def kubeconfig() -> str:
    return os.environ.get("KUBECONFIG") or str(run_dir() / "kubeconfig")


def connect(pool: int = 0) -> client.ApiClient:
    """A client of $KUBECONFIG, or of the local control plane; `pool` connections if given."""
    api = config.new_client_from_config(config_file=kubeconfig())
    if pool:
        api.rest_client.pool_manager.connection_pool_kw["maxsize"] = pool
    return api


def apiserver_requests_by_kind(api: client.ApiClient) -> dict[str, float]:
    """The API server's apiserver_request_total, all clients, per "VERB resource[/subresource]"
    (with the code when it is not a 2xx): watches and non-resource requests (the /metrics scrape itself) left out."""
    resp = api.call_api(*api.param_serialize("GET", "/metrics", auth_settings=["BearerToken"]))
    resp.read()
    counts: dict[str, float] = {}
    for line in resp.data.decode().splitlines():
        if not line.startswith("apiserver_request_total{") or 'verb="WATCH"' in line:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
        if not labels.get("resource"):
            continue
        sub = "/" + labels["subresource"] if labels.get("subresource") else ""
        kind = f"{labels['verb']} {labels['resource']}{sub}"
        if not labels.get("code", "2").startswith("2"):  # conflicts, not-founds: work done again or for nothing
            kind += f" {labels['code']}"
        counts[kind] = counts.get(kind, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def apiserver_requests(api: client.ApiClient) -> float:
    """apiserver_request_total summed over everything but WATCH and the /metrics scrape."""
    return sum(apiserver_requests_by_kind(api).values())


class ApiServerProfile:
    """The API server's CPU from start() to stop(), split by what it served: CPU profiles
    taken back to back from its /debug/pprof (admin only; hack/cluster turns it on), each
    sample counted under the first of KINDS whose frames its stack holds all of. Needs `go`
    (`go tool pprof` reads the profiles)."""

    KINDS = (  # (kind, frames); a kind may come more than once, the first match wins
        ("garbage collection", ("runtime.gcBgMarkWorker",)),
        ("garbage collection", ("runtime.bgsweep",)),
        ("PATCH of a status", ("(*patcher).patchResource", "StatusREST).Update")),
        ("PATCH", ("(*patcher).patchResource",)),
        ("PUT of a status", ("UpdateResource", "StatusREST).Update")),
        ("PUT", ("UpdateResource",)),
        ("POST", ("createHandler",)),
        ("DELETE", ("DeleteResource",)),
        ("GET", ("GetResource",)),
        ("LIST and WATCH", ("ListResource",)),
        ("the watch cache", ("storage/etcd3.(*watchChan)",)),
        ("the watch cache", ("storage/cacher.",)),
        ("the etcd client", ("go.etcd.io/etcd/client",)),
        ("the etcd client", ("google.golang.org/grpc",)),
        ("HTTP outside the handlers", ("net/http",)),
        ("HTTP outside the handlers", ("x/net/http2",)),
        ("HTTP outside the handlers", ("(*timeoutHandler)",)),
    )
    CHUNK = 10  # seconds per profile: stop() waits for the one running

    def __init__(self, api: client.ApiClient, name: str) -> None:
        self.api, self.stem = api, REPO / ".run" / f"{name}.apiserver"
        self.paths: list[Path] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._record, daemon=True)

    def start(self) -> ApiServerProfile:
        self._thread.start()
        return self

    def _record(self) -> None:
        while not self._stopped.is_set():
            resp = self.api.call_api(*self.api.param_serialize(
                "GET", "/debug/pprof/profile", query_params=[("seconds", self.CHUNK)], auth_settings=["BearerToken"]))
            resp.read()
            if resp.status != 200:
                say(f"no API server profile: {resp.status} (is kube-apiserver run with --profiling?)")
                return
            path = self.stem.with_name(f"{self.stem.name}.{len(self.paths)}.pprof")
            path.write_bytes(resp.data)
            self.paths.append(path)

    def stop(self, label: str, n: int) -> dict[str, float]:
        """Print the API server's CPU per operation by kind ("other" for the rest); seconds by kind."""
        self._stopped.set()
        self._thread.join()
        if not self.paths:
            return {}
        out = subprocess.run(["go", "tool", "pprof", "-traces", *map(str, self.paths)],
                             capture_output=True, text=True, check=True).stdout
        seconds = self.split(out)
        total = sum(seconds.values()) or 1.0
        parts = sorted(((v, k) for k, v in seconds.items()), reverse=True)
        say(f"  {label}: kube-apiserver profile, CPU per operation {total * 1000 / n:.1f} ms: "
            + ", ".join(f"{k} {v * 1000 / n:.1f} ({v / total:.0%})" for v, k in parts))
        return seconds

    @classmethod
    def split(cls, traces: str) -> dict[str, float]:
        """`go tool pprof -traces` output: blocks of "<time> <leaf frame>" then its callers."""
        seconds: dict[str, float] = {}
        for block in traces.split("-----------+")[1:]:
            lines = [line.strip() for line in block.splitlines()[1:] if line.strip()]
            head = re.match(r"([\d.]+)(ms|s|us)\s+(.*)", lines[0]) if lines else None
            if not head:
                continue
            took = float(head[1]) * {"ms": 1e-3, "s": 1.0, "us": 1e-6}[head[2]]
            stack = " ".join([head[3], *lines[1:]])
            kind = next((k for k, frames in cls.KINDS if all(f in stack for f in frames)), "other")
            seconds[kind] = seconds.get(kind, 0.0) + took
        return seconds


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads (fields 14 and 15 of /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def component_cpu(folder: Path | None = None) -> dict[str, float]:
    """CPU seconds each process of the local control plane has used so far, by the pid
    files `hack/cluster up` wrote (empty against a cluster it did not start)."""
    used: dict[str, float] = {}
    for pid_file in sorted(((folder or run_dir()) / "pids").glob("*.pid")):
        try:
            used[pid_file.stem] = cpu_seconds(int(pid_file.read_text()))
        except (OSError, ValueError):
            continue
    return used


# ---------------------------------------------------------------- the operator


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: each sample's value by metric name (labels summed), and by
    name{client="..."} for savepoint_api_requests_total (ours and kopf's apart), and
    by name{client="...",verb="...",code="..."} for it too (each series whole)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        value = float(line.rsplit(" ", 1)[1])
        sums[name] = sums.get(name, 0.0) + value
        who = re.search(r'client="([^"]*)"', line) if name == "savepoint_api_requests_total" else None
        if who:
            key = f'{name}{{client="{who.group(1)}"}}'
            sums[key] = sums.get(key, 0.0) + value
            series = ",".join(f'{k}="{v}"' for k, v in sorted(re.findall(r'(\w+)="([^"]*)"', line)))
            sums[f"{name}{{{series}}}"] = value
    return sums


class Operator:
    """`python -m savepoint` as a child process in its own process group, with its metrics
    served on a free port, its RSS and CPU sampled every half second.

    `namespaces` empty: cluster-wide, as the chart installs it. `wrap` runs it under a
    command (for example "py-spy record -o x --"); the sampled pid is then the wrapper's.
    `sample=False` leaves the sampling thread out (a bench timing its own CPU). A bench
    measures a healthy operator: SAVEPOINT_FAILPOINTS is never passed on.
    """

    def __init__(
        self,
        namespaces: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        wrap: str = "",
        append: bool = False,
        sample: bool = True,
    ) -> None:
        self.port = free_port()
        self.log_path = log_path
        environ = {
            **os.environ,
            "KUBECONFIG": kubeconfig(),
            **(env or {}),
            "PYTHONPATH": str(REPO / "operator"),
            "SAVEPOINT_NAMESPACES": ",".join(namespaces),
            "SAVEPOINT_METRICS_PORT": str(self.port),
        }
        environ.pop("SAVEPOINT_FAILPOINTS", None)
        self.started = time.monotonic()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab" if append else "wb") as log:
            self.proc = subprocess.Popen(
                [*shlex.split(wrap), str(VENV_PYTHON), "-m", "savepoint"],
                env=environ,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,
            )
        self.samples: list[tuple[float, float, float]] = []  # (monotonic, rss KiB, cpu s)
        self._stop = threading.Event()
        if sample:
            threading.Thread(target=self._sample, daemon=True).start()
        deadline = time.monotonic() + 60
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                sys.exit(f"the operator did not come up; see {log_path}")
            time.sleep(0.2)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2):
                return True
        except OSError:
            return False

    def usage(self) -> tuple[float, float]:
        """(RSS KiB, CPU seconds) now."""
        rss = 0.0
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = float(line.split()[1])
        return rss, cpu_seconds(self.proc.pid)

    def _sample(self) -> None:
        while not self._stop.is_set() and self.proc.poll() is None:
            try:
                rss, cpu = self.usage()
            except OSError:
                break
            self.samples.append((time.monotonic(), rss, cpu))
            self._stop.wait(0.5)

    def peak_rss(self, since: float = 0.0) -> float:
        return max((s[1] for s in self.samples if s[0] >= since), default=0.0)

    def metrics(self) -> dict[str, float]:
        """The operator's /metrics: sums by metric name (see parse_metrics)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as resp:
            return parse_metrics(resp.read().decode())

    def stop(self) -> None:
        self._stop.set()
        if self.proc.poll() is None:
            # SIGINT: kopf stops cleanly on it, and py-spy (wrap) writes its profile.
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def wait_idle(
        self,
        background: float = 0.0,
        window: float = 5.0,
        timeout: float = 1800,
        at_least: float = 0,
        cpu_idle: float = 0.25,
    ) -> float:
        """Seconds from start-up until the operator is idle: for `window` seconds, no more
        than `background` (plus one) reconcile passes per second and under `cpu_idle` of a
        core, after at least `at_least` passes (one per Session on a restart).

        `background` is the steady load of the Session resync (sessions divided by
        SAVEPOINT_RESYNC_SECONDS), which never stops. The CPU bound catches kopf's own
        work, which no reconcile counts: after a restart it re-lists every Checkpoint,
        VolumeSnapshot, Pod, claim and chunk, and runs each through its handlers or filters.
        """
        history: list[tuple[float, float, float]] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.metrics()
            now, total = time.monotonic(), m.get("savepoint_reconciles_total", 0.0)
            history.append((now, total, self.usage()[1]))
            old = [h for h in history if h[0] <= now - window]
            if old and total >= at_least:
                t0, n0, c0 = old[-1]
                passes, cpu = (total - n0) / (now - t0), (history[-1][2] - c0) / (now - t0)
                if passes <= background + 1 and cpu <= cpu_idle:
                    return t0 - self.started
            time.sleep(0.25)
        raise TimeoutError("the operator did not become idle")
