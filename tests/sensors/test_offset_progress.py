"""The offset-progress sensor against the real broker, evaluated with `dg.build_sensor_context`.

Each test writes records with chosen producer timestamps a few hours back, then evaluates the
sensor tick by tick, passing the cursor on as the daemon does.
"""

from __future__ import annotations

import socket
import time
from datetime import UTC, datetime, timedelta

import dagster as dg
import pytest
from kafka import KafkaProducer

from cdc_assets.config import TableSpec
from cdc_assets.partitions import REFRESH_TAG
from cdc_assets.slicing import compute_slice
from resources.kafka import KafkaResource
from sensors import offset_progress
from sensors.cursor import FleetCursor
from sensors.offset_progress import (
    RANGE_END_TAG,
    RANGE_START_TAG,
    build_offset_sensor,
    completed_hour_offsets,
)
from sensors.planning import refresh_slot
from sensors.topic_reads import KafkaUnavailableError
from tests.conftest import _free_port

pytestmark = pytest.mark.integration

H: list[datetime] = []  # the 5 hours before the current one, oldest first
KEYS: list[str] = []


@pytest.fixture(autouse=True)
def _hours_before_now():
    """Counts the hours back from when each test starts, not from collection: a suite that
    runs past the top of an hour before reaching these tests would see one more closed hour."""
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    H[:] = [now - timedelta(hours=n) for n in (5, 4, 3, 2, 1)]
    KEYS[:] = [h.strftime("%Y-%m-%d-%H:%M") for h in H]


def _spec(topic: str, *, lateness: int) -> TableSpec:
    return TableSpec(
        name=topic.replace("-", "_"),
        topic=topic,
        primary_key=("id",),
        columns={"id": "bigint"},
        start_hour=(H[0] - timedelta(hours=1)).strftime("%Y-%m-%d-%H:%M"),
        allowed_lateness_minutes=lateness,
        hours_per_run=3,
    )


def _at(hour: int, minutes: int) -> int:
    return int((H[hour] + timedelta(minutes=minutes)).timestamp() * 1000)


class Ticks:
    """Evaluates one table's sensor repeatedly, carrying the cursor like the daemon."""

    def __init__(
        self,
        spec: TableSpec,
        kafka: KafkaResource,
        instance: dg.DagsterInstance,
        **sensor_options,
    ):
        self.sensor = build_offset_sensor(specs=[spec], **sensor_options)
        self.name = spec.name
        self.kafka, self.instance, self.cursor = kafka, instance, None

    def tick(self) -> dg.SensorResult:
        context = dg.build_sensor_context(
            instance=self.instance, cursor=self.cursor, resources={"kafka": self.kafka}
        )
        result = self.sensor(context)
        if result.cursor is not None:
            self.cursor = result.cursor
        return result


def _hours(request: dg.RunRequest) -> tuple[str, str]:
    if request.partition_key:
        return request.partition_key, request.partition_key
    return request.tags[RANGE_START_TAG], request.tags[RANGE_END_TAG]


@pytest.fixture
def instance():
    with dg.instance_for_test() as instance:
        yield instance


