"""Consumer lag as the sensor records it, from one look at a topic (no broker)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sensors.hours import to_ms
from sensors.lag import consumer_lag
from sensors.topic_reads import TopicProgress

H = datetime(2026, 11, 4, 8, tzinfo=UTC)


def _progress(*, starts, ends, newest) -> TopicProgress:
    return TopicProgress(
        partitions=tuple(sorted(ends)),
        log_starts=starts,
        stable_ends=ends,
        in_transaction=frozenset(),
        boundaries={},
        newest_ms={p: to_ms(t) for p, t in newest.items()},
        first_data_hour=None,
    )


def test_a_mirror_that_read_nothing_lags_by_the_whole_topic():
    progress = _progress(
        starts={0: 2, 1: 0},
        ends={0: 10, 1: 5},
        newest={0: H + timedelta(minutes=50), 1: H + timedelta(minutes=20)},
    )
    lag = consumer_lag(progress, None)
    assert lag["lag_messages"].value == 13
    assert lag["lag_messages_by_partition"].value == {"0": 8, "1": 5}
    # Without a mirrored hour, the spread of the partitions' newest messages.
    assert lag["lag_seconds"].value == 30 * 60
    assert "mirrored_until" not in lag


def test_lag_is_counted_from_the_newest_mirrored_hour():
    progress = _progress(
        starts={0: 0, 1: 0}, ends={0: 10, 1: 5}, newest={0: H + timedelta(minutes=70), 1: H}
    )
    mirrored = (H + timedelta(hours=1), {0: 7, 1: 5})
    lag = consumer_lag(progress, mirrored)
    assert lag["lag_messages"].value == 3
    assert lag["lag_seconds"].value == 10 * 60
    assert lag["mirrored_until"].value == mirrored[0].timestamp()


def test_a_mirror_that_read_everything_has_no_lag_in_seconds_either():
    progress = _progress(starts={0: 0}, ends={0: 4}, newest={0: H + timedelta(minutes=70)})
    lag = consumer_lag(progress, (H, {0: 4}))
    assert (lag["lag_messages"].value, lag["lag_seconds"].value) == (0, 0.0)
