"""The in-memory queues that spare the API server: the expiry clock and the child-event filter."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

from savepoint.config import Settings
from savepoint.controllers.expiry import ExpiryQueue
from savepoint.controllers.session import child_changed, made_child, relisted
from savepoint.polling import PollQueue, WorkQueue
from savepoint.session import SESSION_LABEL, child_digest

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def runtime_memo(**queues: object) -> SimpleNamespace:
    """kopf's memo as `python -m savepoint` gives it to the handlers: the Runtime, here
    with no admission threads, and with these queues in place of its own."""
    from savepoint.runtime import Runtime

    runtime = Runtime(Settings(), admission_workers=0)
    for name, queue in queues.items():
        setattr(runtime, name, queue)
    return SimpleNamespace(runtime=runtime)


GRACE = timedelta(days=7)


def checkpoint(name: str, phase: str | None, expires: datetime | None, deleting: bool = False) -> dict:
    meta: dict = {"namespace": "ns", "name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-30T11:00:00Z"
    status = {"phase": phase} if phase else {}
    if expires:
        status["expiresAt"] = expires.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"metadata": meta, "status": status}


def test_expiry_queue_takes_only_what_is_due_and_forgets_it():
    queue = ExpiryQueue()
    queue.observe("ADDED", checkpoint("overdue", "Ready", NOW - timedelta(seconds=1)))
    queue.observe("ADDED", checkpoint("pending-overdue", "Pending", NOW))
    queue.observe("ADDED", checkpoint("later", "Ready", NOW + timedelta(hours=1)))
    queue.observe("ADDED", checkpoint("rejected", "Rejected", NOW - timedelta(days=1)))
    queue.observe("ADDED", checkpoint("going", "Ready", NOW - timedelta(days=1), deleting=True))
    queue.observe("ADDED", checkpoint("old-expired", "Expired", NOW - GRACE - timedelta(seconds=1)))
    queue.observe("ADDED", checkpoint("new-expired", "Expired", NOW - timedelta(days=1)))
    queue.observe("ADDED", checkpoint("old-failed", "Failed", NOW - GRACE))
    queue.observe("ADDED", checkpoint("new-failed", "Failed", NOW - timedelta(days=1)))
    assert len(queue) == 7  # Rejected and deleting checkpoints have no clock

    expire, delete = queue.take_due(NOW, GRACE)
    assert expire == [("ns", "overdue"), ("ns", "pending-overdue")]
    assert sorted(delete) == [("ns", "old-expired"), ("ns", "old-failed")]
    assert queue.take_due(NOW, GRACE) == ([], [])  # taken: not handed out twice
    assert len(queue) == 3


def test_expiry_queue_follows_the_watch():
    queue = ExpiryQueue()
    queue.observe("ADDED", checkpoint("c", "Ready", NOW + timedelta(hours=1)))
    # A rollback to it moved expiresAt: the newer clock wins.
    queue.observe("MODIFIED", checkpoint("c", "Ready", NOW - timedelta(seconds=5)))
    assert queue.take_due(NOW, GRACE)[0] == [("ns", "c")]
    queue.observe("MODIFIED", checkpoint("c", "Expired", NOW - timedelta(seconds=5)))
    assert queue.take_due(NOW + GRACE, GRACE)[1] == [("ns", "c")]
    queue.observe("MODIFIED", checkpoint("d", "Ready", NOW))
    queue.observe("DELETED", checkpoint("d", "Ready", NOW))
    assert queue.take_due(NOW, GRACE) == ([], [])


def test_expiry_queue_keeps_the_newest_copy_of_each_clocked_checkpoint():
    queue = ExpiryQueue()
    newer = checkpoint("c", "Ready", NOW + timedelta(hours=1))
    newer["metadata"]["resourceVersion"] = "12"
    newer["status"]["volumeSnapshotName"] = "sp-c"
    queue.observe("MODIFIED", newer)
    older = checkpoint("c", "Ready", NOW)
    older["metadata"]["resourceVersion"] = "11"
    queue.observe("MODIFIED", older)  # an older answer arriving late changes nothing
    assert queue.latest(("ns", "c")) == {
        "metadata": {"namespace": "ns", "name": "c", "resourceVersion": "12"},
        "status": {"phase": "Ready", "expiresAt": "2026-11-30T13:00:00Z", "volumeSnapshotName": "sp-c"},
    }
    assert queue.take_due(NOW, GRACE) == ([], [])
    queue.observe("DELETED", newer)
    assert queue.latest(("ns", "c")) is None
    queue.observe("ADDED", checkpoint("r", "Rejected", NOW))
    assert queue.latest(("ns", "r")) is None  # no clock, no copy


def test_the_expiry_loop_wakes_when_the_soonest_checkpoint_falls_due():
    """A checkpoint expires at its expiresAt, not up to an interval later; an ended one is
    due at expiresAt + grace; one due and still queued (a failed try) waits the interval."""
    from savepoint.controllers.expiry import next_wait

    settings = Settings(expiry_interval_seconds=5.0, expired_grace=GRACE)
    queue = ExpiryQueue()
    assert next_wait(queue, settings, NOW) == 5.0
    queue.observe("ADDED", checkpoint("later", "Ready", NOW + timedelta(seconds=60)))
    assert next_wait(queue, settings, NOW) == 5.0
    queue.observe("ADDED", checkpoint("soon", "Ready", NOW + timedelta(seconds=2)))
    queue.observe("ADDED", checkpoint("ended", "Expired", NOW - GRACE + timedelta(seconds=1)))
    assert 1.0 < next_wait(queue, settings, NOW) < 1.1
    queue.observe("ADDED", checkpoint("failed-before", "Ready", NOW - timedelta(seconds=1)))
    assert next_wait(queue, settings, NOW) == 5.0


def test_a_failed_expiry_goes_back_unless_the_watch_was_faster():
    queue = ExpiryQueue()
    queue.observe("ADDED", checkpoint("c", "Ready", NOW))
    [key], _ = queue.take_due(NOW, GRACE)
    queue.put_back(key, (NOW, "Ready"))
    assert queue.take_due(NOW, GRACE)[0] == [key]
    queue.observe("MODIFIED", checkpoint("c", "Ready", NOW + timedelta(hours=1)))  # a rollback moved it
    queue.put_back(key, (NOW, "Ready"))
    assert queue.take_due(NOW, GRACE) == ([], [])


def test_a_storm_is_expired_on_as_many_threads_as_configured(monkeypatch):
    """SAVEPOINT_EXPIRY_WORKERS sets how many expiries run at once: each waits at a barrier
    for that many others, which only that many threads can reach together."""
    import threading

    from savepoint.config import Settings
    from savepoint.controllers.expiry import _in_pool

    monkeypatch.setenv("SAVEPOINT_EXPIRY_WORKERS", "6")
    workers = Settings().expiry_workers
    together = threading.Barrier(workers, timeout=5)

    def expire_one(_key) -> bool:
        together.wait()
        return True

    assert workers == 6
    assert sum(_in_pool(expire_one, list(range(2 * workers)), workers)) == 2 * workers


def test_due_action_reads_one_body():
    queue = ExpiryQueue()
    assert queue.due_action(checkpoint("a", "Ready", NOW), NOW, GRACE) == "expire"
    assert queue.due_action(checkpoint("a", "Ready", NOW + timedelta(seconds=1)), NOW, GRACE) is None
    assert queue.due_action(checkpoint("a", "Expired", NOW - GRACE), NOW, GRACE) == "delete"
    # A Failed checkpoint is deleted when an Expired one would be; it is never "expired".
    assert queue.due_action(checkpoint("a", "Failed", NOW - GRACE), NOW, GRACE) == "delete"
    assert queue.due_action(checkpoint("a", "Failed", NOW), NOW, GRACE) is None
    assert queue.due_action(checkpoint("a", None, None), NOW, GRACE) is None


def claim(uid: str = "u1", phase: str = "Bound", finalizers: list[str] | None = None) -> dict:
    return {
        "metadata": {"namespace": "ns", "name": "s1-workspace", "uid": uid, "finalizers": finalizers or []},
        "spec": {"volumeName": "pv-1"},
        "status": {"phase": phase},
    }


def test_child_digest_ignores_finalizers_and_annotations():
    plain = claim()
    protected = claim(finalizers=["snapshot.storage.kubernetes.io/pvc-as-source-protection"])
    protected["metadata"]["annotations"] = {"x": "y"}
    assert child_digest(plain) == child_digest(protected)
    assert child_digest(plain) != child_digest(claim(phase="Lost"))
    assert child_digest(plain) != child_digest(claim(uid="u2"))


def test_child_changed_skips_repeats_but_never_a_deletion():
    body = claim(uid="unit-test-uid")
    body["metadata"]["name"] = "unit-test-claim"
    assert not child_changed("persistentvolumeclaims", None, body)  # the start-up listing: resume covers it
    assert not child_changed("persistentvolumeclaims", None, body)  # a re-list of an unchanged claim
    body["metadata"]["finalizers"] = ["snapshot.storage.kubernetes.io/pvc-as-source-protection"]
    assert not child_changed("persistentvolumeclaims", "MODIFIED", body)
    body["status"]["phase"] = "Lost"
    assert child_changed("persistentvolumeclaims", "MODIFIED", body)
    assert child_changed("persistentvolumeclaims", "DELETED", body)
    assert child_changed("persistentvolumeclaims", "ADDED", body)  # forgotten on deletion
    body["spec"]["volumeName"] = "pv-2"
    assert child_changed("persistentvolumeclaims", None, body)  # changed while the watch was down


def test_a_child_the_pass_made_starts_no_pass_when_its_added_event_comes():
    pod = claim(uid="made-uid", phase="Pending")
    pod["metadata"]["name"] = "made-by-a-pass"
    made_child("pods", pod)
    assert not child_changed("pods", "ADDED", pod)
    pod["status"]["phase"] = "Running"
    assert child_changed("pods", "MODIFIED", pod)
    made_child("pods", {"metadata": {"namespace": "ns", "name": "no-uid"}})  # a template, not what was made
    assert child_changed("pods", "ADDED", {"metadata": {"namespace": "ns", "name": "no-uid", "uid": "u"}})


def test_a_filter_asks_without_recording():
    body = claim(uid="filter-uid")
    body["metadata"]["name"] = "filter-claim"
    assert child_changed("persistentvolumeclaims", "ADDED", body, record=False)
    assert child_changed("persistentvolumeclaims", "ADDED", body, record=False)  # still unknown
    assert child_changed("persistentvolumeclaims", "ADDED", body)  # the handler records
    assert not child_changed("persistentvolumeclaims", "MODIFIED", body, record=False)
    assert child_changed("persistentvolumeclaims", "DELETED", body, record=False)
    assert not child_changed("persistentvolumeclaims", "MODIFIED", body)  # a filter's DELETED forgot nothing


def test_every_change_to_a_log_chunk_counts():
    chunk = {"metadata": {"namespace": "ns", "name": "unit-test-log-000001", "uid": "c1", "resourceVersion": "1"}}
    assert child_changed("configmaps", "ADDED", chunk)
    assert not child_changed("configmaps", None, chunk)
    chunk["metadata"]["resourceVersion"] = "2"
    assert child_changed("configmaps", "MODIFIED", chunk)


def test_poll_queue_hands_out_each_key_once_per_interval():
    now = [100.0]
    queue = PollQueue(30, clock=lambda: now[0])
    queue.file(("ns", "a"))
    now[0] = 110.0
    queue.file(("ns", "b"))
    queue.file(("ns", "a"))  # filing again keeps its time
    assert queue.take_due() == []
    now[0] = 130.0
    assert queue.take_due() == [("ns", "a")]
    assert queue.take_due() == []  # due again an interval later, not at once
    now[0] = 200.0
    assert queue.take_due(limit=1) == [("ns", "b")]  # the most overdue first (b at 140, a at 160)
    assert queue.take_due() == [("ns", "a")]
    queue.drop(("ns", "a"))
    now[0] = 1000.0
    assert queue.take_due() == [("ns", "b")]
    assert len(queue) == 1


def test_poll_queue_spread_parts_keys_filed_together():
    now = [0.0]
    queue = PollQueue(600, clock=lambda: now[0], spread=0.2)
    keys = [("ns", f"s{i:03d}") for i in range(200)]
    for key in keys:
        queue.file(key)
    now[0] = 479.0
    assert queue.take_due() == []  # none more than a fifth early
    now[0] = 540.0
    first = queue.take_due()
    assert 60 <= len(first) <= 140  # about half: each key has its own share of the fifth
    now[0] = 600.0
    assert sorted(first + queue.take_due()) == keys  # none late
    # Taken together, due again apart: the share is the key's own, each time.
    now[0] = 1200.0 + 1e-6
    again = queue.take_due()
    assert set(again) == set(keys) and len(queue) == 200
    now[0] = 1200.0 + 540.0
    assert sorted(queue.take_due()) == sorted(first)


def test_a_deleted_object_leaves_no_lock_or_pass_record_behind():
    import asyncio

    from savepoint import controllers
    from savepoint.handlers.fork import fork_event
    from savepoint.handlers.session import session_resync_clock

    def passes(kind: str, name: str) -> None:
        controllers.one_pass(kind, "ns", name, lambda: None)
        assert (kind, "ns", name) in controllers._locks and (kind, "ns", name) in controllers._done

    passes("checkpoint", "c")
    passes("session", "s")
    passes("fork", "f")
    body = checkpoint("c", "Ready", NOW)
    memo = runtime_memo()
    memo.runtime.observe_checkpoint("MODIFIED", body)
    assert ("checkpoint", "ns", "c") in controllers._done  # only a deletion forgets
    memo.runtime.observe_checkpoint("DELETED", body)
    asyncio.run(session_resync_clock(type="DELETED", body={"metadata": {"namespace": "ns", "name": "s"}}, memo=memo))
    fork = {"metadata": {"namespace": "ns", "name": "f"}}
    asyncio.run(fork_event(type="DELETED", body=fork, memo=memo))
    for kind, name in (("checkpoint", "c"), ("session", "s"), ("fork", "f")):
        assert (kind, "ns", name) not in controllers._locks
        assert (kind, "ns", name) not in controllers._done


def test_a_fork_is_passed_when_new_or_listed_and_polled_until_it_finishes():
    from savepoint.controllers import cache

    now = [0.0]
    passes = WorkQueue("unit", 0, lambda key, payload: None)
    polls = PollQueue(10, clock=lambda: now[0])
    memo = runtime_memo(fork_passes=passes, fork_polls=polls)

    def fork(rv: str, phase: str | None = None) -> dict:
        return {"metadata": {"namespace": "ns", "name": "f", "resourceVersion": rv}, "status": {"phase": phase}}

    try:
        memo.runtime.observe_fork("ADDED", fork("1"))
        assert passes.take(0) == (("ns", "f"), None)
        memo.runtime.observe_fork("MODIFIED", fork("2", "Restoring"))  # our own status: no pass of its own
        assert passes.take(0) is None
        now[0] = 10.0
        assert polls.take_due() == [("ns", "f")]  # the safety net's pass, while unfinished
        memo.runtime.observe_fork(None, fork("2", "Restoring"))  # listed again (a restart, a re-list)
        assert passes.take(0) == (("ns", "f"), None)
        memo.runtime.observe_fork("MODIFIED", fork("3", "Succeeded"))
        now[0] = 100.0
        assert polls.take_due() == [] and passes.take(0) is None
        memo.runtime.observe_fork(None, fork("3", "Succeeded"))  # a finished one listed: nothing to do
        assert passes.take(0) is None and len(polls) == 0
        memo.runtime.observe_fork("ADDED", fork("4"))
        memo.runtime.observe_fork("DELETED", fork("5"))
        assert len(polls) == 0 and not cache.forks.has("ns", "f")
    finally:
        cache.clear()


def test_forget_keeps_a_lock_a_pass_still_holds():
    from savepoint import controllers

    lock = controllers.object_lock("session", "ns", "busy")
    with lock:
        controllers.forget("session", "ns", "busy")
        assert controllers.object_lock("session", "ns", "busy") is lock
    controllers.forget("session", "ns", "busy")
    assert controllers.object_lock("session", "ns", "busy") is not lock


def test_a_pass_from_an_older_listing_does_not_swallow_a_pass_asked_after_it(monkeypatch):
    """one_pass skips a pass when one that started after it was asked has succeeded. A
    resume pass that works from its namespace's listing saw the cluster as of the listing,
    not as of its start: a pass asked in between (a Pod deleted after the listing) runs."""
    from savepoint import controllers

    clock = [10.0]
    monkeypatch.setattr(controllers.time, "monotonic", lambda: clock[0])
    ran: list[str] = []
    listed_at = 10.0  # the namespace listing
    clock[0] = 20.0  # the resume pass starts later, and reports what it worked from
    controllers.one_pass("session", "ns", "listed", lambda: ran.append("resume") or listed_at)
    clock[0] = 15.0  # a child event between the listing and that pass, served after it
    controllers.one_pass("session", "ns", "listed", lambda: ran.append("event"))
    assert ran == ["resume", "event"]

    clock[0] = 30.0  # a pass that read everything itself still coalesces what came before it
    controllers.one_pass("session", "ns", "fresh", lambda: ran.append("fresh"))
    clock[0] = 25.0
    controllers.one_pass("session", "ns", "fresh", lambda: ran.append("skipped"))
    assert ran[-1] == "fresh"
    controllers.forget("session", "ns", "listed")
    controllers.forget("session", "ns", "fresh")


def test_work_queue_works_in_the_order_filed_and_a_refiled_key_keeps_its_place():
    queue = WorkQueue("unit", 0, lambda key, payload: None)
    queue.file(("ns", "a"), 1)
    queue.file(("ns", "b"), 2)
    queue.file(("ns", "a"), 3)  # still waiting: the newer payload, the older place
    assert len(queue) == 2
    assert queue.take(0) == (("ns", "a"), 3)
    assert queue.take(0) == (("ns", "b"), 2)
    assert queue.take(0.01) is None


def test_work_queue_threads_outlive_a_failing_pass():
    import threading

    done: list[tuple[str, str]] = []
    finished = threading.Event()

    def work(key: tuple[str, str], payload: object) -> None:
        if payload == "bad":
            raise RuntimeError("this pass fails")
        done.append(key)
        finished.set()

    queue = WorkQueue("unit", 1, work)
    queue.start()
    queue.start()  # once only
    queue.file(("ns", "a"), "bad")
    queue.file(("ns", "b"), "good")
    assert finished.wait(5)
    assert done == [("ns", "b")]
    assert [t.name for t in threading.enumerate()].count("unit-0") == 1


def test_a_new_checkpoint_waits_in_our_queue_trimmed(monkeypatch):
    """The watch's thread returns at once, filing a key and the body without
    managedFields; the pass runs on the queue's threads."""
    queue = WorkQueue("unit", 0, lambda key, payload: None)
    memo = runtime_memo(admissions=queue)
    body = checkpoint("c", None, NOW)
    body["metadata"]["managedFields"] = [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}]
    memo.runtime.observe_checkpoint("ADDED", body)
    memo.runtime.observe_checkpoint(None, checkpoint("done", "Ready", NOW))
    key, seen = queue.take(0)
    assert key == ("ns", "c")
    assert "managedFields" not in seen.body["metadata"] and seen.body["metadata"]["name"] == "c"
    assert seen.at <= time.monotonic()  # when it arrived: a namespace read after that serves it
    assert not seen.listed  # its create event: no earlier pass can have asked for its snapshot
    assert "managedFields" in body["metadata"]  # the watch's own body is left as it was
    assert queue.take(0) is None  # a settled one is not queued


