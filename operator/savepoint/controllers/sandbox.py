"""A sandbox's own credentials: ensured by the Session reconcile before its Pod.

The ServiceAccount, Role and RoleBinding are named after the session and owned by it,
so a retry finds what the first try made and deleting the Session deletes them. The
Role's window of chunk names is widened as the log grows; which window was granted is
remembered in memory and compared with the chunk listing the Session pass makes anyway,
so a pass usually costs no request here. After a restart, the first pass in a namespace
lists the sandbox Roles and RoleBindings there (two requests per namespace, not two GETs
per Session); a Session that listing did not show gets its three objects made without a
read first.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import kopf

from savepoint import k8s, sandbox
from savepoint.eventlog import EventLog
from savepoint.session import MANAGED_BY, SESSION_LABEL

# Session uid -> the highest chunk index its Role is known to cover.
_granted: dict[str, int] = {}
_guard = threading.Lock()
# Namespace -> a lock held while its sandbox Roles are listed; present once they have been.
_listing: dict[str, threading.Lock] = {}
_listed: set[str] = set()
_unlisted: set[str] = set()  # listed as far as we could: the listing was refused there
SANDBOX_SELECTOR = ",".join([*(f"{k}={v}" for k, v in MANAGED_BY.items()), SESSION_LABEL])

log = logging.getLogger(__name__)


def _learn_namespace(namespace: str) -> None:
    """Remember the window of every sandbox Role in the namespace whose RoleBinding exists
    too (it is made last, so both mean the ServiceAccount is there): once per namespace
    per process, so the thousands of resume passes after a restart do not each read two."""
    with _guard:
        if namespace in _listed:
            return
        lock = _listing.setdefault(namespace, threading.Lock())
    with lock:
        if namespace in _listed:
            return
        # Unlisted (an account that may not list them): each one is read when it is needed.
        listed = k8s.list_roles_and_bindings(namespace, SANDBOX_SELECTOR)
        roles, bindings = listed or ([], [])
        bound = {ref["uid"] for binding in bindings for ref in binding["metadata"].get("ownerReferences") or []}
        with _guard:
            for role in roles:
                for ref in role["metadata"].get("ownerReferences") or []:
                    if ref.get("kind") == "Session" and ref["uid"] in bound:
                        _granted.setdefault(ref["uid"], sandbox.granted_window(role))
            _listed.add(namespace)
            if listed is None:
                _unlisted.add(namespace)


def _owned_by(obj: dict, body: dict) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == body["metadata"]["uid"] for r in refs)


def _check_owner(obj: dict, body: dict) -> None:
    if not _owned_by(obj, body):
        kind, name = obj.get("kind") or "object", obj["metadata"]["name"]
        # One left by an earlier Session of the same name, still being collected.
        raise kopf.TemporaryError(f"{kind} {name} belongs to another object", delay=2)


def ensure_sandbox_access(body: dict[str, Any], newest: int | None = None) -> str:
    """Make the sandbox's ServiceAccount, Role and RoleBinding; return the account's name.

    `newest` is the log's newest chunk index when the caller has just listed it: then
    widening costs no request unless the Role must grow. Without it, a Role already made
    by this process is left as it is (the pass's end widens it from its own listing).
    """
    meta = body["metadata"]
    namespace, session, uid = meta["namespace"], meta["name"], meta["uid"]
    name = sandbox.account_name(session)
    _learn_namespace(namespace)
    with _guard:
        granted = _granted.get(uid)
    if granted is None:
        # Not in the namespace's listing, nor made by this process since: most likely a new
        # Session, whose objects are made without a read first (one there after all, left
        # half-made or made by another replica, answers 409 and is read). Where the listing
        # was refused, the RoleBinding is read first: it is made last (binding a Role that
        # does not exist yet is refused to anyone without `bind`), so finding it and the
        # Role means the ServiceAccount was made too.
        role = None
        if namespace in _unlisted and k8s.get_role_binding(namespace, name):
            role = k8s.get_role(namespace, name)
        if role is None:
            _check_owner(k8s.ensure_service_account(sandbox.build_service_account(body)), body)
            if newest is None:
                newest = EventLog(k8s.core(), namespace, session, discovery="names").newest_chunk()
            role = k8s.ensure_role(sandbox.build_role(body, sandbox.window(newest)))
            _check_owner(k8s.ensure_role_binding(sandbox.build_role_binding(body)), body)
        _check_owner(role, body)
        granted = sandbox.granted_window(role)
    elif newest is None:
        return name
    assert newest is not None  # a Role found without a listing is only read when the caller listed the log
    if sandbox.needs_widening(granted, newest):
        granted = sandbox.window(newest)
        if not k8s.set_role_rules(namespace, name, sandbox.role_rules(session, granted)):
            forget(uid)  # deleted behind our back: make it again
            return ensure_sandbox_access(body, newest)
    with _guard:
        _granted[uid] = granted
    return name


def forget(uid: str) -> None:
    with _guard:
        _granted.pop(uid, None)
