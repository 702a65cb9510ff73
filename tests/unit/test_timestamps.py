"""The one RFC 3339 format of status fields and events."""

from datetime import UTC, datetime, timedelta, timezone

from savepoint.timestamps import parse_rfc3339, rfc3339


def test_status_times_are_whole_seconds_in_utc_with_a_z():
    moment = datetime(2026, 12, 1, 13, 14, 15, 999999, tzinfo=timezone(timedelta(hours=2)))
    assert rfc3339(moment) == "2026-12-01T11:14:15Z"
    assert rfc3339(moment, micro=True) == "2026-12-01T11:14:15.999999Z"


def test_a_naive_time_counts_as_utc_both_ways():
    assert rfc3339(datetime(2026, 1, 2, 3, 4, 5)) == "2026-01-02T03:04:05Z"
    assert parse_rfc3339("2026-01-02T03:04:05") == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def test_parse_reads_what_the_api_server_kopf_and_events_write():
    want = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert parse_rfc3339("2026-01-02T03:04:05Z") == want
    assert parse_rfc3339("2026-01-02T05:04:05+02:00") == want
    assert parse_rfc3339("2026-01-02T03:04:05.250000Z") == want + timedelta(milliseconds=250)
    moment = datetime(2026, 6, 30, 23, 59, 59, 123456, tzinfo=UTC)
    assert parse_rfc3339(rfc3339(moment, micro=True)) == moment
    assert parse_rfc3339(rfc3339(moment)) == moment.replace(microsecond=0)