def test_only_a_new_or_listed_unsettled_checkpoint_is_filed_for_admission():
    """Level-based, without kopf's create and resume handlers: an ADDED event or a listing
    (start-up, take-over) of an unsettled checkpoint files it; the operator's own status
    writes (MODIFIED) do not file it again; a deletion with kopf's old finalizer files its
    release."""
    from savepoint.runtime import RELEASE

    queue = WorkQueue("unit", 0, lambda key, payload: None)
    memo = runtime_memo(admissions=queue)
    pending = checkpoint("pending", "Pending", NOW + timedelta(days=1))
    memo.runtime.observe_checkpoint("MODIFIED", pending)
    assert queue.take(0) is None
    memo.runtime.observe_checkpoint(None, pending)
    key, seen = queue.take(0)
    assert key == ("ns", "pending") and seen.listed
    for settled in ("Ready", "Failed", "Rejected", "Expired"):
        memo.runtime.observe_checkpoint(None, checkpoint("s", settled, NOW))
    assert queue.take(0) is None
    old = checkpoint("old", "Ready", NOW, deleting=True)
    old["metadata"]["finalizers"] = ["kopf.zalando.org/KopfFinalizerMarker"]
    memo.runtime.observe_checkpoint("MODIFIED", old)
    assert queue.take(0) == (("ns", "old"), RELEASE)
    old["metadata"]["finalizers"] = []
    memo.runtime.observe_checkpoint("MODIFIED", old)
    assert queue.take(0) is None


