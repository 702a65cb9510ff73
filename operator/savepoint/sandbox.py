"""Pure decisions for a sandbox's own credentials: its ServiceAccount, Role and RoleBinding.

A sandbox Pod runs as `savepoint-sandbox-<session>`, which may append to its session's
event log and do nothing else (docs/security.md). RBAC cannot limit `create` (or `list`)
by name, so the Role grants:

- get/patch/update on the session's chunk names, 000001 up to the newest chunk plus a
  lookahead window, widened by the Session controller as the log grows;
- patch on its heartbeat object `<session>-heartbeat` (savepoint.usage: its resource
  samples);
- create on configmaps, which the chart's ValidatingAdmissionPolicy narrows to this
  session's next chunks (name `<session>-log-<6 digits>`) and its heartbeat object, all
  labelled savepoint.dev/session.

Nothing here talks to the API server (savepoint.k8s does).
"""

from __future__ import annotations

import re
from typing import Any

from savepoint.constants import HEARTBEAT_SUFFIX
from savepoint.session import MANAGED_BY, SANDBOX_ACCOUNT_PREFIX, SESSION_LABEL, owner_reference, sandbox_account
from savepoint.usage import heartbeat_name

ACCOUNT_PREFIX = SANDBOX_ACCOUNT_PREFIX
# Chunks a sandbox may use beyond the newest one before the operator widens its Role.
LOOKAHEAD = 16
_CHUNK_RE = re.compile(r"-log-(\d{6})$")


def account_name(session: str) -> str:
    """The ServiceAccount, Role and RoleBinding of a session's sandbox (all three share it)."""
    return sandbox_account(session)


def chunk_name(session: str, index: int) -> str:
    return f"{session}-log-{index:06d}"


def chunk_index(name: str) -> int:
    """The index in a chunk's name (`<session>-log-000042` -> 42)."""
    match = _CHUNK_RE.search(name)
    if match is None:
        raise ValueError(f"{name!r} is not an event-log chunk name")
    return int(match[1])


def window(newest: int, lookahead: int = LOOKAHEAD) -> int:
    """The highest chunk index the Role should cover for a log whose newest chunk is `newest`."""
    return max(1, newest) + lookahead


def needs_widening(granted: int, newest: int, lookahead: int = LOOKAHEAD) -> bool:
    """True once the log has used half of the lookahead: widen before the sandbox runs out."""
    return newest > granted - lookahead // 2


def granted_window(role: dict[str, Any] | None) -> int:
    """The highest chunk index a sandbox Role built here covers; 0 for none, and for a
    Role without the heartbeat rule (made by an older operator), so that it is rewritten."""
    names = [n for rule in (role or {}).get("rules") or [] for n in rule.get("resourceNames") or []]
    if not any(n.endswith(HEARTBEAT_SUFFIX) for n in names):
        return 0
    indices = [int(m[1]) for m in (_CHUNK_RE.search(n) for n in names) if m]
    return max(indices, default=0)


def _metadata(body: dict[str, Any]) -> dict[str, Any]:
    meta = body["metadata"]
    return {
        "name": account_name(meta["name"]),
        "namespace": meta["namespace"],
        "labels": {SESSION_LABEL: meta["name"], **MANAGED_BY},
        "ownerReferences": [owner_reference(body)],
    }


def build_service_account(body: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(body)}


def role_rules(session: str, upto: int) -> list[dict[str, Any]]:
    return [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "verbs": ["get", "patch", "update"],
            "resourceNames": [chunk_name(session, i) for i in range(1, upto + 1)],
        },
        # Not limited by name (RBAC cannot): the admission policy limits it to this
        # session's own chunks.
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "verbs": ["patch"],
            "resourceNames": [heartbeat_name(session)],
        },
    ]


def build_role(body: dict[str, Any], upto: int) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(body),
        "rules": role_rules(body["metadata"]["name"], upto),
    }


def build_role_binding(body: dict[str, Any]) -> dict[str, Any]:
    meta = body["metadata"]
    name = account_name(meta["name"])
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(body),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": meta["namespace"]}],
    }
