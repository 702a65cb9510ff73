"""`Client`: the synchronous client, on the `kubernetes` package.

It only carries the requests of the operations in `core` to the API server; every
decision is made there. See docs/python-client.md.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

from savepoint.client import core
from savepoint.client.errors import ConfigurationError, SessionNotFound
from savepoint.client.objects import Checkpoint, Fork, Session, typed
from savepoint.constants import MERGE_PATCH
from savepoint.eventlog import Cursor, Event, EventLog
from savepoint.models import GROUP, VERSION, SessionSpec

DEFAULT_TIMEOUT = 300.0
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

OnProgress = Callable[[core.Progress], Any] | None


def name_of(obj: str | Any) -> str:
    """A name, or the name of a typed object."""
    return obj if isinstance(obj, str) else obj.metadata.name


def kubeconfig_namespace(kubeconfig: str | None, context: str | None) -> str:
    """The namespace of the kubeconfig's context (the current one unless named), else `default`."""
    from kubernetes import config

    contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
    if context:
        active = next((c for c in contexts if c["name"] == context), active)
    return (active.get("context") or {}).get("namespace") or "default"


def in_cluster_namespace() -> str:
    with open(SERVICE_ACCOUNT_NAMESPACE) as f:
        return f.read().strip()


def use_in_cluster(kubeconfig: str | None, context: str | None, in_cluster: bool | None, err: Exception) -> bool:
    """Whether a failed kubeconfig load falls back to the in-cluster service account (as kubectl does)."""
    if in_cluster is False or kubeconfig or context or not os.environ.get("KUBERNETES_SERVICE_HOST"):
        raise ConfigurationError(f"cannot load a kubeconfig: {err}") from None
    return True


def _connect(kubeconfig: str | None, context: str | None, in_cluster: bool | None) -> tuple[Any, str]:
    from kubernetes import client, config

    if not in_cluster:
        try:
            api = config.new_client_from_config(config_file=kubeconfig, context=context)
            return api, kubeconfig_namespace(kubeconfig, context)
        except config.ConfigException as err:
            use_in_cluster(kubeconfig, context, in_cluster, err)
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException as err:
        raise ConfigurationError(f"cannot load the in-cluster configuration: {err}") from None
    return client.ApiClient(configuration), in_cluster_namespace()


