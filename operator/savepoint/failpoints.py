"""Named crash points for restart tests.

SAVEPOINT_FAILPOINTS=name[,name...] makes the operator SIGKILL itself when it reaches one
of those points, so a test can stop it at an exact line and prove the restart resumes
correctly. Unset (always, in production) every point is a no-op.
"""

from __future__ import annotations

import logging
import os
import signal

_ACTIVE = frozenset(p for p in os.environ.get("SAVEPOINT_FAILPOINTS", "").split(",") if p)


def hit(name: str) -> None:
    if name in _ACTIVE:
        logging.getLogger(__name__).warning("failpoint %s: killing the operator", name)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
