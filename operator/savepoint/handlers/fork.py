"""Fork handlers: forks and rollbacks advance on their own events and their target's.

Which forks a Session's, a Checkpoint's or a child's event moves on is read from the
unfinished Forks the cache keeps (controllers/fork.py, waiting_on_*); the Checkpoint and
child events come from the runtime's own watches (Runtime.observe_checkpoint, observe_child).
"""

from __future__ import annotations

import kopf

from savepoint.constants import RESTORING_ANNOTATION
from savepoint.controllers import cache, forget
from savepoint.controllers import fork as forks
from savepoint.models import FINISHED_FORK_PHASES, GROUP, VERSION

FORKS = (GROUP, VERSION, "forks")
SESSIONS = (GROUP, VERSION, "sessions")


@kopf.on.event(*FORKS, id="fork_event")
async def fork_event(
    type: str | None, body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, **_: object
) -> None:
    # Its body for the passes and for which forks an event moves on (controllers/cache.py);
    # forgetting it once it is gone. A new Fork, or an unfinished one listed (at start-up,
    # or when a watch lists again), gets a pass. A Fork's spec never changes (the CRD makes
    # it immutable), so its other events need none, and kopf, with no change handler on
    # Forks, writes nothing on them: no progress or last-handled-configuration annotations.
    cache.forks.observe(type, dict(body))
    if type == "DELETED":
        forget("fork", namespace, name)
        forks.forget_rollback(namespace, name)
    elif type in (None, "ADDED") and (body.get("status") or {}).get("phase") not in FINISHED_FORK_PHASES:
        memo.runtime.fork_passes.file((namespace, name))


# A filter, so the events of the thousands of sessions no fork waits on cost nothing more.
def _awaited_session(namespace: str, name: str, **_: object) -> bool:
    return bool(forks.waiting_on_session(namespace, name))


@kopf.on.event(*SESSIONS, id="fork_session_event", when=_awaited_session)
async def fork_session_event(
    type: str | None, body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, **_: object
) -> None:
    cache.sessions.observe(type, dict(body))  # the pass reads it: this event's copy, not an older one
    for fork_name in forks.waiting_on_session(namespace, name):
        memo.runtime.fork_passes.file((namespace, fork_name))
    annotations = body.get("metadata", {}).get("annotations") or {}
    if RESTORING_ANNOTATION not in annotations and forks.rollbacks_waiting_on(namespace, name):
        # A rollback handed its Session back (its hold released): the Session's pass starts
        # the Pod on the restored claim. Nothing else would ask for it: kopf's update
        # handler does not see a savepoint.dev annotation (its own prefix), and the child
        # events of the swap may all have come while the hold was still on.
        memo.runtime.session_passes.file((namespace, name))


# A safety net now, not the engine: events above move every step. Its first tick comes an
# interval after the Fork is seen, not at once beside the create handler's pass.
@kopf.timer(
    *FORKS,
    interval=10,
    initial_delay=10,
    id="fork_progress",
    when=lambda status, **_: status.get("phase") not in FINISHED_FORK_PHASES,
)
def fork_progress(namespace: str, name: str, memo: kopf.Memo, **_: object) -> None:
    memo.runtime.fork_pass(namespace, name)
