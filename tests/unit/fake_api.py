"""An in-memory API server behind savepoint.k8s, for table tests of whole reconcile passes.

Objects are kept by (kind, namespace, name), where kind is the plural ("sessions",
"pods", "configmaps", ...). Like the API server: every write bumps resourceVersion; a
read, patch or delete of a missing object answers 404; a create of an existing name,
a patch carrying a stale metadata.resourceVersion, or a delete whose uid precondition
fails answers 409; a status patch touches status only and a spec change bumps
generation. Errors are injected per verb and kind (`fail("create", "volumesnapshots",
500)`), and every request is recorded in `requests`.

`install(monkeypatch)` puts the fake behind the k8s functions the controllers call, with
the same meaning of each answer as savepoint.k8s (through the same `k8s.call`), and
behind `k8s.core()` for the event log's ConfigMaps. What needs the real API server
(schema and CEL validation, finalizers, garbage collection, watches, admission) is left
to tests/integration.
"""

from __future__ import annotations

import copy
import itertools
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from savepoint import k8s


@dataclass(frozen=True)
class Request:
    verb: str  # get, list, create, patch, patch_status, delete
    kind: str
    namespace: str
    name: str


@dataclass
class _Fault:
    verb: str
    kind: str
    status: int
    times: int
    reason: str