def test_a_re_list_is_told_from_the_start_up_listing():
    body = claim(uid="relist-uid", phase="Pending")
    body["metadata"]["name"] = "relist-claim"
    assert not relisted("persistentvolumeclaims", None, body)  # the start-up listing
    assert not child_changed("persistentvolumeclaims", None, body, record=False)  # the resume pass covers it
    assert relisted("persistentvolumeclaims", None, body)  # listed again: a watch could not resume
    assert not relisted("persistentvolumeclaims", "MODIFIED", body)
    body["status"]["phase"] = "Bound"  # bound while no watch was open: only the re-list shows it
    assert child_changed("persistentvolumeclaims", None, body, record=False)
    made = claim(uid="made-uid-2")
    made["metadata"]["name"] = "made-then-listed"
    made_child("persistentvolumeclaims", made)  # made by a pass before kopf's first listing got to it
    assert not relisted("persistentvolumeclaims", None, made)


def test_a_re_list_brings_every_session_resync_forward_once(monkeypatch):
    now = [1000.0]
    queue = PollQueue(600, clock=lambda: now[0])
    for name in ("a", "b"):
        queue.file(("ns", name))
    passes = WorkQueue("unit", 0, lambda key, payload: None)
    memo = runtime_memo(resyncs=queue, session_passes=passes)
    pod = claim(uid="relist-pod-uid", phase="Running")
    pod["metadata"].update(name="relist-pod", labels={SESSION_LABEL: "a"})
    memo.runtime.observe_child("pods", None, pod)  # start-up listing: the resume passes cover it
    assert queue.take_due() == [] and passes.take(0) is None
    memo.runtime.observe_child("pods", None, pod)  # the re-list
    assert sorted(queue.take_due()) == [("ns", "a"), ("ns", "b")]
    assert passes.take(0) is None  # unchanged: the resyncs cover what went meanwhile
    memo.runtime.observe_child("pods", None, pod)  # the next child of the same re-list
    assert queue.take_due() == []
    pod["status"]["phase"] = "Failed"
    memo.runtime.observe_child("pods", "MODIFIED", pod)
    assert passes.take(0)[0] == ("ns", "a")


