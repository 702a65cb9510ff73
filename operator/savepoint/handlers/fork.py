"""Fork handlers: forks and rollbacks advance on their own events and their target's."""

from __future__ import annotations

import kopf

from savepoint.controllers import cache, forget
from savepoint.models import FINISHED_FORK_PHASES, GROUP, SETTLED_CHECKPOINT_PHASES, VERSION
from savepoint.session import SESSION_LABEL

FORKS = (GROUP, VERSION, "forks")
SESSIONS = (GROUP, VERSION, "sessions")
CHECKPOINTS = (GROUP, VERSION, "checkpoints")


@kopf.on.resume(*FORKS, id="fork_resume")
@kopf.on.create(*FORKS, id="fork_create")
def fork_reconcile(namespace: str, name: str, memo: kopf.Memo, **_: object) -> None:
    memo.runtime.fork_pass(namespace, name)


@kopf.index(*FORKS, id="forks_by_session")
def forks_by_session(namespace: str, name: str, status: kopf.Status, **_: object) -> dict | None:
    """Unfinished forks by the session they wait on (status.targetSession: the fork's new
    session, or the session a rollback swaps), so that session's events move them on."""
    if status.get("phase") in FINISHED_FORK_PHASES or not status.get("targetSession"):
        return None
    return {(namespace, status["targetSession"]): name}


@kopf.index(*FORKS, id="rollbacks_by_session")
def rollbacks_by_session(namespace: str, name: str, spec: kopf.Spec, status: kopf.Status, **_: object) -> dict | None:
    """The unfinished rollbacks among those: only a rollback's steps wait on the Session's
    Pod and claim (a fork's new Session tells it all through its own status)."""
    if spec.get("mode") != "Rollback" or status.get("phase") in FINISHED_FORK_PHASES:
        return None
    if not status.get("targetSession"):
        return None
    return {(namespace, status["targetSession"]): name}


@kopf.index(*FORKS, id="forks_by_checkpoint")
def forks_by_checkpoint(namespace: str, name: str, spec: kopf.Spec, status: kopf.Status, **_: object) -> dict | None:
    """Forks still waiting for their checkpoint (no plan resolved yet), by that checkpoint."""
    checkpoint = (spec.get("source") or {}).get("checkpoint")
    if not checkpoint or status.get("plan") or status.get("phase") in FINISHED_FORK_PHASES:
        return None
    return {(namespace, checkpoint): name}


def _awaited_checkpoint(namespace: str, name: str, status: kopf.Status, forks_by_checkpoint: kopf.Index, **_: object):
    # Only a settled checkpoint moves a waiting fork on; a Pending one keeps it waiting.
    settled = status.get("phase") in SETTLED_CHECKPOINT_PHASES
    return settled and (namespace, name) in forks_by_checkpoint


@kopf.on.event(*CHECKPOINTS, id="fork_checkpoint_event", when=_awaited_checkpoint)
def fork_checkpoint_event(
    namespace: str, name: str, forks_by_checkpoint: kopf.Index, memo: kopf.Memo, **_: object
) -> None:
    for fork_name in list(forks_by_checkpoint.get((namespace, name), ())):
        memo.runtime.fork_pass(namespace, fork_name)


@kopf.on.event(*FORKS, id="fork_event")
async def fork_event(type: str | None, body: kopf.Body, namespace: str, name: str, **_: object) -> None:
    # Its body for the passes (controllers/cache.py); forgetting it once it is gone.
    cache.forks.observe(type, dict(body))
    if type == "DELETED":
        forget("fork", namespace, name)


# Filters, so the events of the thousands of sessions no fork waits on cost no worker thread.
def _awaited_session(namespace: str, name: str, forks_by_session: kopf.Index, **_: object) -> bool:
    return (namespace, name) in forks_by_session


def _awaited_child(namespace: str, labels: dict[str, str], rollbacks_by_session: kopf.Index, **_: object) -> bool:
    return (namespace, labels.get(SESSION_LABEL)) in rollbacks_by_session


@kopf.on.event(*SESSIONS, id="fork_session_event", when=_awaited_session)
def fork_session_event(
    type: str | None,
    body: kopf.Body,
    namespace: str,
    name: str,
    forks_by_session: kopf.Index,
    memo: kopf.Memo,
    **_: object,
) -> None:
    cache.sessions.observe(type, dict(body))  # the pass reads it: this event's copy, not an older one
    for fork_name in list(forks_by_session.get((namespace, name), ())):
        memo.runtime.fork_pass(namespace, fork_name)


@kopf.on.event("", "v1", "pods", labels={SESSION_LABEL: kopf.PRESENT}, id="fork_pod_event", when=_awaited_child)
@kopf.on.event(
    "", "v1", "persistentvolumeclaims", labels={SESSION_LABEL: kopf.PRESENT}, id="fork_claim_event", when=_awaited_child
)
def fork_child_event(
    namespace: str, labels: dict[str, str], rollbacks_by_session: kopf.Index, memo: kopf.Memo, **_: object
) -> None:
    for fork_name in list(rollbacks_by_session.get((namespace, labels[SESSION_LABEL]), ())):
        memo.runtime.fork_pass(namespace, fork_name)


# A safety net now, not the engine: events above move every step.
@kopf.timer(
    *FORKS, interval=10, id="fork_progress", when=lambda status, **_: status.get("phase") not in FINISHED_FORK_PHASES
)
def fork_progress(namespace: str, name: str, memo: kopf.Memo, **_: object) -> None:
    memo.runtime.fork_pass(namespace, name)
