"""savepoint_api_requests_total counts kopf's requests beside ours, without a cluster."""

from __future__ import annotations

import asyncio

import pytest
from kopf._cogs.clients import api, errors
from prometheus_client import REGISTRY

from savepoint import metrics


def _count(client: str, verb: str, code: str) -> float:
    labels = {"client": client, "verb": verb, "code": code}
    return REGISTRY.get_sample_value("savepoint_api_requests_total", labels) or 0.0


def test_kopf_sends_every_request_through_the_function_we_wrap():
    # count_kopf_requests replaces kopf._cogs.clients.api.request; kopf's verbs find it
    # through the module global. A kopf release that moves either fails here.
    assert callable(api.request)
    for verb in (api.get, api.post, api.patch, api.delete, api.stream):
        assert "request" in verb.__code__.co_names, f"kopf's {verb.__name__} no longer calls api.request"


class _Response:
    status = 200

    async def __aenter__(self) -> _Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def json(self) -> dict:
        return {"kind": "Checkpoint"}


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """kopf's request replaced by a fake answering 200, or 404 for a /missing URL, then wrapped."""
    sent: list[tuple[str, str]] = []

    async def fake(method: str, url: str, **kwargs: object) -> _Response:
        sent.append((method, url))
        if "/missing" in url:
            raise errors.APINotFoundError({"message": "not found"}, status=404, headers={})
        return _Response()

    monkeypatch.setattr(api, "request", fake)  # restored after the test, wrapper and all
    metrics.count_kopf_requests()
    metrics.count_kopf_requests()  # a second call must not count twice
    return sent


def test_kopf_requests_count_with_the_kopf_label(counted):
    gets, patches, missing = _count("kopf", "GET", "200"), _count("kopf", "PATCH", "200"), _count("kopf", "GET", "404")
    watches, ours = _count("kopf", "WATCH", "200"), _count("operator", "GET", "200")

    async def run() -> None:
        assert await api.get("/apis/savepoint.dev/v1alpha1/checkpoints", settings=None, logger=None) == {
            "kind": "Checkpoint"
        }
        await api.patch("/apis/savepoint.dev/v1alpha1/namespaces/n/checkpoints/c", settings=None, logger=None)
        await api.request("get", "/api/v1/pods?watch=true&allowWatchBookmarks=true", settings=None, logger=None)
        with pytest.raises(errors.APINotFoundError):
            await api.get("/api/v1/namespaces/n/pods/missing", settings=None, logger=None)

    asyncio.run(run())
    assert len(counted) == 4
    assert _count("kopf", "GET", "200") == gets + 1
    assert _count("kopf", "PATCH", "200") == patches + 1
    assert _count("kopf", "WATCH", "200") == watches + 1
    assert _count("kopf", "GET", "404") == missing + 1
    assert _count("operator", "GET", "200") == ours  # kopf's traffic is not ours


def test_our_client_counts_with_the_operator_label():
    before = _count("operator", "DELETE", "404")
    metrics.api_requests.labels("DELETE", "404").inc()
    assert _count("operator", "DELETE", "404") == before + 1
    assert _count("kopf", "DELETE", "404") == 0.0
