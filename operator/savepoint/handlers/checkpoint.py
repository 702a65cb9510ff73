"""Checkpoint handlers: admission and snapshot progress, the finalizer, and the expiry loop."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import kopf

from savepoint import metrics, peering
from savepoint.checkpoint import CHECKPOINT_LABEL, snapshot_state
from savepoint.config import load
from savepoint.controllers import checkpoint, forget
from savepoint.metrics import count_errors
from savepoint.models import GROUP, VERSION, CheckpointSpec
from savepoint.polling import PollQueue, WorkQueue

CHECKPOINTS = (GROUP, VERSION, "checkpoints")
# Phases reconcile_checkpoint has nothing to do for (expiry is the sweep's job).
SETTLED = ("Ready", "Failed", "Rejected", "Expired")
settings = load()
# Threads that admit new Checkpoints and resume unsettled ones. The client's rate limiter
# (SAVEPOINT_API_QPS) paces them; more threads would only wait on it.
ADMISSION_WORKERS = 8


def _unsettled(status: kopf.Status, **_: object) -> bool:
    # At start-up thousands of settled checkpoints: a filter, not a handler, turns them
    # away, so none costs a worker thread or a log line.
    return status.get("phase") not in SETTLED


def _admission_pass(key: tuple[str, str], seen: dict) -> None:
    # kopf filed it while this replica was active. Asked afresh only when the expiry loop's
    # last look says standby: a replica that has just taken over must not drop it.
    if not peering.last_known(settings) and not peering.is_active(settings):
        return  # this replica stood down meanwhile: the active one resumes the checkpoint
    with count_errors("checkpoint"):
        checkpoint.reconcile_checkpoint(*key, settings, seen=seen)


# New and resumed Checkpoints wait here, each as a key and a trimmed body, for a pass on
# one of a few threads; the pending poll below retries one whose pass failed. (In kopf's
# own queues, thousands waiting under a backlog were thousands of whole bodies.)
admissions = WorkQueue("checkpoint-admission", ADMISSION_WORKERS, _admission_pass)
metrics.admissions_waiting.set_function(lambda: len(admissions))


@kopf.on.resume(*CHECKPOINTS, id="checkpoint_resume", when=_unsettled)
@kopf.on.create(*CHECKPOINTS, id="checkpoint_create")
def checkpoint_reconcile(namespace: str, name: str, status: kopf.Status, body: kopf.Body, **_: object) -> None:
    if _unsettled(status):
        admissions.start()
        admissions.file((namespace, name), trimmed(dict(body)))


def trimmed(body: dict) -> dict:
    """What a pass reads of a Checkpoint's body: all of it but managedFields, the largest part."""
    meta = {k: v for k, v in body["metadata"].items() if k != "managedFields"}
    return {**body, "metadata": meta}


# A safety net behind the VolumeSnapshot watch, and the clock of the snapshot timeout.
# Every Pending checkpoint polls, so at 5 s a few hundred in flight spent more of the API
# budget on polls than on new checkpoints: poll at a quarter of the timeout, 5 to 30 s.
PENDING_POLL_SECONDS = min(30.0, max(5.0, settings.snapshot_timeout.total_seconds() / 4))


pending_polls = PollQueue(PENDING_POLL_SECONDS)


def checkpoint_pending_poll() -> None:
    """Reconcile the Pending checkpoints whose poll is due (the expiry loop's thread calls it)."""

    def poll(key: tuple[str, str]) -> None:
        if key in admissions:
            return  # its pass is on its way: a poll would only read a snapshot not made yet
        try:
            with count_errors("checkpoint"):
                checkpoint.poll_pending(*key, settings)
        except Exception:  # counted; the next poll (or watch event) tries again
            checkpoint.log.exception("polling checkpoint %s/%s", *key)

    due = pending_polls.take_due()
    if due:
        with ThreadPoolExecutor(4, thread_name_prefix="checkpoint-poll") as pool:
            list(pool.map(poll, due))


def _snapshot_settled(body: kopf.Body, type: str | None, **_: object) -> bool:
    # Only a ready or failed snapshot moves its Checkpoint on; the snapshotter's many
    # intermediate updates would each cost a reconcile that finds nothing to do (the
    # pending poll keeps the timeout's clock).
    # A snapshot being deleted (expiry, or its Checkpoint going) has nothing to tell its
    # Checkpoint either: in an expiry storm its finalizer updates cost a GET each.
    # Nor does one from a listing (start-up, or a re-list): thousands of long-ready
    # snapshots, each a GET that finds its Checkpoint settled. Pending ones get their
    # resume pass or poll.
    # DELETED also comes when a snapshot leaves the watch's selector, as every one does
    # once labelled settled (handlers/operator.py): its Checkpoint is Ready already.
    if type in (None, "DELETED") or body.get("metadata", {}).get("deletionTimestamp"):
        return False
    state = snapshot_state(dict(body))
    return state.ready or state.error is not None


