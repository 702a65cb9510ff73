"""`AsyncClient`: the asyncio client, on `kubernetes.aio` (the asyncio client in the `kubernetes` package).

The same operations as `Client` (savepoint.client.core), carried by an async driver:
every method is the sync one's, awaited. The event log client is synchronous, so
`log(session)` runs its calls in a worker thread (asyncio.to_thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from savepoint.client import core
from savepoint.client.errors import ConfigurationError
from savepoint.client.objects import Checkpoint, Fork, Session, typed
from savepoint.client.sync import (
    DEFAULT_TIMEOUT,
    Client,
    SessionLog,
    in_cluster_namespace,
    kubeconfig_namespace,
    name_of,
    use_in_cluster,
)
from savepoint.constants import MERGE_PATCH
from savepoint.eventlog import Cursor, Event
from savepoint.models import GROUP, VERSION, SessionSpec

# A plain function, or a coroutine function (awaited before the operation goes on).
OnProgress = Callable[[core.Progress], Any] | None


async def _connect(kubeconfig: str | None, context: str | None, in_cluster: bool | None) -> tuple[Any, str]:
    from kubernetes.aio import client, config

    if not in_cluster:
        try:
            api = await config.new_client_from_config(config_file=kubeconfig, context=context)
            return api, kubeconfig_namespace(kubeconfig, context)
        except config.ConfigException as err:
            use_in_cluster(kubeconfig, context, in_cluster, err)
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException as err:
        raise ConfigurationError(f"cannot load the in-cluster configuration: {err}") from None
    return client.ApiClient(configuration), in_cluster_namespace()


class _Call:
    def __init__(self, custom: Any) -> None:
        self.custom = custom
        self.stream: Any = None

    async def do(self, r: core.Request) -> Any:
        if isinstance(r, core.NextEvent):
            return await self.next()
        await self.close()
        if isinstance(r, core.Create):
            return await self.custom.create_namespaced_custom_object(GROUP, VERSION, r.namespace, r.plural, r.body)
        if isinstance(r, core.Get):
            return await self.custom.get_namespaced_custom_object(GROUP, VERSION, r.namespace, r.plural, r.name)
        if isinstance(r, core.List):
            selector = {"label_selector": r.label_selector} if r.label_selector else {}
            if r.namespace is None:
                found = await self.custom.list_cluster_custom_object(GROUP, VERSION, r.plural, **selector)
            else:
                found = await self.custom.list_namespaced_custom_object(
                    GROUP, VERSION, r.namespace, r.plural, **selector
                )
            return found["items"]
        if isinstance(r, core.Patch):
            return await self.custom.patch_namespaced_custom_object(
                GROUP, VERSION, r.namespace, r.plural, r.name, r.body, _content_type=MERGE_PATCH
            )
        if isinstance(r, core.Delete):
            return await self.custom.delete_namespaced_custom_object(GROUP, VERSION, r.namespace, r.plural, r.name)
        if isinstance(r, core.Watch):
            from kubernetes.aio import watch

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
                # A total for the whole stream (aiohttp's): the server ends it at timeout_seconds.
                _request_timeout=float(r.timeout_seconds + core.WATCH_GRACE_SECONDS),
            )
            return await self.next()
        raise TypeError(f"unknown request {r!r}")

    async def next(self) -> dict[str, Any] | None:
        import aiohttp

        if self.stream is None:
            return None
        # A Watch closes itself on any exception out of __anext__: forget it, never close it twice.
        try:
            event = await self.stream.__anext__()
        except (StopAsyncIteration, TimeoutError, aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
            self.stream = None  # ended, or the connection went quiet or broke: resume from the last version
            return None
        except BaseException:
            self.stream = None
            raise
        return {"type": event["type"], "object": event["raw_object"]}

    async def close(self) -> None:
        stream, self.stream = self.stream, None
        if stream is not None:
            await stream.close()


class AsyncClient:
    """The asyncio twin of `Client`: `async with AsyncClient(namespace=...) as client: ...`."""

    def __init__(
        self,
        namespace: str | None = None,
        *,
        kubeconfig: str | None = None,
        context: str | None = None,
        in_cluster: bool | None = None,
        api_client: Any = None,
    ) -> None:
        self._settings = (kubeconfig, context, in_cluster)
        self.api_client = api_client
        self.namespace = namespace or ("default" if api_client is not None else "")
        self._sync: Client | None = None
        self.sessions = AsyncSessions(self)
        self.checkpoints = AsyncCheckpoints(self)
        self.forks = AsyncForks(self)

    async def connect(self) -> AsyncClient:
        """Load the configuration (done by `async with`, or by the first call)."""
        if self.api_client is None:
            self.api_client, default = await _connect(*self._settings)
            self.namespace = self.namespace or default
        return self

    async def close(self) -> None:
        if self.api_client is not None:
            await self.api_client.close()
        if self._sync is not None:
            self._sync.close()

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    def log(self, session: str | Session) -> AsyncSessionLog:
        """The session's event log; its calls run in a worker thread."""
        if self._sync is None:
            kubeconfig, context, in_cluster = self._settings
            self._sync = Client(self.namespace or None, kubeconfig=kubeconfig, context=context, in_cluster=in_cluster)
        return AsyncSessionLog(self._sync.log(session))

    async def _run(self, operation: core.Operation, on_progress: OnProgress = None, kind: str | None = None) -> Any:
        from kubernetes.aio.client import CustomObjectsApi
        from kubernetes.aio.client.exceptions import ApiException

        await self.connect()
        call = _Call(CustomObjectsApi(self.api_client))
        send: Any = None
        error: BaseException | None = None
        try:
            while True:
                try:
                    request = operation.throw(error) if error is not None else operation.send(send)
                except StopIteration as stop:
                    result = stop.value
                    break
                send, error = None, None
                if isinstance(request, core.Report):
                    if on_progress is not None:
                        reported = on_progress(request.progress)
                        if inspect.isawaitable(reported):
                            await reported
                    continue
                try:
                    send = await call.do(request)
                except ApiException as err:
                    error = core.api_error(err.status or 0, err.body, err.reason)
        finally:
            await call.close()
            operation.close()
        if kind is None or result is None:
            return result
        if isinstance(result, list):
            return [typed(item, kind) for item in result]
        return typed(result, kind)


