"""The operator's machinery that kopf does not drive: our queues and the threads that work them.

`python -m savepoint` loads the Settings once, builds one Runtime and hands it to kopf as
the operator's memo; each handler reaches it as `memo.runtime` and calls one method here
or one controller. Nothing here decides what an object should be (the controllers and the
pure modules do); this module only says when a pass runs and on which thread:

- Checkpoint admission: kopf's create/resume handler files the key and a trimmed body in
  `admissions` and returns; a few threads of ours run the passes (kopf would hold a queue
  of whole watch bodies per object still waiting).
- The expiry loop: a full sweep when this replica becomes active, then what the
  watch-fed `expiry` queue says is due, and the Pending checkpoints' polls.
- The Session resync (`resyncs`), the idle deadlines (`idle_timers`, spec.idle) and the
  heartbeat loop (status.resources), each one thread.
- Handing freed heap back to the OS (savepoint.memory).

A kopf timer per object would keep every object's body in memory (savepoint.polling).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from savepoint import k8s, memory, metrics, peering
from savepoint.checkpoint import CHECKPOINT_LABEL, moves_checkpoint, snapshot_name
from savepoint.config import Settings
from savepoint.controllers import cache, checkpoint, expiry, forget, fork, heartbeat
from savepoint.controllers import session as sessions
from savepoint.metrics import count_errors
from savepoint.models import SETTLED_CHECKPOINT_PHASES
from savepoint.polling import DeadlineQueue, PollQueue, WorkQueue
from savepoint.usage import HeartbeatSeen

log = logging.getLogger(__name__)

Key = tuple[str, str]

# Threads that admit new Checkpoints, resume unsettled ones and make them Ready. Each
# waits on the API server most of the time (a burst of 200 on the local control plane:
# 0.41x its floor with 8, 0.56x with 16, no better with 32); the client's rate limiter
# (SAVEPOINT_API_QPS) paces them all.
ADMISSION_WORKERS = 16
RESYNC_TICK_SECONDS = 5.0
# A resync that failed (the API server away) is tried again this soon, not a whole
# resync interval later.
RESYNC_RETRY_SECONDS = 30.0
# At most one early resync of every Session per this many seconds: a re-list sends an
# event for each child, thousands at once.
RELIST_RESYNC_GAP_SECONDS = 60.0
# How often freed heap memory is handed back to the OS (savepoint.memory).
RELEASE_MEMORY_SECONDS = 30.0


# What an admission thread is filed for a Checkpoint being deleted that still has kopf's finalizer.
RELEASE = "release"
# How long the snapshot watch waits before it watches again after an error.
SNAPSHOT_WATCH_RETRY_SECONDS = 1.0


@dataclass(frozen=True)
class Arrived:
    """What an admission thread is filed for a Checkpoint the watch delivered: its body, and
    when (monotonic) it came."""

    body: dict
    at: float


@dataclass(frozen=True)
class SnapshotSettled:
    """What an admission thread is filed for a Checkpoint whose VolumeSnapshot is ready or failed."""

    snapshot: dict


def pending_poll_seconds(settings: Settings) -> float:
    """The Pending checkpoints' poll: a safety net behind the VolumeSnapshot watch, and the
    clock of the snapshot timeout. At 5 s, a few hundred in flight spent more of the API
    budget on polls than on new checkpoints: a quarter of the timeout, 5 to 30 s."""
    return min(30.0, max(5.0, settings.snapshot_timeout.total_seconds() / 4))


def trimmed(body: dict) -> dict:
    """What a pass reads of a Checkpoint's body: all of it but managedFields, the largest part."""
    meta = {k: v for k, v in body["metadata"].items() if k != "managedFields"}
    return {**body, "metadata": meta}


