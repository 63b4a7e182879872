"""Where a profiled run's Spark time went: its event log, summarized per SQL query and job.

`scripts/bench.sh --profile-runs` writes each Spark variant's event log beside its result, and
this summary of it (`result-*.spark.txt`). `python -m benchmarks.spark_profile LOG` prints, in
order, every SQL query the run executed (its wall time and the Python line that started it) and
the jobs outside any query, then the totals. A query's time includes its jobs' (a MERGE shows as
one query of several jobs).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Query:
    id: int
    description: str
    start_ms: int
    end_ms: int | None = None
    jobs: list[int] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return ((self.end_ms or self.start_ms) - self.start_ms) / 1000


@dataclass
class Job:
    id: int
    start_ms: int
    query: int | None
    call_site: str
    end_ms: int | None = None
    tasks: int = 0

    @property
    def seconds(self) -> float:
        return ((self.end_ms or self.start_ms) - self.start_ms) / 1000


def _events(path: Path):
    """The log's events; Spark 4 writes an application's log as a folder of rolling files."""
    files = sorted(path.glob("events_*")) if path.is_dir() else [path]
    for file in files:
        with file.open() as lines:
            for line in lines:
                yield json.loads(line)


def read(path: Path) -> tuple[list[Query], list[Job], dict]:
    queries: dict[int, Query] = {}
    jobs: dict[int, Job] = {}
    app: dict = {}
    for event in _events(path):
        kind = event.get("Event", "")
        if kind == "SparkListenerApplicationStart":
            app["start_ms"] = event["Timestamp"]
        elif kind == "SparkListenerApplicationEnd":
            app["end_ms"] = event["Timestamp"]
        elif kind.endswith("SparkListenerSQLExecutionStart"):
            description = event.get("description") or ""
            queries[event["executionId"]] = Query(
                event["executionId"], " ".join(description.split())[:110], event["time"]
            )
        elif kind.endswith("SparkListenerSQLExecutionEnd"):
            if event["executionId"] in queries:
                queries[event["executionId"]].end_ms = event["time"]
        elif kind == "SparkListenerJobStart":
            properties = event.get("Properties") or {}
            query = properties.get("spark.sql.execution.id")
            stages = event.get("Stage Infos") or []
            jobs[event["Job ID"]] = Job(
                event["Job ID"],
                event["Submission Time"],
                int(query) if query is not None else None,
                (properties.get("callSite.short") or "").split(" at ")[-1],
                tasks=sum(s.get("Number of Tasks", 0) for s in stages),
            )
            if query is not None and int(query) in queries:
                queries[int(query)].jobs.append(event["Job ID"])
        elif kind == "SparkListenerJobEnd":
            if event["Job ID"] in jobs:
                jobs[event["Job ID"]].end_ms = event["Completion Time"]
    return sorted(queries.values(), key=lambda q: q.start_ms), list(jobs.values()), app


def summary(path: Path) -> str:
    queries, jobs, app = read(path)
    origin = app.get("start_ms") or min([q.start_ms for q in queries] or [0])
    lines = [f"{'at s':>7} {'s':>7} {'jobs':>4}  query (or job outside one)"]
    # The outermost queries only: a query started inside another's time is part of it.
    events = [
        (q.start_ms, q.seconds, len(q.jobs), q.description or "(no description)") for q in queries
    ]
    events += [
        (j.start_ms, j.seconds, 1, f"job {j.id} at {j.call_site}") for j in jobs if j.query is None
    ]
    for start, seconds, count, text in sorted(events):
        if seconds >= 0.05:
            lines.append(f"{(start - origin) / 1000:7.1f} {seconds:7.2f} {count:4d}  {text}")
    spark_s = sum(j.seconds for j in jobs)
    lines.append(
        f"{len(queries)} queries, {len(jobs)} jobs, {spark_s:.1f} s in jobs"
        + (
            f", application {(app['end_ms'] - app['start_ms']) / 1000:.1f} s"
            if "end_ms" in app and "start_ms" in app
            else ""
        )
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path, help="event logs (files or Spark 4 folders)")
    for log in parser.parse_args(argv).logs:
        print(f"== {log}")
        print(summary(log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