class AsyncSessions:
    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    async def create(
        self,
        name: str,
        spec: SessionSpec | dict[str, Any],
        *,
        labels: dict[str, str] | None = None,
        wait: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        on_progress: OnProgress = None,
    ) -> Session:
        body = core.build_session(name, spec, labels=labels)
        await self._c.connect()
        op = core.create_session(self._c.namespace, body, wait_up=wait, timeout=timeout, clock=time.monotonic)
        return await self._c._run(op, on_progress, "Session")

    async def get(self, name: str) -> Session:
        await self._c.connect()
        return await self._c._run(core.get("Session", self._c.namespace, name), kind="Session")

    async def list(self) -> list[Session]:
        await self._c.connect()
        return await self._c._run(core.list_objects("Session", self._c.namespace), kind="Session")

    async def pause(
        self,
        session: str | Session,
        *,
        wait: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        on_progress: OnProgress = None,
    ) -> Session:
        return await self._mode(session, "Paused", wait, timeout, on_progress)

    async def resume(
        self,
        session: str | Session,
        *,
        wait: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        on_progress: OnProgress = None,
    ) -> Session:
        return await self._mode(session, "Running", wait, timeout, on_progress)

    async def _mode(
        self, session: str | Session, mode: str, wait: bool, timeout: float, on_progress: OnProgress
    ) -> Session:
        await self._c.connect()
        op = core.set_operating_mode(
            self._c.namespace, name_of(session), mode, wait_done=wait, timeout=timeout, clock=time.monotonic
        )
        return await self._c._run(op, on_progress, "Session")

    async def wait(
        self,
        session: str | Session,
        *phases: str,
        timeout: float = DEFAULT_TIMEOUT,
        on_progress: OnProgress = None,
    ) -> Session:
        await self._c.connect()
        op = core.wait_session(
            self._c.namespace, name_of(session), phases or ("Ready",), timeout=timeout, clock=time.monotonic
        )
        return await self._c._run(op, on_progress, "Session")

    async def rollback(
        self,
        session: str | Session,
        *,
        to: str | Checkpoint,
        idempotency_key: str | None = None,
        wait: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        on_progress: OnProgress = None,
    ) -> Fork:
        await self._c.connect()
        op = core.rollback(
            self._c.namespace,
            name_of(session),
            name_of(to),
            key=idempotency_key,
            wait_done=wait,
            timeout=timeout,
            clock=time.monotonic,
        )
        return await self._c._run(op, on_progress, "Fork")

    async def delete(self, session: str | Session, *, wait: bool = False, timeout: float = DEFAULT_TIMEOUT) -> None:
        await self._c.connect()
        op = core.delete(
            "Session", self._c.namespace, name_of(session), wait_gone=wait, timeout=timeout, clock=time.monotonic
        )
        await self._c._run(op)