def test_poll_queue_hurries_all_keys_or_some():
    now = [0.0]
    queue = PollQueue(600, clock=lambda: now[0])
    queue.file(("ns", "a"))
    queue.file(("ns", "b"))
    queue.hurry(30, keys=[("ns", "b"), ("ns", "gone")])
    now[0] = 30.0
    assert queue.take_due() == [("ns", "b")]
    queue.hurry()
    assert queue.take_due() == [("ns", "a"), ("ns", "b")]


def test_a_pending_poll_skips_a_checkpoint_still_waiting_for_admission(monkeypatch):
    from savepoint import runtime

    now = [0.0]
    polls = PollQueue(5, clock=lambda: now[0])
    polls.file(("ns", "waiting"))
    polls.file(("ns", "admitted"))
    queue = WorkQueue("unit", 0, lambda key, payload: None)
    queue.file(("ns", "waiting"), {})
    polled: list[tuple[str, str]] = []
    memo = runtime_memo(pending_polls=polls, admissions=queue)
    monkeypatch.setattr(runtime.checkpoint, "poll_pending", lambda ns, name, settings: polled.append((ns, name)))
    now[0] = 10.0
    memo.runtime.poll_pending_checkpoints()
    assert polled == [("ns", "admitted")]
    assert ("ns", "waiting") in queue


