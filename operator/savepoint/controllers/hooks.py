"""Checkpoint hooks: preCheckpoint before the cut, postCheckpoint once the snapshot has
settled (docs/checkpoints.md#hooks).

Only a checkpoint admitted with `status.hooks` has anything here; without hooks the
Checkpoint controller makes no extra request. Each hook's run is written to
`status.hooks` before the next side effect: preCheckpoint's success before the
VolumeSnapshot is created (a restart after the cut never runs it again), postCheckpoint's
`Running` before its exec (a restart while it runs marks it Interrupted, never runs it
twice). `write` is the Checkpoint controller's status writer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from savepoint import k8s, metrics
from savepoint.conditions import ConditionType, Reason, set_condition
from savepoint.hooks import POST, PRE, STDERR_KEEP, ExecResult, container_of, describe, env_values, hooks_of, refusal
from savepoint.models import CheckpointHook, HookPhase

log = logging.getLogger(__name__)
Writer = Callable[..., None]
# Seconds allowed beyond timeoutSeconds for the exec's own round trips.
EXEC_SLACK = 5.0


def initial_status(session: dict[str, Any]) -> dict[str, Any] | None:
    """`status.hooks` for a checkpoint admitted now: each configured hook Pending; None without hooks."""
    hooks = hooks_of(session.get("spec"))
    if hooks is None:
        return None
    pending = {"phase": HookPhase.PENDING.value}
    return {
        PRE: pending if hooks.pre_checkpoint else None,
        POST: pending if hooks.post_checkpoint else None,
    }


def _phase(body: dict, which: str) -> str | None:
    return (((body.get("status") or {}).get("hooks") or {}).get(which) or {}).get("phase")


def _condition(
    body: dict, which: str, status: bool | None, reason: Reason, message: str, old: list[dict] | None = None
) -> list[dict]:
    """The conditions with this hook's replaced; None for an outcome nobody knows (Unknown)."""
    kind = ConditionType.PRE_CHECKPOINT_HOOK if which == PRE else ConditionType.POST_CHECKPOINT_HOOK
    if old is None:
        old = (body.get("status") or {}).get("conditions") or []
    conditions = set_condition(old, kind, bool(status), reason, message, body["metadata"].get("generation"))
    if status is None:
        conditions[-1]["status"] = "Unknown"
    return conditions


def _hook_status(body: dict, which: str, phase: HookPhase, result: ExecResult | None = None) -> dict:
    run: dict[str, Any] = {"phase": phase.value}
    if result is not None:
        run["exitCode"] = result.exit_code
        run["durationMs"] = int(result.seconds * 1000)
    hooks = dict((body.get("status") or {}).get("hooks") or {})
    hooks[which] = run
    return hooks


def _session_and_pod(body: dict, session: dict | None) -> tuple[dict | None, dict | None, dict | None]:
    meta = body["metadata"]
    session = session or k8s.get_custom("sessions", meta["namespace"], body["spec"]["sessionName"])
    if session is None:
        return None, None, None
    pod_name = (session.get("status") or {}).get("podName")
    pod = k8s.get_pod(meta["namespace"], pod_name) if pod_name else None
    if pod is not None and pod["metadata"].get("deletionTimestamp"):
        pod = None
    node_name = ((pod or {}).get("spec") or {}).get("nodeName")
    node = k8s.get_node(node_name) if node_name else None
    return session, pod, node


def _exec(body: dict, which: str, hook: CheckpointHook, pod: dict) -> tuple[str | None, ExecResult]:
    """(container, result) of one run; a container that is not there is a result too."""
    container, why = container_of(hook, pod)
    if container is None:
        return None, ExecResult(None, error=why)
    outcome = k8s.exec_in_pod(
        pod["metadata"]["namespace"],
        pod["metadata"]["name"],
        container,
        list(hook.exec.command),
        timeout=hook.timeout_seconds + 0.0,
        keep=STDERR_KEEP,
    )
    result = ExecResult(**outcome._asdict())
    metrics.hook_seconds.labels(which, "ok" if result.ok else "failed").observe(result.seconds)
    log.info(
        "checkpoint %s/%s: %s hook in %s/%s ended %s in %.3fs",
        body["metadata"]["namespace"],
        body["metadata"]["name"],
        which,
        pod["metadata"]["name"],
        container,
        "ok" if result.ok else f"(exit {result.exit_code}, timed out {result.timed_out})",
        result.seconds,
    )
    return container, result


def _skip_all(body: dict, write: Writer, why: str) -> None:
    hooks = dict(body["status"].get("hooks") or {})
    conditions = body["status"].get("conditions") or []
    for which in (PRE, POST):
        if (hooks.get(which) or {}).get("phase") == HookPhase.PENDING:
            hooks[which] = {"phase": HookPhase.SKIPPED.value}
            conditions = _condition(body, which, True, Reason.HOOK_SKIPPED, why, old=conditions)
    write(body, {"hooks": hooks, "conditions": conditions}, event=("HooksSkipped", why))


