"""`kubectl savepoint`: checkpoint, fork, roll back and read sessions from the command line.

Installed as the console script `kubectl-savepoint`, which kubectl finds on PATH as a
plugin; `python -m savepoint.cli` is the same program. It talks to the cluster of the
current kubeconfig context (or `--context`) with the `kubernetes` client, and imports
nothing of the operator beyond the API constants and the event-log client.

Exit codes: 0 done; 1 the operation failed (the reason is printed); 2 bad usage, or an
idempotency key already used for a different request; 124 gave up waiting (--timeout).

The decisions (names, object bodies, when a wait is over, what a progress line says,
table layout) are pure functions at the top, tested without a cluster; the commands
below them only fetch, create and print.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TextIO, cast

from savepoint.errors import SavepointError
from savepoint.models import GROUP, VERSION

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 124

# Prefix of generated names; the server appends 5 random characters. Kept short so the
# name stays a valid label value (63 characters), which the operator relies on.
MAX_GENERATE_PREFIX = 40


class CLIError(Exception):
    """A failure to report as `error: <message>` with an exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------------ pure logic


def key_name(prefix: str, key: str) -> str:
    """The object name an idempotency key stands for: the same key, the same name."""
    return f"{prefix}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def generate_prefix(base: str, kind: str) -> str:
    """A generateName prefix such as `s1-ckpt-`, trimmed so the final name stays short."""
    stem = base[: MAX_GENERATE_PREFIX - len(kind) - 2].rstrip("-.")
    return f"{stem}-{kind}-"


def _metadata(prefix: str, base: str, kind: str, key: str | None) -> dict[str, Any]:
    if key:
        return {"name": key_name(prefix, key), "annotations": {"savepoint.dev/idempotency-key": key}}
    return {"generateName": generate_prefix(base, kind)}


def build_checkpoint(
    session: str, *, label: str | None = None, ttl: str | None = None, key: str | None = None
) -> dict[str, Any]:
    spec: dict[str, Any] = {"sessionName": session}
    if label is not None:
        spec["label"] = label
    if ttl is not None:
        spec["ttl"] = ttl
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Checkpoint",
        "metadata": _metadata("ckpt", session, "ckpt", key),
        "spec": spec,
    }


def build_fork(
    *,
    target: str,
    checkpoint: str | None = None,
    session: str | None = None,
    at_event: str | None = None,
    key: str | None = None,
) -> dict[str, Any]:
    """A Fork into a new session `target`, from a checkpoint, or from a session's log."""
    if (checkpoint is None) == (session is None):
        raise ValueError("a fork needs exactly one of checkpoint or session")
    source: dict[str, Any] = {"checkpoint": checkpoint} if checkpoint else {"session": session}
    if at_event is not None:
        if session is None:
            raise ValueError("--at-event forks from a session, not a checkpoint")
        source["atEvent"] = at_event
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Fork",
        "metadata": _metadata("fork", target, "fork", key),
        "spec": {"source": source, "mode": "Fork", "target": {"sessionName": target}},
    }


def build_rollback(session: str, checkpoint: str, *, key: str | None = None) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Fork",
        "metadata": _metadata("rollback", session, "rollback", key),
        "spec": {"source": {"checkpoint": checkpoint}, "mode": "Rollback"},
    }


