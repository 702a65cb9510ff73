"""The operator's machinery that kopf does not drive: our queues and the threads that work them.

`python -m savepoint` loads the Settings once, builds one Runtime and hands it to kopf as
the operator's memo; each handler reaches it as `memo.runtime` and calls one method here
or one controller. Nothing here decides what an object should be (the controllers and the
pure modules do); this module only says when a pass runs and on which thread:

- The watches of the Checkpoints and the Sessions' Pods, claims and log chunks
  (savepoint.watches): one thread each reads the stream, keeps the bodies the passes
  read (controllers/cache.py) and files keys for passes. kopf watches only the Sessions
  and Forks, whose handlers it drives. The VolumeSnapshots' watch is open only while a
  checkpoint is unsettled (`snapshot_watches`).
- Checkpoint admission: a new or unsettled Checkpoint's key and trimmed body wait in
  `admissions`; a few threads of ours run the passes.
- The Session and Fork passes that child, checkpoint and snapshot events ask for
  (`session_passes`, `fork_passes`): a key filed again while it waits is one pass.
- The expiry loop: a full sweep when this replica becomes active, then what the
  watch-fed `expiry` queue says is due, and the Pending checkpoints' polls.
- The Session resync (`resyncs`), the unfinished Forks' poll (`fork_polls`), the idle
  deadlines (`idle_timers`, spec.idle) and the heartbeat loop (status.resources), each
  one thread.
- Handing freed heap back to the OS (savepoint.memory).

A kopf timer per object would keep every object's body in memory (savepoint.polling).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from savepoint import eventlog, k8s, memory, metrics, peering, watches
from savepoint.checkpoint import CHECKPOINT_LABEL, moves_checkpoint, snapshot_name
from savepoint.config import Settings
from savepoint.constants import RECLAIM_LABEL
from savepoint.controllers import cache, checkpoint, expiry, forget, fork, heartbeat
from savepoint.controllers import session as sessions
from savepoint.logdigest import CHECKPOINT_CREATED
from savepoint.metrics import count_errors
from savepoint.models import FINISHED_FORK_PHASES, SETTLED_CHECKPOINT_PHASES
from savepoint.polling import DeadlineQueue, PollQueue, Spaced, WorkQueue
from savepoint.session import SESSION_LABEL
from savepoint.usage import HeartbeatSeen, heartbeat_session

log = logging.getLogger(__name__)

Key = tuple[str, str]

# Threads that admit new Checkpoints, resume unsettled ones and make them Ready. Each
# waits on the API server most of the time (a burst of 200 on the local control plane:
# 0.41x its floor with 8, 0.56x with 16, no better with 32); the client's rate limiter
# (SAVEPOINT_API_QPS) paces them all.
ADMISSION_WORKERS = 16
# Threads for the Session passes and the Fork passes that watch events ask for (the
# create, update and resume passes run on kopf's own 16).
SESSION_PASS_WORKERS = 8
FORK_PASS_WORKERS = 4
# A Session's passes for the checkpoint.created events our own checkpoints append: at most
# one per this many seconds (the first at once). Under a burst each one was a Session
# status write for a latestCheckpoint the next one replaced a moment later.
OWN_APPEND_GAP_SECONDS = 5.0
RESYNC_TICK_SECONDS = 5.0
# Each Session's resync comes up to this share of SAVEPOINT_RESYNC_SECONDS early, its own
# share: Sessions made together, or all resynced at a take-over, would otherwise resync
# together every interval (500 made in two minutes: about 300 passes in one two-minute
# window every ten minutes).
RESYNC_SPREAD = 0.2
# An unfinished Fork's pass at least this often, whatever its events: the safety net.
FORK_POLL_SECONDS = 10.0
# A resync that failed (the API server away) is tried again this soon, not a whole
# resync interval later.
RESYNC_RETRY_SECONDS = 30.0
# At most one early resync of every Session per this many seconds: a re-list sends an
# event for each child, thousands at once.
RELIST_RESYNC_GAP_SECONDS = 60.0
# How often freed heap memory may be handed back to the OS (savepoint.memory): at the end
# of each window of this length with at least RELEASE_BUSY_CPU_SECONDS of the operator's
# CPU in it, and of the quiet window after one (memory.Releases).
RELEASE_MEMORY_SECONDS = 30.0
RELEASE_BUSY_CPU_SECONDS = 1.0
# The VolumeSnapshot watch's streams last this long; it closes at the end of one in which
# every checkpoint it was opened for has settled.
SNAPSHOT_WATCH_WINDOW_SECONDS = 60
# A namespace being deleted is said in the log at most once per this many seconds.
TERMINATING_NOTE_SECONDS = 300.0


# What an admission thread is filed for a Checkpoint being deleted that still has kopf's finalizer.
RELEASE = "release"
# The Sessions' children, each kind's store for the passes (controllers/cache.py).
CHILD_STORES: dict[str, cache.Store | cache.Chunks] = {
    "pods": cache.pods,
    "persistentvolumeclaims": cache.claims,
    "configmaps": cache.chunks,
}


@dataclass(frozen=True)
class Arrived:
    """What an admission thread is filed for a Checkpoint the watch delivered: its body,
    when (monotonic) it came, and whether a listing brought it (not its create event)."""

    body: dict
    at: float
    listed: bool = False


@dataclass(frozen=True)
class SnapshotSettled:
    """What an admission thread is filed for a Checkpoint whose VolumeSnapshot is ready or failed."""

    snapshot: dict


_terminating_noted: dict[str, float] = {}


@contextmanager
def a_pass(kind: str, namespace: str) -> Iterator[None]:
    """One counted pass (metrics.count_errors). A pass the API server refuses because the
    namespace is being deleted is no error: deleting a namespace deletes the Pods and
    claims before the Sessions, and the passes their events ask for would re-create them.
    It ends quietly; the deletion of the objects themselves follows, as watch events."""
    with count_errors(kind):
        try:
            yield
        except Exception as err:
            if not k8s.namespace_terminating(err):
                raise
            now = time.monotonic()
            if now - _terminating_noted.get(namespace, float("-inf")) >= TERMINATING_NOTE_SECONDS:
                for gone in [ns for ns, at in _terminating_noted.items() if now - at >= TERMINATING_NOTE_SECONDS]:
                    del _terminating_noted[gone]
                _terminating_noted[namespace] = now
                log.info("namespace %s is being deleted: nothing more is made in it", namespace)


def pending_poll_seconds(settings: Settings) -> float:
    """The Pending checkpoints' poll: a safety net behind the VolumeSnapshot watch, and the
    clock of the snapshot timeout. At 5 s, a few hundred in flight spent more of the API
    budget on polls than on new checkpoints: a quarter of the timeout, 5 to 30 s."""
    return min(30.0, max(5.0, settings.snapshot_timeout.total_seconds() / 4))


def trimmed(body: dict) -> dict:
    """What a pass reads of a Checkpoint's body: all of it but managedFields, the largest part."""
    meta = {k: v for k, v in body["metadata"].items() if k != "managedFields"}
    return {**body, "metadata": meta}