class Runtime:
    """One per operator process: the settings, our queues, and the threads that work them."""

    def __init__(self, settings: Settings, admission_workers: int = ADMISSION_WORKERS) -> None:
        self.settings = settings
        self.admissions = WorkQueue("checkpoint-admission", admission_workers, self._admission_pass)
        self.pending_polls = PollQueue(pending_poll_seconds(settings))
        self.expiry = expiry.ExpiryQueue()
        self.resyncs = PollQueue(settings.resync_seconds)
        self.idle_timers = DeadlineQueue()
        self._relist_resync_at = float("-inf")
        # (namespace, session) -> the checkpoints not admitted yet that wait for it.
        self._waiting: dict[Key, set[str]] = {}
        self._waiting_lock = threading.Lock()

    def start(self) -> None:
        """Start the threads (daemons: they end with the process)."""
        metrics.admissions_waiting.set_function(lambda: len(self.admissions))
        self.admissions.start()
        for name, loop in (
            ("checkpoint-expiry", self._expiry_loop),
            ("session-resync", self._resync_loop),
            ("session-idle", self._idle_loop),
            ("session-heartbeat", self._heartbeat_loop),
            ("release-memory", self._release_memory_loop),
        ):
            threading.Thread(target=loop, name=name, daemon=True).start()
        for namespace in self.settings.namespaces or (None,):
            watch = threading.Thread(
                target=self._snapshot_watch_loop, args=(namespace,), name="snapshot-watch", daemon=True
            )
            watch.start()

    # --- Checkpoints -----------------------------------------------------------------

    def admit_checkpoint(self, key: Key, body: dict | None = None) -> None:
        """File a Checkpoint for an admission pass (with the body the watch delivered; one
        filed again without a body keeps the body it waits with)."""
        if body is not None:
            self.admissions.file(key, Arrived(trimmed(body), time.monotonic()))
        elif key not in self.admissions:
            self.admissions.file(key)

    def _admission_pass(self, key: Key, seen: Arrived | SnapshotSettled | str | tuple[str, str] | None) -> None:
        # Filed while this replica was active. Asked afresh only when the expiry loop's last
        # look says standby: a replica that has just taken over must not drop it.
        if not peering.last_known(self.settings) and not peering.is_active(self.settings):
            return  # this replica stood down meanwhile: the active one resumes the checkpoint
        with count_errors("checkpoint"):
            if isinstance(seen, str):  # RELEASE
                checkpoint.release(*key)
            elif isinstance(seen, tuple):  # (its snapshot, its uid): the Checkpoint is gone
                checkpoint.drop_snapshot(key[0], *seen)
            elif isinstance(seen, SnapshotSettled):
                checkpoint.reconcile_checkpoint(*key, self.settings, snapshot=seen.snapshot)
            elif isinstance(seen, Arrived):
                checkpoint.reconcile_checkpoint(*key, self.settings, seen=seen.body, seen_at=seen.at)
            else:
                checkpoint.reconcile_checkpoint(*key, self.settings, seen=seen)

    def _snapshot_watch_loop(self, namespace: str | None) -> None:
        """Watch the Checkpoints' VolumeSnapshots from now on, never listing them: a restart
        with 10,000 ready ones reads none. A snapshot that settles moves its Checkpoint on.
        What a restart or a lost watch (410 Gone) did not see, each Pending checkpoint's own
        pass (its resume) or poll reads from its snapshot; after a 410 those polls come now."""
        version: str | None = None
        while True:
            try:
                if version is None:
                    version = k8s.volume_snapshots_version(namespace, CHECKPOINT_LABEL)
                for event_type, body in k8s.watch_volume_snapshots(namespace, version, CHECKPOINT_LABEL):
                    version = body.get("metadata", {}).get("resourceVersion") or version
                    name = moves_checkpoint(event_type, body)
                    key = (body.get("metadata", {}).get("namespace", ""), name or "")
                    # Only a Checkpoint still unsettled (in the store): the snapshotter updates a
                    # ready snapshot again, and a pass for a Ready checkpoint would only read it.
                    if name is not None and cache.checkpoints.has(*key):
                        self.admissions.file(key, SnapshotSettled(trimmed(body)))
            except k8s.Expired:
                version = None
                self.pending_polls.hurry()
            except Exception:  # the API server away: watch again from where it stopped
                log.warning("the VolumeSnapshot watch failed; watching again", exc_info=True)
                time.sleep(SNAPSHOT_WATCH_RETRY_SECONDS)

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
            self.admit_checkpoint(key, body)
        self._note_waiting(event_type, body)
        pending = phase in (None, "Pending")
        if event_type != "DELETED" and pending and not meta.get("deletionTimestamp"):
            self.pending_polls.file(key)
            if checkpoint.waiting(body):
                # A Session not created yet is final after the short missing grace: look again then.
                self.pending_polls.hurry(self.settings.missing_grace.total_seconds() + 1, [key])
        else:
            self.pending_polls.drop(key)
        if event_type == "DELETED":
            forget("checkpoint", *key)

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
                with count_errors("checkpoint"):
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
                elif not listed:
                    expiry.sweep(self.settings, self.expiry)  # overdue at start-up (or take-over) expire at once
                    listed = True
                else:
                    expiry.drain(self.settings, self.expiry)  # then only what the watch-fed queue says is due
                if listed:
                    self.poll_pending_checkpoints()
            except Exception:  # the loop outlives any one failure
                log.exception("checkpoint expiry sweep failed")
            time.sleep(self.settings.expiry_interval_seconds)

    # --- Sessions --------------------------------------------------------------------

    def session_pass(self, namespace: str, name: str, **options: Any) -> None:
        """One Session pass (controllers/session.reconcile_session's options)."""
        with count_errors("session"):
            sessions.reconcile_session(namespace, name, self.settings, timers=self.idle_timers, **options)

    def observe_session(self, event_type: str | None, body: dict) -> None:
        """A Session's watch event: its body for the passes, its resync clock, or forgetting it."""
        cache.sessions.observe(event_type, body)
        namespace, name = body["metadata"].get("namespace", ""), body["metadata"]["name"]
        key = (namespace, name)
        if event_type == "DELETED":
            self.resyncs.drop(key)
            self.idle_timers.drop(key)
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

    def fork_pass(self, namespace: str, name: str) -> None:
        with count_errors("fork"):
            fork.reconcile_fork(namespace, name, self.settings)

    def _release_memory_loop(self) -> None:
        while True:
            time.sleep(RELEASE_MEMORY_SECONDS)
            memory.release()
