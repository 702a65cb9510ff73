"""A Session's event log, through the operator's client: what every controller reads.

Its own module so the Checkpoint and Fork controllers need not import the Session
controller (which builds on the Checkpoint controller) for it.
"""

from __future__ import annotations

from typing import Any

from savepoint import k8s
from savepoint.eventlog import EventLog
from savepoint.session import owner_reference


def event_log(body: dict[str, Any]) -> EventLog:
    meta = body["metadata"]
    return EventLog(k8s.core(), meta["namespace"], meta["name"], owner=owner_reference(body))