def same_request(existing: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether an object found under an idempotency key's name is the one we would create.

    Only the fields we set are compared: the API server adds defaults to the rest.
    """

    def covers(have: Any, want: Any) -> bool:
        if isinstance(want, dict):
            return isinstance(have, dict) and all(covers(have.get(k), v) for k, v in want.items())
        return have == want

    return covers(existing.get("spec") or {}, wanted["spec"])


@dataclass(frozen=True)
class Outcome:
    ok: bool
    message: str


def _reason_text(phase: str, status: dict[str, Any]) -> str:
    parts = [phase]
    if status.get("reason"):
        parts.append(status["reason"])
    if status.get("message"):
        parts.append(status["message"])
    return ": ".join(parts)


def checkpoint_outcome(obj: dict[str, Any]) -> Outcome | None:
    """Ready: success; Rejected, Failed, Expired: a terminal failure; else still going."""
    status = obj.get("status") or {}
    phase = status.get("phase")
    name = obj["metadata"]["name"]
    if phase == "Ready":
        through = status.get("throughSequence")
        where = f" through event {through}" if through is not None else ""
        expires = f", expires {status['expiresAt']}" if status.get("expiresAt") else ""
        return Outcome(True, f"checkpoint {name} is Ready{where}{expires}")
    if phase in ("Rejected", "Failed", "Expired"):
        return Outcome(False, _reason_text(phase, status))
    return None


def fork_outcome(obj: dict[str, Any]) -> Outcome | None:
    """Succeeded: success; Failed: a terminal failure; else still going."""
    status = obj.get("status") or {}
    phase = status.get("phase")
    name = obj["metadata"]["name"]
    rollback = (obj.get("spec") or {}).get("mode") == "Rollback"
    if phase == "Succeeded":
        target = status.get("targetSession") or "?"
        how = f" ({status['restoreMode']})" if status.get("restoreMode") else ""
        what = f"session {target} rolled back" if rollback else f"session {target} is Ready"
        return Outcome(True, f"{what}{how}; fork {name} Succeeded")
    if phase == "Failed":
        return Outcome(False, _reason_text(phase, status))
    return None


def progress_line(obj: dict[str, Any], elapsed: float) -> str:
    """One line for the current state of a waited-on object, e.g. `[  2.1s] Pending: ...`."""
    status = obj.get("status") or {}
    phase = status.get("phase") or "Waiting for the operator"
    detail = status.get("message") or ""
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if not detail and ready and ready.get("status") != "True":
        detail = ready.get("message") or ready.get("reason") or ""
    return f"[{elapsed:6.1f}s] {phase}" + (f": {detail}" if detail else "")


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

    Returns the outcome, or raises CLIError(EXIT_TIMEOUT) when `timeout` passes first.
    `get()` returning None means the object is gone (deleted under us): a failure.
    """
    started = clock()
    last = ""
    while True:
        obj = get()
        elapsed = clock() - started
        if obj is None:
            return Outcome(False, "the object was deleted while waiting")
        line = progress_line(obj, elapsed)
        state = line.split("] ", 1)[1]
        if state != last:
            say(line)
            last = state
        decided = outcome(obj)
        if decided is not None:
            return decided
        if elapsed >= timeout:
            raise CLIError(f"timed out after {timeout:g}s; last state: {state}", EXIT_TIMEOUT)
        sleep(interval)


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


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


# ------------------------------------------------------------------- the cluster side


class Cluster:
    """The few API calls the plugin makes, on one kubeconfig context and namespace."""

    def __init__(self, context: str | None, namespace: str | None) -> None:
        from kubernetes import client, config

        try:
            api = config.new_client_from_config(context=context)
            contexts, active = config.list_kube_config_contexts()
            if context:
                active = next((c for c in contexts if c["name"] == context), active)
            default_ns = (active.get("context") or {}).get("namespace") or "default"
        except config.ConfigException as err:
            if context or not os.environ.get("KUBERNETES_SERVICE_HOST"):
                raise CLIError(f"cannot load a kubeconfig: {err}") from None
            config.load_incluster_config()
            api = client.ApiClient()
            with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
                default_ns = f.read().strip()
        self.namespace = namespace or default_ns
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    def create(self, plural: str, body: dict[str, Any]) -> dict[str, Any]:
        created = self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, plural, body)
        return cast(dict[str, Any], created)

    def get(self, plural: str, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            found = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, plural, name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return cast(dict[str, Any], found)

    def list(self, plural: str, all_namespaces: bool = False) -> list[dict[str, Any]]:
        if all_namespaces:
            found = self.custom.list_cluster_custom_object(GROUP, VERSION, plural)
        else:
            found = self.custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, plural)
        return cast(list[dict[str, Any]], cast(dict[str, Any], found)["items"])

    def event_log(self, session: str) -> Any:
        from savepoint.eventlog import EventLog

        return EventLog(self.core, self.namespace, session)


def api_message(err: Any) -> str:
    """The API server's own message from an ApiException (admission denials included)."""
    try:
        body = json.loads(err.body)
        return body.get("message") or str(err.reason)
    except (TypeError, ValueError):
        return f"{err.status} {err.reason}"


def create_once(cluster: Cluster, plural: str, body: dict[str, Any], out: TextIO) -> dict[str, Any]:
    """Create the object; under an idempotency key, an existing one for the same request is reused."""
    from kubernetes.client.exceptions import ApiException

    kind = body["kind"].lower()
    try:
        created = cluster.create(plural, body)
    except ApiException as err:
        name = body["metadata"].get("name")
        if err.status != 409 or not name:
            raise CLIError(f"creating the {kind}: {api_message(err)}") from None
        existing = cluster.get(plural, name)
        if existing is None:  # deleted between our create and get: try once more
            return create_once(cluster, plural, body, out)
        if not same_request(existing, body):
            key = body["metadata"]["annotations"]["savepoint.dev/idempotency-key"]
            raise CLIError(
                f"idempotency key {key!r} already names {kind} {name} with a different spec; "
                "use a new key for a new request",
                EXIT_USAGE,
            ) from None
        print(f"{kind} {name} already exists (same idempotency key): not created again", file=out)
        return existing
    print(f"{kind} {created['metadata']['name']} created in namespace {cluster.namespace}", file=out)
    return created