def test_closed_hours_are_requested_once_and_an_idle_partition_keeps_an_hour_open(
    create_topic, send, topic_prefix, kafka, instance
):
    topic = create_topic(f"{topic_prefix}-idle", partitions=2)
    spec = _spec(topic, lateness=600)  # far from passed: only moved-past partitions close
    for hour in range(4):
        send(topic, b"a", b"{}", _at(hour, 10), partition=0)
    for hour in range(3):  # partition 1 goes idle after H2
        send(topic, b"b", b"{}", _at(hour, 20), partition=1)
    ticks = Ticks(spec, kafka, instance)

    first = ticks.tick()
    assert [_hours(r) for r in first.run_requests] == [(KEYS[0], KEYS[1])]
    # The hour's own checks run with it; retention_risk is re-run on its own.
    checks = {key.name for key in first.run_requests[0].asset_check_keys}
    assert "accounting" in checks and "retention_risk" not in checks
    # H0 and H1 can't change any more: they left the cursor; H2 is watched.
    assert FleetCursor.parse(ticks.cursor).tables[spec.name].watch_from == KEYS[2]

    again = ticks.tick()
    assert again.run_requests == []
    assert f"hour {KEYS[2]} is open" in again.skip_reason.skip_message
    assert "partitions [1]" in again.skip_reason.skip_message
    cursor = ticks.cursor
    ticks.tick()
    assert ticks.cursor == cursor  # stable across evaluations

    # Partition 1 moves past H2: exactly H2 is requested, for its exact slice.
    send(topic, b"b", b"{}", _at(3, 30), partition=1)
    third = ticks.tick()
    assert [_hours(r) for r in third.run_requests] == [(KEYS[2], KEYS[2])]
    consumer = kafka.consumer()
    try:
        slice_ = compute_slice(
            consumer,
            table=spec.name,
            topic=topic,
            hour_start=H[2],
            now=datetime.now(UTC),
            allowed_lateness=timedelta(minutes=600),
        )
    finally:
        consumer.close()
    ends = ",".join(f"{p}={o}" for p, o in sorted(slice_.end_offsets().items()))
    assert f"ends[{ends}]" in third.run_requests[0].run_key
    assert ticks.tick().run_requests == []

    # Lag: the whole topic is unread by a mirror that has materialized nothing.
    lag = first.asset_events[0].metadata
    assert lag["lag_messages"].value == 7


def test_late_data_on_an_hour_closed_by_lateness_requests_it_again(
    create_topic, send, topic_prefix, kafka, instance
):
    topic = create_topic(f"{topic_prefix}-late", partitions=1)
    spec = _spec(topic, lateness=0)
    send(topic, b"a", b"{}", _at(0, 10))
    send(topic, b"a", b"{}", _at(1, 10))
    ticks = Ticks(spec, kafka, instance)

    first = ticks.tick()
    # H0..H2 closed (H1 and the empty H2..H4 by lateness); runs of at most 3 hours.
    assert [_hours(r) for r in first.run_requests] == [(KEYS[0], KEYS[2]), (KEYS[3], KEYS[4])]
    assert ticks.tick().run_requests == []

    # A record stamped inside H1 arrives late, at the end of the log: H1's end moves, and so
    # do the starts of the empty hours after it. They run again, in one run, in order.
    send(topic, b"a", b"{}", _at(1, 40))
    late = ticks.tick()
    assert [_hours(r) for r in late.run_requests] == [(KEYS[1], KEYS[3]), (KEYS[4], KEYS[4])]
    assert {r.run_key for r in late.run_requests}.isdisjoint(r.run_key for r in first.run_requests)
    assert ticks.tick().run_requests == []


def test_out_of_order_timestamps_follow_the_log(create_topic, send, topic_prefix, kafka, instance):
    topic = create_topic(f"{topic_prefix}-order", partitions=1)
    spec = _spec(topic, lateness=600)
    send(topic, b"a", b"{}", _at(0, 10))  # offset 0
    send(topic, b"a", b"{}", _at(1, 5))  # offset 1
    send(topic, b"a", b"{}", _at(0, 50))  # offset 2: stamped H0, written after an H1 record
    send(topic, b"a", b"{}", _at(2, 5))  # offset 3
    ticks = Ticks(spec, kafka, instance)
    (request,) = ticks.tick().run_requests
    assert _hours(request) == (KEYS[0], KEYS[1])
    # H0 is offset 0 only; offsets 1 and 2 belong to H1: the slice follows the log.
    assert ":ends[0=3]:" in request.run_key