def _failed_before_cut(body: dict, write: Writer, message: str, result: ExecResult | None) -> None:
    """Record a refused or failed preCheckpoint; postCheckpoint is skipped: nothing was cut."""
    status: dict[str, Any] = {}
    if _phase(body, PRE) is not None:
        status["hooks"] = _hook_status(body, PRE, HookPhase.FAILED, result)
        status["conditions"] = _condition(body, PRE, False, Reason.HOOK_FAILED, message)
    if _phase(body, POST) == HookPhase.PENDING:
        body["status"] = {**body["status"], **status}
        status["hooks"] = _hook_status(body, POST, HookPhase.SKIPPED)
        status["conditions"] = _condition(
            body, POST, True, Reason.HOOK_SKIPPED, "no snapshot was cut: the checkpoint failed before it"
        )
    write(body, status)


def before_cut(body: dict, write: Writer, session: dict | None = None) -> str | None:
    """Run preCheckpoint (and check that postCheckpoint can run) before the snapshot is made.
    None when the cut may go on; otherwise the message to fail the checkpoint with
    (HookFailed): no snapshot is taken then."""
    hooks_status = (body.get("status") or {}).get("hooks")
    if not hooks_status or _phase(body, PRE) not in (HookPhase.PENDING, None):
        return None  # no hooks, or preCheckpoint done (or skipped) already
    if _phase(body, PRE) is None and _phase(body, POST) != HookPhase.PENDING:
        return None
    session, pod, node = _session_and_pod(body, session)
    hooks = hooks_of((session or {}).get("spec"))
    if session is None or hooks is None:
        _skip_all(body, write, "the session has no hooks any more")
        return None
    if pod is None:
        # A paused session runs nothing: its disk is quiescent without a flush.
        _skip_all(body, write, "the session has no sandbox Pod (paused): nothing to run the hooks in")
        return None
    refused = refusal(PRE if hooks.pre_checkpoint else POST, pod, node)
    if refused:
        _failed_before_cut(body, write, refused, None)
        return refused
    if _phase(body, PRE) is None:
        return None
    if hooks.pre_checkpoint is None:  # removed from the Session since admission
        why = f"the session has no {PRE} hook any more"
        write(
            body,
            {
                "hooks": _hook_status(body, PRE, HookPhase.SKIPPED),
                "conditions": _condition(body, PRE, True, Reason.HOOK_SKIPPED, why),
            },
        )
        return None
    container, result = _exec(body, PRE, hooks.pre_checkpoint, pod)
    if not result.ok:
        message = describe(PRE, hooks.pre_checkpoint, container, result, env_values(pod))
        _failed_before_cut(body, write, message, result)
        return message
    done = f"{PRE} hook ran in container {container} in {int(result.seconds * 1000)} ms"
    write(
        body,
        {
            "hooks": _hook_status(body, PRE, HookPhase.SUCCEEDED, result),
            "conditions": _condition(body, PRE, True, Reason.HOOK_SUCCEEDED, done),
        },
    )
    return None


def after_cut(body: dict, write: Writer) -> None:
    """Run postCheckpoint once, now that the snapshot is ready or has failed. Its failure
    is a Warning Event and a False condition; the checkpoint's own outcome stands."""
    phase = _phase(body, POST)
    if phase == HookPhase.RUNNING:
        message = f"the operator restarted while the {POST} hook ran; it is not run again"
        write(
            body,
            {
                "hooks": _hook_status(body, POST, HookPhase.INTERRUPTED),
                "conditions": _condition(body, POST, None, Reason.HOOK_INTERRUPTED, message),
            },
            event=(Reason.HOOK_INTERRUPTED.value, message),
            warn=True,
        )
        return
    if phase != HookPhase.PENDING:
        return
    write(body, {"hooks": _hook_status(body, POST, HookPhase.RUNNING)})
    session, pod, node = _session_and_pod(body, None)
    hooks = hooks_of((session or {}).get("spec"))
    hook = hooks.post_checkpoint if hooks else None
    if hook is None or pod is None:
        why = f"the session has no {POST} hook any more" if hook is None else "the session has no sandbox Pod any more"
        write(
            body,
            {
                "hooks": _hook_status(body, POST, HookPhase.SKIPPED),
                "conditions": _condition(body, POST, True, Reason.HOOK_SKIPPED, why),
            },
        )
        return
    refused = refusal(POST, pod, node)
    if refused:
        container, result, message = None, ExecResult(None, error=refused), refused
    else:
        container, result = _exec(body, POST, hook, pod)
        message = describe(POST, hook, container, result, env_values(pod))
    if result.ok:
        done = f"{POST} hook ran in container {container} in {int(result.seconds * 1000)} ms"
        write(
            body,
            {
                "hooks": _hook_status(body, POST, HookPhase.SUCCEEDED, result),
                "conditions": _condition(body, POST, True, Reason.HOOK_SUCCEEDED, done),
            },
        )
        return
    write(
        body,
        {
            "hooks": _hook_status(body, POST, HookPhase.FAILED, result),
            "conditions": _condition(body, POST, False, Reason.HOOK_FAILED, message),
        },
        event=(Reason.HOOK_FAILED.value, message),
        warn=True,
    )
