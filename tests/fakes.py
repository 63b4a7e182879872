"""An in-memory stand-in for the few `KafkaConsumer` calls the slicing and the offset sensor
make, for the unit tests of their pure logic only: the integration tests use the real broker."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from kafka import TopicPartition
from kafka.structs import OffsetAndTimestamp


@dataclass
class FakeConsumer:
    """Topics as committed logs: `logs[topic][partition]` holds each offset's timestamp (ms),
    from `log_starts` (retention) on. `high_watermarks` are the read_uncommitted ends (an open
    transaction's records lie above the stable end). Every `timeout_ms` a call gets is kept."""

    logs: dict[str, dict[int, list[int]]]
    log_starts: dict[TopicPartition, int] = field(default_factory=dict)
    high_watermarks: dict[TopicPartition, int] = field(default_factory=dict)
    timeouts: list[tuple[str, int | None]] = field(default_factory=list)
    _assigned: list[TopicPartition] = field(default_factory=list)
    _positions: dict[TopicPartition, int] = field(default_factory=dict)

    def _stamps(self, tp: TopicPartition) -> list[int]:
        return self.logs[tp.topic][tp.partition]

    def topics(self) -> set[str]:
        return set(self.logs)

    def partitions_for_topic(self, topic: str) -> set[int]:
        return set(self.logs.get(topic, {}))

    def beginning_offsets(self, tps, timeout_ms=None):
        self.timeouts.append(("beginning_offsets", timeout_ms))
        return {tp: self.log_starts.get(tp, 0) for tp in tps}

    def end_offsets(self, tps, timeout_ms=None):
        self.timeouts.append(("end_offsets", timeout_ms))
        return {tp: self.high_watermarks.get(tp, len(self._stamps(tp))) for tp in tps}

    def offsets_for_times(self, timestamps, timeout_ms=None):
        self.timeouts.append(("offsets_for_times", timeout_ms))
        found = {}
        for tp, ms in timestamps.items():
            stamps = self._stamps(tp)
            at = next(
                (o for o in range(self.log_starts.get(tp, 0), len(stamps)) if stamps[o] >= ms),
                None,
            )
            found[tp] = None if at is None else OffsetAndTimestamp(at, stamps[at], -1)
        return found

    def assign(self, tps):
        self._assigned = list(tps)

    def seek(self, tp, offset):
        self._positions[tp] = offset

    def poll(self, timeout_ms=0):
        self.timeouts.append(("poll", timeout_ms))
        out = {}
        for tp in self._assigned:
            start, stamps = self._positions[tp], self._stamps(tp)
            if start < len(stamps):
                out[tp] = [
                    SimpleNamespace(offset=o, timestamp=stamps[o])
                    for o in range(start, len(stamps))
                ]
                self._positions[tp] = len(stamps)
        return out

    def position(self, tp, timeout_ms=None):
        self.timeouts.append(("position", timeout_ms))
        return self._positions[tp]

    def pause(self, *tps):
        pass

    def unsubscribe(self):
        self._assigned = []