def test_an_open_transaction_keeps_its_hour_open(
    create_topic, send, topic_prefix, broker, kafka, instance
):
    topic = create_topic(f"{topic_prefix}-txn", partitions=1)
    spec = _spec(topic, lateness=0)
    send(topic, b"a", b"{}", _at(0, 10))
    producer = KafkaProducer(bootstrap_servers=broker, transactional_id=f"{topic}-tx")
    producer.init_transactions()
    producer.begin_transaction()
    producer.send(topic, key=b"a", value=b"{}", timestamp_ms=_at(0, 40), partition=0).get(30)
    producer.flush()
    ticks = Ticks(spec, kafka, instance)
    try:
        held = ticks.tick()
        assert held.run_requests == []
        assert f"hour {KEYS[0]} is open" in held.skip_reason.skip_message
        assert "open transaction" in held.skip_reason.skip_message
    finally:
        producer.commit_transaction()
        producer.close()
    released = ticks.tick()
    assert [_hours(r) for r in released.run_requests][0][0] == KEYS[0]


def test_an_hour_already_materialized_with_its_slice_is_not_requested_again(
    create_topic, send, topic_prefix, kafka, instance
):
    topic = create_topic(f"{topic_prefix}-done", partitions=1)
    spec = _spec(topic, lateness=600)
    send(topic, b"a", b"{}", _at(0, 10))
    send(topic, b"a", b"{}", _at(1, 10))
    # A person materialized H0 from the UI before the sensor first ran (metadata as the
    # asset writes it).
    instance.report_runless_asset_event(
        dg.AssetMaterialization(
            asset_key=spec.name,
            partition=KEYS[0],
            metadata={"kafka_offsets": {"0": {"start": 0, "end": 1, "records": 1}}},
        )
    )
    tick = Ticks(spec, kafka, instance).tick()
    assert tick.run_requests == []
    # Lag is measured from the newest materialized hour: H0 ended at offset 1 of 2.
    lag = tick.asset_events[0].metadata
    assert lag["lag_messages"].value == 1
    assert lag["mirrored_until"].value == H[1].timestamp()
    assert lag["lag_seconds"].value == 10 * 60  # the newest message is stamped H1 + 10 min


def test_a_kafka_that_does_not_answer_fails_the_tick_fast_and_clearly(instance):
    dead = KafkaResource(bootstrap_servers=f"127.0.0.1:{_free_port()}", request_timeout_ms=5_000)
    spec = _spec("nowhere", lateness=0)
    started = time.monotonic()
    with pytest.raises(KafkaUnavailableError) as failure:
        Ticks(spec, dead, instance).tick()
    # Well inside Dagster's own sensor timeout (60 s): the daemon is never held up.
    assert time.monotonic() - started < 45
    message = str(failure.value)
    assert "table 'nowhere'" in message and dead.bootstrap_servers in message
    assert "cursor kept" in message


