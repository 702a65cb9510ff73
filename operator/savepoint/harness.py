"""`python -m savepoint.harness`: the reference harness, a process inside a sandbox Pod.

A harness is whatever runs your agent in the sandbox. This one is the example to copy: it
records the conversation in the session's event log with `savepoint.eventlog` (as the
sandbox's own ServiceAccount, from the environment the operator injects) and writes its
work into the workspace volume crash-consistently, so a checkpoint taken at any moment
restores each file whole or not at all. docs/event-log.md describes it.

    serve                           the container's main process: wait for SIGTERM
    turn --message TEXT [--reply TEXT] [--write PATH=CONTENT ...] [--buffered]
                                    one run: run.started, user.message, agent.message,
                                    the files, run.completed; prints the seqs as JSON.
                                    --buffered keeps the files in the harness's buffer
                                    (outside the workspace) until `flush`
    flush                           move the buffered files into the workspace, each
                                    atomically (a preCheckpoint hook)
    write PATH CONTENT              write one workspace file atomically
    read PATH                       print a workspace file (exit 1 when absent)
    append TYPE JSON [--subject S]  append one event; prints it
    churn PATH --seconds N          rewrite PATH atomically in a loop (self-checking content)
    verify PATH                     exit 0 when PATH is whole, 1 when torn, 2 when absent

Imports only the standard library and the event-log client (never kopf).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKSPACE_ENV = "SAVEPOINT_WORKSPACE"
DEFAULT_WORKSPACE = "/workspace"
# Where `turn --buffered` keeps writes the workspace does not hold yet: the container's own
# filesystem, which no checkpoint captures (what an agent's in-memory state is to a snapshot).
BUFFER_ENV = "SAVEPOINT_HARNESS_BUFFER"
DEFAULT_BUFFER = "/tmp/savepoint-harness-buffer"
RECORD_MAGIC = b"savepoint-harness-record"

# verify's exit codes
WHOLE, TORN, ABSENT = 0, 1, 2


class HarnessError(Exception):
    """Bad input or a missing file: printed as one line, exit status 1."""


# ------------------------------------------------------------------ workspace files


def workspace() -> Path:
    return Path(os.environ.get(WORKSPACE_ENV) or DEFAULT_WORKSPACE)


def resolve(path: str, root: Path) -> Path:
    """PATH relative to the workspace (or absolute inside it); never outside it."""
    if not path:
        raise HarnessError("path is empty")
    root = Path(os.path.abspath(root))
    full = Path(os.path.abspath(root / path))
    if full == root or root not in full.parents:
        raise HarnessError(f"path {path!r} is outside the workspace {root}")
    return full


def write_atomic(path: Path, data: bytes) -> None:
    """Crash-consistent write: a temporary file in the same folder, fsync, rename, fsync
    of the folder. A reader, a crash or a snapshot sees the old content or the new, never
    a mix; at worst a stray `.<name>.*.tmp` file is left beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dirfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dirfd)  # makes the rename itself durable
    finally:
        os.close(dirfd)


def parse_assignment(text: str) -> tuple[str, str]:
    """`PATH=CONTENT` (the first `=` splits) for `turn --write`."""
    path, sep, content = text.partition("=")
    if not sep or not path:
        raise HarnessError(f"--write {text!r}: expected PATH=CONTENT")
    return path, content


# ------------------------------------------------------------------ the write buffer


def buffer_dir() -> Path:
    return Path(os.environ.get(BUFFER_ENV) or DEFAULT_BUFFER)


def buffer_write(buffer: Path, path: str, content: bytes) -> Path:
    """Keep one pending write (PATH relative to the workspace) in the buffer. Entries are
    named by the time they were made, so `flush` applies them in order (the last write of a
    path wins); each entry is itself written atomically."""
    entry = buffer / f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.json"
    record = {"path": path, "content": content.decode("utf-8", "surrogateescape")}
    write_atomic(entry, json.dumps(record).encode("utf-8", "surrogateescape"))
    return entry


