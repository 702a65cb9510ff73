"""Checkpoint handlers: admission and snapshot progress, the finalizer, and the expiry loop."""

from __future__ import annotations

import threading

import kopf

from savepoint.checkpoint import CHECKPOINT_LABEL
from savepoint.config import load
from savepoint.controllers import checkpoint
from savepoint.metrics import count_errors
from savepoint.models import GROUP, VERSION, CheckpointSpec

CHECKPOINTS = (GROUP, VERSION, "checkpoints")
settings = load()


@kopf.on.resume(*CHECKPOINTS, id="checkpoint_resume")
@kopf.on.create(*CHECKPOINTS, id="checkpoint_create")
def checkpoint_reconcile(namespace: str, name: str, **_: object) -> None:
    with count_errors("checkpoint"):
        checkpoint.reconcile_checkpoint(namespace, name, settings)


@kopf.timer(
    *CHECKPOINTS,
    interval=5,
    id="checkpoint_pending_poll",
    when=lambda status, **_: status.get("phase") in (None, "Pending"),
)
def checkpoint_pending_poll(namespace: str, name: str, **_: object) -> None:
    with count_errors("checkpoint"):
        checkpoint.reconcile_checkpoint(namespace, name, settings)


@kopf.on.event("snapshot.storage.k8s.io", "v1", "volumesnapshots", labels={CHECKPOINT_LABEL: kopf.PRESENT})
def checkpoint_snapshot_event(namespace: str, labels: dict[str, str], **_: object) -> None:
    with count_errors("checkpoint"):
        checkpoint.reconcile_checkpoint(namespace, labels[CHECKPOINT_LABEL], settings)


if settings.webhook:

    @kopf.on.validate(*CHECKPOINTS, id="validate-checkpoints", operations=["CREATE"])
    def checkpoint_admission(namespace: str, name: str, spec: kopf.Spec, dryrun: bool, **_: object) -> None:
        """The status path's checks, answered at `kubectl apply` time (DESIGN 2)."""
        rejection = checkpoint.check(namespace, name, CheckpointSpec.model_validate(dict(spec)), settings)
        if rejection is not None:
            code = (
                501
                if rejection.reason == "SnapshotsUnsupported"
                else 404
                if rejection.reason == "SessionNotFound"
                else 409
            )
            raise kopf.AdmissionError(f"{rejection.reason}: {rejection.message}", code=code)


@kopf.on.delete(*CHECKPOINTS, id="checkpoint_release")
def checkpoint_release(body: kopf.Body, **_: object) -> None:
    checkpoint.release(dict(body))


@kopf.on.startup()
def checkpoint_expiry_loop(**_: object) -> None:
    """One sweep at start-up (overdue checkpoints expire at once), then every few seconds."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                checkpoint.sweep(settings)
            except Exception:  # the loop outlives any one failure
                checkpoint.log.exception("checkpoint expiry sweep failed")
            stop.wait(settings.expiry_interval_seconds)

    threading.Thread(target=loop, name="checkpoint-expiry", daemon=True).start()
