"""Operator-wide start-up settings."""

from __future__ import annotations

import logging
from pathlib import Path

import kopf

from savepoint import k8s

# How long kopf keeps an idle per-object worker (see operator_configure).
WORKER_IDLE_SECONDS = 0.05


class QuietWatchHandlers(logging.Filter):
    """Drops kopf's "Handler '…' succeeded." line for watch-event handlers, which run on
    every event of every Checkpoint, Session and child: at a restart one line per listed
    object, and writing them was a fifth of the start-up CPU. kopf logs those handlers
    through its local (never posted) logger; failures and the change handlers' lines stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.levelno == logging.INFO
            and getattr(record, "k8s_skip", False)
            and isinstance(record.msg, str)
            and record.msg.endswith(" succeeded.")
        )


@kopf.on.startup()
def operator_configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: object) -> None:
    config = memo.runtime.settings
    logging.getLogger().setLevel(config.log_level)
    kopf_objects = logging.getLogger("kopf.objects")
    if config.log_level != "DEBUG" and not any(isinstance(f, QuietWatchHandlers) for f in kopf_objects.filters):
        kopf_objects.addFilter(QuietWatchHandlers())
    # Keep kopf's bookkeeping out of status, which is the API users read.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="savepoint.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="savepoint.dev", key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    # Cluster-wide, one listing would be every Checkpoint at once: a response of tens of
    # megabytes parsed whole, whose peak the heap keeps long after (docs/performance.md).
    settings.watching.chunk_size = k8s.LIST_PAGE
    settings.execution.max_workers = 16
    # Objects processed at once. Unlimited, a burst of thousands of events opened as many
    # API connections (kopf's client has no pool limit), each with its own TLS buffers,
    # while the 16 handler threads above could serve only 16 of them anyway.
    settings.queueing.worker_limit = 64
    # kopf keeps each object's worker, and its place among the 64 above, for idle_timeout
    # after the object's last event (5 s by default): that capped each watch at about
    # 13 objects/s, so a restart re-listing 2,000 checkpoints took 80 s while the process
    # sat mostly idle, and a burst of new checkpoints queued behind the idle workers.
    settings.queueing.idle_timeout = WORKER_IDLE_SECONDS
    if config.webhook:
        cert, key = Path(config.webhook_cert_dir) / "tls.crt", Path(config.webhook_cert_dir) / "tls.key"
        if not (cert.is_file() and key.is_file()):
            raise kopf.PermanentError(f"SAVEPOINT_WEBHOOK needs {cert} and {key} (SAVEPOINT_WEBHOOK_CERT_DIR)")
        # The ValidatingWebhookConfiguration is deployment config (the Helm chart), not ours to manage.
        settings.admission.server = kopf.WebhookServer(
            addr=config.webhook_addr,
            port=config.webhook_port,
            certfile=str(cert),
            pkeyfile=str(key),
        )
        settings.admission.managed = None
    if config.namespaces:
        # kopf stops watching a namespace as soon as its deletion starts, before the
        # namespace controller deletes our objects, so their finalizers would never run and
        # the namespace would stay Terminating. Serve the listed namespaces statically.
        settings.scanning.disabled = True
    if config.peering:
        settings.peering.name = config.peering
        settings.peering.mandatory = True
        # kopf pauses every replica that sees a live peer of the same or a higher priority:
        # with equal priorities all replicas would pause. peering.is_active() reads the same.
        settings.peering.priority = config.peering_priority
        settings.peering.lifetime = config.peering_lifetime_seconds
    else:
        settings.peering.standalone = True