@kopf.on.event(
    "snapshot.storage.k8s.io",
    "v1",
    "volumesnapshots",
    labels={CHECKPOINT_LABEL: kopf.PRESENT},
    when=_snapshot_settled,
)
def checkpoint_snapshot_event(
    namespace: str, labels: dict[str, str], annotations: dict[str, str], body: kopf.Body, **_: object
) -> None:
    # The label holds a hashed name when the checkpoint's is longer than a label value may be.
    name = annotations.get(CHECKPOINT_LABEL) or labels[CHECKPOINT_LABEL]
    with count_errors("checkpoint"):
        checkpoint.reconcile_checkpoint(namespace, name, settings, snapshot=dict(body))


if settings.webhook:

    @kopf.on.validate(*CHECKPOINTS, id="validate-checkpoints", operations=["CREATE"])
    def checkpoint_admission(namespace: str, name: str, spec: kopf.Spec, dryrun: bool, **_: object) -> None:
        """The status path's checks, answered at `kubectl apply` time (DESIGN 2)."""
        rejection = checkpoint.check(namespace, name, CheckpointSpec.model_validate(dict(spec)), settings)
        if rejection is not None:
            code = (
                501
                if rejection.reason in ("SnapshotsUnsupported", "HooksDisabled")
                else 404
                if rejection.reason == "SessionNotFound"
                else 409
            )
            raise kopf.AdmissionError(f"{rejection.reason}: {rejection.message}", code=code)


@kopf.index(*CHECKPOINTS, id="checkpoints_waiting")
def checkpoints_waiting(namespace: str, name: str, spec: kopf.Spec, status: kopf.Status, **_: object) -> dict | None:
    """Checkpoints not admitted yet (waiting for their Session), by that Session."""
    if status.get("phase") not in (None, "Pending") or status.get("createdAt"):
        return None
    return {(namespace, spec.get("sessionName")): name}


def _awaited_session(namespace: str, name: str, status: kopf.Status, checkpoints_waiting: kopf.Index, **_: object):
    # A filter: the events of the sessions no checkpoint waits for cost no worker thread.
    return (namespace, name) in checkpoints_waiting and status.get("phase") not in (None, "Provisioning")


@kopf.on.event(GROUP, VERSION, "sessions", id="checkpoint_session_event", when=_awaited_session)
def checkpoint_session_event(namespace: str, name: str, checkpoints_waiting: kopf.Index, **_: object) -> None:
    """A Session some checkpoints wait for is no longer Provisioning: admit them now."""
    admissions.start()
    for waiting in list(checkpoints_waiting.get((namespace, name), ())):
        admissions.file((namespace, waiting))


@kopf.on.delete(*CHECKPOINTS, id="checkpoint_release")
def checkpoint_release(body: kopf.Body, **_: object) -> None:
    checkpoint.release(dict(body))


@kopf.on.event(*CHECKPOINTS, id="checkpoint_clocks")
async def checkpoint_clocks(type: str | None, body: kopf.Body, **_: object) -> None:
    # In the event loop, not a worker thread: it only files keys and times in memory.
    raw = dict(body)
    checkpoint.expiry_queue.observe(type, raw)
    key = (raw["metadata"].get("namespace", ""), raw["metadata"]["name"])
    pending = (raw.get("status") or {}).get("phase") in (None, "Pending")
    if type != "DELETED" and pending and not raw["metadata"].get("deletionTimestamp"):
        pending_polls.file(key)
        if checkpoint.waiting(raw):
            # A Session not created yet is final after the short missing grace: look again then.
            pending_polls.hurry(settings.missing_grace.total_seconds() + 1, [key])
    else:
        pending_polls.drop(key)
    if type == "DELETED":
        forget("checkpoint", *key)


@kopf.on.startup()
def checkpoint_expiry_loop(**_: object) -> None:
    """A full sweep at start-up (overdue checkpoints expire at once), then the due ones every
    few seconds; the same thread polls the Pending checkpoints that are due. A daemon
    thread: it ends with the process."""

    def loop() -> None:
        listed = False  # whether this replica has swept a full listing since it became active
        while True:
            metrics.beat("expiry loop", max(10 * settings.expiry_interval_seconds, 1800))
            try:
                if not peering.is_active(settings):  # a standby replica leaves expiry to the active one
                    listed = False
                elif not listed:
                    checkpoint.sweep(settings)  # overdue at start-up (or take-over) expire at once
                    listed = True
                else:
                    checkpoint.drain(settings)  # then only what the watch-fed queue says is due
                if listed:
                    checkpoint_pending_poll()
            except Exception:  # the loop outlives any one failure
                checkpoint.log.exception("checkpoint expiry sweep failed")
            time.sleep(settings.expiry_interval_seconds)

    threading.Thread(target=loop, name="checkpoint-expiry", daemon=True).start()