def test_a_kafka_that_accepts_connections_but_never_answers_fails_the_tick_at_its_timeout(
    instance,
):
    """A listening socket that never answers: the bootstrap hangs until the tick's time is up
    (kafka-python's own timeout, capped to the tick's), well before the resource's 30 s."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        servers = f"127.0.0.1:{silent.getsockname()[1]}"
        spec = _spec("silent", lateness=0)
        started = time.monotonic()
        with pytest.raises(KafkaUnavailableError) as failure:
            Ticks(
                spec,
                KafkaResource(bootstrap_servers=servers, request_timeout_ms=30_000),
                instance,
                kafka_timeout_seconds=2,
            ).tick()
        elapsed = time.monotonic() - started
    assert 2 <= elapsed < 6
    message = str(failure.value)
    assert "did not answer within 2 s" in message
    assert "table 'silent'" in message and servers in message and "cursor kept" in message


def test_a_tier0_table_gets_a_refresh_of_its_open_hours_once_per_slot(
    create_topic, send, topic_prefix, kafka, instance
):
    topic = create_topic(f"{topic_prefix}-tier0", partitions=1)
    spec = _spec(topic, lateness=600).model_copy(update={"refresh_minutes": 15})
    for hour in range(4):
        send(topic, b"a", b"{}", _at(hour, 10), partition=0)
    ticks = Ticks(spec, kafka, instance)

    slot = refresh_slot(spec, datetime.now(UTC))
    first = ticks.tick()
    hourly = [r for r in first.run_requests if REFRESH_TAG not in r.tags]
    refreshes = [r for r in first.run_requests if REFRESH_TAG in r.tags]
    assert [_hours(r) for r in hourly] == [(KEYS[0], KEYS[2])]
    current = datetime.now(UTC).strftime("%Y-%m-%d-%H:00")
    # H3 is open (lateness far from passed), and so are H4 and the current hour.
    assert [r.partition_key for r in refreshes] == [KEYS[3], KEYS[4], current]
    assert all(r.tags[REFRESH_TAG] == "true" for r in refreshes)
    assert all(r.asset_selection == [dg.AssetKey(spec.name)] for r in refreshes)
    assert all("accounting" in {k.name for k in r.asset_check_keys} for r in refreshes)

    assert all(r.run_key.endswith(f":{slot}") for r in refreshes) or slot != refresh_slot(
        spec, datetime.now(UTC)
    )
    again = ticks.tick()
    # The same slot: requested once (the cursor holds the slot; the run keys would make Dagster
    # drop a repeat anyway), and the tick says why nothing was requested.
    if refresh_slot(spec, datetime.now(UTC)) == slot:
        assert again.run_requests == []
        assert spec.name in again.skip_reason.skip_message


def test_no_refresh_is_requested_while_one_of_the_table_is_in_flight(
    create_topic, send, topic_prefix, kafka, instance
):
    """A refresh queued behind a long run covers what the next slot's would read: none is
    added behind it, so refreshes never queue back to back ahead of the hour's final run."""
    topic = create_topic(f"{topic_prefix}-busy", partitions=1)
    spec = _spec(topic, lateness=600).model_copy(update={"refresh_minutes": 15})
    send(topic, b"a", b"{}", _at(4, 10), partition=0)
    mirror = dg.asset(name=spec.name)(lambda: None)
    queued = instance.create_run_for_job(
        job_def=dg.Definitions(
            assets=[mirror], jobs=[dg.define_asset_job("j", selection="*")]
        ).resolve_job_def("j"),
        asset_selection=frozenset({dg.AssetKey(spec.name)}),
        tags={REFRESH_TAG: "true"},
        status=dg.DagsterRunStatus.STARTED,  # queued needs a code origin; both hold the slot
    )
    ticks = Ticks(spec, kafka, instance)
    assert [r for r in ticks.tick().run_requests if REFRESH_TAG in r.tags] == []
    # It ended: the next tick refreshes.
    instance.report_run_failed(queued)
    assert [r for r in ticks.tick().run_requests if REFRESH_TAG in r.tags]


def test_a_refresh_running_for_over_an_hour_is_taken_as_dead(
    create_topic, send, topic_prefix, kafka, instance, monkeypatch
):
    """The default run launcher can't tell a dead run worker: a refresh 'started' for over
    REFRESH_DEAD_AFTER no longer holds the table's refreshes back."""
    topic = create_topic(f"{topic_prefix}-dead", partitions=1)
    spec = _spec(topic, lateness=600).model_copy(update={"refresh_minutes": 15})
    send(topic, b"a", b"{}", _at(4, 10), partition=0)
    mirror = dg.asset(name=spec.name)(lambda: None)
    instance.create_run_for_job(
        job_def=dg.Definitions(
            assets=[mirror], jobs=[dg.define_asset_job("j", selection="*")]
        ).resolve_job_def("j"),
        asset_selection=frozenset({dg.AssetKey(spec.name)}),
        tags={REFRESH_TAG: "true"},
        status=dg.DagsterRunStatus.STARTED,
    )
    monkeypatch.setattr(offset_progress, "REFRESH_DEAD_AFTER", timedelta(0))
    assert [r for r in Ticks(spec, kafka, instance).tick().run_requests if REFRESH_TAG in r.tags]


