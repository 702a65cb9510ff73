"""RFC 3339 times as Savepoint writes and reads them: UTC, with a `Z`.

Standard library only: the event-log client, which runs inside sandboxes, uses it too.
Status fields (createdAt, expiresAt, condition times) carry whole seconds; an event's
`time` carries microseconds, so events appended within one second still read in order.
"""

from __future__ import annotations

from datetime import UTC, datetime


def rfc3339(moment: datetime, micro: bool = False) -> str:
    """`moment` in UTC with a `Z` (a naive one counts as UTC), to the second or the microsecond."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


def now_rfc3339(micro: bool = False) -> str:
    return rfc3339(datetime.now(UTC), micro)


def parse_rfc3339(text: str) -> datetime:
    """An aware datetime from an RFC 3339 time (a `Z` or an offset; none counts as UTC)."""
    moment = datetime.fromisoformat(text)
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
