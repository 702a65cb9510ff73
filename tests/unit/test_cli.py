"""The kubectl plugin's decisions, without a cluster: names, bodies, waiting, tables, parsing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from savepoint import cli
from savepoint.client import core
from savepoint.eventlog import TOMBSTONE_KEY, Event


def ckpt(name: str, session: str = "s1", **status) -> dict:
    return {"metadata": {"name": name}, "spec": {"sessionName": session}, "status": status}


def test_idempotency_key_gives_a_stable_short_name():
    body = cli.build_checkpoint("s1", key="retry-42")
    again = cli.build_checkpoint("s1", key="retry-42")
    assert body["metadata"]["name"] == again["metadata"]["name"] == cli.key_name("ckpt", "retry-42")
    assert body["metadata"]["name"].startswith("ckpt-") and len(body["metadata"]["name"]) == 15
    assert body["metadata"]["annotations"] == {"savepoint.dev/idempotency-key": "retry-42"}
    assert cli.key_name("ckpt", "other") != body["metadata"]["name"]


def test_without_a_key_names_are_generated_and_stay_label_sized():
    body = cli.build_checkpoint("s" * 48, label="before refactor", ttl="2h")
    assert "name" not in body["metadata"]
    prefix = body["metadata"]["generateName"]
    assert prefix.endswith("-ckpt-") and len(prefix) + 5 <= 63
    assert body["spec"] == {"sessionName": "s" * 48, "label": "before refactor", "ttl": "2h"}


def test_fork_bodies():
    from_ckpt = cli.build_fork(target="s2", checkpoint="c1")
    assert from_ckpt["spec"] == {"source": {"checkpoint": "c1"}, "mode": "Fork", "target": {"sessionName": "s2"}}
    at_event = cli.build_fork(target="s2", session="s1", at_event="000000000007-abc")
    assert at_event["spec"]["source"] == {"session": "s1", "atEvent": "000000000007-abc"}
    rollback = cli.build_rollback("s1", "c1", key="k")
    assert rollback["spec"] == {"source": {"checkpoint": "c1"}, "mode": "Rollback"}
    assert rollback["metadata"]["name"] == cli.key_name("rollback", "k")
    with pytest.raises(ValueError):
        cli.build_fork(target="s2", checkpoint="c1", at_event="x")


def test_same_request_ignores_server_defaults_but_not_our_fields():
    wanted = cli.build_checkpoint("s1", label="a", key="k")
    stored = {"spec": {"sessionName": "s1", "label": "a", "ttl": None, "extra": 1}}
    assert cli.same_request(stored, wanted)
    assert not cli.same_request({"spec": {"sessionName": "s2", "label": "a"}}, wanted)
    fork = cli.build_fork(target="s2", checkpoint="c1", key="k")
    assert cli.same_request({"spec": {**fork["spec"], "target": {"sessionName": "s2", "overrides": {}}}}, fork)


def test_checkpoint_outcomes():
    assert cli.checkpoint_outcome(ckpt("c1")) is None
    assert cli.checkpoint_outcome(ckpt("c1", phase="Pending")) is None
    ready = cli.checkpoint_outcome(ckpt("c1", phase="Ready", throughSequence=4, expiresAt="2030-01-01T00:00:00Z"))
    assert ready.ok and "through event 4" in ready.message
    rejected = cli.checkpoint_outcome(
        ckpt("c1", phase="Rejected", reason="SessionBusy", message="session s1 has a run in flight")
    )
    assert rejected == cli.Outcome(False, "Rejected: SessionBusy: session s1 has a run in flight")
    assert not cli.checkpoint_outcome(ckpt("c1", phase="Failed", reason="SnapshotFailed")).ok


def test_fork_outcomes():
    fork = {"metadata": {"name": "f1"}, "spec": {"mode": "Rollback"}, "status": {"phase": "Restoring"}}
    assert cli.fork_outcome(fork) is None
    fork["status"] = {"phase": "Succeeded", "targetSession": "s1", "restoreMode": "snapshot"}
    assert cli.fork_outcome(fork).message.startswith("session s1 rolled back (snapshot)")
    fork["status"] = {"phase": "Failed", "reason": "CheckpointExpired", "message": "checkpoint c1 expired"}
    assert cli.fork_outcome(fork) == cli.Outcome(False, "Failed: CheckpointExpired: checkpoint c1 expired")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_wait_prints_each_state_once_and_returns_the_outcome():
    states = iter(
        [
            ckpt("c1"),
            ckpt("c1", phase="Pending"),
            ckpt("c1", phase="Pending"),
            ckpt("c1", phase="Pending", message="snapshot s1-c1 not ready yet"),
            ckpt("c1", phase="Ready", throughSequence=2),
        ]
    )
    lines: list[str] = []
    clock = FakeClock()
    result = cli.wait(
        lambda: next(states), cli.checkpoint_outcome, timeout=60, say=lines.append, clock=clock, sleep=clock.sleep
    )
    assert result.ok
    assert [line.split("] ", 1)[1] for line in lines] == [
        "Waiting for the operator",
        "Pending",
        "Pending: snapshot s1-c1 not ready yet",
        "Ready",
    ]
    assert lines[1].startswith("[   0.5s]")


def test_an_admitted_checkpoint_without_a_phase_says_it_is_snapshotting():
    """A fast snapshot's checkpoint has no Pending: its cut annotation says it is admitted."""
    admitted = ckpt("c1")
    cut = '{"createdAt":"2026-12-01T00:00:00Z","throughSequence":7}'
    admitted["metadata"]["annotations"] = {"savepoint.dev/cut": cut}
    assert core.state_text(admitted) == "Snapshotting: through event 7"
    admitted["metadata"]["annotations"]["savepoint.dev/cut"] = "not json"
    assert core.state_text(admitted) == "Waiting for the operator"