def finish(
    cluster: Cluster,
    plural: str,
    obj: dict[str, Any],
    args: argparse.Namespace,
    outcome: Callable[[dict[str, Any]], Outcome | None],
    out: TextIO,
) -> int:
    if not args.wait:
        return EXIT_OK
    name = obj["metadata"]["name"]
    result = wait(
        lambda: cluster.get(plural, name),
        outcome,
        timeout=args.timeout,
        say=lambda line: print(line, file=out, flush=True),
    )
    if result.ok:
        print(result.message, file=out)
        return EXIT_OK
    raise CLIError(result.message)


# ----------------------------------------------------------------------- commands


def cmd_checkpoint_create(cluster: Cluster, args: argparse.Namespace, out: TextIO) -> int:
    body = build_checkpoint(args.session, label=args.label, ttl=args.ttl, key=args.idempotency_key)
    obj = create_once(cluster, "checkpoints", body, out)
    return finish(cluster, "checkpoints", obj, args, checkpoint_outcome, out)


def cmd_checkpoint_list(cluster: Cluster, args: argparse.Namespace, out: TextIO) -> int:
    items = cluster.list("checkpoints", args.all_namespaces)
    rows = checkpoint_rows(items, args.session, datetime.now(UTC), with_namespace=args.all_namespaces)
    where = "any namespace" if args.all_namespaces else f"namespace {cluster.namespace}"
    if not rows:
        whose = f" for session {args.session}" if args.session else ""
        print(f"No checkpoints{whose} in {where}.", file=sys.stderr)
        return EXIT_OK
    headers = ("NAMESPACE", *CHECKPOINT_COLUMNS) if args.all_namespaces else CHECKPOINT_COLUMNS
    print(format_table(headers, rows), file=out)
    return EXIT_OK


def cmd_fork(cluster: Cluster, args: argparse.Namespace, out: TextIO) -> int:
    if args.at_event is not None or args.latest:
        body = build_fork(target=args.name, session=args.source, at_event=args.at_event, key=args.idempotency_key)
    else:
        body = build_fork(target=args.name, checkpoint=args.source, key=args.idempotency_key)
    obj = create_once(cluster, "forks", body, out)
    return finish(cluster, "forks", obj, args, fork_outcome, out)


def cmd_rollback(cluster: Cluster, args: argparse.Namespace, out: TextIO) -> int:
    checkpoint = cluster.get("checkpoints", args.to)
    if checkpoint is None:
        raise CLIError(f"CheckpointNotFound: checkpoint {args.to} not found in namespace {cluster.namespace}")
    owner = (checkpoint.get("spec") or {}).get("sessionName")
    if owner != args.session:
        raise CLIError(
            f"checkpoint {args.to} belongs to session {owner}, not {args.session}: a rollback restores a "
            f"session's own checkpoint (use `fork {args.to} --name NEW` to start a new session from it)",
            EXIT_USAGE,
        )
    body = build_rollback(args.session, args.to, key=args.idempotency_key)
    obj = create_once(cluster, "forks", body, out)
    return finish(cluster, "forks", obj, args, fork_outcome, out)


def _require_log(cluster: Cluster, session: str) -> Any:
    log = cluster.event_log(session)
    if not log.chunk_names() and cluster.get("sessions", session) is None:
        raise CLIError(f"SessionNotFound: session {session} not found in namespace {cluster.namespace}")
    return log


def cmd_log_tail(cluster: Cluster, args: argparse.Namespace, out: TextIO) -> int:
    log = _require_log(cluster, args.session)
    last = log.cursor().seq
    if last and args.lines > 0:
        for event in log.read(tail_start(last, args.lines), last, partial=True):
            print(format_event(event, args.output), file=out, flush=True)
    if not args.follow:
        return EXIT_OK
    try:
        while True:
            time.sleep(args.interval)
            now = log.cursor().seq
            if now > last:
                for event in log.read(last + 1, now, partial=True):
                    print(format_event(event, args.output), file=out, flush=True)
                last = now
    except KeyboardInterrupt:
        return EXIT_OK


def cmd_erase(cluster: Cluster, args: argparse.Namespace, out: TextIO) -> int:
    log = _require_log(cluster, args.session)
    erased = log.erase(args.subject)
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = sys.stdout
    try:
        cluster = Cluster(getattr(args, "context", None), getattr(args, "namespace", None))
        return args.run(cluster, args, out)
    except CLIError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.code
    except Exception as err:  # the API's and the network's errors, said briefly
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        if isinstance(err, ApiException):
            hint = ""
            if err.status == 404 and "the server could not find the requested resource" in api_message(err):
                hint = " (are the savepoint.dev CRDs installed?)"
            print(f"error: {api_message(err)}{hint}", file=sys.stderr)
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