class _Transport:
    """Runs core operations, each request as one call of the `kubernetes` client."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api_client)

    def run(self, operation: core.Operation, on_progress: OnProgress = None) -> Any:
        from kubernetes.client.exceptions import ApiException

        call = _Call(self.custom)  # one per run: a Client may be shared by threads
        send: Any = None
        error: BaseException | None = None
        try:
            while True:
                try:
                    request = operation.throw(error) if error is not None else operation.send(send)
                except StopIteration as stop:
                    return stop.value
                send, error = None, None
                if isinstance(request, core.Report):
                    if on_progress is not None:
                        on_progress(request.progress)
                    continue
                try:
                    send = call.do(request)
                except ApiException as err:
                    error = core.api_error(err.status or 0, err.body, err.reason)
        finally:
            call.close()
            operation.close()


class _Call:
    def __init__(self, custom: Any) -> None:
        self.custom = custom
        self.stream: Iterator[Any] | None = None

    def do(self, r: core.Request) -> Any:
        if isinstance(r, core.NextEvent):
            return self.next()
        self.close()
        if isinstance(r, core.Create):
            return self.custom.create_namespaced_custom_object(GROUP, VERSION, r.namespace, r.plural, r.body)
        if isinstance(r, core.Get):
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, r.namespace, r.plural, r.name)
        if isinstance(r, core.List):
            selector = {"label_selector": r.label_selector} if r.label_selector else {}
            if r.namespace is None:
                found = self.custom.list_cluster_custom_object(GROUP, VERSION, r.plural, **selector)
            else:
                found = self.custom.list_namespaced_custom_object(GROUP, VERSION, r.namespace, r.plural, **selector)
            return found["items"]
        if isinstance(r, core.Patch):
            return self.custom.patch_namespaced_custom_object(
                GROUP, VERSION, r.namespace, r.plural, r.name, r.body, _content_type=MERGE_PATCH
            )
        if isinstance(r, core.Delete):
            return self.custom.delete_namespaced_custom_object(GROUP, VERSION, r.namespace, r.plural, r.name)
        if isinstance(r, core.Watch):
            from kubernetes import watch

            self.stream = watch.Watch().stream(
                self.custom.list_namespaced_custom_object,
                GROUP,
                VERSION,
                r.namespace,
                r.plural,
                field_selector=f"metadata.name={r.name}",
                resource_version=r.resource_version,
                timeout_seconds=r.timeout_seconds,
                allow_watch_bookmarks=True,
                _request_timeout=(10, r.timeout_seconds + core.WATCH_GRACE_SECONDS),
            )
            return self.next()
        raise TypeError(f"unknown request {r!r}")

    def next(self) -> dict[str, Any] | None:
        from urllib3.exceptions import ProtocolError, ReadTimeoutError

        if self.stream is None:
            return None
        try:
            event = next(self.stream)
        except StopIteration:
            return None
        except (ReadTimeoutError, ProtocolError):  # the connection went quiet or broke: resume from the last version
            self.close()
            return None
        return {"type": event["type"], "object": event["raw_object"]}

    def close(self) -> None:
        stream, self.stream = self.stream, None
        close = getattr(stream, "close", None)
        if close is not None:
            close()


class Client:
    """Savepoint's API in one namespace: `sessions`, `checkpoints`, `forks` and `log(session)`.

    `Client()` uses the current kubeconfig context and its namespace; inside a Pod with no
    kubeconfig it uses the Pod's service account. `kubeconfig=`, `context=` pick another;
    `in_cluster=True` skips the kubeconfig; `api_client=` reuses a `kubernetes.client.ApiClient`.
    """

    def __init__(
        self,
        namespace: str | None = None,
        *,
        kubeconfig: str | None = None,
        context: str | None = None,
        in_cluster: bool | None = None,
        api_client: Any = None,
    ) -> None:
        if api_client is None:
            api_client, default = _connect(kubeconfig, context, in_cluster)
        else:
            default = "default"
        self.api_client = api_client
        self.namespace = namespace or default
        self._transport = _Transport(api_client)
        self.sessions = Sessions(self)
        self.checkpoints = Checkpoints(self)
        self.forks = Forks(self)

    def log(self, session: str | Session) -> SessionLog:
        """The session's event log (savepoint.eventlog), through this client's credentials."""
        from kubernetes import client

        name = name_of(session)
        return SessionLog(
            EventLog(client.CoreV1Api(self.api_client), self.namespace, name),
            lambda: self._run(core.get("Session", self.namespace, name, missing_ok=True)) is not None,
        )

    def _run(self, operation: core.Operation, on_progress: OnProgress = None, kind: str | None = None) -> Any:
        result = self._transport.run(operation, on_progress)
        if kind is None or result is None:
            return result
        if isinstance(result, list):
            return [typed(item, kind) for item in result]
        return typed(result, kind)

    def close(self) -> None:
        self.api_client.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class Sessions:
    def __init__(self, client: Client) -> None:
        self._c = client

    def create(
        self,
        name: str,
        spec: SessionSpec | dict[str, Any],
        *,
        labels: dict[str, str] | None = None,
        wait: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        on_progress: OnProgress = None,
    ) -> Session:
        """Create a session; with wait, return it once Ready (SessionFailed if it fails)."""
        body = core.build_session(name, spec, labels=labels)
        op = core.create_session(self._c.namespace, body, wait_up=wait, timeout=timeout, clock=time.monotonic)
        return self._c._run(op, on_progress, "Session")

    def get(self, name: str) -> Session:
        return self._c._run(core.get("Session", self._c.namespace, name), kind="Session")

    def list(self) -> list[Session]:
        return self._c._run(core.list_objects("Session", self._c.namespace), kind="Session")

    def pause(
        self,
        session: str | Session,
        *,
        wait: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        on_progress: OnProgress = None,
    ) -> Session:
        """operatingMode Paused: the Pod goes, the workspace stays; with wait, return it once Paused."""
        op = core.set_operating_mode(
            self._c.namespace, name_of(session), "Paused", wait_done=wait, timeout=timeout, clock=time.monotonic
        )
        return self._c._run(op, on_progress, "Session")

    def resume(
        self,
        session: str | Session,
        *,
        wait: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        on_progress: OnProgress = None,
    ) -> Session:
        """operatingMode Running; with wait, return it once Ready again."""
        op = core.set_operating_mode(
            self._c.namespace, name_of(session), "Running", wait_done=wait, timeout=timeout, clock=time.monotonic
        )
        return self._c._run(op, on_progress, "Session")

    def wait(
        self,
        session: str | Session,
        *phases: str,
        timeout: float = DEFAULT_TIMEOUT,
        on_progress: OnProgress = None,
    ) -> Session:
        """Wait until the session is in one of `phases` (default: Ready); SessionFailed if it fails."""
        op = core.wait_session(
            self._c.namespace, name_of(session), phases or ("Ready",), timeout=timeout, clock=time.monotonic
        )
        return self._c._run(op, on_progress, "Session")

    def rollback(
        self,
        session: str | Session,
        *,
        to: str | Checkpoint,
        idempotency_key: str | None = None,
        wait: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        on_progress: OnProgress = None,
    ) -> Fork:
        """Restore the session in place from one of its own checkpoints; with wait, return the Succeeded Fork."""
        op = core.rollback(
            self._c.namespace,
            name_of(session),
            name_of(to),
            key=idempotency_key,
            wait_done=wait,
            timeout=timeout,
            clock=time.monotonic,
        )
        return self._c._run(op, on_progress, "Fork")

    def delete(self, session: str | Session, *, wait: bool = False, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Delete the session (its Pod, workspace, log and checkpoints go with it); with wait, until it is gone."""
        op = core.delete(
            "Session", self._c.namespace, name_of(session), wait_gone=wait, timeout=timeout, clock=time.monotonic
        )
        self._c._run(op)


