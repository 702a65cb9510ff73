"""`python -m savepoint` as a child process of a test: the shared cluster-wide operator
of tests/conftest.py, the fault tests' own operators and the peering replicas."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def namespaced_env(kubeconfig: str, namespace: str, **env: str) -> dict[str, str]:
    """The environment of an operator that watches one namespace only, without the webhook."""
    return {
        **os.environ,
        "KUBECONFIG": kubeconfig,
        "PYTHONPATH": str(REPO / "operator"),
        "SAVEPOINT_NAMESPACES": namespace,
        "SAVEPOINT_WEBHOOK": "false",
        "SAVEPOINT_METRICS_PORT": "0",
        "SAVEPOINT_RESYNC_SECONDS": "10",
        "SAVEPOINT_LOG_LEVEL": os.environ.get("SAVEPOINT_FAULT_LOG_LEVEL", "INFO"),
        **env,
    }


class OperatorProcess:
    """An operator that a test may stop, SIGKILL and start again.

    `env` is its whole environment; `start(**extra)` adds to it for that one start.
    With `check_start` seconds, start() waits that long and fails the test if the
    operator has exited meanwhile (a bad setting), and then, once `metrics_url` is set,
    until its metrics server answers (a test may read a metric at once); without, it
    returns at once, as a kill loop needs. The log holds this test run's starts, each
    under a header line.
    """

    def __init__(self, env: Mapping[str, str], log_path: Path, check_start: float = 0) -> None:
        self.env = dict(env)
        self.log_path = log_path
        self.check_start = check_start
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.kills = 0
        # Where the shared operator serves its webhook and metrics (set by its fixture).
        self.webhook: dict = {}
        self.metrics_url = ""

    def start(self, **extra_env: str) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab" if self.starts else "wb") as out:
            out.write(f"\n===== start {self.starts + 1} at {time.strftime('%H:%M:%S')} =====\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "savepoint"],
                env={**self.env, **extra_env},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.starts += 1
        if self.check_start:
            time.sleep(self.check_start)
            self._exited_at_start()
            deadline = time.monotonic() + 60
            while self.metrics_url and not _answers(f"{self.metrics_url}/metrics"):
                self._exited_at_start()
                if time.monotonic() > deadline:
                    pytest.fail(f"the operator's metrics server did not answer; see {self.log_path}", pytrace=False)
                time.sleep(0.2)

    def _exited_at_start(self) -> None:
        if not self.alive():
            pytest.fail(f"the operator exited at start; see {self.log_path}", pytrace=False)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure_running(self) -> None:
        if not self.alive():
            self.start()

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs, whatever the operator was doing stops mid-line."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.kills += 1

    def wait_exit(self, timeout: float, what: str) -> int:
        """Wait for the process to die by itself (a failpoint) and return its exit code."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the operator did not exit at {what} within {timeout}s", pytrace=False)

    def stop(self) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _answers(url: str) -> bool:
    """Whether an HTTP server answers at `url`, whatever its status."""
    try:
        urllib.request.urlopen(url, timeout=2).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True
