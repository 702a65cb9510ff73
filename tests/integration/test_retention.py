"""Log retention on the real control plane: the operator deletes old chunks on the Session
resync (SAVEPOINT_RESYNC_SECONDS=10 for the tests' operator), and what needed them says so."""

from __future__ import annotations

import re
import time
import urllib.request

from savepoint.eventlog import EventLog
from tests.conftest import wait_for
from tests.integration.test_checkpoint import get_checkpoint, get_snapshot, make_checkpoint, wait_checkpoint
from tests.integration.test_fork import make_fork, wait_fork
from tests.integration.test_session import make_session, wait_phase

WINDOW_SECONDS = 5


def _metric(operator, name: str) -> float:
    text = urllib.request.urlopen(f"{operator.metrics_url}/metrics", timeout=10).read().decode()
    match = re.search(rf"^{name} (\S+)$", text, flags=re.M)
    return float(match[1]) if match else 0.0


def test_retention_deletes_old_chunks_on_the_resync_and_forks_that_need_them_fail(operator, core, crds, namespace):
    core.patch_namespace(
        namespace, {"metadata": {"annotations": {"savepoint.dev/log-retention": f"{WINDOW_SECONDS}s"}}}
    )
    make_session(crds, namespace, "s1")
    wait_phase(crds, namespace, "s1", "Ready", timeout=90)
    log = EventLog(core, namespace, "s1", max_chunk_bytes=1024)
    written = [log.append("note", {"i": i, "pad": "p" * 300}) for i in range(12)]
    make_checkpoint(crds, namespace, "c1")
    c1 = wait_checkpoint(crds, namespace, "c1", "Ready")
    assert c1["status"]["throughSequence"] == written[-1].seq
    chunks = log.chunk_names()
    assert len(chunks) >= 4, chunks
    chunks_before = _metric(operator, "savepoint_eventlog_retention_chunks_deleted_total")
    bytes_before = _metric(operator, "savepoint_eventlog_retention_bytes_freed_total")

    # Once every old chunk's newest event is older than the window, the next resync deletes
    # the chunks; the newest one, being written, stays.
    started = time.monotonic()
    left = wait_for(
        lambda: (names := log.chunk_names()) == chunks[-1:] and names,
        timeout=WINDOW_SECONDS + 2 * 10 + 10,
        interval=1,
        what="the old chunks deleted by log retention",
    )
    assert left == chunks[-1:]
    print(f"old chunks gone {time.monotonic() - started:.1f}s after the checkpoint")
    first = int(core.read_namespaced_config_map(chunks[-1], namespace).metadata.annotations["savepoint.dev/first-seq"])
    assert first > 2
    assert _metric(operator, "savepoint_eventlog_retention_chunks_deleted_total") - chunks_before >= len(chunks) - 1
    assert _metric(operator, "savepoint_eventlog_retention_bytes_freed_total") - bytes_before > 300 * (first - 1)

    # A fork at an event in the deleted span: refused, naming the span and retention.
    make_fork(crds, namespace, "f-event", {"session": "s1", "atEvent": written[1].id}, target="s2")
    fork = wait_fork(crds, namespace, "f-event")["status"]
    assert (fork["phase"], fork["reason"]) == ("Failed", "SessionHistoryUnavailable"), fork
    # The span it needs (events 1..2), all of it deleted.
    assert f"events 1..{written[1].seq} " in fork["message"] and "retention" in fork["message"], fork["message"]

    # The checkpoint keeps its snapshot, and its status says the log prefix is gone.
    def marked():
        resume = (get_checkpoint(crds, namespace, "c1") or {}).get("status", {}).get("resume") or {}
        return resume if resume.get("logPrefixAvailable") is False else None

    resume = wait_for(marked, timeout=30, what="c1's resume to say its log prefix is gone")
    assert resume["kind"] == "snapshot" and "retention" in resume["message"], resume
    assert f"events 1..{first - 1}" in resume["message"], resume
    assert get_checkpoint(crds, namespace, "c1")["status"]["phase"] == "Ready"
    assert get_snapshot(crds, namespace, c1["status"]["volumeSnapshotName"]) is not None

    # A fork from it is refused too, saying so; nothing is made for it.
    make_fork(crds, namespace, "f-ckpt", {"checkpoint": "c1"}, target="s3")
    fork = wait_fork(crds, namespace, "f-ckpt")["status"]
    assert (fork["phase"], fork["reason"]) == ("Failed", "SessionHistoryUnavailable"), fork
    assert "log prefix of checkpoint c1" in fork["message"] and "retention" in fork["message"], fork["message"]
    sessions = crds.list_namespaced_custom_object("savepoint.dev", "v1alpha1", namespace, "sessions")["items"]
    assert [s["metadata"]["name"] for s in sessions] == ["s1"]

    # A rollback to it still restores the snapshot: the disk was never the log's to lose.
    make_fork(crds, namespace, "rb", {"checkpoint": "c1"}, mode="Rollback")
    rollback = wait_fork(crds, namespace, "rb", timeout=180)["status"]
    assert rollback["phase"] == "Succeeded", rollback