class AsyncCheckpoints:
    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    async def create(
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
        await self._c.connect()
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
        return await self._c._run(op, on_progress, "Checkpoint")

    async def get(self, name: str) -> Checkpoint:
        await self._c.connect()
        return await self._c._run(core.get("Checkpoint", self._c.namespace, name), kind="Checkpoint")

    async def list(self, session: str | Session | None = None, *, all_namespaces: bool = False) -> list[Checkpoint]:
        await self._c.connect()
        found: list[Checkpoint] = await self._c._run(
            core.list_objects("Checkpoint", None if all_namespaces else self._c.namespace), kind="Checkpoint"
        )
        return found if session is None else [c for c in found if c.spec.session_name == name_of(session)]

    async def wait(
        self, checkpoint: str | Checkpoint, *, timeout: float = DEFAULT_TIMEOUT, on_progress: OnProgress = None
    ) -> Checkpoint:
        await self._c.connect()
        op = core.wait_named(
            self._c.namespace, "Checkpoint", name_of(checkpoint), timeout=timeout, clock=time.monotonic
        )
        return await self._c._run(op, on_progress, "Checkpoint")

    async def delete(
        self, checkpoint: str | Checkpoint, *, wait: bool = False, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        await self._c.connect()
        op = core.delete(
            "Checkpoint", self._c.namespace, name_of(checkpoint), wait_gone=wait, timeout=timeout, clock=time.monotonic
        )
        await self._c._run(op)


class AsyncForks:
    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    async def create(
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
        body = core.build_fork(
            target=target,
            checkpoint=None if checkpoint is None else name_of(checkpoint),
            session=None if session is None else name_of(session),
            at_event=at_event,
            overrides=overrides,
            key=idempotency_key,
        )
        await self._c.connect()
        op = core.create_fork(self._c.namespace, body, wait_done=wait, timeout=timeout, clock=time.monotonic)
        return await self._c._run(op, on_progress, "Fork")

    async def get(self, name: str) -> Fork:
        await self._c.connect()
        return await self._c._run(core.get("Fork", self._c.namespace, name), kind="Fork")

    async def list(self) -> list[Fork]:
        await self._c.connect()
        return await self._c._run(core.list_objects("Fork", self._c.namespace), kind="Fork")

    async def wait(self, fork: str | Fork, *, timeout: float = DEFAULT_TIMEOUT, on_progress: OnProgress = None) -> Fork:
        await self._c.connect()
        op = core.wait_named(self._c.namespace, "Fork", name_of(fork), timeout=timeout, clock=time.monotonic)
        return await self._c._run(op, on_progress, "Fork")


class AsyncSessionLog:
    """SessionLog's calls, each in a worker thread."""

    def __init__(self, log: SessionLog) -> None:
        self.sync = log

    async def append(self, type: str, data: dict[str, Any], subject: str | None = None) -> Event:
        return await asyncio.to_thread(self.sync.append, type, data, subject)

    async def read(self, from_seq: int = 1, to_seq: int | None = None, *, partial: bool = False) -> list[Event]:
        return await asyncio.to_thread(self.sync.read, from_seq, to_seq, partial=partial)

    async def cursor(self) -> Cursor:
        return await asyncio.to_thread(self.sync.cursor)

    async def erase(self, subject: str) -> int:
        return await asyncio.to_thread(self.sync.erase, subject)

    async def tail(self, count: int = 10, *, follow: bool = False, interval: float = 1.0) -> AsyncIterator[Event]:
        events = self.sync.tail(count, follow=follow, interval=interval)
        done = object()
        try:
            while (event := await asyncio.to_thread(next, events, done)) is not done:
                yield event  # type: ignore[misc]
        finally:
            with contextlib.suppress(ValueError):  # still running in its thread (cancelled): it ends by itself
                events.close()
