"""What a run that is a thin client of a warm Spark Connect server costs, and what becomes of the
MERGE of a run killed mid-way (issue 49's design question), on a server of
devtools/spark_connect.py started here (`--port`, 15012) and stopped at the end.

- `thin`: processes that each connect, MERGE 200 rows from a local frame into one Delta table
  and exit, as a run worker would; each prints its session, create (the first) and MERGE
  seconds (pyspark's import not included). Then the same MERGEs in one process's embedded
  session (`SparkResource`), for comparison.
- `killed`: a client starts a MERGE of 3M rows, each newer than the table's (left alone, it
  commits), and is SIGKILLed 4 s after sending it; the table's commits are counted for 40 s.
  Then the same with a session id of its own, which a second client (the rerun) attaches to
  right after the kill: it interrupts the session's operations (`interruptAll`) and waits until
  the server reports none of them running (GetStatus).

    PYTHONPATH=. .venv/bin/python -m benchmarks.connect_runs --thin 5
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from devtools import spark_connect

COLUMNS = "id bigint, name string, seq bigint"
MERGE = (
    "MERGE INTO delta.`{path}` AS t USING changes AS s ON t.id = s.id "
    "WHEN MATCHED AND s.seq > t.seq THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT *"
)


def _create(spark, path: str) -> None:
    """The table, as the pipeline creates a mirror when its log shows none."""
    spark.sql(f"CREATE TABLE delta.`{path}` ({COLUMNS}) USING delta").collect()


def _merge(spark, path: str, seq: int) -> float:
    """MERGEs 200 rows at sequence `seq` from a local frame; returns its seconds."""
    started = time.monotonic()
    rows = [(i, f"name{i}-{seq}", seq) for i in range(200)]
    spark.createDataFrame(rows, COLUMNS).createOrReplaceTempView("changes")
    spark.sql(MERGE.format(path=path)).collect()
    return time.monotonic() - started


def _thin(remote: str, path: str, seq: str) -> None:
    """One run: connect, MERGE 200 rows at sequence `seq` (the first creates the table), exit."""
    from pyspark.sql import SparkSession

    started = time.monotonic()
    spark = SparkSession.builder.remote(remote).create()
    connected = created = time.monotonic()
    if int(seq) == 1:
        _create(spark, path)
        created = time.monotonic()
    merged = _merge(spark, path, int(seq))
    spark.stop()
    print(
        f"session {connected - started:.2f} s, create {created - connected:.2f} s, "
        f"MERGE {merged:.2f} s, in all {time.monotonic() - started:.2f} s"
    )


def _embedded(path: str, runs: str) -> None:
    """The same MERGEs, `runs` of them, in one process's embedded session (`SparkResource`)."""
    from resources.spark import SparkResource

    started = time.monotonic()
    spark = SparkResource().session
    session = time.monotonic() - started
    _create(spark, path)
    merges = [_merge(spark, path, seq) for seq in range(1, int(runs) + 1)]
    print(
        f"embedded: session {session:.2f} s, MERGEs " + ", ".join(f"{m:.2f}" for m in merges) + " s"
    )


def _long(remote: str, path: str, seq: str) -> None:
    """A run whose MERGE takes long: 3M rows at sequence `seq`, each newer than the table's."""
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.remote(remote).create()
    rows = spark.range(3_000_000).selectExpr("id", "concat('x', id) AS name", f"{int(seq)} AS seq")
    rows.createOrReplaceTempView("changes")
    print("merging", flush=True)
    spark.sql(MERGE.format(path=path)).collect()


def _interrupt(remote: str) -> None:
    """The rerun: interrupt every operation of the session, then wait until none is running or
    terminating (GetStatus: pyspark 4.2's client has it, not yet public)."""
    from pyspark.sql import SparkSession
    from pyspark.sql.connect.proto import base_pb2

    states = base_pb2.GetStatusResponse.OperationStatus.OperationState
    started = time.monotonic()
    spark = SparkSession.builder.remote(remote).create()
    stopped = spark.interruptAll()
    interrupted = time.monotonic()
    while True:
        statuses = spark.client._get_operation_statuses().operation_statuses  # noqa: SLF001
        live = [
            s
            for s in statuses
            if s.state in (states.OPERATION_STATE_RUNNING, states.OPERATION_STATE_TERMINATING)
        ]
        if not live:
            break
        time.sleep(0.1)
    ended = time.monotonic()
    print(
        f"the rerun interrupted {len(stopped)} operation(s) in {interrupted - started:.2f} s; "
        f"none running {ended - interrupted:.2f} s later: "
        + ", ".join(sorted(states.Name(s.state) for s in statuses))
    )


def _commits(path: str) -> int:
    return len(list((Path(path) / "_delta_log").glob("*.json")))


def _child(*args: str, **options) -> subprocess.Popen:
    command = [sys.executable, "-m", "benchmarks.connect_runs", "--child", *args]
    return subprocess.Popen(command, **options)


def _killed(remote: str, path: str, seq: int, *, interrupt: bool) -> None:
    """A long MERGE at `seq` (newer than every row: left alone, it commits), its client killed
    4 s after it sent the MERGE."""
    before = _commits(path)
    child = _child("long", remote, path, str(seq), stdout=subprocess.PIPE, text=True)
    while child.stdout.readline().strip() != "merging":
        if child.poll() is not None:
            sys.exit("the long run ended before its MERGE")
    time.sleep(4)
    child.send_signal(signal.SIGKILL)
    child.wait()
    if interrupt:
        _child("interrupt", remote).wait()
    time.sleep(40)
    after = _commits(path)
    how = "then its session interrupted by a rerun" if interrupt else "nothing else"
    print(f"killed 4 s into its MERGE, {how}: {after - before} commit(s) in the next 40 s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.connect_runs", description=__doc__)
    parser.add_argument("--thin", type=int, default=5, help="thin-client runs (5)")
    parser.add_argument("--port", type=int, default=15012, help="the server's, while it runs")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        children = {"thin": _thin, "embedded": _embedded, "long": _long, "interrupt": _interrupt}
        children[kind](*rest)
        return 0
    with tempfile.TemporaryDirectory() as folder:
        config = spark_connect.ConnectConfig(port=args.port, data_dir=Path(folder) / "server")
        started = time.monotonic()
        spark_connect.start(config)
        print(f"server ready in {time.monotonic() - started:.1f} s at {config.remote}")
        try:
            path = f"{folder}/table"
            for seq in range(1, args.thin + 1):
                print(f"thin run {seq}: ", end="", flush=True)
                if _child("thin", config.remote, path, str(seq)).wait():
                    return 1
            if _child("embedded", f"{folder}/embedded", str(args.thin)).wait():
                return 1
            _killed(config.remote, path, 1000, interrupt=False)
            session = f"{config.remote}/;session_id={uuid.uuid4()}"
            _killed(session, path, 2000, interrupt=True)
        finally:
            spark_connect.stop(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
