"""Savepoint's exception classes, all in one flat module.

This module imports nothing beyond the standard library: the event-log client
(`savepoint.eventlog`) runs inside sandboxes without the operator's dependencies.
"""

from __future__ import annotations


class SavepointError(Exception):
    """Base class of every error Savepoint raises on purpose."""


class SettingsError(SavepointError):
    """A SAVEPOINT_* setting has a value the operator cannot use; the message names it."""


class EventLogError(SavepointError):
    """The event log could not do what was asked (also: retries exhausted under contention)."""


class HistoryUnavailable(EventLogError):
    """Part of the requested sequence range can no longer be read.

    `reason` is "retention" (the chunks holding it were deleted) or "erasure" (the events
    were tombstoned). A rebuild that needs the range must fail with
    SessionHistoryUnavailable; it cannot be repaired.
    """

    def __init__(self, session: str, from_seq: int, to_seq: int, reason: str) -> None:
        self.session = session
        self.from_seq = from_seq
        self.to_seq = to_seq
        self.reason = reason
        why = {
            "retention": "their log chunks were deleted by log retention",
            "erasure": "they were erased (data replaced by a tombstone)",
        }.get(reason, reason)
        span = f"event {from_seq}" if from_seq == to_seq else f"events {from_seq}..{to_seq}"
        super().__init__(f"{span} of session {session!r} are unavailable: {why}")


class SequenceOutOfRange(EventLogError):
    """A sequence number past the end of the log was asked for."""

    def __init__(self, session: str, seq: int, last_seq: int) -> None:
        self.session = session
        self.seq = seq
        self.last_seq = last_seq
        super().__init__(f"session {session!r} has no event {seq}: its log ends at sequence {last_seq}")


class EventTooLarge(EventLogError):
    """An event whose encoding could never fit in an empty log chunk."""

    def __init__(self, event_type: str, size: int, limit: int) -> None:
        self.event_type = event_type
        self.size = size
        self.limit = limit
        super().__init__(
            f"event of type {event_type!r} is {size} bytes encoded, but a log chunk holds at "
            f"most {limit} bytes (max_chunk_bytes); store large payloads elsewhere (for "
            "example in the workspace) and put a reference in the event"
        )


class EventTooDeep(EventLogError):
    """An event whose data nests deeper than the log accepts (savepoint.eventlog.MAX_EVENT_DEPTH)."""

    def __init__(self, event_type: str, limit: int) -> None:
        self.event_type = event_type
        self.limit = limit
        super().__init__(
            f"event of type {event_type!r}: data nests deeper than {limit} levels of objects and "
            f"arrays (MAX_EVENT_DEPTH); flatten it, or store it elsewhere and put a reference in the event"
        )


class MalformedChunk(EventLogError):
    """A log chunk (ConfigMap) holds something this library did not write."""

    def __init__(self, chunk: str, key: str | None, problem: str) -> None:
        self.chunk = chunk
        self.key = key
        self.problem = problem
        where = f"key {key!r} of ConfigMap {chunk!r}" if key is not None else f"ConfigMap {chunk!r}"
        super().__init__(f"malformed event-log chunk: {where}: {problem} (was the ConfigMap edited by hand?)")
