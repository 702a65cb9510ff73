"""The only module that talks to the API server.

Objects travel as plain dicts (the wire form). Writers are safe to repeat: create
treats AlreadyExists as "it is there", delete treats NotFound as done. Each function
says what the API server's refusals mean through `call`, once.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from functools import cache
from typing import Any, NamedTuple, cast
from urllib.parse import quote

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from savepoint import metrics
from savepoint.config import Settings
from savepoint.constants import GROUP, MERGE_PATCH, SNAPSHOT_GROUP, SNAPSHOT_VERSION, VERSION

_lock = threading.Lock()
log = logging.getLogger(__name__)


class RateLimiter:
    """A token bucket shared by every request this process makes through api_client().

    The same idea as client-go's QPS/Burst: a storm of work (thousands of checkpoints
    expiring at once) queues here instead of flooding the API server.
    """

    def __init__(self, qps: float, burst: int) -> None:
        self.qps, self.burst = qps, max(1, burst)
        self._tokens = float(self.burst)
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def take(self) -> float:
        """Wait for a token; the seconds waited."""
        if self.qps <= 0:
            return 0.0
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.qps)
            self._stamp = now
            self._tokens -= 1
            wait = -self._tokens / self.qps if self._tokens < 0 else 0.0
        if wait:
            time.sleep(wait)
        return wait


def with_timeout(args: tuple, kwargs: dict[str, Any], timeout: float) -> dict[str, Any]:
    """call_api's keyword arguments with `timeout` unless the call set its own.

    call_api(method, url, header_params, body, post_params, _request_timeout): the
    timeout is the fourth argument after the URL, or a keyword.
    """
    if timeout <= 0 or len(args) >= 4 or kwargs.get("_request_timeout") is not None:
        return kwargs
    return {**kwargs, "_request_timeout": timeout}


# What a request raises when no HTTP answer came back: refused or reset connections,
# timeouts, retries exhausted (urllib3's MaxRetryError), TLS failures.
TRANSPORT_ERRORS = (urllib3.exceptions.HTTPError, OSError)


def _instrument(api: client.ApiClient, limiter: RateLimiter, timeout: float = 0.0) -> None:
    """Count, rate-limit and time-bound every request of this client (typed and raw calls alike)."""
    # Every typed and raw (_preload_content=False) call goes through call_api; the
    # kubernetes client 37 ApiClient has no `request` method to wrap.
    send = api.call_api

    def request(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        waited = limiter.take()
        if waited:
            metrics.api_throttle_seconds.inc(waited)
        try:
            response = send(method, url, *args, **with_timeout(args, kwargs, timeout))
        except ApiException as err:
            metrics.api_requests.labels(method, str(err.status)).inc()
            raise
        except TRANSPORT_ERRORS:
            metrics.api_requests.labels(method, "error").inc()
            raise
        metrics.api_requests.labels(method, str(getattr(response, "status", 200))).inc()
        return response

    api.call_api = request  # type: ignore[method-assign]


# The client's rate limit and timeout: the operator's settings (configure(), at start);
# a library user (a test, a bench) that never calls it gets the environment's.
_settings: list[Settings] = []


def configure(settings: Settings) -> None:
    """Use these settings for the API client (before its first request)."""
    _settings[:] = [settings]


@cache
def api_client() -> client.ApiClient:
    with _lock:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        settings = _settings[0] if _settings else Settings()
        configuration = client.Configuration.get_default_copy()
        # One pooled connection per thread that may call at once (kopf's workers, the
        # expiry workers, the sweep): past the pool's size, every call would open a new
        # TLS connection and throw it away, at a cost to both ends.
        configuration.connection_pool_maxsize = 64
        _space_credential_refresh(configuration)
        api = client.ApiClient(configuration)
        _instrument(api, RateLimiter(settings.api_qps, settings.api_burst), settings.api_timeout_seconds)
        return api


# How often the kubeconfig loader's credential hook runs at most (see below).
CREDENTIAL_REFRESH_SECONDS = 1.0


def _space_credential_refresh(configuration: client.Configuration) -> None:
    """Run the kubeconfig loader's credential hook at most once a second, not before every
    request. The hook reloads credentials that have expired (an exec plugin's token),
    and then sets every connection setting again, the host among them, which looks up
    the proxy settings in the environment each time: about a seventh of the operator's
    CPU under a burst of checkpoints, run from a kubeconfig. In a Pod the in-cluster
    loader's hook only rereads the token file when it is due, cheaply."""
    hook = configuration.refresh_api_key_hook
    if hook is None:
        return
    last = [float("-inf")]
    guard = threading.Lock()

    def spaced(conf: client.Configuration) -> None:
        with guard:
            now = time.monotonic()
            if now - last[0] < CREDENTIAL_REFRESH_SECONDS:
                return
            last[0] = now
            hook(conf)

    configuration.refresh_api_key_hook = spaced


def core() -> client.CoreV1Api:
    return client.CoreV1Api(api_client())


def custom() -> Any:
    # Any, not CustomObjectsApi: its methods answer the objects as plain dicts, typed `object`.
    return client.CustomObjectsApi(api_client())


def _raw(response: Any) -> dict:
    return json.loads(response.data)


def status_message(err: ApiException) -> str:
    """The API server's own message from a refusal (a Status body), else the exception's text."""
    try:
        return str(json.loads(cast(str, err.body))["message"])
    except (TypeError, ValueError, KeyError):
        return str(err.reason or err)


def namespace_terminating(err: BaseException | None) -> bool:
    """Whether an error, or one it was raised from, is the API server refusing to create
    anything in a namespace that is being deleted (403, cause NamespaceTerminating)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, ApiException) and err.status == 403:
            try:
                causes = json.loads(cast(str, err.body))["details"]["causes"]
            except (TypeError, ValueError, KeyError):
                causes = []
            if any(isinstance(c, dict) and c.get("reason") == "NamespaceTerminating" for c in causes):
                return True
        err = err.__cause__ or err.__context__
    return False


_RAISE: Any = object()
# The codes the API server answers when it refuses an object as written (bad field, failed schema or CEL rule).
REFUSED = (400, 422)


class Refused(ApiException):
    """The API server refused the object as written (400, 422); `message` is its reason."""

    def __init__(self, err: ApiException) -> None:
        super().__init__(status=err.status, reason=err.reason)
        self.body, self.headers = err.body, err.headers
        self.message = status_message(err)


def call(send: Callable[[], Any], *, absent: Any = _RAISE, exists: Any = _RAISE, refused: bool = False) -> Any:
    """Send one request and say once what its refusals mean: 404 answers `absent`, 409
    (AlreadyExists, or a failed precondition) answers `exists`, and with `refused` a 400 or
    422 raises Refused. Any other error is raised as it came.
    """
    try:
        return send()
    except ApiException as err:
        if err.status == 404 and absent is not _RAISE:
            return absent
        if err.status == 409 and exists is not _RAISE:
            return exists
        if refused and err.status in REFUSED:
            raise Refused(err) from None
        raise


def get_pod(namespace: str, name: str) -> dict | None:
    return call(lambda: _raw(core().read_namespaced_pod(name, namespace, _preload_content=False)), absent=None)


def get_pvc(namespace: str, name: str) -> dict | None:
    return call(
        lambda: _raw(core().read_namespaced_persistent_volume_claim(name, namespace, _preload_content=False)),
        absent=None,
    )


def get_namespace(name: str) -> dict:
    return _raw(core().read_namespace(name, _preload_content=False))


def get_node(name: str) -> dict | None:
    return call(lambda: _raw(core().read_node(name, _preload_content=False)), absent=None)


class ExecOutcome(NamedTuple):
    """How an exec ended: its exit code (None when it did not run to an end), a timeout,
    the kept end of stderr, an error of the exec itself, and its wall time."""

    exit_code: int | None
    timed_out: bool = False
    stderr: str = ""
    error: str | None = None
    seconds: float = 0.0


def exec_in_pod(namespace: str, pod: str, container: str, command: list[str], timeout: float, keep: int) -> ExecOutcome:
    """Run `command` in a container through the API server's pods/exec (a websocket) and
    wait at most `timeout` seconds for it to end. Only stderr's last `keep` characters are
    kept; stdout is read and dropped. Never raises for the command's own failure: that is
    the result. On a timeout the stream is closed; the process in the container may run on.
    """
    import yaml
    from kubernetes.stream import stream
    from kubernetes.stream.ws_client import ERROR_CHANNEL, STDERR_CHANNEL, STDOUT_CHANNEL

    # stream() swaps the transport of the ApiClient it is given while it connects: its own
    # client, so the shared one keeps serving the other threads' requests meanwhile.
    own = client.ApiClient(api_client().configuration)
    started = time.monotonic()
    try:
        ws = stream(
            client.CoreV1Api(own).connect_get_namespaced_pod_exec,
            pod,
            namespace,
            command=command,
            container=container,
            stderr=True,
            stdin=False,
            stdout=True,
            tty=False,
            _preload_content=False,
        )
    except ApiException as err:
        metrics.api_requests.labels("EXEC", str(err.status)).inc()
        return ExecOutcome(None, error=status_message(err) or str(err), seconds=time.monotonic() - started)
    metrics.api_requests.labels("EXEC", "101").inc()
    stderr, error = "", ""
    try:
        deadline = started + timeout
        while ws.is_open():
            left = deadline - time.monotonic()
            if left <= 0:
                return ExecOutcome(None, timed_out=True, stderr=stderr, seconds=time.monotonic() - started)
            ws.update(timeout=min(left, 1.0))
            ws.read_channel(STDOUT_CHANNEL)
            stderr = (stderr + ws.read_channel(STDERR_CHANNEL))[-keep:]
            error += ws.read_channel(ERROR_CHANNEL)
        stderr = (stderr + ws.read_channel(STDERR_CHANNEL))[-keep:]
        error += ws.read_channel(ERROR_CHANNEL)
    finally:
        ws.close()
        own.close()
    seconds = time.monotonic() - started
    # The error channel ends the exec with a metav1.Status: Success, NonZeroExitCode with
    # the code, or why the exec itself failed (no such executable, container gone).
    try:
        status = yaml.safe_load(error) if error else None
    except yaml.YAMLError:
        status = None
    if not isinstance(status, dict):
        return ExecOutcome(None, stderr=stderr, error="the exec ended without an exit status", seconds=seconds)
    if status.get("status") == "Success":
        return ExecOutcome(0, stderr=stderr, seconds=seconds)
    causes = (status.get("details") or {}).get("causes") or []
    code = next((c.get("message") for c in causes if c.get("reason") == "ExitCode"), None)
    if status.get("reason") == "NonZeroExitCode" and code is not None and str(code).isdigit():
        return ExecOutcome(int(code), stderr=stderr, seconds=seconds)
    return ExecOutcome(None, stderr=stderr, error=str(status.get("message") or "exec failed"), seconds=seconds)


def ensure_pod(body: dict) -> dict:
    """Create the Pod, or read the one of that name; Refused when the API server rejects it."""
    ns = body["metadata"]["namespace"]
    made = call(
        lambda: _raw(core().create_namespaced_pod(ns, cast(Any, body), _preload_content=False)),
        exists=None,
        refused=True,
    )
    return made if made is not None else (get_pod(ns, body["metadata"]["name"]) or body)


def ensure_pvc(body: dict) -> dict:
    ns = body["metadata"]["namespace"]
    made = call(
        lambda: _raw(core().create_namespaced_persistent_volume_claim(ns, cast(Any, body), _preload_content=False)),
        exists=None,
    )
    return made if made is not None else (get_pvc(ns, body["metadata"]["name"]) or body)


def list_pods(namespace: str, label_selector: str) -> list[dict]:
    response = core().list_namespaced_pod(namespace, label_selector=label_selector, _preload_content=False)
    return _raw(response).get("items", [])


def list_pvcs(namespace: str, label_selector: str) -> list[dict]:
    response = core().list_namespaced_persistent_volume_claim(
        namespace, label_selector=label_selector, _preload_content=False
    )
    return _raw(response).get("items", [])


def delete_pod(namespace: str, name: str, uid: str | None = None) -> None:
    """Delete the Pod; gone already, or another Pod of that name (the uid precondition), is done."""
    options = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid) if uid else None)
    call(lambda: core().delete_namespaced_pod(name, namespace, body=options), absent=None, exists=None)


def delete_pvc(namespace: str, name: str) -> None:
    call(lambda: core().delete_namespaced_persistent_volume_claim(name, namespace), absent=None)


def annotate_pod(namespace: str, name: str, annotations: dict[str, str]) -> dict | None:
    """The Pod as annotated (None: it is gone)."""
    patch = {"metadata": {"annotations": annotations}}
    return call(lambda: _raw(core().patch_namespaced_pod(name, namespace, patch, _preload_content=False)), absent=None)


def _object_path(group: str, version: str, namespace: str, plural: str, name: str = "") -> str:
    path = f"/apis/{group}/{version}/namespaces/{quote(namespace, safe='')}/{plural}"
    return f"{path}/{quote(name, safe='')}" if name else path


def _send(method: str, path: str, body: dict[str, Any] | None = None, answer: bool = True) -> dict:
    """One request for a custom object, the answer parsed (without `answer`, not parsed: an
    empty dict); ApiException for any other answer than 2xx, as from the typed methods.
    Straight to the client's call_api (counted, rate-limited and time-bound by _instrument):
    the typed methods check and serialize their arguments first, which was a third of the
    CPU of the operator's every request."""
    api = api_client()
    headers = {"Accept": "application/json", "User-Agent": api.user_agent}
    if body is not None:
        headers["Content-Type"] = MERGE_PATCH if method == "PATCH" else "application/json"
    api.update_params_for_auth(headers, [], ["BearerToken"], path, method, body)
    response = api.call_api(method, api.configuration.host + path, headers, body, None)
    response.read()
    if not 200 <= response.status <= 299:
        raise ApiException.from_response(http_resp=response, body=None, data=None)
    return json.loads(cast(bytes, response.data)) if answer else {}


def get_custom(plural: str, namespace: str, name: str) -> dict | None:
    return call(lambda: _send("GET", _object_path(GROUP, VERSION, namespace, plural, name)), absent=None)


def patch_status(plural: str, namespace: str, name: str, status: dict[str, Any]) -> dict | None:
    """Merge-patch the status subresource; the object as written, None if it is gone."""
    path = _object_path(GROUP, VERSION, namespace, plural, name) + "/status"
    return call(lambda: _send("PATCH", path, {"status": status}), absent=None)


# Objects per page of a listing, ours and kopf's (settings.watching.chunk_size): a cluster's
# thousands of Checkpoints never arrive, and are never parsed, as one response.
LIST_PAGE = 500


def iter_custom(plural: str, namespace: str | None = None, label_selector: str = "") -> Iterator[dict]:
    """Every object of one of our kinds, listed a page at a time: one page is in memory at once."""
    token = None
    while True:
        if namespace:
            result = custom().list_namespaced_custom_object(
                GROUP, VERSION, namespace, plural, label_selector=label_selector, limit=LIST_PAGE, _continue=token
            )
        else:
            result = custom().list_cluster_custom_object(
                GROUP, VERSION, plural, label_selector=label_selector, limit=LIST_PAGE, _continue=token
            )
        yield from result.get("items", [])
        token = (result.get("metadata") or {}).get("continue")
        if not token:
            return


def list_custom(plural: str, namespace: str | None = None, label_selector: str = "") -> list[dict]:
    return list(iter_custom(plural, namespace, label_selector))


def patch_custom(plural: str, namespace: str, name: str, patch: dict[str, Any]) -> dict | None:
    """Merge-patch; None when the object is gone."""
    return call(lambda: _send("PATCH", _object_path(GROUP, VERSION, namespace, plural, name), patch), absent=None)


def create_custom(plural: str, namespace: str, body: dict[str, Any]) -> dict | None:
    """Create; None when an object of that name already exists, Refused when the API server rejects it."""
    return call(lambda: _send("POST", _object_path(GROUP, VERSION, namespace, plural), body), exists=None, refused=True)


def delete_custom(plural: str, namespace: str, name: str) -> None:
    call(lambda: custom().delete_namespaced_custom_object(GROUP, VERSION, namespace, plural, name), absent=None)


# --- kopf peering ------------------------------------------------------------------------


def get_kopf_peering(name: str, namespace: str | None = None) -> dict | None:
    """kopf's peering object: a KopfPeering in `namespace`, else the ClusterKopfPeering."""
    if namespace:
        return call(
            lambda: custom().get_namespaced_custom_object("kopf.dev", "v1", namespace, "kopfpeerings", name),
            absent=None,
        )
    return call(lambda: custom().get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", name), absent=None)


# --- CSI snapshots and storage ---------------------------------------------------------


def get_volume_snapshot(namespace: str, name: str) -> dict | None:
    path = _object_path(SNAPSHOT_GROUP, SNAPSHOT_VERSION, namespace, "volumesnapshots", name)
    return call(lambda: _send("GET", path), absent=None)


def ensure_volume_snapshot(body: dict) -> dict:
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    made = call(
        lambda: _send("POST", _object_path(SNAPSHOT_GROUP, SNAPSHOT_VERSION, ns, "volumesnapshots"), body), exists=None
    )
    return made if made is not None else (get_volume_snapshot(ns, name) or body)


class Expired(Exception):
    """A watch's resourceVersion is older than the API server keeps (410 Gone)."""


class Kind(NamedTuple):
    """A kind the runtime lists and watches itself (savepoint.watches); `core` names the
    core API's methods for it (list_namespaced_<core>), empty for a custom resource."""

    group: str
    version: str
    plural: str
    core: str = ""


PODS = Kind("", "v1", "pods", "pod")
CLAIMS = Kind("", "v1", "persistentvolumeclaims", "persistent_volume_claim")
CONFIG_MAPS = Kind("", "v1", "configmaps", "config_map")
CHECKPOINTS = Kind(GROUP, VERSION, "checkpoints")
VOLUME_SNAPSHOTS = Kind(SNAPSHOT_GROUP, SNAPSHOT_VERSION, "volumesnapshots")


def _collection(kind: Kind, namespace: str | None, **kwargs: Any) -> Any:
    """A raw (not deserialized) listing or watch of one kind, in a namespace or all of them."""
    kwargs["_preload_content"] = False
    if kind.core:
        api = core()
        if namespace is None:
            return getattr(api, f"list_{kind.core}_for_all_namespaces")(**kwargs)
        return getattr(api, f"list_namespaced_{kind.core}")(namespace, **kwargs)
    if namespace is None:
        return custom().list_cluster_custom_object(kind.group, kind.version, kind.plural, **kwargs)
    return custom().list_namespaced_custom_object(kind.group, kind.version, namespace, kind.plural, **kwargs)


def list_page(kind: Kind, namespace: str | None, selector: str, token: str | None = None) -> dict:
    """One page of a listing: its items, and in its metadata the `continue` token of the
    next page (none on the last) and the resourceVersion a watch goes on from."""
    return _raw(_collection(kind, namespace, label_selector=selector, limit=LIST_PAGE, _continue=token))


def collection_version(kind: Kind, namespace: str | None, selector: str) -> str:
    """The resourceVersion of a kind as it is now (a listing of one): a watch from it sees
    every change after now, and none of what is already there."""
    answer = _raw(_collection(kind, namespace, label_selector=selector, limit=1))
    return str(answer["metadata"]["resourceVersion"])


def watch(
    kind: Kind, namespace: str | None, resource_version: str, selector: str, timeout: int = 300
) -> Iterator[tuple[str, dict]]:
    """(type, object) of each change to the selected objects after resource_version,
    BOOKMARKs included, until the API server ends the stream; Expired for a 410."""
    response = _collection(
        kind,
        namespace,
        label_selector=selector,
        resource_version=resource_version,
        allow_watch_bookmarks=True,
        timeout_seconds=timeout,
        watch=True,
        _request_timeout=(10, timeout + 30),
    )
    try:
        for line in iter_resp_lines(response):
            if not line:
                continue
            event = json.loads(line)
            if event["type"] == "ERROR":
                if event["object"].get("code") == 410:
                    raise Expired(event["object"].get("message", ""))
                raise ApiException(status=event["object"].get("code"), reason=event["object"].get("message"))
            yield event["type"], event["object"]
    finally:
        response.close()
        response.release_conn()


def request_volume_snapshot_deletion(namespace: str, name: str) -> None:
    """Ask for deletion without waiting for it (gone already is fine)."""
    _delete_volume_snapshot(namespace, name)


def _delete_volume_snapshot(namespace: str, name: str) -> bool:
    """Ask for deletion; True when the snapshot was gone already."""

    def send() -> bool:  # _send, its answer unread: an expiry storm sends thousands of these
        path = _object_path(SNAPSHOT_GROUP, SNAPSHOT_VERSION, namespace, "volumesnapshots", name)
        _send("DELETE", path, answer=False)
        return False

    return call(send, absent=True)


def delete_volume_snapshot(namespace: str, name: str) -> bool:
    """Ask for deletion; True once the snapshot is gone."""
    return _delete_volume_snapshot(namespace, name) or get_volume_snapshot(namespace, name) is None


_classes: tuple[float, list[dict]] = (float("-inf"), [])


def list_volume_snapshot_classes(max_age: float = 0.0) -> list[dict]:
    """All VolumeSnapshotClasses; empty when the snapshot CRDs are not installed.

    With max_age, a listing at most that many seconds old is reused: admission needs the
    classes for every checkpoint, and they change about never.
    """
    global _classes
    fetched, items = _classes
    if time.monotonic() - fetched <= max_age:
        return items
    result = call(
        lambda: custom().list_cluster_custom_object(SNAPSHOT_GROUP, SNAPSHOT_VERSION, "volumesnapshotclasses"),
        absent=None,
    )
    if result is None:
        return []
    _classes = (time.monotonic(), result.get("items", []))
    return _classes[1]


# PersistentVolume name -> its CSI driver, which never changes for a volume.
_volume_drivers: dict[str, str] = {}


def csi_driver_of_claim(pvc: dict) -> str | None:
    """The CSI driver behind a claim: its bound PV's driver, else its StorageClass provisioner."""
    volume = (pvc.get("spec") or {}).get("volumeName")
    if volume in _volume_drivers:
        return _volume_drivers[volume]
    if volume:
        pv = call(lambda: _raw(core().read_persistent_volume(volume, _preload_content=False)), absent={})
        driver = ((pv.get("spec") or {}).get("csi") or {}).get("driver")
        if driver:
            if len(_volume_drivers) > 50_000:
                _volume_drivers.clear()
            _volume_drivers[volume] = driver
            return driver
    class_name = (pvc.get("spec") or {}).get("storageClassName")
    if not class_name:
        return None
    sc = call(
        lambda: _raw(client.StorageV1Api(api_client()).read_storage_class(class_name, _preload_content=False)),
        absent=None,
    )
    return sc.get("provisioner") if sc is not None else None


# --- Kubernetes Events ----------------------------------------------------------------


def post_event(body: dict, reason: str, message: str, warning: bool = False) -> None:
    """A core/v1 Event on the object, readable in `kubectl describe`; never raises."""
    meta = body["metadata"]
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": body.get("apiVersion"),
            "kind": body.get("kind"),
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "reason": reason,
        "message": message[:1024],
        "type": "Warning" if warning else "Normal",
        "source": {"component": "savepoint"},
        "firstTimestamp": now[:19] + "Z",
        "lastTimestamp": now[:19] + "Z",
        "count": 1,
    }
    try:
        core().create_namespaced_event(meta["namespace"], cast(Any, event))  # a dict body, as the others
    except Exception:  # an Event is a courtesy; losing one must not fail a reconcile
        logging.getLogger(__name__).debug("could not post event %s on %s", reason, meta["name"], exc_info=True)


def pod_warning(namespace: str, pod: dict, reasons: tuple[str, ...]) -> str | None:
    """The newest message of the kubelet's Warning Events on this Pod with one of `reasons`
    (FailedMount: the CSI node plugin refused to publish the volume), or None (also when
    the Events cannot be read)."""
    meta = pod["metadata"]
    selector = f"involvedObject.kind=Pod,involvedObject.name={meta['name']},type=Warning"
    try:
        events = core().list_namespaced_event(namespace, field_selector=selector)
    except ApiException as err:  # a hint for the status message: unreadable Events are no hint
        log.debug("reading the Events of Pod %s/%s: %s", namespace, meta["name"], err)
        return None
    found = [e for e in events.items if e.reason in reasons and (e.involved_object.uid in (None, meta.get("uid")))]
    if not found:
        return None
    newest = max(found, key=lambda e: (e.last_timestamp or e.event_time or e.first_timestamp or 0, e.count or 0))
    return f"{newest.reason}: {newest.message}"


# --- A sandbox's own credentials ------------------------------------------------------


def rbac() -> client.RbacAuthorizationV1Api:
    return client.RbacAuthorizationV1Api(api_client())


def _create_or_get(create: Any, read: Any, namespace: str, body: dict) -> dict:
    """Create; when it exists already, the existing object (the caller checks its owner)."""
    made = call(lambda: _raw(create(namespace, body, _preload_content=False)), exists=None)
    if made is not None:
        return made
    return _raw(read(body["metadata"]["name"], namespace, _preload_content=False))


def ensure_service_account(body: dict) -> dict:
    api = core()
    ns = body["metadata"]["namespace"]
    return _create_or_get(api.create_namespaced_service_account, api.read_namespaced_service_account, ns, body)


def ensure_role(body: dict) -> dict:
    api = rbac()
    return _create_or_get(api.create_namespaced_role, api.read_namespaced_role, body["metadata"]["namespace"], body)


def ensure_role_binding(body: dict) -> dict:
    api = rbac()
    ns = body["metadata"]["namespace"]
    return _create_or_get(api.create_namespaced_role_binding, api.read_namespaced_role_binding, ns, body)


def get_role(namespace: str, name: str) -> dict | None:
    return call(lambda: _raw(rbac().read_namespaced_role(name, namespace, _preload_content=False)), absent=None)


def get_role_binding(namespace: str, name: str) -> dict | None:
    return call(lambda: _raw(rbac().read_namespaced_role_binding(name, namespace, _preload_content=False)), absent=None)


def list_roles_and_bindings(namespace: str, label_selector: str) -> tuple[list[dict], list[dict]] | None:
    """The Roles and RoleBindings with the label; None when either cannot be listed (say,
    a ClusterRole from before `list` was granted), logged with the API server's code."""
    api = rbac()
    try:
        bindings = _raw(
            api.list_namespaced_role_binding(namespace, label_selector=label_selector, _preload_content=False)
        )
        roles = _raw(api.list_namespaced_role(namespace, label_selector=label_selector, _preload_content=False))
    except ApiException as err:
        log.warning("cannot list Roles and RoleBindings in %s (%s)", namespace, err.status)
        return None
    return roles["items"], bindings["items"]


def set_role_rules(namespace: str, name: str, rules: list[dict]) -> bool:
    """Replace a Role's rules (a merge patch replaces the whole list); False when the Role is gone."""

    def send() -> bool:
        rbac().patch_namespaced_role(
            name, namespace, {"rules": rules}, _content_type="application/merge-patch+json", _preload_content=False
        )
        return True

    return call(send, absent=False)
