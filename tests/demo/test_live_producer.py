"""The live demo producer: pacing, state and resume on a fake clock, then on the real broker."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaConsumer, TopicPartition

from cdc_assets.config import DEFAULT_TABLES_FILE, TableSpec, load_tables
from demo.live import (
    KafkaSink,
    LiveState,
    SinkError,
    StateError,
    due_until,
    follow,
    hours_due,
    load_state,
    save_state,
    seed_state,
)
from demo.reference import replay_with_errors
from demo.source import DEMO_TABLES, DemoRecord, DemoSource

REPO = Path(__file__).resolve().parents[2]
SPECS = {spec.name: spec for spec in load_tables()}
H0 = datetime(2026, 10, 5, 12, tzinfo=UTC)  # in the past: the broker takes old CreateTimes
HOUR = timedelta(hours=1)
CHANGES = 40
QUIET = {"progress_every_s": 900}  # fewer checkpoints (flush, save) on the fake clock


class Clock:
    """A fake wall clock: `sleep` advances it instead of waiting."""

    def __init__(self, start: datetime) -> None:
        self.moment = start
        self.sleeps = 0

    def now(self) -> datetime:
        return self.moment

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.sleeps += 1
        self.moment += timedelta(seconds=seconds)

    def until(self, end: datetime):
        return lambda: self.moment >= end


class ListSink:
    """Collects what `follow` sends, with the fake time of sending; can fail on demand."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.sent: list[tuple[DemoRecord, datetime]] = []
        self.delivered: list[DemoRecord] = []
        self._pending: list[DemoRecord] = []
        self.fail_next_flush = False

    def send(self, record: DemoRecord) -> None:
        self.sent.append((record, self.clock.now()))
        self._pending.append(record)

    def flush(self) -> None:
        if self.fail_next_flush:
            self.fail_next_flush = False
            self._pending = []  # lost in flight
            raise SinkError("broker went away")
        self.delivered += self._pending
        self._pending = []


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def _run(state: LiveState, sink: Any, clock: Clock, path: Path, stop_at: datetime, **kw: Any):
    kw.setdefault("log", lambda message: None)
    return follow(
        state,
        sink,
        changes_per_hour=CHANGES,
        state_path=path,
        now=clock.now,
        sleep=clock.sleep,
        should_stop=clock.until(stop_at),
        **kw,
    )


def _expected(seed: int, seeded: list[datetime], live: list[datetime], specs=None) -> list:
    """What a producer that seeded `seeded` and then generated each of `live` sends."""
    source = DemoSource((specs or SPECS).values(), seed=seed)
    records = source.generate(seeded, CHANGES) if seeded else []
    for hour in live:
        records += source.generate([hour], CHANGES)
    return records


def _envelope(value: bytes) -> dict[str, Any]:
    document = json.loads(value)
    return document["payload"] if "payload" in document else document


# -- pacing ---------------------------------------------------------------------------------------


def test_due_until_sends_in_order_when_the_clock_reaches_each_stamp() -> None:
    stamps = [100, 200, 300, 400]

    assert due_until(stamps, 0, 99) == 0
    assert due_until(stamps, 0, 100) == 1
    assert due_until(stamps, 0, 350) == 3
    assert due_until(stamps, 3, 350) == 3
    assert due_until(stamps, 0, 10_000) == 4
    assert due_until(stamps, 4, 10_000) == 4
    assert due_until([], 0, 10_000) == 0


def test_due_until_sends_a_late_stamped_record_right_after_its_predecessor() -> None:
    stamps = [100, 500, 150, 160, 600, 90]

    assert due_until(stamps, 0, 499) == 1  # the late 150 waits for 500, its predecessor
    assert due_until(stamps, 0, 500) == 4  # ... and goes with it, like 160
    assert due_until(stamps, 2, 0) == 4  # once 500 is out, 150 and 160 are due at any time
    assert due_until(stamps, 4, 600) == 6


