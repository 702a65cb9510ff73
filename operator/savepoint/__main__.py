"""`python -m savepoint`: run the operator against the current kubeconfig or in-cluster.

It loads the settings once (a bad one stops it here, naming the variable), registers the
handlers, builds the Runtime (savepoint.runtime) and passes it to every handler as kopf's
memo."""

from __future__ import annotations

import asyncio
import logging
import sys

import kopf

from savepoint import eventlog, k8s, memory, metrics, peering
from savepoint.config import load
from savepoint.controllers import cache
from savepoint.errors import SettingsError
from savepoint.runtime import Runtime

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class ObjectFormatter(logging.Formatter):
    """Puts [namespace/name] before the lines kopf logs about one object ("Handler
    'session_create' failed ..."), which otherwise do not say which object they are about.
    kopf passes the object as the record's `k8s_ref`."""

    def format(self, record: logging.LogRecord) -> str:
        ref = getattr(record, "k8s_ref", None)
        if isinstance(ref, dict) and ref.get("name"):
            where = f"{ref['namespace']}/{ref['name']}" if ref.get("namespace") else ref["name"]
            record = logging.makeLogRecord({**record.__dict__, "msg": f"[{where}] {record.msg}"})
        return super().format(record)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(ObjectFormatter(LOG_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])


def main() -> None:
    memory.limit_arenas()  # before any thread starts
    try:
        settings = load()
    except SettingsError as error:
        sys.exit(f"savepoint: {error}")
    configure_logging(settings.log_level)
    k8s.configure(settings)
    import savepoint.handlers  # noqa: F401  (registers the handlers)

    if settings.webhook:
        import savepoint.handlers.webhook  # noqa: F401  (kopf refuses admission handlers with no server)
    runtime = Runtime(settings)

    metrics.observe_eventlog()
    # Our own chunk reads and writes, for the passes (controllers/logview.py); a write counts
    # as a fresh read for admission's cut.
    eventlog.on_chunk = cache.chunks.put
    metrics.count_kopf_requests()
    metrics.serve(settings.metrics_port)
    memory.freeze_startup()
    runtime.start()

    async def run() -> None:
        metrics.watch_loop(asyncio.get_running_loop())  # /healthz pings the loop kopf runs in
        await kopf.operator(
            clusterwide=not settings.namespaces,
            namespaces=list(settings.namespaces),
            standalone=not settings.peering,
            # Our own identity, so peering.is_active() knows which record in the peering is ours.
            identity=peering.identity(),  # type: ignore[arg-type]  # kopf's Identity: a str NewType it does not export
            liveness_endpoint=None,
            memo=kopf.Memo(runtime=runtime),  # every handler's `memo.runtime`
        )

    asyncio.run(run())


if __name__ == "__main__":
    main()