def _match(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selectors: k=v, k!=v, k, !k, joined by commas."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class _Reply:
    """What a `_preload_content=False` call answers: the body as bytes."""

    def __init__(self, obj: Any) -> None:
        self.data = json.dumps(obj).encode()


class FakeAPI:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.requests: list[Request] = []
        self.events: list[tuple[str, str, str, bool]] = []  # (object name, reason, message, warning)
        self.faults: list[_Fault] = []
        self._version = itertools.count(1)
        self._uid = itertools.count(1)
        self._lock = threading.RLock()
        self._core = FakeCore(self)

    # --- setup and inspection ----------------------------------------------------------

    def add(self, kind: str, obj: dict) -> dict:
        """Store an object as if created earlier (no request recorded); returns the stored copy."""
        with self._lock:
            return self._create(kind, obj.get("metadata", {}).get("namespace", ""), obj)

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        """The stored object (a copy), without a request."""
        found = self.objects.get((kind, namespace, name))
        return copy.deepcopy(found) if found is not None else None

    def names(self, kind: str) -> list[str]:
        return sorted(name for (k, _, name) in self.objects if k == kind)

    def fail(self, verb: str, kind: str, status: int, times: int = 1, reason: str = "") -> None:
        """The next `times` requests of this verb on this kind answer `status`, unapplied."""
        self.faults.append(_Fault(verb, kind, status, times, reason or {409: "Conflict"}.get(status, "Injected")))

    def core(self) -> FakeCore:
        """What `k8s.core()` answers: the event log's ConfigMap calls on this store."""
        return self._core

    def writes(self) -> list[Request]:
        return [r for r in self.requests if r.verb not in ("get", "list")]

    # --- the verbs, as the API server answers them ------------------------------------

    def _begin(self, verb: str, kind: str, namespace: str, name: str) -> None:
        self.requests.append(Request(verb, kind, namespace, name))
        for fault in self.faults:
            if fault.times > 0 and fault.verb == verb and fault.kind == kind:
                fault.times -= 1
                raise ApiException(status=fault.status, reason=fault.reason)

    def _stamp(self, obj: dict) -> None:
        obj["metadata"]["resourceVersion"] = str(next(self._version))

    def _create(self, kind: str, namespace: str, body: dict) -> dict:
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if namespace:
            meta["namespace"] = namespace
        key = (kind, namespace, meta["name"])
        if key in self.objects:
            raise ApiException(status=409, reason="AlreadyExists")
        meta.setdefault("uid", f"uid-{kind}-{meta['name']}-{next(self._uid)}")
        meta.setdefault("creationTimestamp", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        meta.setdefault("generation", 1)
        self._stamp(obj)
        self.objects[key] = obj
        return copy.deepcopy(obj)

    def read(self, kind: str, namespace: str, name: str) -> dict:
        with self._lock:
            self._begin("get", kind, namespace, name)
            obj = self.objects.get((kind, namespace, name))
            if obj is None:
                raise ApiException(status=404, reason="NotFound")
            return copy.deepcopy(obj)

    def create(self, kind: str, namespace: str, body: dict) -> dict:
        with self._lock:
            self._begin("create", kind, namespace, body["metadata"]["name"])
            return self._create(kind, namespace, body)

    def patch(self, kind: str, namespace: str, name: str, patch: dict, status: bool = False) -> dict:
        with self._lock:
            self._begin("patch_status" if status else "patch", kind, namespace, name)
            obj = self.objects.get((kind, namespace, name))
            if obj is None:
                raise ApiException(status=404, reason="NotFound")
            wanted = (patch.get("metadata") or {}).get("resourceVersion")
            if wanted is not None and wanted != obj["metadata"]["resourceVersion"]:
                raise ApiException(status=409, reason="Conflict")
            if status:
                patch = {"status": patch.get("status")}
            new = merge_patch(obj, patch)
            if new.get("spec") != obj.get("spec"):
                new["metadata"]["generation"] = obj["metadata"].get("generation", 1) + 1
            self._stamp(new)
            self.objects[(kind, namespace, name)] = new
            return copy.deepcopy(new)

    def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> None:
        with self._lock:
            self._begin("delete", kind, namespace, name)
            obj = self.objects.get((kind, namespace, name))
            if obj is None:
                raise ApiException(status=404, reason="NotFound")
            if uid is not None and obj["metadata"].get("uid") != uid:
                raise ApiException(status=409, reason="Conflict")
            del self.objects[(kind, namespace, name)]

    def list(self, kind: str, namespace: str | None, selector: str = "") -> list[dict]:
        with self._lock:
            self._begin("list", kind, namespace or "", selector)  # a list's "name": its selector
            return [
                copy.deepcopy(obj)
                for (k, ns, _), obj in sorted(self.objects.items())
                if k == kind
                and (namespace is None or ns == namespace)
                and _match(obj["metadata"].get("labels") or {}, selector)
            ]

    # --- installed over savepoint.k8s --------------------------------------------------

    def install(self, monkeypatch: Any) -> FakeAPI:
        call = k8s.call
        functions: dict[str, Any] = {
            "core": self.core,
            "get_pod": lambda ns, name: call(lambda: self.read("pods", ns, name), absent=None),
            "get_pvc": lambda ns, name: call(lambda: self.read("persistentvolumeclaims", ns, name), absent=None),
            "get_namespace": lambda name: self.read("namespaces", "", name),
            "get_node": lambda name: call(lambda: self.read("nodes", "", name), absent=None),
            "ensure_pod": lambda body: self._ensure("pods", body, refused=True),
            "ensure_pvc": lambda body: self._ensure("persistentvolumeclaims", body),
            "list_pods": lambda ns, selector: self.list("pods", ns, selector),
            "list_pvcs": lambda ns, selector: self.list("persistentvolumeclaims", ns, selector),
            "delete_pod": lambda ns, name, uid=None: call(
                lambda: self.delete("pods", ns, name, uid), absent=None, exists=None
            ),
            "delete_pvc": lambda ns, name: call(lambda: self.delete("persistentvolumeclaims", ns, name), absent=None),
            "annotate_pod": lambda ns, name, annotations: call(
                lambda: self.patch("pods", ns, name, {"metadata": {"annotations": annotations}}), absent=None
            ),
            "get_custom": lambda plural, ns, name: call(lambda: self.read(plural, ns, name), absent=None),
            "patch_status": lambda plural, ns, name, status: call(
                lambda: self.patch(plural, ns, name, {"status": status}, status=True), absent=None
            ),
            "iter_custom": self._iter_custom,
            "list_custom": lambda plural, ns=None, selector="": list(self._iter_custom(plural, ns, selector)),
            "patch_custom": lambda plural, ns, name, patch: call(
                lambda: self.patch(plural, ns, name, patch), absent=None
            ),
            "create_custom": lambda plural, ns, body: call(
                lambda: self.create(plural, ns, body), exists=None, refused=True
            ),
            "delete_custom": lambda plural, ns, name: call(lambda: self.delete(plural, ns, name), absent=None),
            "get_volume_snapshot": lambda ns, name: call(lambda: self.read("volumesnapshots", ns, name), absent=None),
            "ensure_volume_snapshot": lambda body: self._ensure("volumesnapshots", body),
            "request_volume_snapshot_deletion": lambda ns, name: call(
                lambda: self.delete("volumesnapshots", ns, name), absent=None
            ),
            "delete_volume_snapshot": self._delete_volume_snapshot,
            "list_volume_snapshot_classes": lambda max_age=0.0: self.list("volumesnapshotclasses", None),
            "csi_driver_of_claim": self._csi_driver_of_claim,
            "post_event": self._post_event,
            "pod_warning": lambda ns, pod, reasons: None,
            "ensure_service_account": lambda body: self._ensure("serviceaccounts", body, read_raises=True),
            "ensure_role": lambda body: self._ensure("roles", body, read_raises=True),
            "ensure_role_binding": lambda body: self._ensure("rolebindings", body, read_raises=True),
            "get_role": lambda ns, name: call(lambda: self.read("roles", ns, name), absent=None),
            "get_role_binding": lambda ns, name: call(lambda: self.read("rolebindings", ns, name), absent=None),
            "list_roles_and_bindings": self._list_roles_and_bindings,
            "set_role_rules": lambda ns, name, rules: call(
                lambda: self.patch("roles", ns, name, {"rules": rules}) and True, absent=False
            ),
        }
        for name, function in functions.items():
            assert hasattr(k8s, name), f"savepoint.k8s has no {name}: the fake is out of date"
            monkeypatch.setattr(k8s, name, function)
        forget_process_memory(monkeypatch)
        return self

    def _ensure(self, kind: str, body: dict, refused: bool = False, read_raises: bool = False) -> dict:
        """Create, or read the object of that name (gone in between: the body, or a 404 raised)."""
        meta = body["metadata"]
        made = k8s.call(lambda: self.create(kind, meta["namespace"], body), exists=None, refused=refused)
        if made is not None:
            return made
        if read_raises:
            return self.read(kind, meta["namespace"], meta["name"])
        return k8s.call(lambda: self.read(kind, meta["namespace"], meta["name"]), absent=None) or body

    def _list_roles_and_bindings(self, namespace: str, selector: str) -> tuple[list[dict], list[dict]] | None:
        try:
            bindings = self.list("rolebindings", namespace, selector)
            return self.list("roles", namespace, selector), bindings
        except ApiException:
            return None

    def _iter_custom(self, plural: str, namespace: str | None = None, label_selector: str = "") -> Iterator[dict]:
        yield from self.list(plural, namespace, label_selector)

    def _delete_volume_snapshot(self, namespace: str, name: str) -> bool:
        gone = k8s.call(lambda: self.delete("volumesnapshots", namespace, name) or False, absent=True)
        return gone or k8s.call(lambda: self.read("volumesnapshots", namespace, name), absent=None) is None

    def _csi_driver_of_claim(self, pvc: dict) -> str | None:
        """The driver named by the claim's StorageClass (the fake keeps no PersistentVolumes)."""
        class_name = (pvc.get("spec") or {}).get("storageClassName")
        if not class_name:
            return None
        sc = k8s.call(lambda: self.read("storageclasses", "", class_name), absent=None)
        return sc.get("provisioner") if sc is not None else None

    def _post_event(self, body: dict, reason: str, message: str, warning: bool = False) -> None:
        self.events.append((body["metadata"]["name"], reason, message, warning))


class FakeCore:
    """The ConfigMap calls of CoreV1Api that savepoint.eventlog makes, on the fake's store."""

    def __init__(self, api: FakeAPI) -> None:
        self.api = api

    @staticmethod
    def _answer(obj: Any, preload: bool) -> Any:
        return obj if preload else _Reply(obj)

    def list_namespaced_config_map(self, namespace: str, label_selector: str = "", **kwargs: Any) -> Any:
        items = self.api.list("configmaps", namespace, label_selector)
        return self._answer({"items": items, "metadata": {}}, kwargs.get("_preload_content", True))

    def read_namespaced_config_map(self, name: str, namespace: str, **kwargs: Any) -> Any:
        return self._answer(self.api.read("configmaps", namespace, name), kwargs.get("_preload_content", True))

    def create_namespaced_config_map(self, namespace: str, body: dict, **kwargs: Any) -> Any:
        return self._answer(self.api.create("configmaps", namespace, body), kwargs.get("_preload_content", True))

    def patch_namespaced_config_map(self, name: str, namespace: str, body: dict, **kwargs: Any) -> Any:
        return self._answer(self.api.patch("configmaps", namespace, name, body), kwargs.get("_preload_content", True))

    def delete_namespaced_config_map(self, name: str, namespace: str, **kwargs: Any) -> None:
        self.api.delete("configmaps", namespace, name)


def forget_process_memory(monkeypatch: Any) -> None:
    """Start each test as a fresh operator process: no remembered passes, children, grants
    or namespaces (all of it is rebuilt from the API after a restart, as in production)."""
    from savepoint import controllers
    from savepoint.controllers import cache, expiry, heartbeat, sandbox, session

    monkeypatch.setattr(controllers, "_done", {})
    monkeypatch.setattr(sandbox, "_granted", {})
    monkeypatch.setattr(sandbox, "_listed", set())
    monkeypatch.setattr(sandbox, "_listing", {})
    monkeypatch.setattr(session, "_children", {})
    monkeypatch.setattr(session, "_log_restored", {})
    monkeypatch.setattr(session, "_resume_listings", {})
    cache.clear()
    expiry.clocks.clear()
    monkeypatch.setattr(heartbeat, "_beats", {})