def test_hours_due() -> None:
    now = H0 + timedelta(minutes=42)

    assert hours_due(None, now, 24) == ([H0], 0)
    assert hours_due(H0, now, 24) == ([], 0)
    assert hours_due(H0 + HOUR, now, 24) == ([], 0)  # the seeded hour ends in the future
    assert hours_due(H0 - HOUR, now, 24) == ([H0], 0)
    assert hours_due(H0 - 4 * HOUR, now, 24) == ([H0 - 3 * HOUR, H0 - 2 * HOUR, H0 - HOUR, H0], 0)
    assert hours_due(H0 - 4 * HOUR, now, 1) == ([H0 - HOUR, H0], 2)
    assert hours_due(H0 - 4 * HOUR, now, 0) == ([H0], 3)


# -- the loop on a fake clock ---------------------------------------------------------------------


def test_follow_seeds_then_sends_each_record_when_it_is_due(tmp_path: Path) -> None:
    clock = Clock(H0 + timedelta(minutes=40))
    path = tmp_path / "state.pickle"
    state = seed_state(DemoSource(SPECS.values(), seed=7), 2, CHANGES, clock.now())
    sink = ListSink(clock)

    final = _run(state, sink, clock, path, H0 + 2 * HOUR + timedelta(minutes=30))

    expected = _expected(7, [H0 - 2 * HOUR, H0 - HOUR], [H0, H0 + HOUR, H0 + 2 * HOUR])
    sent = [record for record, _ in sink.sent]
    assert sent == expected[: len(sent)] == sink.delivered
    assert final.hour == H0 + 2 * HOUR and 0 < final.sent < len(final.records)
    assert len(sent) == len(expected) - len(final.records) + final.sent
    latest = 0
    for record, at in sink.sent:
        latest = max(latest, record.timestamp_ms)
        # Never before its stamp (nor before its predecessor's), and at most a tick later;
        # what was stamped before the producer started went out at once.
        assert _ms(at) >= latest
        assert _ms(at) <= max(latest, _ms(H0 + timedelta(minutes=40))) + 1_000
    assert any(r.timestamp_ms < p.timestamp_ms for p, r in zip(sent, sent[1:], strict=False))
    saved = load_state(path)
    assert (saved.hour, saved.sent, saved.records) == (final.hour, final.sent, final.records)


def test_follow_resumes_mid_hour_and_catches_up_the_hours_it_missed(tmp_path: Path) -> None:
    clock = Clock(H0 + timedelta(minutes=10))
    path = tmp_path / "state.pickle"
    sink = ListSink(clock)
    _run(
        seed_state(DemoSource(SPECS.values(), seed=3), 1, CHANGES, clock.now()),
        sink,
        clock,
        path,
        H0 + timedelta(minutes=35),
    )
    interrupted = len(sink.delivered)

    clock.moment = H0 + 3 * HOUR + timedelta(minutes=5)  # down for almost three hours
    resumed = load_state(path)
    _run(resumed, sink, clock, path, H0 + 4 * HOUR)

    expected = _expected(3, [H0 - HOUR], [H0, H0 + HOUR, H0 + 2 * HOUR, H0 + 3 * HOUR])
    assert sink.delivered == expected
    # The missed hours went out at once, at the restart.
    restart = H0 + 3 * HOUR + timedelta(minutes=5)
    first_live = next(i for i, (r, _) in enumerate(sink.sent) if r.timestamp_ms > _ms(restart))
    assert interrupted < first_live
    assert all(at == restart for _, at in sink.sent[interrupted:first_live])
    assert all(at > restart for _, at in sink.sent[first_live:])
    for table in DEMO_TABLES:
        records = [(0, n, r.value) for n, r in enumerate(r for r in expected if r.table == table)]
        state, _ = replay_with_errors(SPECS[table], records)
        assert state == resumed.source.state(table)