def test_the_runtime_knows_which_checkpoints_wait_for_which_session():
    """Fed by the Checkpoint watch: a checkpoint waits from its creation until it is cut
    (createdAt) or settled; a Session's event then admits exactly those."""
    memo = runtime_memo()
    runtime = memo.runtime
    new = {"metadata": {"namespace": "ns", "name": "c1"}, "spec": {"sessionName": "s"}}
    runtime.observe_checkpoint("ADDED", new)
    runtime.observe_checkpoint("ADDED", {**new, "metadata": {"namespace": "ns", "name": "c2"}})
    assert runtime.waiting_for("ns", "s") == ["c1", "c2"]
    cut = {**new, "status": {"phase": "Pending", "createdAt": "2026-11-30T12:00:00Z"}}
    runtime.observe_checkpoint("MODIFIED", cut)
    assert runtime.waiting_for("ns", "s") == ["c2"]
    runtime.observe_checkpoint("DELETED", {**new, "metadata": {"namespace": "ns", "name": "c2"}})
    assert runtime.waiting_for("ns", "s") == []
    assert runtime.waiting_for("other", "s") == []


def test_a_checkpoint_admitted_without_a_pending_write_no_longer_waits_and_is_polled():
    """Its owner patch carries the cut (no phase yet): it no longer waits for its Session,
    and its poll (which shows Pending for a snapshot still not ready) stays filed."""
    from savepoint.constants import CUT_ANNOTATION
    from savepoint.cut import cut_annotation

    now = [0.0]
    polls = PollQueue(30, clock=lambda: now[0])
    memo = runtime_memo(pending_polls=polls)
    runtime = memo.runtime
    new = {"metadata": {"namespace": "ns", "name": "c1"}, "spec": {"sessionName": "s"}}
    runtime.observe_checkpoint("ADDED", new)
    assert runtime.waiting_for("ns", "s") == ["c1"]
    cut = cut_annotation({"throughSequence": 3, "createdAt": "2026-11-30T12:00:00Z"})
    admitted = {**new, "metadata": {**new["metadata"], "annotations": {CUT_ANNOTATION: cut}}}
    runtime.observe_checkpoint("MODIFIED", admitted)
    assert runtime.waiting_for("ns", "s") == []
    now[0] = 30.0
    assert polls.take_due() == [("ns", "c1")]


