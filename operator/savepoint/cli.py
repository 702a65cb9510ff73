"""`kubectl savepoint`: checkpoint, fork, roll back and read sessions from the command line.

Installed as the console script `kubectl-savepoint`, which kubectl finds on PATH as a
plugin; `python -m savepoint.cli` is the same program. It is a thin layer over the
Python client (savepoint.client): the client names, creates, waits (by watch) and maps
failures to their reasons; this module parses arguments, prints progress, tables and
results, and turns the client's exceptions into exit codes.

Exit codes: 0 done; 1 the operation failed (the reason is printed); 2 bad usage, or an
idempotency key already used for a different request; 124 gave up waiting (--timeout).

The formatting (what a result line and a table say) is pure functions at the top,
tested without a cluster; the commands below them call the client and print.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

from savepoint.client import core
from savepoint.client.core import (  # noqa: F401  (re-exported: the plugin's names for the same rules)
    MAX_GENERATE_PREFIX,
    Outcome,
    Tracker,
    build_checkpoint,
    build_fork,
    build_rollback,
    checkpoint_outcome,
    fork_outcome,
    generate_prefix,
    key_name,
    progress_line,
    same_request,
)
from savepoint.client.errors import (
    CheckpointOfAnotherSession,
    ClientError,
    IdempotencyKeyConflict,
    WaitTimeout,
)
from savepoint.client.sync import Client
from savepoint.errors import SavepointError
from savepoint.timestamps import parse_rfc3339

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 124


class CLIError(Exception):
    """A failure to report as `error: <message>` with an exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------------ pure logic