def test_follow_caps_the_catch_up(tmp_path: Path) -> None:
    clock = Clock(H0 + timedelta(minutes=59, seconds=59))
    path = tmp_path / "state.pickle"
    sink = ListSink(clock)
    state = _run(LiveState(DemoSource(SPECS.values(), seed=5)), sink, clock, path, H0 + HOUR)
    clock.moment = H0 + 30 * HOUR
    logged: list[str] = []

    stop_at = H0 + 30 * HOUR + timedelta(seconds=1)
    state = _run(state, sink, clock, path, stop_at, max_catch_up_hours=2, log=logged.append)

    committed = {
        _envelope(r.value)["source"]["ts_ms"] // 3_600_000
        for r in sink.delivered
        if r.kind == "change" and r.value
    }
    assert sorted(committed) == [_ms(h) // 3_600_000 for h in (H0, H0 + 28 * HOUR, H0 + 29 * HOUR)]
    assert state.hour == H0 + 30 * HOUR  # generated, its records not due yet
    assert logged[0] == "skipping 27 hours the producer was down for"
    assert [line.split(":")[0] for line in logged[1:4]] == [
        f"generated hour {h:%Y-%m-%d %H}" for h in (H0 + 28 * HOUR, H0 + 29 * HOUR, H0 + 30 * HOUR)
    ]


def test_follow_resends_from_the_last_acknowledged_record_after_a_sink_error(
    tmp_path: Path,
) -> None:
    clock = Clock(H0 + timedelta(minutes=50))
    path = tmp_path / "state.pickle"
    sink = ListSink(clock)
    state = seed_state(DemoSource(SPECS.values(), seed=9), 1, CHANGES, clock.now())
    # The first checkpoint (once the seeded hour is out, before H0 is generated) fails: what
    # was in flight is lost, and sent again.
    sink.fail_next_flush = True

    _run(state, sink, clock, path, H0 + HOUR, progress_every_s=60)

    assert sink.delivered == _expected(9, [H0 - HOUR], [H0])
    assert len(sink.sent) > len(sink.delivered)


def test_state_file_is_written_atomically_and_checked_on_load(tmp_path: Path) -> None:
    path = tmp_path / "demo" / "source.pickle"
    state = seed_state(DemoSource(SPECS.values(), seed=7), 1, 20, H0)

    save_state(path, state)
    save_state(path, state)

    assert [p.name for p in path.parent.iterdir()] == ["source.pickle"]
    assert load_state(path).records == state.records
    path.write_bytes(b"not a pickle")
    with pytest.raises(StateError, match=r"scripts/demo.sh --reset"):
        load_state(path)
    path.write_bytes(pickle.dumps({"source": None}))
    with pytest.raises(StateError, match="not a demo producer state"):
        load_state(path)
    state.version = 0
    save_state(path, state)
    with pytest.raises(StateError, match="version 0"):
        load_state(path)


# -- on the real broker ---------------------------------------------------------------------------


def _private_specs(prefix: str) -> dict[str, TableSpec]:
    return {
        name: spec.model_copy(update={"topic": f"{prefix}.{spec.topic}"})
        for name, spec in SPECS.items()
    }


def _read(bootstrap: str, topic: str) -> list[Any]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        out = []
        deadline = time.monotonic() + 20
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            assert time.monotonic() < deadline
            for batch in consumer.poll(timeout_ms=1_000).values():
                out += batch
        return sorted(out, key=lambda m: (m.partition, m.offset))
    finally:
        consumer.close()


@pytest.mark.integration
def test_follow_on_kafka_resumes_the_same_source(broker: str, tmp_path: Path) -> None:
    specs = _private_specs(f"t{uuid.uuid4().hex[:10]}")
    path = tmp_path / "state.pickle"
    clock = Clock(H0 + timedelta(minutes=40))
    state = seed_state(DemoSource(specs.values(), seed=7), 2, CHANGES, clock.now())
    save_state(path, state)
    topics = [spec.topic for spec in specs.values()]

    sink = KafkaSink(broker, topics)
    try:
        first = _run(state, sink, clock, path, H0 + HOUR + timedelta(minutes=20), **QUIET)
    finally:
        sink.close()
    assert first.hour == H0 + HOUR and 0 < first.sent < len(first.records)
    lsn_before = max(
        _envelope(r.value)["source"]["lsn"]
        for r in first.records[: first.sent]
        if r.kind == "change" and r.value
    )

    clock.moment = H0 + 3 * HOUR + timedelta(minutes=10)
    resumed = load_state(path)
    sink = KafkaSink(broker, topics)
    try:
        last = _run(resumed, sink, clock, path, H0 + 4 * HOUR, **QUIET)
    finally:
        sink.close()
    assert last.hour == H0 + 3 * HOUR and last.sent == len(last.records)

    expected = _expected(7, [H0 - 2 * HOUR, H0 - HOUR], [H0 + n * HOUR for n in range(4)], specs)
    changes = [_envelope(r.value) for r in expected if r.kind == "change" and r.value]
    lsns = [change["source"]["lsn"] for change in changes]
    assert all(a < b for a, b in zip(lsns, lsns[1:], strict=False))
    assert all(
        _envelope(r.value)["source"]["lsn"] > lsn_before
        for r in last.records
        if r.kind == "change" and r.value
    )
    for name, spec in specs.items():
        messages = _read(broker, spec.topic)
        mine = [r for r in expected if r.table == name]
        # Kafka holds exactly the records, each partition in send order, CreateTime kept.
        partition_of: dict[bytes | None, int] = {}
        for message in messages:
            assert partition_of.setdefault(message.key, message.partition) == message.partition
        by_partition: defaultdict[int, list[tuple]] = defaultdict(list)
        for record in mine:
            by_partition[partition_of[record.key]].append(
                (record.key, record.value, record.timestamp_ms)
            )
        got: defaultdict[int, list[tuple]] = defaultdict(list)
        for message in messages:
            got[message.partition].append((message.key, message.value, message.timestamp))
        assert got == by_partition
        # Inserted keys never repeat across the restart.
        inserts = [_envelope(r.value) for r in mine if r.kind == "change" and r.value]
        inserted = [
            tuple(change["after"][col] for col in spec.primary_key)
            for change in inserts
            if change["op"] in ("c", "r")
        ]
        assert len(inserted) == len(set(inserted)) > 0
        state, _ = replay_with_errors(spec, [(m.partition, m.offset, m.value) for m in messages])
        assert state == last.source.state(name)


def _tables_file(tmp_path: Path, prefix: str) -> Path:
    text = DEFAULT_TABLES_FILE.read_text().replace("topic: demo.", f"topic: {prefix}.demo.")
    path = tmp_path / "tables.yaml"
    path.write_text(text)
    return path


@pytest.mark.integration
def test_command_line_follows_until_sigterm_and_refuses_a_bad_state(
    broker: str, tmp_path: Path
) -> None:
    state = tmp_path / "demo" / "source.pickle"
    log = tmp_path / "producer.log"
    command = [
        sys.executable,
        "-m",
        "demo.produce",
        "--follow",
        "--state",
        str(state),
        "--bootstrap",
        broker,
        "--hours",
        "1",
        "--changes-per-hour",
        "30",
        "--tables-file",
        str(_tables_file(tmp_path, f"t{uuid.uuid4().hex[:10]}")),
    ]
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while "generated hour" not in log.read_text():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text()
    assert "following: new demo source" in text and "stopped;" in text
    saved = load_state(state)
    current = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    assert saved.hour in (current, current - HOUR) and saved.sent > 0

    # Resuming a source whose topics are gone, and a damaged state file, both say what to do.
    fresh = tmp_path / "other.pickle"
    specs = _private_specs(f"t{uuid.uuid4().hex[:10]}")
    save_state(fresh, seed_state(DemoSource(specs.values(), seed=1), 1, 10, H0))
    for path, message in [(fresh, "are not on the broker"), (state, "cannot read")]:
        if path == state:
            state.write_bytes(state.read_bytes()[:100])
        index = command.index("--state") + 1
        result = subprocess.run(
            [*command[:index], str(path), *command[index + 1 :]],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ},
        )
        assert result.returncode == 1
        assert message in result.stderr and "scripts/demo.sh --reset" in result.stderr