def test_the_cache_keeps_the_newest_body_without_managed_fields():
    from savepoint.controllers.cache import Store, newest

    store = Store(keep=lambda body: (body.get("status") or {}).get("phase") != "Ready")

    def body(rv: str, phase: str = "Pending") -> dict:
        meta = {"namespace": "ns", "name": "c", "resourceVersion": rv, "managedFields": [{"manager": "x"}]}
        return {"metadata": meta, "status": {"phase": phase}}

    store.observe("ADDED", body("10"))
    store.put(body("8"))  # an older copy (a late watch event) does not replace a newer one
    got = store.get("ns", "c")
    assert got["metadata"]["resourceVersion"] == "10" and "managedFields" not in got["metadata"]
    got["status"]["phase"] = "changed"  # a copy: the store's own is untouched
    assert store.get("ns", "c")["status"]["phase"] == "Pending"
    store.put(body("12", "Ready"))  # settled: no longer kept
    assert store.get("ns", "c") is None and len(store) == 0
    store.observe("ADDED", body("13"))
    store.observe("DELETED", body("14"))
    assert store.get("ns", "c") is None
    assert newest(body("3"), None, body("21"))["metadata"]["resourceVersion"] == "21"
    assert newest(None, None) is None


def test_the_cache_is_bounded_dropping_the_least_recently_written():
    from savepoint.controllers.cache import Store

    store = Store(limit=2)
    for name in ("a", "b", "c"):
        store.put({"metadata": {"namespace": "ns", "name": name, "resourceVersion": "1"}})
    assert store.get("ns", "a") is None and len(store) == 2
    store.put({"metadata": {"namespace": "ns", "name": "b", "resourceVersion": "2"}})  # b is now the newest
    store.put({"metadata": {"namespace": "ns", "name": "d", "resourceVersion": "1"}})
    assert store.get("ns", "c") is None and store.get("ns", "b") is not None