def wait(
    get: Callable[[], dict[str, Any] | None],
    outcome: Callable[[dict[str, Any]], Outcome | None],
    *,
    timeout: float,
    interval: float = 0.5,
    say: Callable[[str], None] = lambda line: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Outcome:
    """Poll `get()` until `outcome()` is decided; print each new progress line once.

    The commands wait by watch, through the client; this is the same state machine
    (core.Tracker) for a caller that can only poll. Returns the outcome, or raises
    CLIError(EXIT_TIMEOUT) when `timeout` passes first. `get()` returning None means the
    object is gone (deleted under us): a failure.
    """
    started = clock()
    tracker = Tracker("", "", outcome, started)
    while True:
        obj = get()
        now = clock()
        if obj is None:
            return Outcome(False, "the object was deleted while waiting")
        progress, decided = tracker.observe(obj, now)
        if progress is not None:
            say(progress.line)
        if decided is not None:
            return decided
        if now - started >= timeout:
            raise CLIError(f"timed out after {timeout:g}s; last state: {tracker.last}", EXIT_TIMEOUT)
        sleep(interval)


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    return parse_rfc3339(text)


def human_duration(seconds: float) -> str:
    """kubectl-style short ages: 45s, 12m, 5h, 29d."""
    seconds = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size or (unit == "m" and seconds >= size):
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def expires_cell(status: dict[str, Any], now: datetime) -> str:
    if status.get("phase") == "Expired":
        return "expired"
    at = parse_time(status.get("expiresAt"))
    if at is None:
        return "-"
    left = (at - now).total_seconds()
    return f"in {human_duration(left)}" if left > 0 else "due"


CHECKPOINT_COLUMNS = ("NAME", "SESSION", "PHASE", "THROUGH", "LABEL", "EXPIRES")


def checkpoint_row(obj: dict[str, Any], now: datetime) -> tuple[str, ...]:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    through = status.get("throughSequence")
    return (
        obj["metadata"]["name"],
        spec.get("sessionName", ""),
        status.get("phase") or "-",
        "-" if through is None else str(through),
        spec.get("label") or "",
        expires_cell(status, now),
    )


def checkpoint_rows(
    items: Sequence[dict[str, Any]], session: str | None, now: datetime, *, with_namespace: bool = False
) -> list[tuple[str, ...]]:
    """Rows for `checkpoint list`: optionally one session's, oldest first."""
    chosen = [o for o in items if session is None or (o.get("spec") or {}).get("sessionName") == session]
    chosen.sort(key=lambda o: (o["metadata"].get("creationTimestamp") or "", o["metadata"]["name"]))
    if with_namespace:
        return [(o["metadata"].get("namespace", ""), *checkpoint_row(o, now)) for o in chosen]
    return [checkpoint_row(o, now) for o in chosen]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns three spaces apart, like `kubectl get`."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=False)]
    lines = [
        "   ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in [headers, *rows]
    ]
    return "\n".join(lines)


def format_event(event: Any, output: str = "text") -> str:
    """One event of `log tail`: aligned text, or the event's own JSON line."""
    if output == "json":
        return event.to_json()
    data = "(erased)" if event.erased else json.dumps(event.data, separators=(",", ":"), ensure_ascii=False)
    subject = f" subject={event.subject}" if event.subject else ""
    return f"{event.seq:>6}  {event.time}  {event.type:<22}{subject} {data}"


def tail_start(last_seq: int, count: int) -> int:
    """First sequence number of the last `count` events of a log ending at `last_seq`."""
    return max(1, last_seq - count + 1)


# ----------------------------------------------------------------------- commands


def reporter(out: TextIO) -> Callable[[core.Progress], None]:
    """Print each step the client reports: the object made (or found), then each new state."""

    def report(progress: core.Progress) -> None:
        kind = progress.kind.lower()
        if progress.step == "created":
            print(f"{kind} {progress.name} created in namespace {progress.namespace}", file=out)
        elif progress.step == "reused":
            print(f"{kind} {progress.name} already exists (same idempotency key): not created again", file=out)
        else:
            print(progress.line, file=out, flush=True)

    return report


def _done(decide: Callable[[dict[str, Any]], Outcome | None], obj: Any, args: argparse.Namespace, out: TextIO) -> int:
    if args.wait:
        outcome = decide(obj.wire())
        assert outcome is not None and outcome.ok  # the client returns only what succeeded
        print(outcome.message, file=out)
    return EXIT_OK


def cmd_checkpoint_create(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    checkpoint = client.checkpoints.create(
        args.session,
        label=args.label,
        ttl=args.ttl,
        idempotency_key=args.idempotency_key,
        wait=args.wait,
        timeout=args.timeout,
        on_progress=reporter(out),
    )
    return _done(checkpoint_outcome, checkpoint, args, out)


def cmd_checkpoint_list(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    items = [c.wire() for c in client.checkpoints.list(all_namespaces=args.all_namespaces)]
    rows = checkpoint_rows(items, args.session, datetime.now(UTC), with_namespace=args.all_namespaces)
    where = "any namespace" if args.all_namespaces else f"namespace {client.namespace}"
    if not rows:
        whose = f" for session {args.session}" if args.session else ""
        print(f"No checkpoints{whose} in {where}.", file=sys.stderr)
        return EXIT_OK
    headers = ("NAMESPACE", *CHECKPOINT_COLUMNS) if args.all_namespaces else CHECKPOINT_COLUMNS
    print(format_table(headers, rows), file=out)
    return EXIT_OK


def cmd_fork(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    from_log = args.at_event is not None or args.latest
    fork = client.forks.create(
        args.name,
        checkpoint=None if from_log else args.source,
        session=args.source if from_log else None,
        at_event=args.at_event,
        idempotency_key=args.idempotency_key,
        wait=args.wait,
        timeout=args.timeout,
        on_progress=reporter(out),
    )
    return _done(fork_outcome, fork, args, out)


def cmd_rollback(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    fork = client.sessions.rollback(
        args.session,
        to=args.to,
        idempotency_key=args.idempotency_key,
        wait=args.wait,
        timeout=args.timeout,
        on_progress=reporter(out),
    )
    return _done(fork_outcome, fork, args, out)


def cmd_log_tail(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    try:
        for event in client.log(args.session).tail(args.lines, follow=args.follow, interval=args.interval):
            print(format_event(event, args.output), file=out, flush=True)
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def cmd_erase(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    erased = client.log(args.session).erase(args.subject)
    noun = "event" if erased == 1 else "events"
    print(f"erased {erased} {noun} with subject {args.subject!r} from the log of session {args.session}", file=out)
    return EXIT_OK


# ------------------------------------------------------------------------- parsing


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def build_parser() -> argparse.ArgumentParser:
    # Cluster options are accepted before or after the subcommand, as kubectl users expect;
    # SUPPRESS keeps a subcommand's unset copy from overwriting the top-level value.
    # `log tail -n N` means lines, as in tail(1): there the namespace is --namespace, or
    # -n before the subcommand.
    long_common = argparse.ArgumentParser(add_help=False)
    long_common.add_argument("--namespace", default=argparse.SUPPRESS, help="namespace (default: the context's)")
    long_common.add_argument("--context", default=argparse.SUPPRESS, help="kubeconfig context (default: the current)")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-n", "--namespace", default=argparse.SUPPRESS, help="namespace (default: the context's)")
    common.add_argument("--context", default=argparse.SUPPRESS, help="kubeconfig context (default: the current)")

    waiting = argparse.ArgumentParser(add_help=False)
    waiting.add_argument("--wait", action="store_true", help="block until done, showing progress")
    waiting.add_argument("--timeout", type=_positive, default=300.0, help="seconds to wait (default 300)")
    waiting.add_argument(
        "--idempotency-key", help="name the created object after this key, so a retried command applies once"
    )

    parser = argparse.ArgumentParser(
        prog="kubectl savepoint",
        parents=[common],
        description="Checkpoint, fork, roll back and read Savepoint sessions.",
        epilog="Exit codes: 0 done, 1 failed (reason printed), 2 usage, 124 timed out waiting.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ckpt = commands.add_parser("checkpoint", aliases=["ckpt"], help="create and list checkpoints")
    ckpt_commands = ckpt.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    create = ckpt_commands.add_parser("create", parents=[common, waiting], help="checkpoint a session")
    create.add_argument("session", metavar="SESSION")
    create.add_argument("--label", help="free text shown in listings")
    create.add_argument("--ttl", help="lifetime such as 2h or 7d (capped by the workspace)")
    create.set_defaults(run=cmd_checkpoint_create)
    listing = ckpt_commands.add_parser("list", aliases=["ls"], parents=[common], help="list checkpoints")
    listing.add_argument("session", metavar="SESSION", nargs="?", help="only this session's")
    listing.add_argument("-A", "--all-namespaces", action="store_true")
    listing.set_defaults(run=cmd_checkpoint_list)

    fork = commands.add_parser(
        "fork",
        parents=[common, waiting],
        help="start a new session from a checkpoint or a point in a log",
        description="fork CHECKPOINT --name NEW: disk and conversation from the checkpoint. "
        "fork SESSION --at-event ID --name NEW: the conversation up to that event, with a fresh disk. "
        "fork SESSION --latest --name NEW: from the session's newest live checkpoint.",
    )
    fork.add_argument("source", metavar="CHECKPOINT|SESSION")
    fork.add_argument("--name", required=True, help="the new session's name")
    how = fork.add_mutually_exclusive_group()
    how.add_argument("--at-event", metavar="ID", help="fork SESSION's conversation up to this event id")
    how.add_argument("--latest", action="store_true", help="fork SESSION from its newest live checkpoint")
    fork.set_defaults(run=cmd_fork)

    rollback = commands.add_parser("rollback", parents=[common, waiting], help="restore a session in place")
    rollback.add_argument("session", metavar="SESSION")
    rollback.add_argument("--to", required=True, metavar="CHECKPOINT", help="one of the session's checkpoints")
    rollback.set_defaults(run=cmd_rollback)

    log = commands.add_parser("log", help="read a session's event log")
    log_commands = log.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    tail = log_commands.add_parser("tail", parents=[long_common], help="print the last events")
    tail.add_argument("session", metavar="SESSION")
    tail.add_argument("-f", "--follow", action="store_true", help="keep printing new events")
    tail.add_argument("-n", "--lines", type=int, default=10, metavar="N", help="how many events (default 10)")
    tail.add_argument("-o", "--output", choices=["text", "json"], default="text")
    tail.add_argument("--interval", type=_positive, default=1.0, help=argparse.SUPPRESS)
    tail.set_defaults(run=cmd_log_tail)

    erase = commands.add_parser(
        "erase",
        parents=[common],
        help="tombstone every event of a subject (irreversible)",
        description="Replace the data of every event with this subject by a tombstone. A rebuild or "
        "fork that needs those events then fails with SessionHistoryUnavailable.",
    )
    erase.add_argument("session", metavar="SESSION")
    erase.add_argument("--subject", required=True)
    erase.set_defaults(run=cmd_erase)
    return parser


# Refusals of the request itself: the command line asked for something that cannot be.
USAGE_ERRORS = (IdempotencyKeyConflict, CheckpointOfAnotherSession)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = sys.stdout
    try:
        client = Client(getattr(args, "namespace", None), context=getattr(args, "context", None))
        return args.run(client, args, out)
    except CLIError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.code
    except ClientError as err:
        print(f"error: {err}", file=sys.stderr)
        if isinstance(err, WaitTimeout):
            return EXIT_TIMEOUT
        return EXIT_USAGE if isinstance(err, USAGE_ERRORS) else EXIT_FAILED
    except Exception as err:  # the event log's, the API's and the network's errors, said briefly
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        if isinstance(err, ApiException):
            print(f"error: {core.api_error(err.status or 0, err.body, err.reason).message}", file=sys.stderr)
            return EXIT_FAILED
        if isinstance(err, HTTPError | OSError):
            print(f"error: cannot reach the API server: {err}", file=sys.stderr)
            return EXIT_FAILED
        if isinstance(err, SavepointError):  # the event log's own errors say what happened
            print(f"error: {err}", file=sys.stderr)
            return EXIT_FAILED
        raise


if __name__ == "__main__":
    sys.exit(main())
