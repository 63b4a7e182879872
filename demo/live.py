"""The demo's live producer: keeps a `DemoSource` writing changes at the current time.

`python -m demo.produce --follow` runs it (see `run`). On its first start it seeds the last
few closed UTC hours, then generates every UTC hour when it begins (``generate([hour])``, one
call per hour, so the source database carries over from hour to hour) and sends the hour's
records in their commit order, each once the wall clock reaches its timestamp. A record stamped
earlier than its predecessor (the connector's deliberately late CreateTimes, the re-sent
duplicates) goes out right after that predecessor; records whose time has passed go out at once.

Everything needed to continue lives in one pickle (`LiveState`): the source database, the
records of the last generated hour and how many of them Kafka acknowledged. It is written
atomically after each generated hour, about once a minute, and on shutdown, so a restarted
producer continues the same database (LSNs keep increasing, ids never collide): it sends the
rest of the interrupted hour, generates and sends the hours it missed at once, then goes live.
After a crash the records sent since the last checkpoint go out again, as after a Debezium
connector restart; the mirrors converge regardless (a re-sent malformed record is
another error row).
"""

from __future__ import annotations

import argparse
import os
import pickle
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Protocol

from kafka import KafkaAdminClient, KafkaProducer
from kafka.errors import KafkaError

from cdc_assets.config import load_tables
from demo.produce import DEFAULT_TOPIC_CONFIGS, closed_hours, ensure_topics, new_producer
from demo.source import RECORD_KINDS, DemoRecord, DemoSource

STATE_VERSION = 1
RESET_HINT = "start the demo over with `scripts/demo.sh --reset`"
_HOUR = timedelta(hours=1)
_FLUSH_TIMEOUT_S = 60
_RETRY_S = 5.0


class StateError(RuntimeError):
    """The state file cannot be used to continue the demo source."""


class SinkError(RuntimeError):
    """Records could not be delivered; they are sent again from the last checkpoint."""


@dataclass
class LiveState:
    """What a restarted producer needs to continue where it stopped.

    Attributes:
        source: The demo source database, after its last `generate` call.
        hour: The last hour generated (None before the first one).
        records: The records of the last `generate` call, in send order.
        sent: How many of `records` Kafka acknowledged.
        version: Format version of the state file.
    """

    source: DemoSource
    hour: datetime | None = None
    records: list[DemoRecord] = field(default_factory=list)
    sent: int = 0
    version: int = STATE_VERSION


class RecordSink(Protocol):
    """Where `follow` sends records: Kafka (`KafkaSink`), or a list in the tests."""

    def send(self, record: DemoRecord) -> None:
        """Sends one record asynchronously; raises `SinkError` if it cannot even be queued."""

    def flush(self) -> None:
        """Waits for every record sent so far; raises `SinkError` if any of them failed."""


# -- pacing (pure) --------------------------------------------------------------------------------


def due_until(timestamps_ms: Sequence[int], start: int, now_ms: int) -> int:
    """The end of the run of records that are due at `now_ms`, starting at index `start`.

    Records go out in order, each once the clock reaches its timestamp: `records[start:result]`
    are due now, `records[result]` (if any) waits for `timestamps_ms[result]`. The records
    before `start` went out already, so a record stamped no later than one of them (a late
    CreateTime, a re-sent duplicate) is due right after its predecessor, whatever the clock.
    """
    reached = max(now_ms, max(timestamps_ms[:start], default=now_ms))
    end = start
    while end < len(timestamps_ms) and timestamps_ms[end] <= reached:
        end += 1
    return end


def hours_due(
    last_hour: datetime | None, now: datetime, max_catch_up: int
) -> tuple[list[datetime], int]:
    """The hours to generate at `now` after `last_hour`, oldest first, and how many are skipped.

    Every hour that began after `last_hour` up to the current one is due; of those that already
    ended, only the last `max_catch_up` are generated (the source "was idle" in the others).
    """
    current = now.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    if last_hour is None:
        return [current], 0
    count = int((current - last_hour) / _HOUR)
    if count <= 0:
        return [], 0
    kept = min(count, max_catch_up + 1)
    return [current - _HOUR * n for n in range(kept - 1, -1, -1)], count - kept


# -- state ----------------------------------------------------------------------------------------


def seed_state(source: DemoSource, hours: int, changes_per_hour: int, now: datetime) -> LiveState:
    """A fresh state whose pending records are the last `hours` closed hours (none for 0)."""
    if hours <= 0:
        return LiveState(source=source)
    seeded = closed_hours(now, hours)
    return LiveState(
        source=source,
        hour=seeded[-1],
        records=source.generate(seeded, changes_per_hour),
    )


