"""kopf decorators; each handler delegates to a controller in savepoint.controllers (docs/architecture.md)."""

from savepoint.handlers import checkpoint, fork, operator, session  # noqa: F401  (registers the handlers)
