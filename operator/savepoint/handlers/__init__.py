"""kopf decorators only; each handler delegates to savepoint.reconcile."""

from savepoint.handlers import checkpoint, fork, operator, session  # noqa: F401  (registers the handlers)