class Checkpoints:
    def __init__(self, client: Client) -> None:
        self._c = client

    def create(
        self,
        session: str | Session,
        *,
        label: str | None = None,
        ttl: str | None = None,
        idempotency_key: str | None = None,
        wait: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        on_progress: OnProgress = None,
    ) -> Checkpoint:
        """Checkpoint the session; with wait, return the checkpoint once Ready or raise its reason.

        The same idempotency_key in the same namespace always names the same Checkpoint, so a
        retried call returns the checkpoint the first one made.
        """
        op = core.create_checkpoint(
            self._c.namespace,
            name_of(session),
            label=label,
            ttl=ttl,
            key=idempotency_key,
            wait_ready=wait,
            timeout=timeout,
            clock=time.monotonic,
        )
        return self._c._run(op, on_progress, "Checkpoint")

    def get(self, name: str) -> Checkpoint:
        return self._c._run(core.get("Checkpoint", self._c.namespace, name), kind="Checkpoint")

    def list(self, session: str | Session | None = None, *, all_namespaces: bool = False) -> list[Checkpoint]:
        """Checkpoints, oldest first: of one session, or all of the namespace (or of every namespace)."""
        found: list[Checkpoint] = self._c._run(
            core.list_objects("Checkpoint", None if all_namespaces else self._c.namespace), kind="Checkpoint"
        )
        if session is None:
            return found
        return [c for c in found if c.spec.session_name == name_of(session)]

    def wait(
        self, checkpoint: str | Checkpoint, *, timeout: float = DEFAULT_TIMEOUT, on_progress: OnProgress = None
    ) -> Checkpoint:
        """Wait for an existing checkpoint to be Ready (or raise its reason)."""
        op = core.wait_named(
            self._c.namespace, "Checkpoint", name_of(checkpoint), timeout=timeout, clock=time.monotonic
        )
        return self._c._run(op, on_progress, "Checkpoint")

    def delete(self, checkpoint: str | Checkpoint, *, wait: bool = False, timeout: float = DEFAULT_TIMEOUT) -> None:
        op = core.delete(
            "Checkpoint", self._c.namespace, name_of(checkpoint), wait_gone=wait, timeout=timeout, clock=time.monotonic
        )
        self._c._run(op)


