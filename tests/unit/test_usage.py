"""What a Session reports about its use, derived without a cluster: status.usage from a
log, status.resources and HeartbeatStale from a heartbeat sample."""

from __future__ import annotations

import json
import time

import pytest

from savepoint import sandbox
from savepoint.eventlog import Event
from savepoint.session import Observed, build_status
from savepoint.usage import (
    HeartbeatSeen,
    arrival,
    count_pauses,
    derive_usage,
    heartbeat_session,
    heartbeat_stale,
    nearest_rank,
    parse_sample,
)
from tests.unit.test_session_logic import BODY, seen, spec


def at(second: float) -> str:
    whole, frac = divmod(second, 1)
    return f"2030-01-01T00:{int(whole) // 60:02d}:{int(whole) % 60:02d}.{int(round(frac * 1e6)):06d}Z"


class Log:
    """Events with increasing seqs, each at a given second."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def add(self, second: float, type: str, **data) -> Event:
        seq = len(self.events) + 1
        event = Event(seq, f"{seq:012d}-abc", type, at(second), data)
        self.events.append(event)
        return event


def a_conversation() -> Log:
    log = Log()
    log.add(0, "run.started", runId="r1")
    log.add(1, "agent.message", runId="r1", usage={"inputTokens": 100, "outputTokens": 20, "llmCalls": 2})
    log.add(2, "run.completed", runId="r1")  # 2000 ms
    log.add(10, "run.started", runId="r2")
    log.add(11, "agent.approval_request", requestId="q1")
    log.add(14.5, "user.approval", requestId="q1", approved=True)  # waited 3500 ms
    log.add(15, "agent.message", runId="r2", usage={"inputTokens": 50, "outputTokens": 5})  # llmCalls 1
    log.add(16, "user.interrupt", runId="r2")
    log.add(18, "run.completed", runId="r2", interrupted=True)  # 8000 ms
    log.add(20, "run.started", runId="r3")
    log.add(21, "agent.approval_request", requestId="q2")
    log.add(22, "user.approval", requestId="q2", approved=False)  # waited 1000 ms
    log.add(25, "run.completed", runId="r3")  # 5000 ms
    return log


def test_usage_of_a_conversation():
    assert derive_usage(a_conversation().events) == {
        "runs": 3,
        "runDurationMs": {"p50": 5000, "max": 8000},
        "interrupts": 1,
        "approvals": {"requested": 2, "approved": 1, "denied": 1, "waitMsTotal": 4500},
        "tokens": {"input": 150, "output": 25, "total": 175},
        "llmCalls": 3,
    }


def test_an_empty_log_uses_nothing():
    usage = derive_usage([])
    assert usage["runs"] == 0 and usage["runDurationMs"] == {} and usage["llmCalls"] == 0
    assert usage["approvals"] == {"requested": 0, "approved": 0, "denied": 0, "waitMsTotal": 0}


def test_a_rolled_back_branch_still_counts_and_a_forks_prefix_does_not():
    log = a_conversation()
    log.add(30, "session.rollback", toSequence=3)  # closes runs r2 and r3
    assert derive_usage(log.events)["runs"] == 3  # they ran, and spent their tokens
    assert derive_usage(log.events)["tokens"]["total"] == 175
    log.add(31, "session.forked", parentSession="p", throughSequence=14)
    log.add(32, "run.started", runId="f1")
    log.add(33, "agent.message", usage={"inputTokens": 7, "outputTokens": 3})
    log.add(35, "run.completed", runId="f1")
    usage = derive_usage(log.events)
    assert usage["runs"] == 1 and usage["runDurationMs"] == {"p50": 3000, "max": 3000}
    assert usage["tokens"] == {"input": 7, "output": 3, "total": 10} and usage["interrupts"] == 0


def test_runs_and_approvals_without_ids_match_in_order_and_a_repeated_run_counts_once():
    log = Log()
    log.add(0, "run.started")
    log.add(4, "run.completed")
    log.add(5, "run.started", runId="x")
    log.add(6, "run.completed", runId="x")
    log.add(7, "run.completed", runId="x")  # a retried write: the same run
    log.add(8, "agent.approval_request")
    log.add(9, "user.approval")  # answered, but neither approved nor denied
    usage = derive_usage(log.events)
    assert usage["runs"] == 2 and usage["runDurationMs"] == {"p50": 1000, "max": 4000}
    assert usage["approvals"] == {"requested": 1, "approved": 0, "denied": 0, "waitMsTotal": 1000}


@pytest.mark.parametrize(
    "spent",
    [{"inputTokens": -5}, {"inputTokens": True}, {"inputTokens": "12"}, {"inputTokens": 1.5}],
)
def test_bad_token_counts_are_ignored_but_the_call_counts(spent):
    log = Log()
    log.add(0, "agent.message", usage=spent)
    log.add(1, "agent.message", usage="not an object")
    usage = derive_usage(log.events)
    assert usage["tokens"] == {"input": 0, "output": 0, "total": 0} and usage["llmCalls"] == 1


def test_clocks_that_disagree_give_zero_not_a_negative_duration():
    log = Log()
    log.add(10, "run.started", runId="r")
    log.add(5, "run.completed", runId="r")
    assert derive_usage(log.events)["runDurationMs"] == {"p50": 0, "max": 0}


def test_nearest_rank():
    assert nearest_rank([], 0.5) is None
    assert nearest_rank([7], 0.5) == 7
    assert nearest_rank([4, 1, 3, 2], 0.5) == 2
    assert nearest_rank([1, 2, 3], 0.5) == 2


def test_25000_events_are_derived_in_linear_time():
    log = Log()
    for i in range(25_000):
        step = i % 4
        if step == 0:
            log.add(i * 0.004, "run.started", runId=str(i // 4))
        elif step == 3:
            log.add(i * 0.004, "run.completed", runId=str(i // 4))
        else:
            log.add(i * 0.004, "agent.message", runId=str(i // 4), usage={"inputTokens": 3, "outputTokens": 1})
    started = time.perf_counter()
    usage = derive_usage(log.events)
    elapsed = time.perf_counter() - started
    assert usage["runs"] == 6250 and usage["llmCalls"] == 12500 and usage["tokens"]["total"] == 50000
    assert elapsed < 2.0, f"derive_usage of 25,000 events took {elapsed:.3f}s"  # linear, not quadratic


def test_pauses_count_transitions_into_paused():
    assert count_pauses("Ready", "Paused", 0) == 1
    assert count_pauses("Paused", "Paused", 1) == 1
    assert count_pauses(None, "Paused", 0) == 0  # created paused: never ran
    assert count_pauses("Paused", "Provisioning", 1) == 1


def test_status_carries_usage_and_counts_a_pause():
    usage = derive_usage(a_conversation().events)
    ready = build_status(BODY, spec(), seen(usage=usage), "c")
    assert ready["usage"]["llmCalls"] == 3 and ready["usage"]["runs"] == 3 and ready["usage"]["pauses"] == 0
    body = {**BODY, "status": {**ready, "usage": {**ready["usage"], "bootMs": 900}}}
    paused = build_status(body, spec(operatingMode="Paused"), seen(pod=None, usage=usage), "c")
    assert paused["phase"] == "Paused" and paused["usage"]["pauses"] == 1
    assert paused["usage"]["bootMs"] == 900  # the operator's own figures stay


# ------------------------------------------------------------------ heartbeat

SAMPLE = {"load1": 0.5, "memBytes": 1024, "memLimitBytes": 4096, "diskBytes": 8192, "sampledAt": at(0)}


def test_a_valid_sample_is_kept_field_by_field():
    assert parse_sample({"sample": json.dumps(SAMPLE)}) == SAMPLE
    odd = {**SAMPLE, "memBytes": -1, "memLimitBytes": True, "load1": float("inf"), "evil": "x" * 100}
    assert parse_sample({"sample": json.dumps(odd)}) == {"diskBytes": 8192, "sampledAt": at(0)}


@pytest.mark.parametrize(
    "data",
    [
        None,
        {},
        {"sample": "not json"},
        {"sample": "[1]"},
        {"sample": json.dumps({**SAMPLE, "sampledAt": "yesterday"})},
        {"sample": json.dumps({k: v for k, v in SAMPLE.items() if k != "sampledAt"})},
        {"sample": json.dumps({**SAMPLE, "pad": "x" * 5000})},
    ],
)
def test_no_valid_sample(data):
    assert parse_sample(data) is None


def test_a_heartbeat_object_is_named_after_the_session_its_label_names():
    beat = {"metadata": {"name": "s1-heartbeat", "labels": {"savepoint.dev/session": "s1"}}}
    assert heartbeat_session(beat) == "s1"
    # A chunk, another session's name, or no label: not a heartbeat.
    assert heartbeat_session({"metadata": {"name": "s1-log-000001", "labels": {"savepoint.dev/session": "s1"}}}) is None
    assert heartbeat_session({"metadata": {"name": "s2-heartbeat", "labels": {"savepoint.dev/session": "s1"}}}) is None
    assert heartbeat_session({"metadata": {"name": "s1-heartbeat"}}) is None


def test_staleness_and_arrival():
    assert not heartbeat_stale(100.0, 160.0, 60)
    assert heartbeat_stale(100.0, 160.5, 60)
    sampled = parse_sample({"sample": json.dumps(SAMPLE)})
    epoch = 1893456000.0  # 2030-01-01T00:00:00Z
    assert arrival(sampled, epoch + 500, listed=False) == epoch + 500  # a watch event: now
    assert arrival(sampled, epoch + 500, listed=True) == epoch  # a listing: when it was sampled
    assert arrival(sampled, epoch - 500, listed=True) == epoch - 500  # never in the future


def test_heartbeat_stale_is_a_condition_and_never_the_phase():
    stale = HeartbeatSeen(dict(SAMPLE), stale=True, threshold_seconds=60)
    status = build_status(BODY, spec(), seen(heartbeat=stale), "c", now="2030-01-01T00:05:00Z")
    assert status["phase"] == "Ready" and status["resources"] == SAMPLE
    cond = next(c for c in status["conditions"] if c["type"] == "HeartbeatStale")
    assert (cond["status"], cond["reason"]) == ("True", "HeartbeatStale")
    assert SAMPLE["sampledAt"] in cond["message"] and "60s" in cond["message"]
    fresh = build_status(
        {**BODY, "status": status}, spec(), seen(heartbeat=HeartbeatSeen(dict(SAMPLE), False, 60)), "c"
    )
    cond = next(c for c in fresh["conditions"] if c["type"] == "HeartbeatStale")
    assert (cond["status"], cond["reason"]) == ("False", "HeartbeatFresh")
    paused = build_status(BODY, spec(operatingMode="Paused"), seen(pod=None, heartbeat=stale), "c")
    cond = next(c for c in paused["conditions"] if c["type"] == "HeartbeatStale")
    assert (cond["status"], cond["reason"]) == ("False", "SandboxNotRunning")


def test_no_heartbeat_seen_means_no_condition_and_no_resources():
    status = build_status(BODY, spec(), seen(), "c")
    assert "resources" not in status
    assert all(c["type"] != "HeartbeatStale" for c in status["conditions"])


def test_the_sandbox_may_patch_only_its_own_heartbeat():
    role = sandbox.build_role(BODY, 2)
    beat = [r for r in role["rules"] if r["verbs"] == ["patch"]]
    assert beat == [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["patch"], "resourceNames": ["s1-heartbeat"]}
    ]
    # A Role an older operator made, without it, reads as no window: it is rewritten.
    old = {"rules": [r for r in role["rules"] if r not in beat]}
    assert sandbox.granted_window(old) == 0
    assert sandbox.granted_window(role) == 2


def test_observed_defaults_stay_compatible():
    plain = Observed(None, None, (0, ""), 0, None, False, False, 0)
    assert plain.usage is None and plain.heartbeat is None
