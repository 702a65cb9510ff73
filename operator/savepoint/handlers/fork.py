"""Fork handlers: forks and rollbacks advance on their own events and their target's."""

from __future__ import annotations

import kopf

from savepoint.config import load
from savepoint.controllers import fork
from savepoint.metrics import count_errors
from savepoint.models import GROUP, VERSION

FORKS = (GROUP, VERSION, "forks")
settings = load()


@kopf.on.resume(*FORKS, id="fork_resume")
@kopf.on.create(*FORKS, id="fork_create")
def fork_reconcile(namespace: str, name: str, **_: object) -> None:
    with count_errors("fork"):
        fork.reconcile_fork(namespace, name, settings)


@kopf.timer(
    *FORKS, interval=2, id="fork_progress", when=lambda status, **_: status.get("phase") not in ("Succeeded", "Failed")
)
def fork_progress(namespace: str, name: str, **_: object) -> None:
    with count_errors("fork"):
        fork.reconcile_fork(namespace, name, settings)
