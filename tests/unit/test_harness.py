"""The reference harness's pure parts and its CLI on a real folder. No cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from savepoint import harness
from savepoint.harness import HarnessError, check_record, make_record, resolve, verify_file, write_atomic


def cli(*args: str, workspace: Path, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SAVEPOINT_WORKSPACE": str(workspace)}
    return subprocess.run(
        [sys.executable, "-m", "savepoint.harness", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_resolve_keeps_paths_inside_the_workspace(tmp_path: Path) -> None:
    assert resolve("notes/a.txt", tmp_path) == tmp_path / "notes" / "a.txt"
    assert resolve(str(tmp_path / "b.txt"), tmp_path) == tmp_path / "b.txt"
    for bad in ("../escape", "/etc/passwd", "a/../../x", ".", ""):
        with pytest.raises(HarnessError):
            resolve(bad, tmp_path)


def test_write_atomic_replaces_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "dir" / "f.txt"
    write_atomic(target, b"one")
    write_atomic(target, b"two")
    assert target.read_bytes() == b"two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["f.txt"]


def test_a_reader_never_sees_a_partial_write(tmp_path: Path) -> None:
    target = tmp_path / "churn.dat"
    write_atomic(target, make_record(0, 256 * 1024))
    stop = threading.Event()
    verdicts: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            verdicts.append(verify_file(target).state)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for generation in range(1, 60):
            write_atomic(target, make_record(generation, 256 * 1024))
    finally:
        stop.set()
        t.join()
    assert verdicts and set(verdicts) == {"whole"}
    assert verify_file(target).generation == 59


def test_records_detect_truncation_and_corruption() -> None:
    record = make_record(7, 1000)
    assert check_record(record) == harness.Verdict("whole", 7)
    assert check_record(record[:-1]).state == "torn"
    assert "payload is 999 bytes" in check_record(record[:-1]).reason
    flipped = bytearray(record)
    flipped[-1] ^= 1
    assert check_record(bytes(flipped)).reason == "payload does not match its sha256"
    assert check_record(record[:10]).state == "torn"
    assert check_record(b"").state == "torn"
    assert make_record(1, 100) != make_record(2, 100)


def test_verify_says_absent(tmp_path: Path) -> None:
    verdict = verify_file(tmp_path / "nothing")
    assert (verdict.state, verdict.exit_code) == ("absent", harness.ABSENT)


def test_parse_assignment_and_object() -> None:
    assert harness.parse_assignment("a/b.txt=x=y") == ("a/b.txt", "x=y")
    assert harness.parse_assignment("empty=") == ("empty", "")
    for bad in ("no-equals", "=content"):
        with pytest.raises(HarnessError, match="PATH=CONTENT"):
            harness.parse_assignment(bad)
    assert harness.parse_object('{"k": 1}') == {"k": 1}
    with pytest.raises(HarnessError, match="must be an object, got list"):
        harness.parse_object("[1]")
    with pytest.raises(HarnessError, match="JSON"):
        harness.parse_object("{nope")


def test_cli_write_read_and_missing_file(tmp_path: Path) -> None:
    assert cli("write", "out/hello.txt", "hi there", workspace=tmp_path).returncode == 0
    got = cli("read", "out/hello.txt", workspace=tmp_path)
    assert (got.returncode, got.stdout) == (0, "hi there")
    missing = cli("read", "nope.txt", workspace=tmp_path)
    assert missing.returncode == 1
    assert "nope.txt: no such file in the workspace" in missing.stderr
    outside = cli("write", "../x", "y", workspace=tmp_path)
    assert outside.returncode == 1 and "outside the workspace" in outside.stderr


def test_cli_churn_then_verify(tmp_path: Path) -> None:
    churned = cli("churn", "c.dat", "--seconds", "0.5", "--size", "4096", workspace=tmp_path)
    assert churned.returncode == 0, churned.stderr
    assert '"generations": ' in churned.stdout
    ok = cli("verify", "c.dat", workspace=tmp_path)
    assert ok.returncode == 0 and '"state": "whole"' in ok.stdout
    (tmp_path / "c.dat").write_bytes((tmp_path / "c.dat").read_bytes()[:100])
    torn = cli("verify", "c.dat", workspace=tmp_path)
    assert torn.returncode == 1 and '"state": "torn"' in torn.stdout
    assert cli("verify", "gone.dat", workspace=tmp_path).returncode == 2


def test_cli_turn_without_session_env_names_the_variables(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAVEPOINT_")}
    got = subprocess.run(
        [sys.executable, "-m", "savepoint.harness", "turn", "--message", "hi"],
        env={**env, "SAVEPOINT_WORKSPACE": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert got.returncode == 1
    assert "SAVEPOINT_NAMESPACE and SAVEPOINT_SESSION must be set" in got.stderr


def test_serve_exits_zero_on_sigterm(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "savepoint.harness", "serve"],
        env={**os.environ, "SAVEPOINT_WORKSPACE": str(tmp_path)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert "savepoint harness serving" in proc.stdout.readline()
        time.sleep(0.2)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()


def test_harness_never_imports_kopf() -> None:
    code = "import sys, savepoint.harness, savepoint.eventlog; print('kopf' in sys.modules)"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    assert got.stdout.strip() == "False"


# --------------------------------------------------------- heartbeat sampling


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_memory_from_a_cgroup_v1_tree(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"memory/memory.usage_in_bytes": "1048576\n", "memory/memory.limit_in_bytes": "268435456\n"})
    assert harness.memory(root) == (1048576, 268435456)
    # No limit: v1 says LONG_MAX rounded down to a page.
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert harness.memory(root) == (1048576, None)


def test_memory_from_a_cgroup_v2_tree(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"memory.current": "4096\n", "memory.max": "max\n"})
    assert harness.memory(root) == (4096, None)
    (root / "memory.max").write_text("536870912\n")
    assert harness.memory(root) == (4096, 536870912)


def test_memory_of_no_cgroup_is_unknown(tmp_path: Path) -> None:
    assert harness.memory(tmp_path) == (None, None)


def test_memory_of_this_machines_own_cgroup() -> None:
    used, limit = harness.memory()
    assert used is not None and used > 0, "this process's memory cgroup was not found under /sys/fs/cgroup"
    assert limit is None or limit > 0


def test_disk_usage_counts_allocated_blocks_and_follows_no_link(tmp_path: Path) -> None:
    empty = harness.disk_usage(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "big").write_bytes(os.urandom(1024 * 1024))
    (tmp_path / "link").symlink_to("/usr")  # not followed: /usr is not the workspace
    grown = harness.disk_usage(tmp_path)
    assert 1024 * 1024 <= grown - empty < 2 * 1024 * 1024
    (tmp_path / "a" / "big").unlink()
    assert harness.disk_usage(tmp_path) - empty < 64 * 1024
    assert harness.disk_usage(tmp_path / "absent") == 0


def test_a_sample_has_the_fields_status_resources_reflects(tmp_path: Path) -> None:
    from savepoint.usage import parse_sample

    cgroup = _tree(tmp_path / "cg", {"memory.current": "2048", "memory.max": "8192"})
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "f").write_bytes(b"x" * 10000)
    got = harness.sample(tmp_path / "ws", cgroup)
    assert set(got) == {"load1", "memBytes", "memLimitBytes", "diskBytes", "sampledAt"}
    assert (got["memBytes"], got["memLimitBytes"]) == (2048, 8192) and got["diskBytes"] >= 10000
    assert got["load1"] >= 0
    # What the operator keeps of it is all of it.
    assert parse_sample({"sample": json.dumps(got)}) == got


def test_heartbeat_interval_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SAVEPOINT_HEARTBEAT_SECONDS", raising=False)
    assert harness.heartbeat_seconds() == 10
    monkeypatch.setenv("SAVEPOINT_HEARTBEAT_SECONDS", "0")
    assert harness.heartbeat_seconds() == 0
    for bad in ("soon", "-1"):
        monkeypatch.setenv("SAVEPOINT_HEARTBEAT_SECONDS", bad)
        with pytest.raises(HarnessError, match="SAVEPOINT_HEARTBEAT_SECONDS"):
            harness.heartbeat_seconds()


def test_token_usage_of_an_agent_message() -> None:
    assert harness.token_usage("plan the work", "ok", None, None) == {
        "inputTokens": 3,
        "outputTokens": 1,
        "llmCalls": 1,
    }
    assert harness.token_usage("a", "b", 1200, 340) == {"inputTokens": 1200, "outputTokens": 340, "llmCalls": 1}


def test_serve_keeps_serving_when_its_heartbeat_cannot_be_written(tmp_path: Path) -> None:
    # No session env: every beat fails; serve says so once on stderr and still stops on SIGTERM.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAVEPOINT_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "savepoint.harness", "serve"],
        env={**env, "SAVEPOINT_WORKSPACE": str(tmp_path), "SAVEPOINT_HEARTBEAT_SECONDS": "0.2"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(30, proc.kill)  # a line that never comes fails, not hangs
    watchdog.start()
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert "heartbeat every 0.2s" in proc.stdout.readline()
        said = proc.stderr.readline()
        assert "heartbeat not written" in said and "SAVEPOINT_NAMESPACE" in said
        time.sleep(1.0)  # five more beats, all failing
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert "heartbeat not written" not in proc.stderr.read()  # said once
    finally:
        watchdog.cancel()
        proc.kill()


def test_flush_moves_buffered_writes_into_the_workspace_in_order(tmp_path: Path) -> None:
    root, buffer = tmp_path / "ws", tmp_path / "buffer"
    root.mkdir()
    harness.buffer_write(buffer, "notes/plan.md", b"v1")
    harness.buffer_write(buffer, "notes/plan.md", b"v2")
    harness.buffer_write(buffer, "todo.txt", b"ship")
    assert not (root / "notes" / "plan.md").exists()  # buffered: not in the workspace yet
    env = {**os.environ, "SAVEPOINT_WORKSPACE": str(root), "SAVEPOINT_HARNESS_BUFFER": str(buffer)}
    done = subprocess.run(
        [sys.executable, "-m", "savepoint.harness", "flush"], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert '"flushed": ["notes/plan.md", "notes/plan.md", "todo.txt"]' in done.stdout
    assert (root / "notes" / "plan.md").read_bytes() == b"v2"  # the last write wins
    assert (root / "todo.txt").read_bytes() == b"ship"
    assert list(buffer.iterdir()) == []
    assert harness.flush(buffer, root) == []  # nothing left: a second flush is a no-op


def test_flush_refuses_a_buffered_path_outside_the_workspace(tmp_path: Path) -> None:
    harness.buffer_write(tmp_path / "buffer", "../escape", b"x")
    with pytest.raises(HarnessError):
        harness.flush(tmp_path / "buffer", tmp_path / "ws")