def test_spaced_passes_the_first_at_once_and_the_rest_of_its_gap_as_one():
    from savepoint.polling import Spaced

    now = [100.0]
    spaced = Spaced(2.0, clock=lambda: now[0])
    key = ("ns", "s")
    assert spaced.ask(key)  # the first: at once
    now[0] = 100.5
    assert not spaced.ask(key)
    now[0] = 101.0
    assert not spaced.ask(key)  # the same deferred pass
    assert spaced.due() == []
    now[0] = 102.0
    assert spaced.due() == [key]  # one pass for both, at the gap's end
    assert spaced.due() == []
    now[0] = 103.0
    assert not spaced.ask(key)  # its gap started again at 102
    now[0] = 104.5
    assert spaced.due() == [key]
    now[0] = 107.0
    assert spaced.ask(key) and spaced.ask(("ns", "other"))  # quiet for a gap: at once again
    spaced.forget(key)
    assert spaced.ask(key)


def test_the_newest_event_of_a_chunk_is_read_from_its_highest_key():
    from savepoint.eventlog import newest_type

    chunk = {"data": {"000000000002": '{"type": "checkpoint.created"}', "000000000001": '{"type": "run.started"}'}}
    assert newest_type(chunk) == "checkpoint.created"
    assert newest_type({"data": {}}) is None
    assert newest_type({"data": {"000000000001": "not json"}}) is None
    assert newest_type({"data": {"000000000001": "[1]"}}) is None


def test_only_the_passes_for_our_own_checkpoint_created_appends_are_spaced():
    """A burst of checkpoints of one Session: the first checkpoint.created starts a pass at
    once, the next within the gap wait for one pass at its end; any other append (the
    sandbox's) starts its pass at once."""
    passes = WorkQueue("unit", 0, lambda key, payload: None)
    memo = runtime_memo(session_passes=passes)

    def chunk(version: int, newest: str) -> dict:
        meta = {"namespace": "ns", "name": "s-log-000001", "uid": "u", "resourceVersion": str(version)}
        return {
            "metadata": {**meta, "labels": {SESSION_LABEL: "s"}},
            "data": {f"{version:012d}": f'{{"type": "{newest}"}}'},
        }

    memo.runtime.observe_child("configmaps", "MODIFIED", chunk(1, "checkpoint.created"))
    assert passes.take(0) == (("ns", "s"), None)
    memo.runtime.observe_child("configmaps", "MODIFIED", chunk(2, "checkpoint.created"))
    assert passes.take(0) is None and ("ns", "s") in memo.runtime.own_appends.later
    memo.runtime.observe_child("configmaps", "MODIFIED", chunk(3, "run.started"))
    assert passes.take(0) == (("ns", "s"), None)


