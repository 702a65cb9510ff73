"""No VolumeSnapshot outlives its Checkpoint: each is owned by it, so a snapshot that a late
pass makes after the Checkpoint's finalizer has run is removed by the garbage collector."""

from __future__ import annotations

import threading

from kubernetes import watch

from savepoint.models import GROUP, VERSION
from tests.conftest import SNAP, wait_for
from tests.integration.test_checkpoint import get_checkpoint, get_snapshot, make_checkpoint
from tests.integration.test_session import make_session, wait_phase

PAUSE = "checkpoint.before_snapshot_created"


class SnapshotEvents:
    """Every ADDED and DELETED VolumeSnapshot of the namespace, however short-lived, seen by
    a watch in a thread until stop(), which closes its stream and waits for the thread."""

    def __init__(self, crds, namespace: str) -> None:
        self.seen: list[tuple[str, str]] = []
        self._watch = watch.Watch()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._record, args=(crds, namespace), daemon=True)
        self._thread.start()

    def _record(self, crds, namespace: str) -> None:
        stream = self._watch.stream(
            crds.list_namespaced_custom_object, *SNAP, namespace, "volumesnapshots", timeout_seconds=240
        )
        try:
            for event in stream:
                self.seen.append((event["type"], event["object"]["metadata"]["name"]))
        except Exception:
            if not self._stopped.is_set():  # a stream closed by stop() ends with an error; that is ours
                raise

    def stop(self) -> None:
        self._stopped.set()
        self._watch.stop()
        self._thread.join(timeout=10)
        assert not self._thread.is_alive(), "the snapshot watch did not stop"


def contents_of(crds, namespace: str, snapshot: str) -> list[str]:
    """The VolumeSnapshotContents bound to one VolumeSnapshot."""
    items = crds.list_cluster_custom_object(*SNAP, "volumesnapshotcontents")["items"]
    wanted = {"namespace": namespace, "name": snapshot}
    return [
        c["metadata"]["name"]
        for c in items
        if {k: (c["spec"].get("volumeSnapshotRef") or {}).get(k) for k in wanted} == wanted
    ]


def test_a_snapshot_made_after_its_checkpoint_was_released_is_collected(operator, crds, namespace):
    make_session(crds, namespace, "s1")
    wait_phase(crds, namespace, "s1", "Ready", timeout=90)
    events = SnapshotEvents(crds, namespace)
    operator.stop()
    # The pass that admits the checkpoint stops for 15 s just before it creates the snapshot.
    operator.start(SAVEPOINT_FAILPOINTS=f"{PAUSE}=sleep:15")
    try:
        make_checkpoint(crds, namespace, "late")

        def paused() -> bool:
            # This start's part of the log: the pass has admitted it and stopped at the failpoint.
            start = operator.log_path.read_text(errors="replace").rsplit("===== start ", 1)[-1]
            return f"failpoint {PAUSE}: pausing" in start

        wait_for(paused, timeout=30, what="checkpoint late admitted, its pass paused")
        assert get_snapshot(crds, namespace, "sp-late") is None
        # Deleted while that pass sleeps: the finalizer finds no snapshot and lets it go.
        crds.delete_namespaced_custom_object(GROUP, VERSION, namespace, "checkpoints", "late")
        wait_for(lambda: get_checkpoint(crds, namespace, "late") is None, timeout=12, what="checkpoint late gone")
        # Then the pass wakes and makes the snapshot of a checkpoint that no longer exists.
        wait_for(lambda: ("ADDED", "sp-late") in events.seen, timeout=30, what="the late snapshot made")
        # The garbage collector removes it, and the snapshot controller its content.
        wait_for(lambda: ("DELETED", "sp-late") in events.seen, timeout=90, what="the late snapshot collected")
        wait_for(lambda: not contents_of(crds, namespace, "sp-late"), timeout=90, what="its content deleted")
    finally:
        events.stop()
        operator.stop()
        operator.start()