def test_tier0_and_hourly_tables_closing_the_same_hours_are_requested_apart(
    create_topic, send, topic_prefix, kafka, instance
):
    """A tier-0 table's hours never share a run with an hourly table's: each run holds one
    pool, and the tier-0 one goes first in the queue."""
    specs = []
    for name, refresh in (("hourly", None), ("tier0", 15)):
        topic = create_topic(f"{topic_prefix}-{name}", partitions=1)
        for hour in range(5):
            send(topic, b"a", b"{}", _at(hour, 10), partition=0)
        specs.append(_spec(topic, lateness=0).model_copy(update={"refresh_minutes": refresh}))
    hourly, tier0 = specs
    sensor = build_offset_sensor(specs=specs)
    context = dg.build_sensor_context(instance=instance, resources={"kafka": kafka})
    result = sensor(context)
    closed = [r for r in result.run_requests if REFRESH_TAG not in r.tags]
    # H0..H2 then H3..H4 for each table (hours_per_run 3), never both tables in one run.
    assert len(closed) == 4 and all(len(r.asset_selection) == 1 for r in closed)
    assert {r.asset_selection[0].to_user_string() for r in closed} == {hourly.name, tier0.name}
    for request in closed:
        (key,) = request.asset_selection
        is_tier0 = key.to_user_string() == tier0.name
        assert (request.tags.get("dagster/priority") == "10") == is_tier0
        assert {c.asset_key for c in request.asset_check_keys} == {key}
    refreshes = [r for r in result.run_requests if REFRESH_TAG in r.tags]
    assert refreshes and all(r.asset_selection == [dg.AssetKey(tier0.name)] for r in refreshes)
    # The queue's order: a refresh before a tier-0 final run before an hourly run; requested
    # in that order too, since the daemon creates a tick's runs one by one.
    assert {r.tags["dagster/priority"] for r in refreshes} == {"20"}
    kinds = [
        "refresh" if REFRESH_TAG in r.tags else r.asset_selection[0].to_user_string()
        for r in result.run_requests
    ]
    assert kinds == sorted(kinds, key=["refresh", tier0.name, hourly.name].index), kinds


def test_tables_per_run_splits_the_tables_whose_same_hours_closed(
    create_topic, send, topic_prefix, kafka, instance
):
    """Three tables whose same hours closed, at most two a run: two runs, the tables by name,
    each hour of each table requested once, and each run's key its own."""
    specs = []
    for name in ("c", "a", "b"):
        topic = create_topic(f"{topic_prefix}-{name}", partitions=1)
        for hour in range(3):
            send(topic, b"a", b"{}", _at(hour, 10), partition=0)
        specs.append(_spec(topic, lateness=0).model_copy(update={"name": f"t_{name}"}))
    sensor = build_offset_sensor(specs=specs, tables_per_run=2)
    context = dg.build_sensor_context(instance=instance, resources={"kafka": kafka})
    requests = sensor(context).run_requests
    # Every hour closed (no lateness, hours in the past): two spans of hours (hours_per_run
    # 3), each as two runs.
    selections = [[k.to_user_string() for k in r.asset_selection] for r in requests]
    assert selections == [["t_a", "t_b"], ["t_c"]] * 2, selections
    assert len({r.run_key for r in requests}) == 4
    assert requests[1].tags["cdc/table"] == "t_c"
    spans = [(r.partition_key, r.tags.get("dagster/asset_partition_range_start")) for r in requests]
    assert spans[0] == spans[1] and spans[2] == spans[3] and spans[0] != spans[2]
    with pytest.raises(ValueError, match="tables_per_run must be at least 1"):
        build_offset_sensor(specs=specs, tables_per_run=0)


def test_a_partial_materialization_does_not_complete_its_hour():
    """What the sensor takes as an hour already materialized with its slice: not a refresh (it
    would leave the hour partial if the hour closed with no record after it)."""
    offsets = {"0": {"start": 5, "end": 9, "records": 4}}
    partial = {
        "kafka_offsets": dg.MetadataValue.json(offsets),
        "partial_hour": dg.MetadataValue.bool(True),
    }
    assert completed_hour_offsets(partial) == {}
    whole = {
        "kafka_offsets": dg.MetadataValue.json(offsets),
        "partial_hour": dg.MetadataValue.bool(False),
    }
    assert completed_hour_offsets(whole) == offsets