def flush(buffer: Path, root: Path) -> list[str]:
    """Move every pending write into the workspace, oldest first: each file is written
    atomically (write_atomic) before its entry goes, so a crash in between leaves the entry
    to apply again, never a half file. Returns the workspace paths written."""
    written: list[str] = []
    if not buffer.is_dir():
        return written
    for entry in sorted(p for p in buffer.iterdir() if p.suffix == ".json" and not p.name.startswith(".")):
        record = json.loads(entry.read_bytes().decode("utf-8", "surrogateescape"))
        target = resolve(record["path"], root)
        write_atomic(target, record["content"].encode("utf-8", "surrogateescape"))
        entry.unlink()
        written.append(str(target.relative_to(root)))
    return written


# --------------------------------------------------------- self-checking records


def make_record(generation: int, size: int = 64 * 1024) -> bytes:
    """Content whose integrity can be checked from the bytes alone: a header line with
    the payload's sha256 and length, then a payload that differs per generation."""
    if size < 1:
        raise HarnessError("--size must be at least 1")
    seed = hashlib.sha256(f"generation {generation}".encode()).hexdigest().encode()
    payload = (seed * (size // len(seed) + 1))[:size]
    digest = hashlib.sha256(payload).hexdigest()
    return b"%s %d %d %s\n" % (RECORD_MAGIC, generation, size, digest.encode()) + payload


@dataclass(frozen=True)
class Verdict:
    state: str  # "whole", "torn" or "absent"
    generation: int | None = None
    reason: str = ""

    @property
    def exit_code(self) -> int:
        return {"whole": WHOLE, "torn": TORN, "absent": ABSENT}[self.state]


def check_record(data: bytes) -> Verdict:
    header, newline, payload = data.partition(b"\n")
    parts = header.split(b" ")
    if not newline or len(parts) != 4 or parts[0] != RECORD_MAGIC:
        return Verdict("torn", reason="no complete header line")
    try:
        generation, size = int(parts[1]), int(parts[2])
    except ValueError:
        return Verdict("torn", reason="header has no generation and size")
    if len(payload) != size:
        return Verdict("torn", generation, f"payload is {len(payload)} bytes, header says {size}")
    if hashlib.sha256(payload).hexdigest().encode() != parts[3]:
        return Verdict("torn", generation, "payload does not match its sha256")
    return Verdict("whole", generation)


def verify_file(path: Path) -> Verdict:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return Verdict("absent", reason=f"{path} does not exist")
    return check_record(data)


def churn(path: Path, seconds: float, size: int) -> int:
    """Rewrite path atomically with generation 1, 2, ... until `seconds` pass; returns the
    number of generations written."""
    deadline = time.monotonic() + seconds
    generation = 0
    while time.monotonic() < deadline:
        generation += 1
        write_atomic(path, make_record(generation, size))
    return generation


# -------------------------------------------------------------------- event log


def open_log() -> Any:
    """The session's log as this Pod's ServiceAccount (SAVEPOINT_NAMESPACE, SAVEPOINT_SESSION,
    SAVEPOINT_SESSION_UID and the projected token, all set up by the operator)."""
    from savepoint.eventlog import EventLog

    return EventLog.from_env()


def turn(
    log: Any,
    message: str,
    reply: str | None,
    writes: Sequence[tuple[str, str]],
    root: Path,
    buffer: Path | None = None,
) -> dict[str, Any]:
    """One run of the reference "agent": it answers, writes its files, and closes the run.
    With `buffer`, the files go to the buffer instead of the workspace (`flush` moves them).
    A failure after run.started still closes the run (with the error), so the Session
    does not stay Running forever."""
    targets = [(resolve(p, root), content) for p, content in writes]  # bad paths fail before any event
    run_id = uuid.uuid4().hex[:12]
    started, user = log.append_many(
        [("run.started", {"runId": run_id}), ("user.message", {"runId": run_id, "text": message})]
    )
    files = [str(t.relative_to(root)) for t, _ in targets]
    try:
        text = reply if reply is not None else f"echo: {message}"
        agent = log.append("agent.message", {"runId": run_id, "text": text, "files": files})
        for target, content in targets:
            if buffer is not None:
                buffer_write(buffer, str(target.relative_to(root)), content.encode())
            else:
                write_atomic(target, content.encode())
    except BaseException as err:
        log.append("run.completed", {"runId": run_id, "error": f"{type(err).__name__}: {err}"})
        raise
    completed = log.append("run.completed", {"runId": run_id, "files": files})
    return {
        "runId": run_id,
        "runStarted": started.seq,
        "userMessage": user.seq,
        "agentMessage": agent.seq,
        "runCompleted": completed.seq,
        "files": files,
        **({"buffered": True} if buffer is not None else {}),
    }


def parse_object(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise HarnessError(f"JSON: {err}") from None
    if not isinstance(data, dict):
        raise HarnessError(f"JSON must be an object, got {type(data).__name__}")
    return data


# -------------------------------------------------------------------------- serve


def serve() -> int:
    """Wait for SIGTERM or SIGINT (exit 0). As PID 1 of its container it also reaps
    children left behind by `kubectl exec` sessions."""
    stop = False

    def on_stop(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    def on_child(_signum: int, _frame: object) -> None:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGCHLD, on_child)
    session = f"{os.environ.get('SAVEPOINT_NAMESPACE', '?')}/{os.environ.get('SAVEPOINT_SESSION', '?')}"
    print(f"savepoint harness serving session {session}, workspace {workspace()}", flush=True)
    while not stop:
        signal.pause()
    print("savepoint harness stopping", flush=True)
    return 0


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m savepoint.harness", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="wait for SIGTERM (the container's main process)")
    t = sub.add_parser("turn", help="one run: run.started, messages, files, run.completed")
    t.add_argument("--message", required=True, help="the user's message")
    t.add_argument("--reply", help="the agent's answer (default: 'echo: MESSAGE')")
    t.add_argument("--write", action="append", default=[], metavar="PATH=CONTENT", help="a file to write")
    t.add_argument("--buffered", action="store_true", help="keep the files in the buffer until `flush`")
    sub.add_parser("flush", help="move the buffered files into the workspace (a preCheckpoint hook)")
    w = sub.add_parser("write", help="write a workspace file atomically")
    w.add_argument("path")
    w.add_argument("content")
    r = sub.add_parser("read", help="print a workspace file")
    r.add_argument("path")
    a = sub.add_parser("append", help="append one event")
    a.add_argument("type")
    a.add_argument("json", help="the event's data, a JSON object")
    a.add_argument("--subject", help="erasure key, e.g. user:4711")
    c = sub.add_parser("churn", help="rewrite PATH atomically in a loop")
    c.add_argument("path")
    c.add_argument("--seconds", type=float, required=True)
    c.add_argument("--size", type=int, default=64 * 1024, help="payload bytes per generation")
    v = sub.add_parser("verify", help="exit 0 when a churned file is whole, 1 torn, 2 absent")
    v.add_argument("path")
    return parser


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    root = workspace()
    if args.command == "serve":
        return serve()
    if args.command == "turn":
        writes = [parse_assignment(item) for item in args.write]
        buffer = buffer_dir() if args.buffered else None
        print(json.dumps(turn(open_log(), args.message, args.reply, writes, root, buffer)))
    elif args.command == "flush":
        print(json.dumps({"flushed": flush(buffer_dir(), root)}))
    elif args.command == "write":
        target = resolve(args.path, root)
        write_atomic(target, args.content.encode())
        print(json.dumps({"path": str(target.relative_to(root)), "bytes": len(args.content.encode())}))
    elif args.command == "read":
        target = resolve(args.path, root)
        try:
            data = target.read_bytes()
        except FileNotFoundError:
            raise HarnessError(f"{args.path}: no such file in the workspace {root}") from None
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    elif args.command == "append":
        event = open_log().append(args.type, parse_object(args.json), subject=args.subject)
        print(event.to_json())
    elif args.command == "churn":
        if args.seconds <= 0:
            raise HarnessError("--seconds must be positive")
        target = resolve(args.path, root)
        started = time.monotonic()
        n = churn(target, args.seconds, args.size)
        print(json.dumps({"path": args.path, "generations": n, "seconds": round(time.monotonic() - started, 3)}))
    elif args.command == "verify":
        verdict = verify_file(resolve(args.path, root))
        out = {"path": args.path, "state": verdict.state, "generation": verdict.generation}
        if verdict.reason:
            out["reason"] = verdict.reason
        print(json.dumps(out))
        return verdict.exit_code
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    try:
        code = run(argv)
    except HarnessError as err:
        print(f"error: {err}", file=sys.stderr)
        code = 1
    except Exception as err:  # the event log's errors (EventLogError, ApiException, ...)
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