def save_state(path: Path, state: LiveState) -> None:
    """Writes `state` to `path` atomically (temporary file in the same folder, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            pickle.dump(state, file, protocol=pickle.HIGHEST_PROTOCOL)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def load_state(path: Path) -> LiveState:
    """Reads a state written by `save_state`.

    Raises:
        StateError: The file is unreadable, not a producer state, or of another version.
    """
    try:
        with open(path, "rb") as file:
            state = pickle.load(file)
    except Exception as exc:  # pickle raises about anything on a damaged or foreign file
        raise StateError(
            f"cannot read the demo producer state {path} ({type(exc).__name__}: {exc}); "
            f"{RESET_HINT}"
        ) from exc
    if not isinstance(state, LiveState) or not isinstance(state.source, DemoSource):
        raise StateError(f"{path} is not a demo producer state; {RESET_HINT}")
    if state.version != STATE_VERSION:
        raise StateError(
            f"{path} has state version {state.version}, this producer reads version "
            f"{STATE_VERSION}; {RESET_HINT}"
        )
    return state


# -- Kafka ----------------------------------------------------------------------------------------


class KafkaSink:
    """Sends `DemoRecord`s to Kafka in order, creating missing topics first.

    Args:
        bootstrap_servers: "host:port[,host:port]".
        topics: Topics to create when missing.
        partitions: Partition count for the topics created here.
        topic_configs: Configs for the topics created here.
    """

    def __init__(
        self,
        bootstrap_servers: str,
        topics: Iterable[str],
        *,
        partitions: int = 3,
        topic_configs: Mapping[str, str] = DEFAULT_TOPIC_CONFIGS,
    ) -> None:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap_servers, client_id="demo-admin")
        try:
            ensure_topics(admin, topics, partitions=partitions, configs=topic_configs)
        finally:
            admin.close()
        self._producer: KafkaProducer = new_producer(bootstrap_servers, "demo-follower")
        self._failures: list[BaseException] = []

    def send(self, record: DemoRecord) -> None:
        try:
            future = self._producer.send(
                record.topic, key=record.key, value=record.value, timestamp_ms=record.timestamp_ms
            )
        except KafkaError as exc:
            raise SinkError(f"cannot send to {record.topic}: {exc!r}") from exc
        future.add_errback(self._failures.append)  # runs on the producer's IO thread

    def flush(self) -> None:
        try:
            self._producer.flush(timeout=_FLUSH_TIMEOUT_S)
        except KafkaError as exc:
            raise SinkError(f"flushing the producer failed: {exc!r}") from exc
        if self._failures:
            failures, self._failures = self._failures, []
            raise SinkError(f"{len(failures)} records were not delivered: {failures[0]!r}")

    def close(self) -> None:
        self._producer.close(timeout=10)


def missing_topics(bootstrap_servers: str, topics: Iterable[str]) -> list[str]:
    """The `topics` the broker does not have."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap_servers, client_id="demo-admin")
    try:
        return sorted(set(topics) - set(admin.list_topics()))
    finally:
        admin.close()


# -- the loop -------------------------------------------------------------------------------------


def follow(
    state: LiveState,
    sink: RecordSink,
    *,
    changes_per_hour: int,
    state_path: Path,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
    sleep: Callable[[float], None] = time.sleep,
    should_stop: Callable[[], bool] = lambda: False,
    log: Callable[[str], None] = print,
    max_catch_up_hours: int = 24,
    progress_every_s: float = 60.0,
    tick_s: float = 1.0,
    batch: int = 500,
) -> LiveState:
    """Sends `state`'s pending records and every following hour's, until `should_stop()`.

    Each hour is generated when it begins (hours missed while the producer was down are
    generated at once, at most `max_catch_up_hours` of them) and persisted to `state_path`
    before any of its records is sent. Records go out when `due_until` says so; `sleep` waits
    at most `tick_s` at a time, so `should_stop` is honoured within about a tick. About every
    `progress_every_s` (by `now`) the sink is flushed, the state saved and a line logged; on
    the way out, too. A `SinkError` rewinds to the last acknowledged record and retries.

    Returns:
        The state as last saved.
    """
    if changes_per_hour < 1:
        raise ValueError(f"changes_per_hour must be at least 1, got {changes_per_hour}")
    cursor = state.sent  # records handed to the sink; state.sent is what Kafka acknowledged
    sent_since_log = 0
    next_progress = now() + timedelta(seconds=progress_every_s)

    def checkpoint() -> None:
        sink.flush()
        state.sent = cursor
        save_state(state_path, state)

    try:
        while not should_stop():
            moment = now()
            try:
                if cursor < len(state.records):
                    stamps = _timestamps(state.records)
                    end = min(due_until(stamps, cursor, _to_ms(moment)), cursor + batch)
                    if end > cursor:
                        for record in state.records[cursor:end]:
                            sink.send(record)
                        sent_since_log += end - cursor
                        cursor = end
                    else:
                        sleep(min(tick_s, (stamps[cursor] - _to_ms(moment)) / 1000))
                else:
                    hours, skipped = hours_due(state.hour, moment, max_catch_up_hours)
                    if hours:
                        checkpoint()  # the previous hour is acknowledged before it is replaced
                        if skipped:
                            log(f"skipping {skipped} hours the producer was down for")
                        _generate(state, hours[0], changes_per_hour, state_path, moment, log)
                        cursor = 0
                    else:
                        assert state.hour is not None  # hours_due always gives the first one
                        to_next_hour = (state.hour + _HOUR - moment).total_seconds()
                        sleep(max(min(tick_s, to_next_hour), 0.001))
                if now() >= next_progress:
                    checkpoint()
                    log(_progress(state, sent_since_log, progress_every_s))
                    sent_since_log = 0
                    next_progress = now() + timedelta(seconds=progress_every_s)
            except SinkError as exc:
                log(f"{exc}; resending from record {state.sent} of the hour in {_RETRY_S:g} s")
                cursor = state.sent
                sleep(_RETRY_S)
    finally:
        try:
            checkpoint()
        except SinkError as exc:
            # The state keeps the last acknowledged record; the next start resends the rest.
            log(f"{exc}; on restart, resending from record {state.sent} of the hour")
    log(f"stopped; {_position(state)}")
    return state


