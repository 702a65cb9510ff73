"""Fork handlers: forks and rollbacks advance on their own events and their target's.

Which forks a Session's, a Checkpoint's or a child's event moves on is read from the
unfinished Forks the cache keeps (controllers/fork.py, waiting_on_*); the Checkpoint and
child events come from the runtime's own watches (Runtime.observe_checkpoint, observe_child).
"""

from __future__ import annotations

import kopf

from savepoint.constants import RESTORING_ANNOTATION
from savepoint.controllers import cache
from savepoint.controllers import fork as forks
from savepoint.models import GROUP, VERSION

FORKS = (GROUP, VERSION, "forks")
SESSIONS = (GROUP, VERSION, "sessions")


@kopf.on.event(*FORKS, id="fork_event")
async def fork_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: object) -> None:
    # kopf, with no change handler, timer or daemon on Forks, writes nothing on them: no
    # progress annotations, and no finalizer that would keep a Fork until we remove it.
    memo.runtime.observe_fork(type, dict(body))


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