def test_wait_times_out_with_the_last_state():
    clock = FakeClock()
    with pytest.raises(cli.CLIError) as caught:
        cli.wait(lambda: ckpt("c1", phase="Pending"), cli.checkpoint_outcome, timeout=3, clock=clock, sleep=clock.sleep)
    assert caught.value.code == cli.EXIT_TIMEOUT
    assert "timed out after 3s; last state: Pending" in str(caught.value)


def test_wait_fails_when_the_object_disappears():
    assert not cli.wait(lambda: None, cli.checkpoint_outcome, timeout=1).ok


def test_checkpoint_table():
    now = datetime(2030, 1, 1, tzinfo=UTC)
    items = [
        {
            **ckpt("c2", phase="Ready", throughSequence=9, expiresAt=(now + timedelta(days=29, hours=3)).isoformat()),
            "spec": {"sessionName": "s1", "label": "after tests"},
        },
        {**ckpt("c1", phase="Expired", throughSequence=3)},
        ckpt("x", session="other", phase="Pending"),
    ]
    items[0]["metadata"]["creationTimestamp"] = "2029-12-02T00:00:00Z"
    items[1]["metadata"]["creationTimestamp"] = "2029-12-01T00:00:00Z"
    rows = cli.checkpoint_rows(items, "s1", now)
    assert rows == [("c1", "s1", "Expired", "3", "", "expired"), ("c2", "s1", "Ready", "9", "after tests", "in 29d")]
    table = cli.format_table(cli.CHECKPOINT_COLUMNS, rows).splitlines()
    assert table[0].split() == ["NAME", "SESSION", "PHASE", "THROUGH", "LABEL", "EXPIRES"]
    assert table[2].index("Ready") == table[0].index("PHASE")
    assert len(cli.checkpoint_rows(items, None, now)) == 3


@pytest.mark.parametrize(("seconds", "text"), [(5, "5s"), (90, "1m"), (3600 * 5, "5h"), (86400 * 3, "3d")])
def test_human_duration(seconds, text):
    assert cli.human_duration(seconds) == text


def test_event_lines_and_tail_window():
    event = Event(7, "000000000007-ab", "user.message", "2030-01-01T00:00:00.000000Z", {"text": "hi"}, "u1")
    line = cli.format_event(event)
    assert line.split()[:3] == ["7", "2030-01-01T00:00:00.000000Z", "user.message"]
    assert 'subject=u1 {"text":"hi"}' in line
    erased = Event(8, "000000000008-cd", "user.message", "t", {TOMBSTONE_KEY: True}, "u1")
    assert cli.format_event(erased).endswith("(erased)")
    assert cli.format_event(event, "json") == event.to_json()
    assert cli.tail_start(3, 10) == 1 and cli.tail_start(30, 10) == 21


def test_parser_accepts_cluster_options_before_or_after_the_command():
    parser = cli.build_parser()
    args = parser.parse_args(["-n", "team-a", "checkpoint", "create", "s1", "--wait", "--idempotency-key", "k"])
    assert (args.namespace, args.session, args.wait, args.idempotency_key) == ("team-a", "s1", True, "k")
    args = parser.parse_args(["checkpoint", "create", "s1", "-n", "team-b", "--context", "kind-x"])
    assert (args.namespace, args.context, args.wait, args.timeout) == ("team-b", "kind-x", False, 300.0)
    args = parser.parse_args(["-n", "team-a", "log", "tail", "s1", "-n", "5", "-f"])
    assert (args.namespace, args.lines, args.follow) == ("team-a", 5, True)
    args = parser.parse_args(["fork", "s1", "--at-event", "E", "--name", "s2"])
    assert (args.source, args.at_event, args.name) == ("s1", "E", "s2")
    assert not hasattr(parser.parse_args(["checkpoint", "list"]), "namespace")
    with pytest.raises(SystemExit):
        parser.parse_args(["fork", "s1", "--at-event", "E", "--latest", "--name", "s2"])
    with pytest.raises(SystemExit):
        parser.parse_args(["rollback", "s1"])
