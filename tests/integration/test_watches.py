"""The runtime's own watch streams (savepoint.watches) against the API server."""

from __future__ import annotations

import queue
import threading

from kubernetes import client

from savepoint import k8s, watches

LABEL = "savepoint.dev/watch-test"


def config_map(name: str) -> dict:
    return {"metadata": {"name": name, "labels": {LABEL: "yes"}}, "data": {"k": "v"}}


def test_a_watch_lists_first_lists_again_after_a_410_and_then_follows_changes(
    core: client.CoreV1Api, namespace: str, monkeypatch
):
    """Listed objects come as kopf's do (event type None), selected by label on the
    server. A version the API server no longer keeps (here the first watch's, "1": a
    real 410) says so through expired(), then everything is listed again; the stream
    then delivers each change once, and ends when stopped."""
    core.create_namespaced_config_map(namespace, config_map("first"))
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "unlabelled"}})
    real_watch, calls = k8s.watch, []

    def watch_from_a_gone_version_first(kind, ns, version, selector, timeout=300):
        calls.append(version)
        return real_watch(kind, ns, "1" if len(calls) == 1 else version, selector, timeout)

    monkeypatch.setattr(k8s, "watch", watch_from_a_gone_version_first)
    seen: queue.Queue = queue.Queue()
    expired = threading.Event()
    stop = threading.Event()
    thread = threading.Thread(
        target=watches.follow,
        args=(k8s.CONFIG_MAPS, namespace, LABEL, lambda t, body: seen.put((t, body["metadata"]["name"]))),
        kwargs={"expired": expired.set, "stop": stop, "timeout": 3},
        daemon=True,
    )
    thread.start()
    assert seen.get(timeout=10) == (None, "first")  # the listing
    assert seen.get(timeout=10) == (None, "first")  # listed again after the 410
    assert expired.is_set() and len(calls) >= 2 and calls[1] != "1"
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
        kwargs={"stop": stop, "timeout": 3},
        daemon=True,
    )
    thread.start()
    core.create_namespaced_config_map(namespace, config_map("bad"))
    core.create_namespaced_config_map(namespace, config_map("good"))
    assert seen.get(timeout=10)[1] == "good"  # listed or ADDED: the thread may not have listed yet
    stop.set()
    thread.join(10)
