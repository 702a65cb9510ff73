"""`python -m savepoint.harness`: the reference harness, a process inside a sandbox Pod.

A harness is whatever runs your agent in the sandbox. This one is the example to copy: it
records the conversation in the session's event log with `savepoint.eventlog` (as the
sandbox's own ServiceAccount, from the environment the operator injects) and writes its
work into the workspace volume crash-consistently, so a checkpoint taken at any moment
restores each file whole or not at all. docs/event-log.md describes it.

    serve                           the container's main process: wait for SIGTERM,
                                    writing a heartbeat every SAVEPOINT_HEARTBEAT_SECONDS
    turn --message TEXT [--reply TEXT] [--write PATH=CONTENT ...]
         [--input-tokens N] [--output-tokens N] [--buffered]
                                    one run: run.started, user.message, agent.message
                                    (with its token usage), the files, run.completed;
                                    prints the seqs as JSON. --buffered keeps the files
                                    in the harness's buffer (outside the workspace) until
                                    `flush`
    heartbeat                       write one resource sample now; prints it
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
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

WORKSPACE_ENV = "SAVEPOINT_WORKSPACE"
DEFAULT_WORKSPACE = "/workspace"
HEARTBEAT_ENV = "SAVEPOINT_HEARTBEAT_SECONDS"
DEFAULT_HEARTBEAT_SECONDS = 10.0
CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 says "no limit" with LONG_MAX rounded down to a page; anything this large is none.
UNLIMITED = 2**62
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


def token_usage(message: str, reply: str, input_tokens: int | None, output_tokens: int | None) -> dict[str, int]:
    """The `data.usage` of an agent.message (docs/event-log.md): what one model call spent.
    This agent calls no model, so unless told it counts words as tokens."""
    return {
        "inputTokens": len(message.split()) if input_tokens is None else input_tokens,
        "outputTokens": len(reply.split()) if output_tokens is None else output_tokens,
        "llmCalls": 1,
    }


def turn(
    log: Any,
    message: str,
    reply: str | None,
    writes: Sequence[tuple[str, str]],
    root: Path,
    input_tokens: int | None = None,
    output_tokens: int | None = None,
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
        spent = token_usage(message, text, input_tokens, output_tokens)
        agent = log.append("agent.message", {"runId": run_id, "text": text, "files": files, "usage": spent})
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


# ---------------------------------------------------------------------- heartbeat


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def memory(root: Path = CGROUP_ROOT) -> tuple[int | None, int | None]:
    """(bytes used, limit or None) of this container's memory cgroup: cgroup v2's
    memory.current and memory.max at the root, else v1's memory.usage_in_bytes and
    memory.limit_in_bytes under memory/ (both count the page cache, as the kubelet does)."""
    if (root / "memory.current").exists():
        used = _read_int(root / "memory.current")
        limit = _read_int(root / "memory.max")  # "max": no limit
    else:
        used = _read_int(root / "memory" / "memory.usage_in_bytes")
        limit = _read_int(root / "memory" / "memory.limit_in_bytes")
    return used, (limit if limit is not None and limit < UNLIMITED else None)


def disk_usage(root: Path) -> int:
    """Bytes the files under root take on disk (allocated blocks, as `du`), not following
    symbolic links nor leaving root's filesystem. A shared filesystem's own figures
    (statvfs) would count every volume on it, so the tree is walked."""
    try:
        device = os.lstat(root).st_dev
    except OSError:
        return 0
    total = 0
    stack = [str(root)]
    while stack:
        folder = stack.pop()
        try:
            entries = os.scandir(folder)
        except OSError:
            continue  # gone, or unreadable: counted as nothing
        with entries:
            for entry in entries:
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                total += info.st_blocks * 512
                if entry.is_dir(follow_symlinks=False) and info.st_dev == device:
                    stack.append(entry.path)
    return total + os.lstat(root).st_blocks * 512


def sample(root: Path, cgroup: Path = CGROUP_ROOT) -> dict[str, Any]:
    """One heartbeat sample: status.resources as the operator reflects it."""
    from savepoint.eventlog import format_time

    used, limit = memory(cgroup)
    out: dict[str, Any] = {"load1": round(os.getloadavg()[0], 2)}
    if used is not None:
        out["memBytes"] = used
    if limit is not None:
        out["memLimitBytes"] = limit
    out["diskBytes"] = disk_usage(root)
    out["sampledAt"] = format_time(datetime.now(UTC))
    return out


def write_heartbeat(log: Any, beat: dict[str, Any]) -> None:
    """Put the sample into the session's one heartbeat object, `<session>-heartbeat`: a
    patch, or the create of it the first time (the sandbox's Role and the admission
    policy allow exactly this object, docs/security.md)."""
    from kubernetes.client.exceptions import ApiException

    from savepoint.constants import HEARTBEAT_KEY, HEARTBEAT_SUFFIX, MANAGED_BY, MANAGED_BY_LABEL, SESSION_LABEL

    name = f"{log.session}{HEARTBEAT_SUFFIX}"
    data = {HEARTBEAT_KEY: json.dumps(beat, separators=(",", ":"))}
    for _ in range(3):
        try:
            log.core.patch_namespaced_config_map(
                name, log.namespace, {"data": data}, _content_type="application/merge-patch+json", _request_timeout=10
            )
            return
        except ApiException as err:
            if err.status != 404:
                raise
        meta: dict[str, Any] = {"name": name, "labels": {SESSION_LABEL: log.session, MANAGED_BY_LABEL: MANAGED_BY}}
        if log.owner:
            meta["ownerReferences"] = [log.owner]
        try:
            log.core.create_namespaced_config_map(
                log.namespace,
                {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data},
                _request_timeout=10,
            )
            return
        except ApiException as err:
            if err.status != 409:  # 409: made meanwhile (another beat): patch it
                raise
    raise HarnessError(f"could not write {name}")


def heartbeat_seconds() -> float:
    """SAVEPOINT_HEARTBEAT_SECONDS: seconds between two heartbeats of serve (default 10; 0
    turns them off)."""
    raw = os.environ.get(HEARTBEAT_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_HEARTBEAT_SECONDS
    except ValueError:
        raise HarnessError(f"{HEARTBEAT_ENV}={raw!r}: expected a number of seconds") from None
    if value < 0:
        raise HarnessError(f"{HEARTBEAT_ENV}={raw!r}: must not be negative")
    return value


def heartbeats(interval: float, root: Path, stop: threading.Event) -> None:
    """Write a sample now and every interval until stop is set. A failed write is said on
    stderr (once per kind of error) and tried again at the next beat: serve keeps serving."""
    said: set[str] = set()
    log = None
    while True:
        try:
            log = log or open_log()
            write_heartbeat(log, sample(root))
        except Exception as err:  # the API server away, a Role without the heartbeat, ...
            kind = f"{type(err).__name__}: {getattr(err, 'status', '')}"
            if kind not in said:
                said.add(kind)
                print(f"savepoint harness: heartbeat not written: {type(err).__name__}: {err}", file=sys.stderr)
        if stop.wait(interval):
            return


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
    interval = heartbeat_seconds()
    print(
        f"savepoint harness serving session {session}, workspace {workspace()}, "
        f"heartbeat {f'every {interval:g}s' if interval else 'off'}",
        flush=True,
    )
    stopped = threading.Event()
    if interval:
        threading.Thread(target=heartbeats, args=(interval, workspace(), stopped), daemon=True).start()
    while not stop:
        signal.pause()
    stopped.set()
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
    t.add_argument("--input-tokens", type=int, help="tokens the model call read (default: the message's words)")
    t.add_argument("--output-tokens", type=int, help="tokens it wrote (default: the reply's words)")
    sub.add_parser("heartbeat", help="write one resource sample to the session's heartbeat object")
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
        for flag, value in (("--input-tokens", args.input_tokens), ("--output-tokens", args.output_tokens)):
            if value is not None and value < 0:
                raise HarnessError(f"{flag} must not be negative")
        buffer = buffer_dir() if args.buffered else None
        got = turn(
            open_log(), args.message, args.reply, writes, root, args.input_tokens, args.output_tokens, buffer=buffer
        )
        print(json.dumps(got))
    elif args.command == "heartbeat":
        beat = sample(root)
        write_heartbeat(open_log(), beat)
        print(json.dumps(beat))
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
