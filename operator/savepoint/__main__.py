"""`python -m savepoint`: run the operator against the current kubeconfig or in-cluster."""

from __future__ import annotations

import asyncio
import logging

import kopf

from savepoint.config import load


def main() -> None:
    settings = load()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    import savepoint.handlers  # noqa: F401  (registers the handlers)
    from savepoint import metrics

    metrics.serve(settings.metrics_port)

    asyncio.run(
        kopf.operator(
            clusterwide=not settings.namespaces,
            namespaces=list(settings.namespaces),
            standalone=not settings.peering,
            liveness_endpoint=None,
        )
    )


if __name__ == "__main__":
    main()
