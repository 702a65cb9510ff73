"""Named crash and pause points for restart and race tests.

SAVEPOINT_FAILPOINTS=name[,name...] makes the operator SIGKILL itself when it reaches one
of those points, so a test can stop it at an exact line and prove the restart resumes
correctly. `name=sleep:SECONDS` pauses the thread there instead, so a test can run
something else in between (force an interleaving of two code paths). Unset (always, in
production) every point is a no-op.
"""

from __future__ import annotations

import logging
import os
import signal
import time


def _parse(text: str) -> dict[str, float | None]:
    """name -> seconds to sleep, or None to kill."""
    points: dict[str, float | None] = {}
    for entry in (p.strip() for p in text.split(",")):
        if not entry:
            continue
        name, _, action = entry.partition("=")
        if not action:
            points[name] = None
        elif action.startswith("sleep:"):
            points[name] = float(action.removeprefix("sleep:"))
        else:
            raise ValueError(f"SAVEPOINT_FAILPOINTS: {entry!r}: the action must be sleep:SECONDS (or none, to kill)")
    return points


_ACTIVE = _parse(os.environ.get("SAVEPOINT_FAILPOINTS", ""))


def hit(name: str) -> None:
    if name not in _ACTIVE:
        return
    pause = _ACTIVE[name]
    log = logging.getLogger(__name__)
    if pause is not None:
        log.warning("failpoint %s: pausing %.1f s", name, pause)
        time.sleep(pause)
        log.warning("failpoint %s: resuming", name)
        return
    log.warning("failpoint %s: killing the operator", name)
    logging.shutdown()
    os.kill(os.getpid(), signal.SIGKILL)
