"""hack/bench's split of an API server profile by what it served: pure text, no cluster."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import REPO

SEP = "-----------+-------------------------------------------------------"


def traces(*samples: tuple[str, list[str]]) -> str:
    """`go tool pprof -traces` text: a header, then per sample its time, leaf frame and callers."""
    out = ["File: kube-apiserver", "Type: cpu"]
    for took, frames in samples:
        out.append(SEP)
        out.append(f"{took:>10}   {frames[0]}")
        out.extend(f"             {f}" for f in frames[1:])
    out.append(SEP)
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def benchlib():
    spec = importlib.util.spec_from_file_location("benchlib", REPO / "hack" / "bench" / "benchlib.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["benchlib"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["benchlib"]


def test_each_sample_goes_to_the_first_kind_its_stack_matches(benchlib) -> None:
    status_patch = ["encoding/json.Marshal",
                    "k8s.io/apiextensions-apiserver/pkg/registry/customresource.(*StatusREST).Update",
                    "k8s.io/apiserver/pkg/endpoints/handlers.(*patcher).patchResource.func2",
                    "net/http.(*conn).serve"]
    patch = ["runtime.mallocgc", "k8s.io/apiserver/pkg/endpoints/handlers.(*patcher).patchResource.func2",
             "net/http.(*conn).serve"]
    gc = ["runtime.scanSpan", "runtime.gcDrain", "runtime.gcBgMarkWorker"]
    tls = ["crypto/tls.(*Conn).Write", "net/http.(*conn).serve"]
    unknown = ["runtime.futex", "runtime.mcall"]
    text = traces(("30ms", status_patch), ("1.5s", patch), ("20ms", status_patch), ("250us", gc),
                  ("10ms", tls), ("40ms", unknown))

    seconds = benchlib.ApiServerProfile.split(text)

    assert seconds == pytest.approx({"PATCH of a status": 0.05, "PATCH": 1.5, "garbage collection": 0.00025,
                                     "HTTP outside the handlers": 0.01, "other": 0.04})


def test_a_profile_with_no_samples_splits_into_nothing(benchlib) -> None:
    assert benchlib.ApiServerProfile.split("File: kube-apiserver\nType: cpu\n") == {}