class Forks:
    def __init__(self, client: Client) -> None:
        self._c = client

    def create(
        self,
        target: str,
        *,
        checkpoint: str | Checkpoint | None = None,
        session: str | Session | None = None,
        at_event: str | None = None,
        overrides: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        wait: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        on_progress: OnProgress = None,
    ) -> Fork:
        """A new session `target`: from a checkpoint (disk and log), a session's event `at_event`
        (log only, fresh disk) or a session's newest live checkpoint (session alone).
        With wait, return the Succeeded Fork once the target session is Ready."""
        body = core.build_fork(
            target=target,
            checkpoint=None if checkpoint is None else name_of(checkpoint),
            session=None if session is None else name_of(session),
            at_event=at_event,
            overrides=overrides,
            key=idempotency_key,
        )
        op = core.create_fork(self._c.namespace, body, wait_done=wait, timeout=timeout, clock=time.monotonic)
        return self._c._run(op, on_progress, "Fork")

    def get(self, name: str) -> Fork:
        return self._c._run(core.get("Fork", self._c.namespace, name), kind="Fork")

    def list(self) -> list[Fork]:
        return self._c._run(core.list_objects("Fork", self._c.namespace), kind="Fork")

    def wait(self, fork: str | Fork, *, timeout: float = DEFAULT_TIMEOUT, on_progress: OnProgress = None) -> Fork:
        op = core.wait_named(self._c.namespace, "Fork", name_of(fork), timeout=timeout, clock=time.monotonic)
        return self._c._run(op, on_progress, "Fork")


class SessionLog:
    """A session's event log: savepoint.eventlog.EventLog, plus `tail` and a clear SessionNotFound."""

    def __init__(self, log: EventLog, session_exists: Callable[[], bool]) -> None:
        self.eventlog = log
        self._session_exists = session_exists

    def append(self, type: str, data: dict[str, Any], subject: str | None = None) -> Event:
        return self.eventlog.append(type, data, subject)

    def read(self, from_seq: int = 1, to_seq: int | None = None, *, partial: bool = False) -> list[Event]:
        """Events from_seq..to_seq; see EventLog.read (HistoryUnavailable unless partial)."""
        self.require()
        return self.eventlog.read(from_seq, to_seq, partial=partial)

    def cursor(self) -> Cursor:
        return self.eventlog.cursor()

    def tail(self, count: int = 10, *, follow: bool = False, interval: float = 1.0) -> Generator[Event, None, None]:
        """The last `count` events (erased ones with their tombstone); with follow, then each new one."""
        self.require()
        last = self.eventlog.cursor().seq
        if last and count > 0:
            yield from self.eventlog.read(max(1, last - count + 1), last, partial=True)
        while follow:
            time.sleep(interval)
            now = self.eventlog.cursor().seq
            if now > last:
                yield from self.eventlog.read(last + 1, now, partial=True)
                last = now

    def erase(self, subject: str) -> int:
        """Tombstone every event of `subject` (irreversible); returns how many."""
        self.require()
        return self.eventlog.erase(subject)

    def require(self) -> None:
        """SessionNotFound unless the log or its Session exists."""
        if not self.eventlog.chunk_names() and not self._session_exists():
            log = self.eventlog
            raise SessionNotFound(f"SessionNotFound: session {log.session} not found in namespace {log.namespace}")
