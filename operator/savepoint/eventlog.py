"""The session event log: an append-only, chunked log of events kept in ConfigMaps.

Used by the operator and by harnesses inside sandboxes, so it imports only the standard
library and the synchronous `kubernetes` client (never kopf). docs/event-log.md is the
user-facing description; DESIGN.md section 3 is the specification.

Storage: ConfigMaps `<session>-log-<index:06d>` (index from 1), labelled
`savepoint.dev/session=<session>`. Each holds one data key per event: the key is the
sequence number zero-padded to 12 digits and the value the event's JSON, so a reader
sees a gap as a missing key. The annotation `savepoint.dev/first-seq` gives the chunk's
first sequence number (an empty chunk still knows where it starts), and
`savepoint.dev/sealed: "true"` marks a chunk that takes no more events.

Concurrency: every write is conditional on the chunk's resourceVersion, so of two
writers that read the same state one wins and the other gets 409 and retries from a
fresh read. A full chunk is first sealed (a conditional write, so an append racing it
conflicts) and only then is the next chunk created holding the new event; AlreadyExists
means another writer rolled over first. Only the newest chunk is ever unsealed, so a
sequence number can be taken in exactly one place.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import random
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

from savepoint.constants import API_VERSION, MANAGED_BY, MANAGED_BY_LABEL, MERGE_PATCH, SESSION_LABEL
from savepoint.errors import (
    EventLogError,
    EventTooDeep,
    EventTooLarge,
    HistoryUnavailable,
    MalformedChunk,
    SequenceOutOfRange,
)

# Re-exported: the readers of Event.time parse it here.
from savepoint.timestamps import parse_rfc3339 as parse_time
from savepoint.timestamps import rfc3339

__all__ = [
    "TOMBSTONE_KEY",
    "Cursor",
    "Event",
    "Seeded",
    "EventLog",
    "effective_history",
    "summarize",
]

TOMBSTONE_KEY = "savepoint.dev/erased"
FIRST_SEQ_ANNOTATION = "savepoint.dev/first-seq"
SEALED_ANNOTATION = "savepoint.dev/sealed"

# Event types with a meaning to this module.
ROLLBACK = "session.rollback"
RUN_STARTED = "run.started"
RUN_COMPLETED = "run.completed"
APPROVAL_REQUEST = "agent.approval_request"
APPROVAL = "user.approval"
INTERRUPT = "user.interrupt"

KEY_DIGITS = 12
MAX_SEQ = 10**KEY_DIGITS - 1
# The API server refuses a ConfigMap whose keys plus values exceed 1 MiB.
CONFIGMAP_DATA_LIMIT = 1024 * 1024
# The hard cap of a chunk's data, and so the largest event that can be stored.
DEFAULT_MAX_CHUNK_BYTES = 900 * 1024
# Where a chunk stops taking small events, chosen by measurement (docs/event-log.md,
# "Performance"): every append makes the API server decode, patch, re-encode and store
# the whole chunk, so appends to a near-full 900 KiB chunk are several times slower
# than to a small one, while small chunks only add objects to a full read.
DEFAULT_ROLLOVER_BYTES = 64 * 1024
# How deep an event's data may nest (objects and arrays): Python's JSON encoder and decoder
# recurse, and far below their limit of about 1,000 so a reader in a deeper stack still copes.
MAX_EVENT_DEPTH = 100

# Optional observers, which the operator sets to count into its metrics
# (metrics.observe_eventlog); a harness leaves them None. on_append gets each event as it
# lands, on_conflict is called for each lost optimistic-concurrency race. Must not raise.
on_append: Callable[[Event], None] | None = None
on_conflict: Callable[[], None] | None = None
# Called by apply_retention for each chunk it deletes, with its name and its data's bytes.
on_retention: Callable[[str, int], None] | None = None
# Called with each chunk this process reads by name or writes, as the API server answered
# (a ConfigMap), and for a write the monotonic time it was sent (None for a read): the
# operator keeps the newest chunk of each log from its watch and these. A conditional
# write only lands on the newest chunk, so its answer is the log's newest chunk as it was
# at some moment after it was sent: as good as a read sent then.
on_chunk: Callable[[dict[str, Any], float | None], None] | None = None

_KEY_RE = re.compile(r"\d{12}")
_META_ACCEPT = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"
_CONTINUE_RE = re.compile(rb'"continue":"([^"]*)"')


# ---------------------------------------------------------------------------- events


def format_time(moment: datetime) -> str:
    """The format of `Event.time`: RFC 3339 in UTC to the microsecond."""
    return rfc3339(moment, micro=True)


def _seq_key(seq: int) -> str:
    return f"{seq:0{KEY_DIGITS}d}"


def newest_type(chunk: dict[str, Any]) -> str | None:
    """The type of a chunk's (a ConfigMap's) newest event; None when it holds none, or the
    newest is not an event as this module writes them."""
    keys = [k for k in (chunk.get("data") or {}) if _KEY_RE.fullmatch(k)]
    if not keys:
        return None
    try:
        kind = json.loads(chunk["data"][max(keys)]).get("type")
    except (ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None


def _new_event_id(seq: int, nonce: str) -> str:
    # The sequence number, zero-padded, then 48 random bits. Sorting ids sorts by seq,
    # which is the log's true order; a ULID would sort by the writer's clock, and
    # writers in different pods disagree about time. The random part makes an id
    # recorded elsewhere (a checkpoint's throughEventId) detect a log that was deleted
    # and rebuilt under the same name, and lets a writer recognise its own event after
    # a write whose outcome it never heard.
    return f"{_seq_key(seq)}-{nonce}"


@dataclass(frozen=True)
class Event:
    seq: int
    id: str
    type: str
    time: str
    data: dict[str, Any]
    subject: str | None = None

    @property
    def erased(self) -> bool:
        return self.data.get(TOMBSTONE_KEY) is True

    def to_json(self) -> str:
        obj: dict[str, Any] = {"seq": self.seq, "id": self.id, "type": self.type, "time": self.time}
        if self.subject is not None:
            obj["subject"] = self.subject
        obj["data"] = self.data
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> Event:
        """Parse one event; ValueError (json.JSONDecodeError included) says what is wrong."""
        return _event_from_obj(json.loads(text))


def _event_from_obj(obj: Any) -> Event:
    # The common case in one expression: reads of 100,000 events go through here.
    if (
        type(obj) is dict
        and type(seq := obj.get("seq")) is int
        and seq > 0
        and type(id_ := obj.get("id")) is str
        and id_
        and type(type_ := obj.get("type")) is str
        and type_
        and type(time_ := obj.get("time")) is str
        and time_
        and type(data := obj.get("data")) is dict
        and ((subject := obj.get("subject")) is None or type(subject) is str)
    ):
        return Event(seq, id_, type_, time_, data, subject)
    if not isinstance(obj, dict):
        raise ValueError("an event must be a JSON object")
    seq = obj.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise ValueError("seq must be a positive integer")
    for name in ("id", "type", "time"):
        if not isinstance(obj.get(name), str) or not obj[name]:
            raise ValueError(f"{name} must be a non-empty string")
    if not isinstance(obj.get("data"), dict):
        raise ValueError("data must be a JSON object")
    subject = obj.get("subject")
    if subject is not None and not isinstance(subject, str):
        raise ValueError("subject must be a string")
    raise ValueError("not an event")  # a subclass of str or dict: not what we write


@dataclass(frozen=True)
class Seeded:
    """A chunk given to EventLog.seed: where it is in the log, and its events."""

    index: int
    first_seq: int
    sealed: bool
    events: list[Event]


@dataclass(frozen=True)
class Cursor:
    seq: int
    id: str


# ---------------------------------------------------------------- pure functions


def effective_history(events: Sequence[Event]) -> list[Event]:
    """The effective conversation: what is left after honouring `session.rollback`.

    A rollback event with `data.toSequence = N` makes the history at that point equal to
    the effective history of events 1..N, followed by the rollback event itself; the
    events between N and the rollback are a closed branch. Because "the history of
    events 1..N" is itself effective, nested rollbacks compose, including a rollback to
    a point inside an earlier closed branch (a checkpoint taken there). A rollback with
    no valid `toSequence` (e.g. erased) counts as an ordinary event. Gaps in the input
    are tolerated: rolling back to a missing N lands on the newest event before it.
    Idempotent: effective_history(effective_history(x)) == effective_history(x).
    """
    ordered = sorted(events, key=lambda e: e.seq)
    seqs: list[int] = []
    parents: list[int] = []
    for i, event in enumerate(ordered):
        parent = i - 1
        if event.type == ROLLBACK:
            target = event.data.get("toSequence")
            if isinstance(target, int) and not isinstance(target, bool) and 0 <= target < event.seq:
                parent = bisect.bisect_right(seqs, target) - 1
        seqs.append(event.seq)
        parents.append(parent)
    chain: list[Event] = []
    i = len(ordered) - 1
    while i >= 0:
        chain.append(ordered[i])
        i = parents[i]
    chain.reverse()
    return chain


def _ident(data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    return str(value)


def _open(pending: list[str | None], ident: str | None) -> None:
    if ident is None or ident not in pending:
        pending.append(ident)


def _close(pending: list[str | None], ident: str | None) -> None:
    if ident is not None and ident in pending:
        pending.remove(ident)
        return
    # No id to match on: the oldest open one, preferring one that had no id either.
    for i, other in enumerate(pending):
        if other is None:
            del pending[i]
            return
    if ident is None and pending:
        del pending[0]


def summarize(events: Sequence[Event]) -> dict[str, Any]:
    """What the Session controller derives its phase from, over the effective history.

    - run_in_flight: a run.started without a later run.completed (matched by
      data.runId when both carry one, else by order);
    - approval_pending: an agent.approval_request without a later user.approval
      (matched by data.requestId likewise);
    - runs: completed runs (run.completed events, a repeated runId counted once).
    """
    runs_open: list[str | None] = []
    approvals_open: list[str | None] = []
    completed_ids: set[str] = set()
    runs = 0
    for event in effective_history(events):
        if event.type == RUN_STARTED:
            _open(runs_open, _ident(event.data, "runId"))
        elif event.type == RUN_COMPLETED:
            run_id = _ident(event.data, "runId")
            _close(runs_open, run_id)
            if run_id is None:
                runs += 1
            elif run_id not in completed_ids:
                completed_ids.add(run_id)
                runs += 1
        elif event.type == APPROVAL_REQUEST:
            _open(approvals_open, _ident(event.data, "requestId"))
        elif event.type == APPROVAL:
            _close(approvals_open, _ident(event.data, "requestId"))
    return {
        "run_in_flight": bool(runs_open),
        "approval_pending": bool(approvals_open),
        "runs": runs,
    }


# ---------------------------------------------------------------------- chunks


@dataclass
class _Meta:
    index: int
    name: str
    first_seq: int


@dataclass
class _Chunk:
    index: int
    name: str
    resource_version: str
    first_seq: int
    sealed: bool
    data: dict[str, str]
    last_seq: int  # first_seq - 1 when empty
    used: int  # bytes of keys plus values, as the API server counts them

    def event(self, seq: int) -> Event | None:
        key = _seq_key(seq)
        text = self.data.get(key)
        if text is None:
            return None
        return _parse_event(self.name, key, text)

    def events(self, lo: int, hi: int) -> list[Event]:
        """Events lo..hi, all of which must be here."""
        out = []
        data = self.data
        for seq in range(lo, hi + 1):
            key = f"{seq:012d}"
            text = data.get(key)
            if text is None:
                raise MalformedChunk(self.name, key, "missing: the chunk has a gap")
            out.append(_parse_event(self.name, key, text))
        return out


_DECODER = json.JSONDecoder()


def _parse_event(chunk: str, key: str, text: str) -> Event:
    try:
        try:
            obj, end = _DECODER.raw_decode(text)  # json.loads without its per-call overhead
            if end != len(text):
                raise ValueError
        except ValueError:
            obj = json.loads(text)  # surrounding whitespace is fine; anything else says why
        event = _event_from_obj(obj)
    except ValueError as err:
        raise MalformedChunk(chunk, key, f"value is not a valid event: {err}") from None
    except RecursionError:
        raise MalformedChunk(chunk, key, "value nests too deeply to parse") from None
    if event.seq != int(key):
        raise MalformedChunk(chunk, key, f"value holds seq {event.seq}, not {int(key)}")
    return event


def _first_seq(meta: dict[str, Any]) -> int:
    raw = (meta.get("annotations") or {}).get(FIRST_SEQ_ANNOTATION)
    if raw is None or not raw.isdigit() or int(raw) < 1:
        raise MalformedChunk(
            meta["name"],
            None,
            f"annotation {FIRST_SEQ_ANNOTATION} is missing or not a positive integer",
        )
    return int(raw)


def _parse_chunk(obj: dict[str, Any], index: int) -> _Chunk:
    meta = obj["metadata"]
    name = meta["name"]
    first = _first_seq(meta)
    if obj.get("binaryData"):
        key = sorted(obj["binaryData"])[0]
        raise MalformedChunk(name, key, "binaryData is never written by the event log")
    data: dict[str, str] = obj.get("data") or {}
    last = first - 1
    used = 0
    for key, value in data.items():
        if not _KEY_RE.fullmatch(key):
            raise MalformedChunk(name, key, "key is not a 12-digit sequence number")
        seq = int(key)
        if seq < first:
            raise MalformedChunk(name, key, f"below the chunk's first sequence {first}")
        last = max(last, seq)
        used += len(key) + len(value.encode())
    sealed = (meta.get("annotations") or {}).get(SEALED_ANNOTATION) == "true"
    return _Chunk(index, name, meta["resourceVersion"], first, sealed, data, last, used)


@dataclass
class _Draft:
    """An event waiting for its sequence number (or, when copying, one that has it)."""

    type: str
    data: dict[str, Any]
    subject: str | None
    time: str
    nonce: str
    fixed: Event | None = None

    def at(self, seq: int) -> Event:
        if self.fixed is not None:
            return self.fixed
        return Event(seq, _new_event_id(seq, self.nonce), self.type, self.time, self.data, self.subject)


def _depth_exceeds(data: Any, limit: int) -> bool:
    """Whether objects and arrays nest more than `limit` deep in `data` (itself level 1).

    Iterative, so it cannot itself run out of stack; a cycle counts as too deep.
    """
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Iterable[Any] = value.values()
        elif isinstance(value, list | tuple):
            children = value
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list | tuple))
    return False


class _Conflict(Exception):
    """409: the chunk changed under us (update) or someone created it first (create)."""


class _Stale(Exception):
    """A write against a seeded chunk (EventLog.seed) did not land as it was: read afresh."""


class _Ambiguous(Exception):
    """The request may or may not have been applied (timeout, 5xx, dropped connection)."""


class _Gone(Exception):
    """404 on a write: the chunk was deleted (log deleted, or a stale cache)."""


class _Diverged(Exception):
    """A copy's next event does not have the target's next sequence number."""


def _classify(err: Exception) -> Exception:
    if isinstance(err, ApiException):
        if err.status == 409:
            return _Conflict()
        if err.status == 404:
            return _Gone()
        if err.status == 429:
            # Refused before it was processed: retrying is safe.
            return _Conflict()
        if err.status == 0 or err.status >= 500:
            return _Ambiguous()
        return err
    if isinstance(err, urllib3.exceptions.HTTPError | ConnectionError | TimeoutError):
        return _Ambiguous()
    return err


def _label_value(session: str) -> str:
    if len(session) <= 63:
        return session
    # Label values stop at 63 characters; chunk names still say exactly whose they are.
    return f"{session[:54]}-{hashlib.sha256(session.encode()).hexdigest()[:8]}"


# ---------------------------------------------------------------------- the log


class EventLog:
    """One session's event log. Thread-safe; any number of processes may write at once."""

    def __init__(
        self,
        core: Any,
        namespace: str,
        session: str,
        *,
        owner: dict[str, Any] | None = None,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        rollover_bytes: int = DEFAULT_ROLLOVER_BYTES,
        max_attempts: int = 200,
        request_timeout: float = 30.0,
        discovery: str = "list",
    ) -> None:
        if discovery not in ("list", "names"):
            raise ValueError('discovery is "list" (label-selector lists) or "names" (GETs by chunk name)')
        if not 1024 <= max_chunk_bytes <= CONFIGMAP_DATA_LIMIT - 4096:
            raise ValueError(
                f"max_chunk_bytes must be between 1024 and {CONFIGMAP_DATA_LIMIT - 4096} "
                f"(a ConfigMap holds at most {CONFIGMAP_DATA_LIMIT} bytes of data)"
            )
        self.core = core
        self.namespace = namespace
        self.session = session
        self.owner = owner
        self.max_chunk_bytes = max_chunk_bytes
        # A chunk takes events while its data stays within rollover_bytes; an event
        # bigger than that (up to max_chunk_bytes) gets a chunk of its own.
        self.rollover_bytes = min(rollover_bytes, max_chunk_bytes)
        self._page = max(1, (8 * 1024 * 1024) // self.rollover_bytes)  # chunks per list call
        self.max_attempts = max_attempts
        self.request_timeout = request_timeout
        # "names": never list, find chunks by GETs of their names (a sandbox's token may
        # not list ConfigMaps: docs/security.md).
        self.discovery = discovery
        # Lost optimistic-concurrency races (409s and 429s), for metrics.
        self.conflicts = 0
        self._selector = f"{SESSION_LABEL}={_label_value(session)}"
        self._name_re = re.compile(re.escape(session) + r"-log-(\d{6})")
        self._lock = threading.RLock()
        self._tail: _Chunk | None = None  # the newest chunk as of our last write to it
        self._hint: int | None = None  # index of the newest chunk we know of
        self._new = False  # taken to have no chunk yet, unread (start_from)
        self.listed: list[str] = []  # the chunk names the last read() found, oldest first
        # The chunk whose values _check_tail last found valid, and those values by key.
        self._checked_chunk: str | None = None
        self._checked: dict[str, str] = {}
        self.retained_from: int | None = None  # set by apply_retention

    def __repr__(self) -> str:
        return f"EventLog(namespace={self.namespace!r}, session={self.session!r})"

    def chunk_name(self, index: int) -> str:
        return f"{self.session}-log-{index:06d}"

    def chunk_names(self) -> list[str]:
        """Names of the chunks that exist now, oldest first (one metadata-only list call)."""
        return [meta.name for meta in self._list_meta()]

    # ------------------------------------------------------------- public API

    def ensure(self) -> None:
        """Create the first chunk, empty, unless the log already has a chunk."""
        if self._list_meta():
            return
        try:
            self._create(1, 1, [])
        except ApiException as err:
            if err.status != 409:  # AlreadyExists: someone else ensured it
                raise

    def seed(self, chunk: dict[str, Any] | None) -> Seeded | None:
        """Take `chunk` (a ConfigMap a watch delivered) as the newest chunk, instead of
        reading it: the next append_once writes against it, one request instead of two.
        Returns where it is and its events, or None when it is not this log's or does not parse.

        A stale chunk costs a conflict, not an event: every write is conditional on its
        resourceVersion, and append_once reads afresh after a write against a seed fails.
        """
        if not chunk:
            return None
        found = self._name_re.fullmatch(chunk.get("metadata", {}).get("name", ""))
        if found is None:
            return None
        try:
            tail = _parse_chunk(chunk, int(found.group(1)))
            events = tail.events(tail.first_seq, tail.last_seq)
        except MalformedChunk:
            return None
        with self._lock:
            self._tail, self._hint = tail, tail.index
        return Seeded(tail.index, tail.first_seq, tail.sealed, events)

    def load_newest(self, hint: int | None = None) -> Seeded | None:
        """The newest chunk read afresh (from index `hint` on, a lower bound of it, when
        given), kept for a following append like a seed; None when the log has no chunk."""
        with self._lock:
            if hint:
                self._hint = hint
            tail = self._load_tail()
            self._tail = tail
        if tail is None:
            return None
        return Seeded(tail.index, tail.first_seq, tail.sealed, tail.events(tail.first_seq, tail.last_seq))

    @property
    def newest_first_seq(self) -> int | None:
        """The first seq of the newest chunk as last read or written (None: not known)."""
        tail = self._tail
        return tail.first_seq if tail is not None else None

    @property
    def newest_index(self) -> int | None:
        """The index of the newest chunk as last read or written (None: not known)."""
        tail = self._tail
        return tail.index if tail is not None else None

    def append(self, type: str, data: dict[str, Any], subject: str | None = None) -> Event:
        """Append one event and return it with its seq and id."""
        return self._write([self._draft(type, data, subject)])[0]

    def append_once(
        self,
        type: str,
        data: dict[str, Any],
        *,
        after: int,
        same: Callable[[Event], bool],
        newest_hint: int | None = None,
    ) -> Event | None:
        """Append unless an event after seq `after` already matches `same` (the write of a
        retried pass); None when it is there. The newest chunk alone answers when it holds
        every event after `after`, and the write reuses that read: one read, one write.
        `newest_hint` is a lower bound of the newest chunk's index (a Session's
        status.eventLog.chunks), which spares listing the chunks first."""
        with self._lock:
            if self._hint is None and newest_hint:
                self._hint = newest_hint
            seeded = self._tail is not None and not self._tail.sealed
            tail = self._tail if seeded else self._load_tail()
            self._tail = tail
        if tail is not None and tail.first_seq <= after + 1:
            if tail.last_seq > after:
                self._check_tail(tail)
            found = tail.events(after + 1, tail.last_seq) if tail.last_seq > after else []
        else:
            found = self.read(from_seq=max(1, after + 1), partial=True)
        if any(same(event) for event in found):
            return None
        if not seeded:
            return self.append(type, data)
        try:
            return self._write([self._draft(type, data)], once=True)[0]
        except _Stale:
            # The seed was not the newest chunk (or the write's outcome is unknown): look
            # again in a fresh read, which shows an event that did land.
            with self._lock:
                self._tail = None
            return self.append_once(type, data, after=after, same=same)

    def append_many(
        self, items: Iterable[tuple[str, dict[str, Any]] | tuple[str, dict[str, Any], str | None]]
    ) -> list[Event]:
        """Append several events in as few writes as fit; they keep their relative order.

        Events that fit one chunk are written in one request (all or none). A batch that
        crosses a chunk boundary is written in several, and another writer's events may
        then fall between its parts.
        """
        drafts = [self._draft(*item) for item in items]
        return self._write(drafts) if drafts else []

    def read(self, from_seq: int = 1, to_seq: int | None = None, *, partial: bool = False) -> list[Event]:
        """Events from_seq..to_seq (inclusive; to_seq None means the end of the log).

        Raises HistoryUnavailable naming the first unreadable span and why (retention
        deleted its chunks, or its events were erased), and SequenceOutOfRange when
        to_seq is past the end. With partial=True nothing is raised for those: deleted
        events are skipped and erased ones returned with their tombstone data.
        """
        if from_seq < 1:
            raise ValueError("from_seq starts at 1")
        if to_seq is not None and to_seq < from_seq:
            return []
        if from_seq == 1 and to_seq is None and self.discovery != "names":
            # The whole log: one paged list of the chunks, without the metadata list first.
            chunks = self._list_chunks(None)
            metas = [_Meta(c.index, c.name, c.first_seq) for c in chunks]
            return self._finish_read(metas, chunks, set(), from_seq, to_seq, partial)
        metas = self._list_meta()
        chosen: list[_Meta] = []
        for i, meta in enumerate(metas):
            ends_before = i + 1 < len(metas) and metas[i + 1].first_seq <= from_seq
            if ends_before:
                continue
            if to_seq is not None and meta.first_seq > to_seq:
                break
            chosen.append(meta)
        if len(chosen) > 3:
            # One paged list beats a request per chunk on long reads.
            chunks = self._list_chunks({m.index for m in chosen})
        else:
            chunks = [c for c in (self._get(m.index) for m in chosen) if c is not None]
        # A chunk listed but gone by the time we fetched it was deleted by retention.
        gone = {m.index for m in chosen} - {c.index for c in chunks}
        return self._finish_read(metas, chunks, gone, from_seq, to_seq, partial)

    def _finish_read(
        self,
        metas: list[_Meta],
        chunks: list[_Chunk],
        gone: set[int],
        from_seq: int,
        to_seq: int | None,
        partial: bool,
    ) -> list[Event]:
        # Chunks created since the listing hold nothing older than what we have.
        while chunks and chunks[-1].sealed and chunks[-1].index == metas[-1].index:
            nxt = self._get(chunks[-1].index + 1)
            if nxt is None or (to_seq is not None and nxt.first_seq > to_seq):
                break
            chunks.append(nxt)
            metas.append(_Meta(nxt.index, nxt.name, nxt.first_seq))
        present = {m.index for m in metas} - gone
        self.listed = [m.name for m in metas if m.index in present]
        # The log's end is known only when its newest chunk was read; a to_seq below the
        # newest chunk's first seq is inside the log anyway.
        if not metas:
            log_end: int | None = 0
        elif chunks and chunks[-1].index == metas[-1].index:
            log_end = chunks[-1].last_seq
            # The newest chunk as just read: an append that follows starts from it instead of
            # listing again (its write is conditional, so a stale one only costs a conflict).
            self._tail, self._hint = chunks[-1], chunks[-1].index
        else:
            log_end = None
        return self._collect(chunks, present, from_seq, to_seq, log_end, partial)

    def cursor(self) -> Cursor:
        """The last event's seq and id; Cursor(0, "") for an empty or missing log."""
        with self._lock:
            self._tail = None
            tail = self._load_tail()
        if tail is None or tail.last_seq < 1:
            return Cursor(0, "")
        event = tail.event(tail.last_seq)
        if event is None:  # an empty chunk after a full one: only by hand
            event = self.read(tail.last_seq, tail.last_seq, partial=True)[-1]
        return Cursor(event.seq, event.id)

    def effective_history(self, *, partial: bool = False) -> list[Event]:
        """effective_history() of the whole log (see read() for partial)."""
        return effective_history(self.read(1, None, partial=partial))

    def apply_retention(self, older_than: timedelta, now: datetime | None = None) -> list[str]:
        """Delete the oldest chunks whose newest event is older than `older_than`.

        Only a prefix of sealed chunks is deleted (the log never gets a hole in the
        middle) and never the newest chunk, which is the one being written. Returns the
        names of the deleted chunks; afterwards `retained_from` is the first sequence
        number still stored (1 when nothing was ever deleted, None for a log with no chunk).
        """
        now = now or datetime.now(UTC)
        if now.tzinfo is None:
            now = now.replace(tzinfo=UTC)
        cutoff = now - older_than
        deleted: list[str] = []
        metas = self._list_meta()
        kept = 0  # index in metas of the oldest chunk that stays
        for meta in metas[:-1]:
            chunk = self._get(meta.index)
            if chunk is not None:
                if not chunk.sealed:
                    break
                newest = chunk.event(chunk.last_seq)
                if newest is not None and parse_time(newest.time) >= cutoff:
                    break
                self._delete_chunk(chunk.name)
                deleted.append(chunk.name)
                if on_retention is not None:
                    on_retention(chunk.name, chunk.used)
            kept += 1
        self.retained_from = metas[kept].first_seq if metas else None
        return deleted

    def erase(self, subject: str) -> int:
        """Replace the data of every event with this subject by a tombstone.

        Covers the events appended before the call. Returns how many events it erased
        now (0 when called again). Type, seq, id, time and subject stay, so erased
        events keep their place; reading them raises HistoryUnavailable.
        """
        erased = 0
        for meta in self._list_meta():
            for attempt in range(1, self.max_attempts + 1):
                chunk = self._get(meta.index)
                if chunk is None:
                    break
                changes: dict[str, str] = {}
                for key, text in chunk.data.items():
                    event = _parse_event(chunk.name, key, text)
                    if event.subject == subject and not event.erased:
                        tomb = dataclasses.replace(event, data={TOMBSTONE_KEY: True})
                        changes[key] = tomb.to_json()
                if not changes:
                    break
                try:
                    self._patch(chunk, {"data": changes})
                except ApiException as err:
                    if not isinstance(_classify(err), _Conflict):
                        raise
                    self._count_conflict()
                    self._backoff(attempt)
                    continue
                erased += len(changes)
                break
            else:
                raise EventLogError(
                    f"erasing subject {subject!r} from {meta.name}: gave up after "
                    f"{self.max_attempts} conflicting attempts"
                )
        with self._lock:
            self._tail = None
        return erased

    def copy_to(self, target: EventLog, through_seq: int) -> Cursor:
        """Copy events 1..through_seq, unchanged, into `target` (a new session's log).

        Idempotent and resumable: events the target already holds are checked (same id)
        and skipped. The target may have gone on to append its own events after a
        completed copy: the cursor returned is then the target's, past through_seq.
        Raises HistoryUnavailable when the source prefix is incomplete, EventLogError
        when the target holds different events.
        """
        if through_seq < 0:
            raise ValueError("through_seq must be >= 0")
        if through_seq == 0:
            target.ensure()
            return Cursor(0, "")
        source = self.read(1, through_seq)
        done = Cursor(through_seq, source[-1].id)
        for attempt in range(1, self.max_attempts + 1):
            now = target.cursor()
            have = now.seq
            upto = min(have, through_seq)
            if upto:
                for event in target.read(1, upto, partial=True):
                    if event.id != source[event.seq - 1].id:
                        raise EventLogError(
                            f"cannot copy {self.session!r} into {target.session!r}: the "
                            f"target already holds a different event at seq {event.seq}"
                        )
            if have >= through_seq:
                return done if have == through_seq else now
            rest = source[have:]
            try:
                target._write([_Draft(e.type, e.data, e.subject, e.time, "", e) for e in rest])
            except _Diverged:
                target._backoff(attempt)
                continue
            return done
        raise EventLogError(f"copying into {target.session!r}: the target kept changing")

    def start_from(self, source: EventLog, through_seq: int, type: str, data: dict[str, Any]) -> list[Event] | None:
        """Write this log, taken to have no chunk yet, without reading it first: events
        1..through_seq of `source`, unchanged, then one event of its own (a fork's
        session.forked). Returns every event written; None when a write did not land,
        which a first chunk already there makes certain (its create answers 409, so
        nothing is written over it). The caller then takes the careful way, cursor(),
        copy_to and append, which checks and finishes whatever part of the copy is in.

        A list of the log would first wait for the API server's cache to catch up with
        etcd (up to 0.1 s); a new log needs no list.
        """
        prefix = source.read(1, through_seq) if through_seq else []
        drafts = [_Draft(e.type, e.data, e.subject, e.time, "", e) for e in prefix]
        drafts.append(self._draft(type, data))
        with self._lock:
            self._tail, self._hint, self._new = None, None, True
            try:
                return self._write(drafts, once=True)
            except _Stale:
                return None
            finally:
                self._new = False

    def delete(self) -> None:
        """Delete every chunk of this log (already gone is fine)."""
        with self._lock:
            for _ in range(10):
                metas = self._list_meta()
                if not metas:
                    break
                for meta in metas:
                    self._delete_chunk(meta.name)
            self._tail = None
            self._hint = None

    # ----------------------------------------------------------------- writing

    def _draft(self, type: str, data: dict[str, Any], subject: str | None = None) -> _Draft:
        if not isinstance(type, str) or not type:
            raise ValueError("an event type is a non-empty string")
        if not isinstance(data, dict):
            raise ValueError("event data is a dict (a JSON object)")
        if TOMBSTONE_KEY in data:
            raise ValueError(f"{TOMBSTONE_KEY} is reserved for erased events")
        if subject is not None and not isinstance(subject, str):
            raise ValueError("subject is a string or None")
        if _depth_exceeds(data, MAX_EVENT_DEPTH):
            raise EventTooDeep(type, MAX_EVENT_DEPTH)
        draft = _Draft(type, data, subject, format_time(datetime.now(UTC)), secrets.token_hex(6))
        widest = self._size(draft.at(MAX_SEQ))
        if widest > self.max_chunk_bytes:
            raise EventTooLarge(type, widest, self.max_chunk_bytes)
        return draft

    @staticmethod
    def _size(event: Event) -> int:
        return KEY_DIGITS + len(event.to_json().encode())

    def _fit(self, pending: list[_Draft], first: int, used: int) -> list[Event]:
        """The leading drafts that go into a chunk holding `used` bytes, as events."""
        batch: list[Event] = []
        for draft in pending:
            event = draft.at(first + len(batch))
            if event.seq != first + len(batch):
                if not batch:
                    raise _Diverged()
                break
            size = self._size(event)
            limit = self.max_chunk_bytes if used == 0 else self.rollover_bytes
            if used + size > limit:
                break
            batch.append(event)
            used += size
        return batch

    def _write(self, pending: list[_Draft], once: bool = False) -> list[Event]:
        written: list[Event] = []
        failures = 0
        # Writes whose outcome we never heard (timeout, 5xx): (chunk index, batch). Each
        # was conditional on a resourceVersion, so at most one of them can ever land, and
        # none can once one of our later writes succeeds. Until then every attempt first
        # looks for them in the very snapshot it is about to write against.
        unsure: list[tuple[int, list[Event]]] = []
        with self._lock:
            while pending:
                if failures >= self.max_attempts:
                    raise EventLogError(
                        f"appending to the event log of session {self.session!r}: gave up "
                        f"after {failures} failed attempts (conflicts or API errors)"
                    )
                batch: list[Event] = []
                index = 0
                try:
                    tail = self._tail if self._tail is not None or self._new else self._load_tail()
                    if tail is not None:
                        self._check_tail(tail)
                    landed = self._find_landed(unsure, tail)
                    if landed is not None:
                        batch = landed
                    elif tail is None or tail.sealed:
                        index = 1 if tail is None else tail.index + 1
                        first = 1 if tail is None else tail.last_seq + 1
                        batch = self._fit(pending, first, 0)
                        if not batch:
                            size = self._size(pending[0].at(first))
                            raise EventTooLarge(pending[0].type, size, self.max_chunk_bytes)
                        self._tail = self._create(index, first, batch)
                        self._hint = index
                    else:
                        index = tail.index
                        batch = self._fit(pending, tail.last_seq + 1, tail.used)
                        if not batch:
                            if tail.used == 0:
                                size = self._size(pending[0].at(tail.last_seq + 1))
                                raise EventTooLarge(pending[0].type, size, self.max_chunk_bytes)
                            self._seal(tail)
                            continue
                        entries = {_seq_key(e.seq): e.to_json() for e in batch}
                        self._tail = self._patch(tail, {"data": entries})
                except (ApiException, urllib3.exceptions.HTTPError, OSError) as err:
                    kind = _classify(err)
                    if kind is err:
                        raise
                    failures += 1
                    self._tail = None
                    if once:
                        if isinstance(kind, _Conflict):
                            self._count_conflict()
                        raise _Stale() from err
                    if isinstance(kind, _Conflict):
                        self._count_conflict()
                    elif isinstance(kind, _Gone):
                        self._hint = None
                    elif isinstance(kind, _Ambiguous) and batch:
                        unsure.append((index, batch))
                    self._backoff(failures)
                    continue
                unsure.clear()
                written.extend(batch)
                if on_append is not None:
                    for event in batch:
                        on_append(event)
                pending = pending[len(batch) :]
                failures = 0
        return written

    def _find_landed(self, unsure: list[tuple[int, list[Event]]], tail: _Chunk | None) -> list[Event] | None:
        """The batch among `unsure` that is in the log after all, if any."""
        for index, batch in unsure:
            if tail is not None and tail.index == index:
                chunk: _Chunk | None = tail
            elif tail is not None and index < tail.index:
                chunk = self._get(index)  # sealed: its contents are final
            else:
                continue  # a create that has not happened (yet): creating it again will tell
            found = chunk.event(batch[0].seq) if chunk is not None else None
            if found is not None and found.id == batch[0].id:
                return batch
        return None

    def _check_tail(self, tail: _Chunk) -> None:
        """Raise MalformedChunk unless every value in the chunk about to be written to (or
        after) parses as an event: a writer never builds on damage it cannot read, which
        writing around would hide. Values already checked are only compared, so an append
        parses just what other writers (or a hand edit) added since this writer's last look.
        """
        known = self._checked if self._checked_chunk == tail.name else {}
        try:
            for key, text in tail.data.items():
                if known.get(key) != text:
                    _parse_event(tail.name, key, text)
        except MalformedChunk:
            self._tail = None  # read it afresh next time: it may have been repaired
            self._checked_chunk, self._checked = None, {}
            raise
        self._checked_chunk, self._checked = tail.name, tail.data

    def _seal(self, tail: _Chunk) -> None:
        # A conditional write: an append racing us against the same resourceVersion
        # conflicts, so nothing lands in this chunk after the seal.
        self._tail = self._patch(tail, {"metadata": {"annotations": {SEALED_ANNOTATION: "true"}}})

    def _count_conflict(self) -> None:
        with self._lock:
            self.conflicts += 1
        if on_conflict is not None:
            on_conflict()

    # Backoff after a lost race: full jitter, growing from BACKOFF_BASE to BACKOFF_CAP.
    BACKOFF_BASE = 0.002
    BACKOFF_CAP = 0.2

    def _backoff(self, attempt: int) -> None:
        # Full jitter spreads the losers of a race so they do not collide again.
        time.sleep(random.uniform(0, min(self.BACKOFF_CAP, self.BACKOFF_BASE * 2 ** min(attempt, 10))))

    # -------------------------------------------------------------- reading

    def _load_tail(self) -> _Chunk | None:
        """The newest chunk, fresh from the API server; None when the log has none."""
        for _ in range(3):
            index = self._hint
            if index is None:
                metas = self._list_meta()
                if not metas:
                    return None
                index = metas[-1].index
            chunk = self._get(index)
            if chunk is None:
                self._hint = None
                continue
            while chunk.sealed:
                nxt = self._get(chunk.index + 1)
                if nxt is None:
                    break  # sealed, next not yet created: the next write creates it
                chunk = nxt
            self._hint = chunk.index
            return chunk
        return None

    def _collect(
        self,
        chunks: list[_Chunk],
        present: set[int],
        from_seq: int,
        to_seq: int | None,
        log_end: int | None,
        partial: bool,
    ) -> list[Event]:
        if to_seq is None:
            end = log_end if log_end is not None else (chunks[-1].last_seq if chunks else 0)
        else:
            end = to_seq
            if log_end is not None and end > log_end:
                raise SequenceOutOfRange(self.session, end, log_end)
        events: list[Event] = []
        gaps: list[tuple[int, int]] = []
        expected = from_seq
        for chunk in chunks:
            lo, hi = max(from_seq, chunk.first_seq), min(end, chunk.last_seq)
            if lo > hi:
                continue
            if lo > expected:
                if chunk.index == 1 or chunk.index - 1 in present:
                    raise MalformedChunk(
                        chunk.name,
                        None,
                        f"starts at seq {chunk.first_seq} but the log before it ends at {expected - 1}",
                    )
                gaps.append((expected, lo - 1))
            elif lo < expected:
                raise MalformedChunk(chunk.name, _seq_key(lo), "overlaps the chunk before it")
            events.extend(chunk.events(lo, hi))
            expected = hi + 1
        if expected <= end:
            gaps.append((expected, end))
        if not partial:
            self._raise_unavailable(events, gaps)
        return events

    def _raise_unavailable(self, events: list[Event], gaps: list[tuple[int, int]]) -> None:
        problems: list[tuple[int, int, str]] = [(a, b, "retention") for a, b in gaps]
        for i, event in enumerate(events):
            if event.erased:
                stop = i
                while (
                    stop + 1 < len(events) and events[stop + 1].erased and events[stop + 1].seq == events[stop].seq + 1
                ):
                    stop += 1
                problems.append((event.seq, events[stop].seq, "erasure"))
                break
        if problems:
            a, b, why = min(problems)
            raise HistoryUnavailable(self.session, a, b, why)

    # ------------------------------------------------------------ API calls

    def _list_meta(self) -> list[_Meta]:
        """Every chunk's index, name and first seq, by index: metadata only, one call."""
        if self.discovery == "names":
            return self._discover()
        metas: list[_Meta] = []
        token: str | None = None
        while True:
            resp = self.core.list_namespaced_config_map(
                self.namespace,
                label_selector=self._selector,
                limit=500,
                _continue=token,
                _preload_content=False,
                _headers={"Accept": _META_ACCEPT},
                _request_timeout=self.request_timeout,
            )
            body = json.loads(resp.data)
            for item in body.get("items") or []:
                meta = item["metadata"]
                match = self._name_re.fullmatch(meta["name"])
                if match:
                    metas.append(_Meta(int(match[1]), meta["name"], _first_seq(meta)))
            token = (body.get("metadata") or {}).get("continue") or None
            if not token:
                break
        metas.sort(key=lambda m: m.index)
        return metas

    def _list_chunks(self, wanted: set[int] | None) -> list[_Chunk]:
        """The chunks with these indices (those that exist; None: all), by index, in paged lists.

        The next page is fetched while this one is parsed: the continue token sits in
        the list's metadata, which the API server writes before the items.
        """
        if self.discovery == "names":
            indices = sorted(wanted) if wanted is not None else [m.index for m in self._discover()]
            return [c for c in (self._get(i) for i in indices) if c is not None]
        page = self._page

        def fetch(token: str | None) -> bytes:
            return self.core.list_namespaced_config_map(
                self.namespace,
                label_selector=self._selector,
                limit=page,
                _continue=token,
                _preload_content=False,
                _request_timeout=self.request_timeout,
            ).data

        found: list[_Chunk] = []
        # Most logs fit one page: the helper thread is started only for a second page.
        pool: ThreadPoolExecutor | None = None
        raw: bytes | None = fetch(None)
        try:
            while raw is not None:
                early = _CONTINUE_RE.search(raw, 0, 4096)
                guess = early[1].decode() if early else None
                pending: Future[bytes] | None = None
                if guess:
                    pool = pool or ThreadPoolExecutor(max_workers=1)
                    pending = pool.submit(fetch, guess)
                body = json.loads(raw)
                token = (body.get("metadata") or {}).get("continue") or None
                for item in body.get("items") or []:
                    match = self._name_re.fullmatch(item["metadata"]["name"])
                    if match and (wanted is None or int(match[1]) in wanted):
                        found.append(_parse_chunk(item, int(match[1])))
                if token != guess:  # the guess was not the list's own token after all
                    raw = fetch(token) if token else None
                else:
                    raw = pending.result() if pending is not None else None
        finally:
            if pool is not None:
                pool.shutdown()
        found.sort(key=lambda c: c.index)
        return found

    def _get(self, index: int) -> _Chunk | None:
        try:
            resp = self.core.read_namespaced_config_map(
                self.chunk_name(index),
                self.namespace,
                _preload_content=False,
                _request_timeout=self.request_timeout,
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return self._parsed(json.loads(resp.data), index)

    def _create(self, index: int, first_seq: int, events: list[Event]) -> _Chunk:
        metadata: dict[str, Any] = {
            "name": self.chunk_name(index),
            "namespace": self.namespace,
            "labels": {SESSION_LABEL: _label_value(self.session), MANAGED_BY_LABEL: MANAGED_BY},
            "annotations": {FIRST_SEQ_ANNOTATION: str(first_seq)},
        }
        if self.owner:
            metadata["ownerReferences"] = [self.owner]
        body = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": metadata,
            "data": {_seq_key(e.seq): e.to_json() for e in events},
        }
        sent = time.monotonic()
        resp = self.core.create_namespaced_config_map(
            self.namespace,
            body,
            _preload_content=False,
            _request_timeout=self.request_timeout,
        )
        return self._parsed(json.loads(resp.data), index, sent)

    def _patch(self, chunk: _Chunk, patch: dict[str, Any]) -> _Chunk:
        # A merge patch carrying metadata.resourceVersion is applied only if the object
        # still has that version (409 otherwise): the same optimistic concurrency as a
        # replace, without sending the whole chunk back for each event.
        body = {**patch, "metadata": {**patch.get("metadata", {}), "resourceVersion": chunk.resource_version}}
        sent = time.monotonic()
        resp = self.core.patch_namespaced_config_map(
            chunk.name,
            self.namespace,
            body,
            _content_type=MERGE_PATCH,
            _preload_content=False,
            _request_timeout=self.request_timeout,
        )
        return self._parsed(json.loads(resp.data), chunk.index, sent)

    @staticmethod
    def _parsed(obj: dict[str, Any], index: int, written_at: float | None = None) -> _Chunk:
        chunk = _parse_chunk(obj, index)
        if on_chunk is not None:
            on_chunk(obj, written_at)
        return chunk

    def _delete_chunk(self, name: str) -> None:
        try:
            self.core.delete_namespaced_config_map(
                name,
                self.namespace,
                _request_timeout=self.request_timeout,
            )
        except ApiException as err:
            if err.status != 404:
                raise

    # ------------------------------------------- discovery by name (no list)

    # Consecutive missing chunks a by-name discovery steps over, looking for the first
    # chunk after a prefix deleted by retention, before it calls the log empty.
    NAME_SCAN_LIMIT = 4096
    _META_ONE = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"

    @classmethod
    def from_env(cls, core: Any = None, **kwargs: Any) -> EventLog:
        """The log of the session this process runs in, from the env the operator injects.

        SAVEPOINT_NAMESPACE and SAVEPOINT_SESSION name the log, SAVEPOINT_SESSION_UID (when
        set) makes the chunks this client creates owned by the Session. Chunks are found by
        name (`discovery="names"`): the sandbox's ServiceAccount may not list ConfigMaps.
        Without `core`, the in-cluster config is loaded (else the kubeconfig).
        """
        import os

        namespace, session = os.environ.get("SAVEPOINT_NAMESPACE"), os.environ.get("SAVEPOINT_SESSION")
        if not namespace or not session:
            raise EventLogError("SAVEPOINT_NAMESPACE and SAVEPOINT_SESSION must be set (the operator sets both)")
        if core is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            core = client.CoreV1Api()
        uid = os.environ.get("SAVEPOINT_SESSION_UID")
        if uid and "owner" not in kwargs:
            # No blockOwnerDeletion: setting it needs rights on the Session a sandbox lacks.
            kwargs["owner"] = {
                "apiVersion": API_VERSION,
                "kind": "Session",
                "name": session,
                "uid": uid,
                "controller": True,
            }
        kwargs.setdefault("discovery", "names")
        return cls(core, namespace, session, **kwargs)

    def _probe(self, index: int, forbidden_ok: bool = True) -> _Meta | None | bool:
        """A chunk's metadata by name; None when it does not exist, False when forbidden."""
        try:
            resp = self.core.read_namespaced_config_map(
                self.chunk_name(index),
                self.namespace,
                _preload_content=False,
                _headers={"Accept": self._META_ONE},
                _request_timeout=self.request_timeout,
            )
        except ApiException as err:
            if err.status == 404:
                return None
            if err.status == 403 and forbidden_ok:
                return False
            raise
        meta = json.loads(resp.data)["metadata"]
        return _Meta(index, meta["name"], _first_seq(meta))

    def _bounds(self, start: int = 1) -> tuple[dict[int, _Meta], int, int]:
        """(metas probed, lowest, newest) chunk index at or after `start`; newest 0 when none.

        The chunks of a log are contiguous (retention deletes a prefix, rollover adds at
        the end), so the newest is found by galloping and bisecting: O(log n) GETs. A 403
        counts as absent past the first chunk (a sandbox's Role covers a window of names)
        and is raised at the first one, which a caller allowed to use the log can read.
        """
        seen: dict[int, _Meta] = {}

        def present(index: int) -> bool:
            got = self._probe(index)
            if isinstance(got, _Meta):
                seen[index] = got
                return True
            return False

        lo = start
        # A 403 on chunk 1 is not "absent": this caller may not read the log at all.
        got = self._probe(lo, forbidden_ok=start != 1)
        while not isinstance(got, _Meta):
            if got is False or lo - start >= self.NAME_SCAN_LIMIT:
                return seen, 0, 0
            lo += 1
            got = self._probe(lo)
        seen[lo] = got
        hi, step = lo, 1
        while present(hi + step):
            hi += step
            step *= 2
        missing = hi + step
        while missing - hi > 1:
            mid = (hi + missing) // 2
            if present(mid):
                hi = mid
            else:
                missing = mid
        return seen, lo, hi

    def newest_chunk(self, start: int = 1) -> int:
        """Index of the newest chunk, searched by name from `start`; 0 when there is none."""
        return self._bounds(start)[2]

    def _discover(self) -> list[_Meta]:
        seen, lo, hi = self._bounds(1)
        metas: list[_Meta] = []
        for index in range(lo, hi + 1) if hi else ():
            meta = seen.get(index) or self._probe(index)
            if isinstance(meta, _Meta):
                metas.append(meta)
        return metas
