"""Which replica is active: kopf's peering decision, readable from our own threads.

kopf pauses this operator's handlers while its peering object (a ClusterKopfPeering, or
a KopfPeering in each watched namespace, named SAVEPOINT_PEERING) lists another live
peer with the same or a higher priority; that pause is internal to kopf. Work that
kopf does not drive (the expiry loop's thread) asks is_active() before each pass, which
applies the same rule to the peering object as it is now. Standalone means active.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any

from savepoint import k8s, metrics
from savepoint.config import Settings
from savepoint.timestamps import parse_rfc3339

log = logging.getLogger(__name__)

# kopf's assumption for a peer that does not say its lifetime.
DEFAULT_LIFETIME = 60


@cache
def identity() -> str:
    """This process's name among the peers, passed to kopf so both mean the same record.

    POD_ID (as kopf reads it) or the host name, which in a Pod is the Pod's name, plus
    the pid and a random part so a restarted process is a new peer. (Not the user name:
    a container's uid may have no passwd entry.)
    """
    base = os.environ.get("POD_ID") or socket.gethostname()
    return f"{base}/{os.getpid()}/{secrets.token_hex(3)}"


def blocking_peers(status: Mapping[str, Any] | None, me: str, priority: int, now: datetime) -> list[str]:
    """The live peers, other than `me`, that make kopf pause us: same or higher priority.

    `status` is a peering object's status, `{identity: {priority, lifetime, lastseen}}`,
    read as kopf reads it (peering.py, Peer): a missing lastseen counts as now, a record
    past lastseen + lifetime is dead.
    """
    blockers: list[str] = []
    for peer, info in (status or {}).items():
        if peer == me or not isinstance(info, Mapping):
            continue
        try:
            lifetime = int(info.get("lifetime", DEFAULT_LIFETIME))
            seen = parse_rfc3339(info["lastseen"]) if info.get("lastseen") else now
            their = int(info.get("priority", 0))
        except (TypeError, ValueError):
            continue  # not a record kopf wrote; kopf would fail on it, we ignore it
        if seen + timedelta(seconds=lifetime) > now and their >= priority:
            blockers.append(peer)
    return blockers


def decide(peerings: Iterable[dict | None], me: str, priority: int, now: datetime) -> bool:
    """Active when every peering object exists and none has a blocking peer.

    Peering is mandatory here (handlers/operator.py): kopf starts paused and stays so
    until it has seen its peering object, so a missing object means standby too.
    """
    return all(body is not None and not blocking_peers(body.get("status"), me, priority, now) for body in peerings)


_last: bool | None = None


def is_active(settings: Settings) -> bool:
    """Whether this replica is the active one now (one GET per peering object when peered)."""
    global _last
    active = _read(settings) if settings.peering else True
    if active != _last:
        _last = active
        metrics.peering_active.set(1 if active else 0)
        if settings.peering:
            state = "active" if active else "standing by"
            log.info("this replica is %s (peering %r, priority %d)", state, settings.peering, settings.peering_priority)
    return active


def last_known(settings: Settings) -> bool:
    """is_active() as the expiry loop last found it (every few seconds), without asking again."""
    return is_active(settings) if _last is None else bool(_last)


def _read(settings: Settings) -> bool:
    try:
        namespaces = settings.namespaces or (None,)
        bodies = [k8s.get_kopf_peering(settings.peering, ns) for ns in namespaces]
    except Exception:  # unknown is not active: a sweep now could race the active replica's
        log.warning("could not read peering %r; standing by", settings.peering, exc_info=True)
        return False
    return decide(bodies, identity(), settings.peering_priority, datetime.now(UTC))
