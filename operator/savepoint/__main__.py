"""`python -m savepoint`: run the operator against the current kubeconfig or in-cluster."""

from __future__ import annotations

import asyncio
import logging

import kopf

from savepoint import memory
from savepoint.config import load


def main() -> None:
    memory.limit_arenas()  # before any thread starts
    settings = load()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    import savepoint.handlers  # noqa: F401  (registers the handlers)
    from savepoint import metrics, peering

    metrics.observe_eventlog()
    metrics.serve(settings.metrics_port)

    async def run() -> None:
        metrics.watch_loop(asyncio.get_running_loop())  # /healthz pings the loop kopf runs in
        await kopf.operator(
            clusterwide=not settings.namespaces,
            namespaces=list(settings.namespaces),
            standalone=not settings.peering,
            # Our own identity, so peering.is_active() knows which record in the peering is ours.
            identity=peering.identity(),
            liveness_endpoint=None,
        )

    asyncio.run(run())


if __name__ == "__main__":
    main()