def _generate(
    state: LiveState,
    hour: datetime,
    changes_per_hour: int,
    state_path: Path,
    moment: datetime,
    log: Callable[[str], None],
) -> None:
    records = state.source.generate([hour], changes_per_hour)
    state.hour, state.records, state.sent = hour, records, 0
    save_state(state_path, state)
    kinds = Counter(r.kind for r in records)
    per_kind = ", ".join(f"{kinds[kind]} {kind}" for kind in RECORD_KINDS)
    how = "live" if hour + _HOUR > moment else "catching up, sending at once"
    log(f"generated hour {_hour_text(hour)}: {len(records)} records ({per_kind}); {how}")


def _progress(state: LiveState, sent: int, every_s: float) -> str:
    return f"sent {sent} records in the last {every_s:g} s; {_position(state)}"


def _position(state: LiveState) -> str:
    if state.hour is None:
        return "no hour generated yet"
    where = f"hour {_hour_text(state.hour)}: {state.sent} of {len(state.records)} records sent"
    if state.sent < len(state.records):
        due = datetime.fromtimestamp(state.records[state.sent].timestamp_ms / 1000, UTC)
        return f"{where}, next one stamped {due:%H:%M:%S}Z"
    return f"{where}, next hour starts {state.hour + _HOUR:%H:%M}Z"


def _timestamps(records: Sequence[DemoRecord]) -> list[int]:
    return [r.timestamp_ms for r in records]


def _hour_text(hour: datetime) -> str:
    return f"{hour:%Y-%m-%d %H:00} UTC"


def _to_ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


# -- command line ---------------------------------------------------------------------------------


def _log(message: str) -> None:
    print(f"{datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ} {message}", flush=True)


def run(args: argparse.Namespace) -> int:
    """`python -m demo.produce --follow ...`: the producer until SIGTERM or SIGINT."""
    state_path = Path(args.state)
    if state_path.exists():
        try:
            state = load_state(state_path)
        except StateError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 1
        topics = [spec.topic for spec in state.source.specs.values()]
        try:
            gone = missing_topics(args.bootstrap, topics)
        except KafkaError as exc:
            print(f"error: Kafka at {args.bootstrap}: {exc!r}", file=sys.stderr, flush=True)
            return 1
        if gone:
            print(
                f"error: {state_path} continues a source whose topics {gone} are not on the "
                f"broker at {args.bootstrap} (was its data deleted?); {RESET_HINT}",
                file=sys.stderr,
                flush=True,
            )
            return 1
        fresh = False
    else:
        specs = load_tables(args.tables_file)
        wrapped = {name for name in args.wrapped.split(",") if name}
        source = DemoSource(specs, seed=args.seed, wrapped=wrapped)
        state = LiveState(source=source)
        topics = [spec.topic for spec in source.specs.values()]
        fresh = True

    stop = {"signal": None}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    # Under `nohup ... &` from a script SIGINT is ignored: the script stops us with SIGTERM.
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, on_signal)

    try:
        sink = KafkaSink(args.bootstrap, topics, partitions=args.partitions)
    except KafkaError as exc:
        print(f"error: Kafka at {args.bootstrap}: {exc!r}", file=sys.stderr, flush=True)
        return 1
    try:
        if fresh:
            state = seed_state(state.source, args.hours, args.changes_per_hour, datetime.now(UTC))
            save_state(state_path, state)
            what = (
                f"new demo source (seed {args.seed}), seeding {args.hours} closed hours up to "
                f"{_hour_text(state.hour + _HOUR)}: {len(state.records)} records"
                if state.hour is not None
                else f"new demo source (seed {args.seed}), no hours seeded"
            )
        else:
            what = f"resumed {state_path}; {_position(state)}"
        _log(
            f"following: {what}; {args.changes_per_hour} changes per hour to {args.bootstrap} "
            f"(pid {os.getpid()})"
        )
        follow(
            state,
            sink,
            changes_per_hour=args.changes_per_hour,
            state_path=state_path,
            should_stop=lambda: stop["signal"] is not None,
            log=_log,
            max_catch_up_hours=args.max_catch_up_hours,
        )
    finally:
        sink.close()
    return 0