def test_a_held_sessions_claim_events_move_its_rollback_and_ask_for_no_session_pass():
    """While a rollback holds a Session, the events of its claims (the restored one made and
    bound) file the rollback's pass only; once released, a claim event asks for the
    Session's pass again."""
    from savepoint.constants import RESTORING_ANNOTATION
    from savepoint.controllers import cache

    passes = WorkQueue("unit", 0, lambda key, payload: None)
    forks = WorkQueue("unit", 0, lambda key, payload: None)
    memo = runtime_memo(session_passes=passes, fork_passes=forks)
    rollback = {
        "metadata": {"namespace": "ns", "name": "f", "resourceVersion": "3"},
        "spec": {"mode": "Rollback"},
        "status": {"targetSession": "s"},
    }
    session = {"metadata": {"namespace": "ns", "name": "s", "resourceVersion": "5"}}
    restored = claim(uid="restored-uid", phase="Pending")
    restored["metadata"].update(name="s-ws-1", labels={SESSION_LABEL: "s"})
    try:
        cache.forks.put(rollback)
        cache.sessions.put({**session, "metadata": {**session["metadata"], "annotations": {RESTORING_ANNOTATION: "f"}}})
        memo.runtime.observe_child("persistentvolumeclaims", "ADDED", restored)
        restored["status"]["phase"] = "Bound"
        memo.runtime.observe_child("persistentvolumeclaims", "MODIFIED", restored)
        assert passes.take(0) is None
        assert forks.take(0) == (("ns", "f"), None) and forks.take(0) is None
        cache.sessions.put({**session, "metadata": {**session["metadata"], "resourceVersion": "6"}})  # released
        restored["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        memo.runtime.observe_child("persistentvolumeclaims", "MODIFIED", restored)
        assert passes.take(0) == (("ns", "s"), None)
    finally:
        cache.clear()


def test_a_held_sessions_log_appends_ask_for_no_pass_until_its_hand_back():
    """While a rollback holds a Session, its append of session.rollback starts no pass:
    that pass would only delay the hand-back's, which starts the Pod and reads the log."""
    from savepoint.constants import RESTORING_ANNOTATION
    from savepoint.controllers import cache

    passes = WorkQueue("unit", 0, lambda key, payload: None)
    memo = runtime_memo(session_passes=passes)
    chunk = {
        "metadata": {"namespace": "ns", "name": "s-log-000001", "resourceVersion": "7", "labels": {SESSION_LABEL: "s"}},
        "data": {"000000000003": '{"type": "session.rollback"}'},
    }
    session = {"metadata": {"namespace": "ns", "name": "s", "resourceVersion": "5"}}
    try:
        cache.sessions.put({**session, "metadata": {**session["metadata"], "annotations": {RESTORING_ANNOTATION: "f"}}})
        memo.runtime.observe_child("configmaps", "MODIFIED", chunk)
        assert passes.take(0) is None
        cache.sessions.put({**session, "metadata": {**session["metadata"], "resourceVersion": "6"}})  # released
        chunk = {**chunk, "metadata": {**chunk["metadata"], "resourceVersion": "8"}, "data": {"000000000004": "{}"}}
        memo.runtime.observe_child("configmaps", "MODIFIED", chunk)
        assert passes.take(0) == (("ns", "s"), None)
    finally:
        cache.clear()


def test_a_read_serves_what_arrived_before_it_started_and_a_later_read_is_kept():
    from savepoint.controllers.cache import Reads

    reads = Reads(limit=2)
    assert reads.since("ns", 1.0) == (False, None)  # never read
    reads.note("ns", 5.0, {"a": "1"})
    assert reads.since("ns", 4.0) == (True, {"a": "1"})  # arrived before the read started
    assert reads.since("ns", 6.0) == (False, None)  # arrived after: the read may not show it
    assert reads.since("ns", None) == (False, None)  # "read now"
    reads.note("ns", 3.0, {"a": "old"})  # an earlier read that answered later
    assert reads.since("ns", 4.0) == (True, {"a": "1"})
    reads.note("ns", 7.0, {"a": "2"})
    assert reads.since("ns", 6.0) == (True, {"a": "2"})
    reads.note("other", 1.0)
    reads.note("third", 1.0)  # beyond the limit: the oldest kept key goes
    assert reads.since("ns", 0.0) == (False, None) and reads.since("third", 0.0)[0]
