"""Pure decisions for checkpoint hooks (Session `checkpointPolicy.hooks`): where a hook
may run, and what a failed one may say.

A hook's output is the sandbox's and may hold anything the agent can read: its env,
mounted Secrets, its token. What reaches a Checkpoint's status, its Events or the log is
only the exit code and a short, scrubbed tail of stderr; stdout is never kept.
savepoint.k8s runs the exec; this module decides around it and talks to nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from savepoint.models import CheckpointHook, CheckpointHooks, SessionSpec

PRE, POST = "preCheckpoint", "postCheckpoint"
# Lines of stderr a failure message keeps, and how long each may be.
TAIL_LINES = 5
LINE_CHARS = 200
# Bytes of stderr kept while a hook runs (the rest scrolls away).
STDERR_KEEP = 16 * 1024
# A Node kwok fakes: its annotation (kwok's own mark) or this project's label.
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_LABEL = ("type", "kwok")
REDACTED = "[redacted]"
# Values shorter than this are not scrubbed one by one ("1", "true"): they would blank
# every digit of the message, and say nothing secret on their own.
MIN_SECRET_CHARS = 4

# KEY=VALUE or KEY: VALUE where KEY names a credential; a JWT (a ServiceAccount token);
# a PEM block.
_CREDENTIAL_ASSIGNMENT = re.compile(
    r"(?i)\b([A-Z0-9_.-]*(?:secret|token|passw(?:or)?d|api[-_]?key|credential|auth)[A-Z0-9_.-]*)(\s*[=:]\s*)(\S+)"
)
_JWT = re.compile(r"eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]+")
_PEM = re.compile(r"-----BEGIN [A-Z ]+-----.*?(-----END [A-Z ]+-----|$)", re.S)


@dataclass(frozen=True)
class ExecResult:
    """What an exec came back with: an exit code (None when it never ran to an end), whether
    it timed out, the kept end of its stderr, and an error of the exec itself (no such
    executable, the container gone) from the API server or kubelet."""

    exit_code: int | None
    timed_out: bool = False
    stderr: str = ""
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.error is None


def hooks_of(session_spec: dict[str, Any] | None) -> CheckpointHooks | None:
    """The Session's hooks, or None when it has none (the common case: nothing changes)."""
    policy = (session_spec or {}).get("checkpointPolicy") or {}
    if not policy.get("hooks"):
        return None
    hooks = SessionSpec.model_validate(session_spec).checkpoint_policy.hooks
    if hooks is None or (hooks.pre_checkpoint is None and hooks.post_checkpoint is None):
        return None
    return hooks


def is_kwok(node: dict[str, Any] | None) -> bool:
    meta = (node or {}).get("metadata") or {}
    key, value = KWOK_LABEL
    return (meta.get("annotations") or {}).get(KWOK_ANNOTATION) == "fake" or (meta.get("labels") or {}).get(
        key
    ) == value


def container_of(hook: CheckpointHook, pod: dict[str, Any]) -> tuple[str | None, str | None]:
    """(the container to run in, None) or (None, why not): the hook's, else the first."""
    names = [c.get("name") for c in (pod.get("spec") or {}).get("containers") or []]
    if not names:
        return None, "the sandbox Pod has no containers"
    if hook.container is None:
        return names[0], None
    if hook.container not in names:
        return None, f"container {hook.container!r} is not in the sandbox Pod (it has {', '.join(map(str, names))})"
    return hook.container, None


def refusal(which: str, pod: dict[str, Any] | None, node: dict[str, Any] | None) -> str | None:
    """Why the hook cannot run in this Pod, or None when it can. A kwok node runs no
    process, so an exec there would hang until its timeout: refused at once."""
    if pod is None:
        return f"{which} hook: the session has no sandbox Pod to run it in"
    node_name = (pod.get("spec") or {}).get("nodeName")
    if not node_name:
        return f"{which} hook: the sandbox Pod is not scheduled on a node yet"
    if is_kwok(node):
        return f"hooks need a real node: {node_name} is a kwok fake"
    if (pod.get("status") or {}).get("phase") != "Running":
        return f"{which} hook: the sandbox Pod is {(pod.get('status') or {}).get('phase') or 'not running'}"
    return None


def env_values(pod: dict[str, Any]) -> list[str]:
    """The literal env values of the Pod's containers: never repeated in a message."""
    values = []
    spec = pod.get("spec") or {}
    for container in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        for item in container.get("env") or []:
            value = item.get("value")
            if isinstance(value, str) and len(value) >= MIN_SECRET_CHARS:
                values.append(value)
    return sorted(set(values), key=len, reverse=True)  # longest first: no half-scrubbed value


def scrub(text: str, secrets: list[str]) -> str:
    """text without the given values, credential assignments, tokens or keys."""
    for value in secrets:
        text = text.replace(value, REDACTED)
    text = _PEM.sub(REDACTED, text)
    text = _JWT.sub(REDACTED, text)
    return _CREDENTIAL_ASSIGNMENT.sub(lambda m: f"{m[1]}{m[2]}{REDACTED}", text)


def stderr_tail(stderr: str, secrets: list[str], lines: int = TAIL_LINES, width: int = LINE_CHARS) -> list[str]:
    """At most `lines` last non-empty lines, each scrubbed, then cut to `width` characters
    (scrubbed first, so a cut never leaves the head of a secret behind)."""
    kept = [line.rstrip() for line in stderr.splitlines() if line.strip()][-lines:]
    out = []
    for line in kept:
        clean = scrub(line, secrets)
        out.append(clean if len(clean) <= width else clean[: width - 1] + "…")
    return out


def describe(which: str, hook: CheckpointHook, container: str | None, result: ExecResult, secrets: list[str]) -> str:
    """The one-paragraph message of a failed hook: what ran where, how it ended, and the
    scrubbed tail of its stderr. Never the command's env; the command itself is the
    Session's spec, readable by whoever reads the Checkpoint."""
    program = hook.exec.command[0]
    if result.timed_out:
        how = f"timed out after {hook.timeout_seconds}s (timeoutSeconds)"
    elif result.error is not None and result.exit_code is None:
        how = f"could not run: {scrub(result.error, secrets)[:LINE_CHARS]}"
    else:
        how = f"exited with code {result.exit_code}"
    where = f" in container {container}" if container else ""
    message = f"{which} hook {program!r}{where} {how}"
    tail = stderr_tail(result.stderr, secrets)
    if tail:
        message += "; stderr (last lines): " + " | ".join(tail)
    return message
