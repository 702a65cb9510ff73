"""The runtime's own watch streams (savepoint.watches) against the API server."""

from __future__ import annotations

import queue
import threading
import time

from kubernetes import client

from savepoint import k8s, watches
from tests.conftest import wait_for

LABEL = "savepoint.dev/watch-test"


def config_map(name: str) -> dict:
    return {"metadata": {"name": name, "labels": {LABEL: "yes"}}, "data": {"k": "v"}}


def watch_from_a_gone_version_first(monkeypatch, gone_version: str) -> list[str]:
    """The first watch asks for a version the API server no longer keeps (a real 410);
    the versions each watch was asked for, in order."""
    real_watch, calls = k8s.watch, []

    def watch(kind, ns, version, selector, timeout=300):
        calls.append(version)
        return real_watch(kind, ns, gone_version if len(calls) == 1 else version, selector, timeout)

    monkeypatch.setattr(k8s, "watch", watch)
    return calls


def on_demand_config_maps(namespace: str, needed: set, **options) -> tuple[watches.OnDemand, queue.Queue]:
    """A running OnDemand watch of the labelled ConfigMaps, needed for the keys in
    `needed`; the queue gets each event's (type, name)."""
    seen: queue.Queue = queue.Queue()
    on_demand = watches.OnDemand(
        k8s.CONFIG_MAPS,
        namespace,
        LABEL,
        lambda t, body: seen.put((t, body["metadata"]["name"])),
        lambda key: key in needed,
        **options,
    )
    threading.Thread(target=on_demand.run, daemon=True).start()
    return on_demand, seen


def test_a_watch_lists_first_lists_again_after_a_410_and_then_follows_changes(
    core: client.CoreV1Api, namespace: str, monkeypatch, gone_version: str
):
    """Listed objects come as kopf's do (event type None), selected by label on the
    server. A version the API server no longer keeps (here the first watch's, "1": a
    real 410) says so through expired(), then everything is listed again; the stream
    then delivers each change once, and ends when stopped."""
    core.create_namespaced_config_map(namespace, config_map("first"))
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "unlabelled"}})
    calls = watch_from_a_gone_version_first(monkeypatch, gone_version)
    seen: queue.Queue = queue.Queue()
    expired = threading.Event()
    stop = threading.Event()
    thread = threading.Thread(
        target=watches.follow,
        args=(k8s.CONFIG_MAPS, namespace, LABEL, lambda t, body: seen.put((t, body["metadata"]["name"]))),
        kwargs={"expired": expired.set, "stop": stop.is_set, "timeout": 3},
        daemon=True,
    )
    thread.start()
    assert seen.get(timeout=10) == (None, "first")  # the listing
    assert seen.get(timeout=10) == (None, "first")  # listed again after the 410
    assert expired.is_set() and len(calls) >= 2 and calls[1] != gone_version
    core.create_namespaced_config_map(namespace, config_map("second"))
    core.delete_namespaced_config_map("first", namespace)
    assert seen.get(timeout=10) == ("ADDED", "second")
    assert seen.get(timeout=10) == ("DELETED", "first")
    stop.set()
    core.patch_namespaced_config_map("second", namespace, {"data": {"k": "w"}})
    thread.join(10)
    assert not thread.is_alive()
    leftover = [seen.get_nowait() for _ in range(seen.qsize())]
    assert all(name == "second" for _, name in leftover), leftover  # never the unlabelled one


def test_one_bad_event_does_not_end_the_stream(core: client.CoreV1Api, namespace: str):
    """A delivery that raises is logged; the next event still comes."""
    seen: queue.Queue = queue.Queue()
    stop = threading.Event()

    def deliver(event_type, body):
        if body["metadata"]["name"] == "bad":
            raise ValueError("a handler's bug")
        seen.put((event_type, body["metadata"]["name"]))

    thread = threading.Thread(
        target=watches.follow,
        args=(k8s.CONFIG_MAPS, namespace, LABEL, deliver),
        kwargs={"stop": stop.is_set, "timeout": 3},
        daemon=True,
    )
    thread.start()
    core.create_namespaced_config_map(namespace, config_map("bad"))
    core.create_namespaced_config_map(namespace, config_map("good"))
    assert seen.get(timeout=10)[1] == "good"  # listed or ADDED: the thread may not have listed yet
    stop.set()
    thread.join(10)


def test_an_on_demand_watch_is_open_only_while_needed_and_misses_nothing_after_watch(
    core: client.CoreV1Api, namespace: str, monkeypatch
):
    """Closed until a needed key asks for it; watch() returns once the watch has the
    version it starts from, so a change made the moment it returns is delivered even when
    reading that version is slow (held 0.5 s here). It stays open across streams while the
    key is needed, closes at a stream's end once none is, and opens again from now: what
    was made while it was closed never comes."""
    real_version = k8s.collection_version
    monkeypatch.setattr(k8s, "collection_version", lambda *args: time.sleep(0.5) or real_version(*args))
    needed: set[tuple[str, str]] = set()
    on_demand, seen = on_demand_config_maps(namespace, needed, window=1)
    assert on_demand.watch((namespace, "unneeded")) and not on_demand.is_open
    core.create_namespaced_config_map(namespace, config_map("before"))
    for round_ in range(3):
        key = (namespace, f"c{round_}")
        needed.add(key)
        assert on_demand.watch(key)
        core.create_namespaced_config_map(namespace, config_map(f"c{round_}"))
        assert seen.get(timeout=10) == ("ADDED", f"c{round_}")
        time.sleep(2.5)  # streams of 1 s end meanwhile
        assert on_demand.is_open
        needed.discard(key)
        wait_for(lambda: not on_demand.is_open, timeout=10, what="the watch closed")
        core.create_namespaced_config_map(namespace, config_map(f"closed{round_}"))
    time.sleep(1)
    assert seen.empty(), [seen.get_nowait() for _ in range(seen.qsize())]


def test_an_on_demand_watch_that_loses_its_version_says_so_and_opens_from_now(
    core: client.CoreV1Api, namespace: str, monkeypatch, gone_version: str
):
    """A 410 closes the watch until it has a version from now again; expired() says what
    was missed, and the changes after that come."""
    calls = watch_from_a_gone_version_first(monkeypatch, gone_version)
    expired = threading.Event()
    needed = {(namespace, "a")}
    on_demand, seen = on_demand_config_maps(namespace, needed, expired=expired.set, window=2)
    assert on_demand.watch((namespace, "a"))
    wait_for(expired.is_set, timeout=10, what="expired() called")
    assert on_demand.watch((namespace, "a"))
    core.create_namespaced_config_map(namespace, config_map("after"))
    assert seen.get(timeout=10) == ("ADDED", "after")
    assert len(calls) >= 2 and calls[1] != gone_version
    needed.clear()  # closed, its thread idle: none left following once the cluster is gone
    wait_for(lambda: not on_demand.is_open, timeout=10, what="the watch closed")
