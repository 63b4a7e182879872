"""The expectations judge rows in memory (great-expectations' pandas engine) exactly as they judge
the same rows in Spark: every kind the tables file allows, hard and not, through both engines.

One table of rows with a column per case (each kind, failing and passing, on every type it
takes: nulls, unicode, NaN, infinities, decimals and integers at their bounds, timestamps and
dates at the calendar's ends) goes to each engine as the decoder would hand it over: a pyarrow
Table, and `spark.createDataFrame` of it with the decoder's Spark schema.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, date, datetime
from decimal import Decimal

import pyarrow as pa
import pytest
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets.columns import DELETED, KAFKA_OFFSET, KAFKA_PARTITION, OP
from cdc_assets.config import TableSpec
from cdc_assets.decoding.types import arrow_type, spark_data_type
from cdc_assets.java_regex import UntranslatableRegex, python_regex
from checks.expectations import (
    Expectation,
    _gx_expectations,
    _summarize,
    _unique_among_live_rows,
    _validate,
    audit_changes,
    validate_batch,
)

pytestmark = pytest.mark.integration

NAN, INF = math.nan, math.inf
DEC = "decimal(12,2)"


def _d(*values):
    return [None if v is None else Decimal(v) for v in values]


def _ts(*values):
    return [None if v is None else datetime(*v, tzinfo=UTC) for v in values]


# Eight rows per column. Row 7 is a delete: the audit leaves it out, the validation does not.
STRINGS = ["abc", "ünï", None, "a\n", "ABC", "a\r", "x y", "é"]
BOOLEANS = [True, None, False, True, True, False, True, True]
INTS = [0, 10, None, -1, 11, 5, 2**31 - 1, -(2**31)]
BIGINTS = [0, 2**62, None, -(2**62), 1, 2**53 + 1, 7, -1]
DOUBLES = [1.5, NAN, None, -0.0, INF, 0.0, -INF, 3.0]
FLOATS = [0.7, 0.1, None, 1.5, NAN, 3.4e38, -0.0, 1.0]
TIMESTAMPS = _ts(
    (2020, 1, 1), None, (1, 1, 1), (9999, 12, 31, 23, 59, 59, 999999), (1970, 1, 1),
    (2262, 4, 12), (2026, 11, 1, 10), None,
)  # fmt: skip
DATES = [date(2020, 1, 1), date(1, 1, 1), date(9999, 12, 31), date(1970, 1, 1)] * 2
DECIMALS = _d("0.10", "1.50", None, "0.09", "1.51", "-9999999999.99", "9999999999.99", "0.00")
DATA = {
    "string": STRINGS,
    "boolean": BOOLEANS,
    "int": INTS,
    "bigint": BIGINTS,
    "double": DOUBLES,
    "float": FLOATS,
    "timestamp": TIMESTAMPS,
    "date": DATES,
    DEC: DECIMALS,
}
OTHER_TYPE = {
    "string": "int",
    "boolean": "string",
    "int": "bigint",
    "bigint": "int",
    "double": "float",
    "float": "double",
    "timestamp": "date",
    "date": "timestamp",
    DEC: "double",
}
EMAIL = r"^[^@\s]+@[^@\s]+\.[a-z]+$"  # the demo's

# (declared type, the column's values, the expectation, whether it holds on them[, AUDIT]).
# The audit runs the hard kinds' cases marked AUDIT (a failing and a holding one of each, and
# those whose translation matters most): the kinds' evaluation is the validation's, and each
# case costs great-expectations' Spark engine a few queries.
AUDIT = "audit"
FLOAT_BELOW = ("float", FLOATS, {"expect": "between", "min": 0.7}, False, AUDIT)
BIGINT_ABOVE = ("bigint", BIGINTS, {"expect": "between", "min": 0, "max": 2**53 - 1}, False, AUDIT)
CASES = [
    ("string", STRINGS, {"expect": "not_null"}, False, AUDIT),
    ("double", [1.5, NAN, -0.0, INF, 0.0, -INF, 3.0, 2.0], {"expect": "not_null"}, True, AUDIT),
    ("timestamp", TIMESTAMPS, {"expect": "not_null"}, False),
    ("date", DATES, {"expect": "not_null"}, True),
    (DEC, DECIMALS, {"expect": "not_null"}, False),
    ("string", STRINGS, {"expect": "in_set", "values": [s for s in STRINGS if s]}, True, AUDIT),
    ("string", STRINGS, {"expect": "in_set", "values": ["abc", "ABC"]}, False, AUDIT),
    ("boolean", BOOLEANS, {"expect": "in_set", "values": [True]}, False),
    ("boolean", BOOLEANS, {"expect": "in_set", "values": [True, False]}, True),
    ("int", INTS, {"expect": "in_set", "values": [v for v in INTS if v is not None]}, True),
    ("int", INTS, {"expect": "in_set", "values": [0, 10, 12]}, False),
    (
        "bigint",
        BIGINTS,
        {"expect": "in_set", "values": [b for b in BIGINTS if b is not None]},
        True,
    ),
    ("bigint", BIGINTS, {"expect": "in_set", "values": [2**53, 0]}, False),  # not 2**53 + 1
    ("double", DOUBLES, {"expect": "in_set", "values": [1.5, 0.0, INF, -INF, 3.0]}, False),  # NaN
    ("double", [1.5, -0.0, None, 3.0], {"expect": "in_set", "values": [1.5, 0.0, 3]}, True),
    ("float", FLOATS, {"expect": "in_set", "values": [0.7, 0.1, 1.5, 3.4e38, 0, 1]}, False),  # NaN
    ("float", [0.7, 0.1, None, 1.0], {"expect": "in_set", "values": [0.7, 0.1, 1]}, True, AUDIT),
    (DEC, DECIMALS, {"expect": "in_set", "values": [0.1, 1.5, 0.09, 1.51, -1e10 + 0.01]}, False),
    (DEC, _d("0.10", "1.50", None, "0"), {"expect": "in_set", "values": [0.1, 1.5, 0]}, True),
    ("int", INTS, {"expect": "between", "min": 0}, False),
    ("int", INTS, {"expect": "between", "max": 10}, False),
    ("int", INTS, {"expect": "between", "min": -(2**31), "max": 2**31 - 1}, True),
    ("int", INTS, {"expect": "between", "min": -0.5, "max": 10.5}, False, AUDIT),
    ("bigint", BIGINTS, {"expect": "between", "min": 1 - 2**53}, False),
    BIGINT_ABOVE,  # 2**53 + 1, which Spark would round to 2**53
    ("double", DOUBLES, {"expect": "between", "min": 0}, False, AUDIT),  # NaN, -inf
    ("double", DOUBLES, {"expect": "between", "max": 3}, False),  # NaN, inf
    ("double", [1.5, -0.0, None, 0.0, 3.0], {"expect": "between", "min": 0, "max": 3}, True),
    FLOAT_BELOW,  # 0.7f < 0.7
    ("float", [0.75, 1.5, None, 3.4e38], {"expect": "between", "min": 0.7}, True),
    ("float", [0.7, 0.1, None], {"expect": "between", "max": 0.7}, True),  # 0.7f < 0.7
    (DEC, DECIMALS, {"expect": "between", "min": 0.1, "max": 1.5}, False),
    (
        DEC,
        _d("0.10", "1.50", None, "0.11"),
        {"expect": "between", "min": 0.1, "max": 1.5},
        True,
        AUDIT,
    ),
    (DEC, DECIMALS, {"expect": "between", "min": -9999999999.99}, True),
    (DEC, DECIMALS, {"expect": "between", "max": 0.095}, False),
    ("string", STRINGS, {"expect": "regex", "regex": "^[a-z]+$"}, False, AUDIT),
    (
        "string",
        ["abc", "a\n", None, "a\r", "a\r\n", "z\u2028"],
        {"expect": "regex", "regex": "^[a-z]+$"},
        True,
    ),  # fmt: skip
    ("string", STRINGS, {"expect": "regex", "regex": r"(?i)^\w+$"}, False),
    ("string", STRINGS, {"expect": "regex", "regex": r"\p{Alpha}"}, False),  # é
    ("string", STRINGS, {"expect": "regex", "regex": r"[\s\S]"}, True),
    ("string", STRINGS, {"expect": "regex", "regex": r"[^\x00-\x7f]|^\S+\Z"}, False),
    ("string", STRINGS, {"expect": "regex", "regex": r"a\z|(?<c>.)\k<c>"}, False),
    (
        "string",
        ["a@b.io", "a@b.io\n", None, "ä@b.io"],
        {"expect": "regex", "regex": EMAIL},
        True,
        AUDIT,
    ),
    (
        "string",
        ["a@b.io", "a@b.IO", None, "a@b.io\n\n"],
        {"expect": "regex", "regex": EMAIL},
        False,
    ),
    ("time", ["10:00:00", None], {"expect": "regex", "regex": r"^\d\d:\d\d:\d\d$"}, True),
    *[(t, DATA[t], {"expect": "type", "type": t}, True) for t in DATA],
    *[(t, DATA[t], {"expect": "type", "type": other}, False) for t, other in OTHER_TYPE.items()],
    (DEC, DECIMALS, {"expect": "type", "type": "decimal(5,1)"}, True),  # precision not judged
    ("binary", [b"x", None], {"expect": "type", "type": "binary"}, True),
    ("array<int>", [[1], None], {"expect": "type", "type": "array<bigint>"}, True),
]
PARTITIONS = [0, 0, 0, 0, 1, 1, 1, 1]
OFFSETS = [10, 11, 12, 13, 20, 21, 22, 23]
OPS = ["c", "u", "c", "c", "u", "c", "r", "d"]


def _column(n: int, case) -> str:
    return f"c{n}"


def _spec(*, hard: bool) -> TableSpec:
    return TableSpec.model_validate(
        {
            "name": "engines",
            "topic": "engines",
            "primary_key": ["id"],
            "start_hour": "2026-11-01-00:00",
            "columns": {"id": "bigint"} | {_column(n, c): c[0] for n, c in enumerate(CASES)},
            "expectations": [
                {"column": _column(n, case), **case[2], "hard": hard}
                for n, case in enumerate(CASES)
                if not hard or AUDIT in case
            ],
        }
    )


def _rows() -> pa.Table:
    """The rows as the decoder's Arrow columns hold them (a case's values padded with nulls)."""
    columns = {
        "id": pa.array(range(1, 9), pa.int64()),
        **{
            _column(n, c): pa.array(c[1] + [None] * (8 - len(c[1])), arrow_type(c[0]))
            for n, c in enumerate(CASES)
        },
        KAFKA_PARTITION: pa.array(PARTITIONS, pa.int32()),
        KAFKA_OFFSET: pa.array(OFFSETS, pa.int64()),
        OP: pa.array(OPS, pa.string()),
    }
    return pa.table(columns)


def _spark_rows(spark, table: pa.Table):
    """The same rows as a Spark DataFrame, typed as the decoder types them for Spark."""
    declared = {"id": "bigint"} | {_column(n, c): c[0] for n, c in enumerate(CASES)}
    schema = T.StructType(
        [T.StructField(name, spark_data_type(t)) for name, t in declared.items()]
        + [
            T.StructField(KAFKA_PARTITION, T.IntegerType()),
            T.StructField(KAFKA_OFFSET, T.LongType()),
            T.StructField(OP, T.StringType()),
        ]
    )
    return spark.createDataFrame([tuple(r.values()) for r in table.to_pylist()], schema)


def _judged(outcome) -> dict:
    """What a check result reports of an outcome: its verdict, counts and observed type."""
    assert outcome.failure is None, f"{outcome.expectation.name}: {outcome.failure}"
    return {"success": outcome.success, "observed_type": outcome.observed_type, **outcome.counts}


@pytest.fixture(scope="module")
def rows(spark):
    table = _rows()
    return table, _spark_rows(spark, table)


def _expected(spec: TableSpec) -> dict[str, bool]:
    by_column = {_column(n, c): c[3] for n, c in enumerate(CASES)}
    return {e.check_name: by_column[e.column] for e in spec.expectations}


def test_validation_judges_rows_in_memory_as_spark_does(spark, rows):
    table, frame = rows
    spec = _spec(hard=False)
    in_memory = validate_batch(spark, spec, "unused", None, table)
    in_spark = validate_batch(spark, spec, "unused", None, frame)

    pandas = {o.expectation.name: _judged(o) for o in in_memory}
    assert pandas == {o.expectation.name: _judged(o) for o in in_spark}
    assert {name: pandas[name]["success"] for name in _expected(spec)} == _expected(spec)
    assert pandas["c0_not_null"] | {"success": False} == {
        "success": False,
        "observed_type": None,
        "element_count": 8,
        "unexpected_count": 1,
        "unexpected_percent": 12.5,
    }
    types = {n: o["observed_type"] for n, o in pandas.items() if n.endswith("_type")}
    assert set(types.values()) == {
        "StringType", "BooleanType", "IntegerType", "LongType", "DoubleType", "FloatType",
        "TimestampType", "DateType", "DecimalType", "BinaryType", "ArrayType",
    }  # fmt: skip


def test_audit_holds_back_the_same_changes_from_rows_in_memory_as_from_spark(spark, rows):
    table, frame = rows
    spec = _spec(hard=True)
    in_memory = audit_changes(spark, spec, table)
    in_spark = audit_changes(spark, spec, frame)

    assert in_memory.failed == in_spark.failed and in_memory.reasons == in_spark.reasons
    pandas = {o.expectation.name: _judged(o) for o in in_memory.outcomes}
    assert pandas == {o.expectation.name: _judged(o) for o in in_spark.outcomes}
    assert {name: pandas[name]["success"] for name in _expected(spec)} == _expected(spec)
    assert all(o["element_count"] == 7 for o in pandas.values())  # the delete left out
    assert (1, 23) not in in_memory.failed  # it breaks rules, but a delete is never held back
    assert len(in_memory.failed) == sum(in_memory.reasons.values()) == 7
    below, above = (f"{_column(CASES.index(c), c)}_between" for c in (FLOAT_BELOW, BIGINT_ABOVE))
    assert in_memory.failed[(0, 10)] == f"expectation '{below}' failed"
    assert above in in_memory.failed[(1, 21)]


# --- queries: none for rows in memory, one for a declared unique ---------------------------


def _last_execution(spark) -> int:
    spark.sparkContext._jsc.sc().listenerBus().waitUntilEmpty()
    executions = spark._jsparkSession.sharedState().statusStore().executionsList()
    ids = [executions.apply(n).executionId() for n in range(executions.size())]
    return max(ids, default=-1)


def _root_executions_since(spark, last: int) -> int:
    """Spark SQL executions started after execution `last` that no other execution started."""
    spark.sparkContext._jsc.sc().listenerBus().waitUntilEmpty()
    executions = spark._jsparkSession.sharedState().statusStore().executionsList()
    found = [executions.apply(n) for n in range(executions.size())]
    return sum(
        1 for e in found if e.executionId() > last and e.executionId() == e.rootExecutionId()
    )


UNIQUE_SPEC = TableSpec.model_validate(
    {
        "name": "people",
        "topic": "people",
        "primary_key": ["id"],
        "start_hour": "2026-11-01-00:00",
        "columns": {"id": "bigint", "email": "string", "score": "double"},
        "expectations": [
            {"column": "email", "expect": "unique"},
            {"column": "score", "expect": "between", "min": 0},
        ],
    }
)
MIRROR = [  # (id, email, score, deleted): the mirror before the hour
    (1, "a@x", 1.0, False),  # below the hour's values' range
    (2, "b@x", 1.0, False),
    (3, "b@x", 1.0, True),  # a tombstone: not a live row
    (4, "ü@x", 1.0, False),
    (5, None, 1.0, False),
    (6, "c@x", NAN, False),
    (12, "ü@x", 2.0, False),
]
HOUR_ROWS = [(8, "ü@x", 2.0), (9, "b@x", NAN), (10, None, 3.0), (11, "new@x", 4.0)]
BASIC = {"result_format": "BASIC", "partial_unexpected_count": 0}


@pytest.fixture(scope="module")
def mirror(spark, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mirror") / "people")
    schema = f"id bigint, email string, score double, {DELETED} boolean"
    # The hour's rows are in the mirror too: the validation runs after the MERGE.
    hour = [(*r, False) for r in HOUR_ROWS]
    spark.createDataFrame(MIRROR + hour, schema).write.format("delta").save(path)
    table = pa.table(
        {
            "id": pa.array([r[0] for r in HOUR_ROWS], pa.int64()),
            "email": pa.array([r[1] for r in HOUR_ROWS], pa.string()),
            "score": pa.array([r[2] for r in HOUR_ROWS], pa.float64()),
        }
    )
    frame = spark.createDataFrame(HOUR_ROWS, "id bigint, email string, score double")
    return path, table, frame


def _great_expectations_on_colliding(spark, path, frame, e: Expectation):
    """great-expectations' own verdict on the live rows that share a value with the hour's."""
    live = spark.read.format("delta").load(path).where(~F.col(DELETED))
    values = frame.select(*e.columns).where(" and ".join(f"{c} is not null" for c in e.columns))
    values = values.distinct()
    colliding = live.join(values, list(e.columns), "left_semi")
    return _summarize(e, _validate(colliding, _gx_expectations(e), BASIC), "spark")


def test_rows_in_memory_run_no_spark_query(spark, rows, mirror):
    table, _ = rows
    path, hour, _ = mirror
    last = _last_execution(spark)
    audit_changes(spark, _spec(hard=True), table)
    validate_batch(spark, _spec(hard=False), "unused", None, table)
    validate_batch(spark, UNIQUE_SPEC, path, None, hour)  # no mirror: nothing to collide with
    assert _root_executions_since(spark, last) == 0


def test_a_declared_unique_is_one_query_of_the_mirror_counting_as_great_expectations(spark, mirror):
    path, table, frame = mirror
    last = _last_execution(spark)
    in_memory = {
        o.expectation.name: o
        for o in validate_batch(spark, UNIQUE_SPEC, path, 0, table, frame=frame)
    }
    assert _root_executions_since(spark, last) == 1
    unique = in_memory["email_unique"]
    last = _last_execution(spark)
    in_spark = _unique_among_live_rows(spark, unique.expectation, path, 0, frame, None)
    assert _root_executions_since(spark, last) == 1

    expected = _great_expectations_on_colliding(spark, path, frame, unique.expectation)
    assert _judged(unique) == _judged(in_spark) == _judged(expected)
    assert unique.counts | {"success": unique.success} == {
        "element_count": 6,  # b@x twice, ü@x three times, new@x
        "unexpected_count": 5,
        "missing_count": 0,
        "unexpected_percent": 83.3333,
        "success": False,
    }
    assert in_memory["score_between"].counts["unexpected_count"] == 1  # the NaN, by pandas


def test_a_compound_unique_counts_as_great_expectations_does(spark, mirror):
    path, table, frame = mirror
    pair = Expectation("pair_unique", "unique", ("email", "score"), {}, False, "WARN", False)
    outcome = _unique_among_live_rows(spark, pair, path, 0, table, frame)
    expected = _great_expectations_on_colliding(spark, path, frame, pair)
    counted = ("element_count", "unexpected_count")
    assert {k: outcome.counts[k] for k in counted} == {k: expected.counts[k] for k in counted}
    assert (outcome.success, outcome.counts["unexpected_count"]) == (expected.success, 2)


# --- the regex translation, against Java's own Pattern ------------------------------------

PATTERNS = [
    EMAIL, r"^SKU-[A-Z]{3}-[0-9]{4}$", r"^\w+$", r"\d", r"^\S+$", r"[^\w]", r"(?i)^[a-z]+$",
    r"(?i)é", r"(?i)\p{Lower}", r"a(?i)b|c", r"((?i)a)b", r"(?i)k", r"(?i)[^a]", r"(?i)(a)\1",
    r"a.c", r"(?s)a.c", r"^.$", r"^a$", r"a\Z", r"a\z", r"(?m)^a$", r"(?m)^", r"(?m)$", r"^$",
    r"\p{Alpha}+", r"\P{Alpha}", r"[\p{Punct}x]", r"\p{Space}", r"\p{XDigit}{2}", r"\h", r"\v",
    r"\R\n", r"[\h]", r"(?<y>\d{4})-\k<y>", r"(a)(b)(c)(d)(e)(f)(g)(h)(i)(j)\10", r"(a)\11",
    r"\Qa.b\E", r"x\Q*\E+", r"[\Q]\E]", r"\x41", r"\x{1F600}", r"\0101", r"\cA", r"\e",
    r"a{1,2}?", r"a++", r"(?>a+)b", r"[a-]", r"[]a]", r"[a-c-e]", r"[^]a]",
    r"(?<=a)b", r"(?<!a)b", "[😀-😂]", r"\#", r"\é",
]  # fmt: skip
SUBJECTS = [
    "", "a", "A", "abc", "aBc", "a\n", "a\r", "a\r\n", "a\u0085", "a\u2028", "\na", "a\nb",
    "a\rb", "a\n\n", "\r\n", "é", "É", "K", "k", "x y", "x\u00a0y", "\u000b", "١٢٣", "123",
    "_", "😀", "a😀", "SKU-ABC-1234", "SKU-ABC-1234\r", "SKU-ÄBC-1234", "a@b.com", "a@b.com\r",
    "ä@b.com", "a@b.COM", "aa", "abab", "2020-2020", "a.b", "x**", "]", "-", "&", "\x1b", "\x01",
    "\t", "\u3000", "abcdefghijj", "abcdefghija1", "#",
]  # fmt: skip


def test_translated_regexes_find_what_javas_pattern_finds(spark):
    pattern_class = spark._jvm.java.util.regex.Pattern
    differ = []
    for java in PATTERNS:
        python = re.compile(python_regex(java))
        compiled = pattern_class.compile(java)
        differ += [
            (java, s)
            for s in SUBJECTS
            if compiled.matcher(s).find() != (python.search(s) is not None)
        ]
    assert differ == []


@pytest.mark.parametrize("java", [r"\bx", r"\p{L}", r"[a[b]]", r"[a&&b]", r"(?U)\w", r"\G"])
def test_a_refused_regex_is_valid_java_with_no_python_equal(spark, java):
    spark._jvm.java.util.regex.Pattern.compile(java)
    with pytest.raises(UntranslatableRegex):
        python_regex(java)