def _still_waiting(key: Key) -> bool:
    """Whether a Checkpoint is not admitted yet, as our store has it (unknown: it may be)."""
    body = cache.checkpoints.get(*key)
    return body is None or checkpoint.waiting(body)


class Runtime:
    """One per operator process: the settings, our queues, and the threads that work them."""

    def __init__(self, settings: Settings, admission_workers: int = ADMISSION_WORKERS) -> None:
        self.settings = settings
        self.admissions = WorkQueue("checkpoint-admission", admission_workers, self._admission_pass)
        self.session_passes = WorkQueue("session-pass", SESSION_PASS_WORKERS, self._asked_session_pass)
        self.fork_passes = WorkQueue("fork-pass", FORK_PASS_WORKERS, self._asked_fork_pass)
        self.own_appends = Spaced(OWN_APPEND_GAP_SECONDS)
        self._stood_by = False  # whether this replica has stood by since its last take-over
        self.pending_polls = PollQueue(pending_poll_seconds(settings))
        self.expiry = expiry.clocks
        self.resyncs = PollQueue(settings.resync_seconds, spread=RESYNC_SPREAD)
        self.fork_polls = PollQueue(FORK_POLL_SECONDS)
        self.idle_timers = DeadlineQueue()
        self._relist_resync_at = float("-inf")
        # (namespace, session) -> the checkpoints not admitted yet that wait for it.
        self._waiting: dict[Key, set[str]] = {}
        self._waiting_lock = threading.Lock()
        # Served namespace (None: all) -> its VolumeSnapshot watch, open while a checkpoint
        # it was opened for is unsettled (in the store): a storm of expiries of Ready ones
        # sends it nothing.
        self.snapshot_watches = {
            namespace: watches.OnDemand(
                k8s.VOLUME_SNAPSHOTS,
                namespace,
                CHECKPOINT_LABEL,
                self.observe_snapshot,
                lambda key: cache.checkpoints.has(*key),
                expired=self.pending_polls.hurry,
                window=SNAPSHOT_WATCH_WINDOW_SECONDS,
            )
            for namespace in settings.namespaces or (None,)
        }

    def start(self) -> None:
        """Start the threads (daemons: they end with the process)."""
        metrics.admissions_waiting.set_function(lambda: len(self.admissions))
        metrics.snapshot_watches_open.set_function(lambda: sum(w.is_open for w in self.snapshot_watches.values()))
        for queue in (self.admissions, self.session_passes, self.fork_passes):
            queue.start()
        for name, loop in (
            ("checkpoint-expiry", self._expiry_loop),
            ("session-resync", self._resync_loop),
            ("fork-poll", self._fork_poll_loop),
            ("session-idle", self._idle_loop),
            ("session-heartbeat", self._heartbeat_loop),
            ("session-own-appends", self._own_appends_loop),
            ("release-memory", self._release_memory_loop),
        ):
            threading.Thread(target=loop, name=name, daemon=True).start()
        for namespace in self.settings.namespaces or (None,):
            for kind, selector, deliver in self.watched():
                threading.Thread(
                    target=watches.follow,
                    args=(kind, namespace, selector, deliver),
                    name=f"watch-{kind.plural}",
                    daemon=True,
                ).start()
        for on_demand in self.snapshot_watches.values():
            threading.Thread(target=on_demand.run, name="watch-volumesnapshots", daemon=True).start()

    def watched(self) -> list[tuple[k8s.Kind, str, watches.Deliver]]:
        """What the runtime watches itself all the time: each kind, its label selector and
        the function each event goes to (the VolumeSnapshots: watch_snapshots())."""
        return [
            (k8s.CHECKPOINTS, "", self.observe_checkpoint),
            *(
                (kind, SESSION_LABEL, self.child_observer(kind.plural))
                for kind in (k8s.PODS, k8s.CLAIMS, k8s.CONFIG_MAPS)
            ),
        ]

    def watch_snapshots(self, key: Key) -> None:
        """Open the VolumeSnapshot watch for an unsettled checkpoint, before any pass of it
        may make its snapshot: a watch opened after would miss the snapshot's readiness,
        left to the Pending poll. It is watched from now on, never listed: a restart with
        10,000 ready snapshots reads none. What a restart or a lost watch (410 Gone) did
        not see, each Pending checkpoint's own pass (its resume) or poll reads from its
        snapshot; after a 410 those polls come now."""
        on_demand = self.snapshot_watches.get(key[0]) or self.snapshot_watches.get(None)
        if on_demand is not None and not on_demand.watch(key):
            log.warning("the VolumeSnapshot watch did not open: checkpoint %s/%s is left to its poll", *key)

    # --- Checkpoints -----------------------------------------------------------------

    def admit_checkpoint(self, key: Key, body: dict | None = None, listed: bool = False) -> None:
        """File a Checkpoint for an admission pass (with the body the watch delivered, from a
        listing or not; one filed again without a body keeps the body it waits with)."""
        if body is not None:
            self.admissions.file(key, Arrived(trimmed(body), time.monotonic(), listed))
        elif key not in self.admissions:
            self.admissions.file(key)

    def _admission_pass(self, key: Key, seen: Arrived | SnapshotSettled | str | tuple[str, str] | None) -> None:
        # Filed while this replica was active. Asked afresh only when the expiry loop's last
        # look says standby: a replica that has just taken over must not drop it.
        if not peering.last_known(self.settings) and not peering.is_active(self.settings):
            return  # this replica stood down meanwhile: the active one resumes the checkpoint
        if not isinstance(seen, str | tuple):  # not a deletion's: the checkpoint may be unsettled
            self.watch_snapshots(key)
        with a_pass("checkpoint", key[0]):
            if isinstance(seen, str):  # RELEASE
                checkpoint.release(*key)
            elif isinstance(seen, tuple):  # (its snapshot, its uid): the Checkpoint is gone
                checkpoint.drop_snapshot(key[0], *seen)
            elif isinstance(seen, SnapshotSettled):
                # Settled meanwhile (the snapshotter updates a ready snapshot again): nothing to do.
                if cache.checkpoints.has(*key):
                    checkpoint.reconcile_checkpoint(*key, self.settings, snapshot=seen.snapshot)
            elif isinstance(seen, Arrived):
                checkpoint.reconcile_checkpoint(
                    *key, self.settings, seen=seen.body, seen_at=seen.at, listed=seen.listed
                )
            elif _still_waiting(key):  # filed by its Session's event: admitted meanwhile, it has no use
                checkpoint.reconcile_checkpoint(*key, self.settings)

    def observe_snapshot(self, event_type: str | None, body: dict) -> None:
        """A VolumeSnapshot that settles moves its Checkpoint on: only one still unsettled
        (in the store), since the snapshotter updates a ready snapshot again, and a pass for
        a Ready checkpoint would only read it."""
        name = moves_checkpoint(event_type, body)
        key = (body.get("metadata", {}).get("namespace", ""), name or "")
        if name is not None and cache.checkpoints.has(*key):
            self.admissions.file(key, SnapshotSettled(trimmed(body)))

    def observe_checkpoint(self, event_type: str | None, body: dict) -> None:
        """A Checkpoint's watch event: its admission (new, or listed unsettled at start-up
        and take-over), its expiry clock, its Pending poll, and forgetting it."""
        self.expiry.observe(event_type, body)
        cache.checkpoints.observe(event_type, body)
        meta = body["metadata"]
        key = (meta.get("namespace", ""), meta["name"])
        phase = (body.get("status") or {}).get("phase")
        if event_type == "DELETED":
            # Its snapshot goes now, on an admission thread (the garbage collector would too).
            vs_name = (body.get("status") or {}).get("volumeSnapshotName") or snapshot_name(meta["name"])
            self.admissions.file(key, (vs_name, meta.get("uid")))
        elif meta.get("deletionTimestamp"):
            if checkpoint.KOPF_FINALIZER in (meta.get("finalizers") or ()):
                self.admissions.file(key, RELEASE)  # a finalizer from before the garbage collector did it
        elif event_type in (None, "ADDED") and phase not in SETTLED_CHECKPOINT_PHASES:
            self.admit_checkpoint(key, body, listed=event_type is None)
        self._note_waiting(event_type, body)
        pending = phase in (None, "Pending")
        if event_type != "DELETED" and pending and not meta.get("deletionTimestamp"):
            self.pending_polls.file(key)
            if phase is not None and checkpoint.waiting(body):
                # Waiting (its admission found no Session, or one not Ready): a Session not
                # created yet is final after the short missing grace, so look again then.
                # Not a new one: its admission is on its way, and would only be polled.
                self.pending_polls.hurry(self.settings.missing_grace.total_seconds() + 1, [key])
        else:
            self.pending_polls.drop(key)
        if event_type == "DELETED":
            forget("checkpoint", *key)
        if phase in SETTLED_CHECKPOINT_PHASES:
            # Forks waiting for it resolve now; a paused Session's reclaim checkpoint lets
            # its pass delete (or keep) the claim: its checkpoint.created event comes a
            # moment before Ready, so the pass that event starts may find it still Pending.
            for name in fork.waiting_on_checkpoint(*key):
                self.fork_passes.file((key[0], name))
            if event_type == "MODIFIED" and (meta.get("labels") or {}).get(RECLAIM_LABEL) == "true":
                self.session_passes.file((key[0], (body.get("spec") or {}).get("sessionName", "")))

    def _note_waiting(self, event_type: str | None, body: dict) -> None:
        meta = body["metadata"]
        key = (meta.get("namespace", ""), (body.get("spec") or {}).get("sessionName", ""))
        waits = event_type != "DELETED" and not meta.get("deletionTimestamp") and checkpoint.waiting(body)
        with self._waiting_lock:
            names = self._waiting.get(key, set())
            if waits:
                self._waiting[key] = names | {meta["name"]}
            elif meta["name"] in names:
                names.discard(meta["name"])
                if not names:
                    del self._waiting[key]

    def waiting_for(self, namespace: str, session: str) -> list[str]:
        """The checkpoints not admitted yet that wait for this Session."""
        with self._waiting_lock:
            return sorted(self._waiting.get((namespace, session), ()))

    def poll_pending_checkpoints(self) -> None:
        """Reconcile the Pending checkpoints whose poll is due."""

        def poll(key: Key) -> None:
            if key in self.admissions:
                return  # its pass is on its way: a poll would only read a snapshot not made yet
            try:
                self.watch_snapshots(key)
                with a_pass("checkpoint", key[0]):
                    checkpoint.poll_pending(*key, self.settings)
            except Exception:  # counted; the next poll (or watch event) tries again
                log.exception("polling checkpoint %s/%s", *key)

        due = self.pending_polls.take_due()
        if due:
            with ThreadPoolExecutor(4, thread_name_prefix="checkpoint-poll") as pool:
                list(pool.map(poll, due))

    def _expiry_loop(self) -> None:
        listed = False  # whether this replica has swept a full listing since it became active
        while True:
            metrics.beat("expiry loop", max(10 * self.settings.expiry_interval_seconds, 1800))
            try:
                if not peering.is_active(self.settings):  # a standby leaves expiry to the active one
                    listed = False
                    self._stood_by = True
                elif not listed:
                    expiry.sweep(self.settings, self.expiry)  # overdue at start-up (or take-over) expire at once
                    listed = True
                    if self._stood_by:
                        self._take_over()
                else:
                    expiry.drain(self.settings, self.expiry)  # then only what the watch-fed queue says is due
                if listed:
                    self.poll_pending_checkpoints()
            except Exception:  # the loop outlives any one failure
                log.exception("checkpoint expiry sweep failed")
            # A standby, or a replica not yet swept, waits the interval: its queue is not its to work.
            interval = self.settings.expiry_interval_seconds
            time.sleep(expiry.next_wait(self.expiry, self.settings) if listed else interval)

    def _take_over(self) -> None:
        """This replica has just become the active one. Its watches kept running while it
        stood by, and its passes were the active replica's: every unsettled checkpoint is
        polled now (a poll finds what its admission has to do) and every Session resynced."""
        self._stood_by = False
        log.info("taking over: polling every unsettled checkpoint and resyncing every Session now")
        self.pending_polls.hurry()
        self.resyncs.hurry()

    # --- Sessions --------------------------------------------------------------------

    def child_observer(self, plural: str) -> watches.Deliver:
        """The function a Session child kind's watch events go to (observe_child)."""
        return lambda event_type, body: self.observe_child(plural, event_type, body)

    def observe_child(self, plural: str, event_type: str | None, body: dict) -> None:
        """A Session's Pod, claim or ConfigMap changed: keep its body for the passes, and
        ask for a pass of its Session only when it changes what the pass reads (each
        checkpoint's snapshot adds and removes a finalizer on the claim; the start-up
        listing is covered by the Sessions' resume passes). A heartbeat ConfigMap goes to
        the heartbeat loop instead."""
        if plural == "configmaps" and heartbeat_session(body) is not None:
            heartbeat.observe(event_type, body)  # in memory only: the heartbeat loop writes the status
            if event_type is not None:
                cache.chunks.delivered(body)
            return
        CHILD_STORES[plural].observe(event_type, body)
        if plural == "configmaps" and event_type is not None:
            cache.chunks.delivered(body)  # after the store has it: admission trusts the store up to it
        if sessions.relisted(plural, event_type, body):
            self.resync_all_after_relist()
        namespace = body["metadata"].get("namespace", "")
        session = (body["metadata"].get("labels") or {}).get(SESSION_LABEL, "")
        if not sessions.child_changed(plural, event_type, body):
            return
        held = fork.held(namespace, session)
        if plural == "configmaps" and held:
            # The rollback's own session.rollback append: a pass now would wait for the
            # hand-back's pass, which starts the Pod, and follows the log in the same pass.
            return
        own = plural == "configmaps" and event_type == "MODIFIED" and eventlog.newest_type(body) == CHECKPOINT_CREATED
        # A held Session's claims are the rollback's: its restored claim made and bound,
        # which move the rollback (below), whose swap then asks for the pass that starts
        # the Pod. A pass on each of them only took the Session's turn from that one.
        if not (held and plural == "persistentvolumeclaims") and (
            not own or self.own_appends.ask((namespace, session))
        ):
            self.session_passes.file((namespace, session))
        if plural != "configmaps":  # a rollback's steps wait on its Session's Pod going and its claim binding
            for name in fork.rollbacks_waiting_on(namespace, session):
                self.fork_passes.file((namespace, name))

    def _own_appends_loop(self) -> None:
        while True:
            self.own_appends.later.wait(RESYNC_TICK_SECONDS)
            for key in self.own_appends.due():
                self.session_passes.file(key)

    def _asked_session_pass(self, key: Key, _: object) -> None:
        if peering.last_known(self.settings):  # a standby's passes are the active replica's
            self.session_pass(*key)

    def session_pass(self, namespace: str, name: str, **options: Any) -> None:
        """One Session pass (controllers/session.reconcile_session's options)."""
        with a_pass("session", namespace):
            sessions.reconcile_session(namespace, name, self.settings, timers=self.idle_timers, **options)

    def observe_session(self, event_type: str | None, body: dict) -> None:
        """A Session's watch event: its body for the passes, its resync clock, or forgetting it."""
        cache.sessions.observe(event_type, body)
        namespace, name = body["metadata"].get("namespace", ""), body["metadata"]["name"]
        key = (namespace, name)
        if event_type == "DELETED":
            self.resyncs.drop(key)
            self.idle_timers.drop(key)
            self.own_appends.forget(key)
            forget("session", namespace, name)
            heartbeat.forget(namespace, name)
            sessions.forget_restore(body["metadata"].get("uid", ""))
        else:
            self.resyncs.file(key)

    def resync_all_after_relist(self) -> None:
        """A re-list tells nothing of the children that went meanwhile (sessions.relisted):
        every Session gets its resync now, not up to SAVEPOINT_RESYNC_SECONDS later."""
        now = time.monotonic()
        if now - self._relist_resync_at >= RELIST_RESYNC_GAP_SECONDS:
            self._relist_resync_at = now
            log.info("a watch listed again (the API server restarted?): resyncing every Session now")
            self.resyncs.hurry()

    def _resync(self, key: Key) -> None:
        try:
            self.session_pass(*key, retention=True, cached=False)
        except Exception:  # counted; the next watch event tries again, or this soon
            log.exception("resyncing session %s/%s", *key)
            self.resyncs.hurry(RESYNC_RETRY_SECONDS, keys=[key])

    def _resync_loop(self) -> None:
        while True:
            time.sleep(RESYNC_TICK_SECONDS)
            if peering.last_known(self.settings):
                for key in self.resyncs.take_due():
                    self._resync(key)

    def _idle_loop(self) -> None:
        # A pass when a Session's idle window ends (spec.idle), to the second, not at its
        # next resync; a standby drops what falls due: the active replica has its own timers.
        while True:
            self.idle_timers.wait(RESYNC_TICK_SECONDS)
            active = peering.last_known(self.settings)
            for key in self.idle_timers.take_due():
                if active:
                    self._resync(key)

    def _heartbeat_loop(self) -> None:
        """Reflect the sandboxes' heartbeats into their Sessions (controllers/heartbeat.py)."""
        while True:
            time.sleep(heartbeat.tick_seconds(self.settings))
            if not peering.last_known(self.settings):
                continue
            passes, patches = heartbeat.due(self.settings)
            for key in passes:
                try:
                    self.session_pass(*key)
                except Exception:  # counted; the next tick tries again
                    log.exception("heartbeat pass of session %s/%s", *key)
            for (namespace, name), resources in patches:
                try:
                    cache.sessions.put(k8s.patch_status("sessions", namespace, name, {"resources": resources}))
                except Exception:
                    log.exception("writing the resources of session %s/%s", namespace, name)
                    continue
                heartbeat.reflected(namespace, name, HeartbeatSeen(resources, False, 0), pass_=False)

    # --- Forks and the process -------------------------------------------------------

    def observe_fork(self, event_type: str | None, body: dict) -> None:
        """A Fork's watch event: its body for the passes, its poll, and a pass when it is new
        or listed (at start-up, or when the watch lists again). A Fork's spec never changes
        (the CRD makes it immutable), so its other events ask for none: the events of its
        Session, checkpoint and children move it on."""
        cache.forks.observe(event_type, body)
        meta = body["metadata"]
        key = (meta.get("namespace", ""), meta["name"])
        if event_type == "DELETED":
            self.fork_polls.drop(key)
            forget("fork", *key)
            fork.forget_rollback(*key)
        elif (body.get("status") or {}).get("phase") in FINISHED_FORK_PHASES:
            self.fork_polls.drop(key)
        else:
            self.fork_polls.file(key)
            if event_type in (None, "ADDED"):
                self.fork_passes.file(key)

    def _fork_poll_loop(self) -> None:
        while True:
            time.sleep(RESYNC_TICK_SECONDS)
            due = self.fork_polls.take_due()
            if peering.last_known(self.settings):
                for key in due:
                    self.fork_passes.file(key)

    def fork_pass(self, namespace: str, name: str) -> None:
        handed_back = None
        with a_pass("fork", namespace):
            handed_back = fork.reconcile_fork(
                namespace, name, self.settings, swapped=lambda session: self.session_passes.file((namespace, session))
            )
        if handed_back:  # its status, and after a restart its Pod, now: not after the Session's watch event
            self.session_passes.file((namespace, handed_back))

    def _asked_fork_pass(self, key: Key, _: object) -> None:
        if peering.last_known(self.settings):
            self.fork_pass(*key)

    def _release_memory_loop(self) -> None:
        releases = memory.Releases(RELEASE_BUSY_CPU_SECONDS)
        while True:
            time.sleep(RELEASE_MEMORY_SECONDS)
            if releases.due():
                memory.release()
                releases.released()
