"""The declared column types, and the one table of what each is stored as in Spark and Arrow.

A table's config declares each column's type (`string`, `bigint`, `decimal(p,s)`,
`array<...>`, ...); the decoder fills Arrow columns of `arrow_type`, Spark reads them as
`spark_data_type`, and the mirror's DDL names `spark_type`. All three come from `_STORED`.
"""

from __future__ import annotations

import re

import pyarrow as pa
from pyspark.sql import types as T

# declared scalar type → (Spark SQL name, Spark type, Arrow type). Spark has no time of day: a
# `time` is stored as its ISO text.
_STORED: dict[str, tuple[str, T.DataType, pa.DataType]] = {
    "string": ("string", T.StringType(), pa.string()),
    "boolean": ("boolean", T.BooleanType(), pa.bool_()),
    "int": ("int", T.IntegerType(), pa.int32()),
    "bigint": ("bigint", T.LongType(), pa.int64()),
    "double": ("double", T.DoubleType(), pa.float64()),
    "float": ("float", T.FloatType(), pa.float32()),
    "timestamp": ("timestamp", T.TimestampType(), pa.timestamp("us", tz="UTC")),
    "date": ("date", T.DateType(), pa.date32()),
    "time": ("string", T.StringType(), pa.string()),
    "binary": ("binary", T.BinaryType(), pa.binary()),
}
SCALAR_TYPES = tuple(_STORED)

_DECIMAL_TYPE = re.compile(r"^decimal\((\d{1,2}),\s*(\d{1,2})\)$")
_ARRAY_TYPE = re.compile(r"^array<(.+)>$")


def is_valid_type(declared: str) -> bool:
    """A scalar type, decimal(p,s) with 1 <= p <= 38 and s <= p, or an array of either."""
    array = _ARRAY_TYPE.match(declared)
    if array:
        return is_valid_type(array[1]) and not array[1].startswith("array<")
    decimal = _DECIMAL_TYPE.match(declared)
    if decimal:
        return 1 <= int(decimal[1]) <= 38 and int(decimal[2]) <= int(decimal[1])
    return declared in _STORED


def array_item(declared: str) -> str | None:
    match = _ARRAY_TYPE.match(declared)
    return match[1] if match else None


def decimal_shape(declared: str) -> tuple[int, int] | None:
    match = _DECIMAL_TYPE.match(declared)
    return (int(match[1]), int(match[2])) if match else None


def spark_type(declared: str) -> str:
    """The Spark SQL type a declared column is stored as."""
    item = array_item(declared)
    if item is not None:
        return f"array<{spark_type(item)}>"
    return declared if decimal_shape(declared) else _STORED[declared][0]


def spark_data_type(declared: str) -> T.DataType:
    """The Spark type a declared column is stored as."""
    return _stored(declared, 1, T.ArrayType, T.DecimalType)


def arrow_type(declared: str) -> pa.DataType:
    """The Arrow type the decoder fills for a declared column."""
    return _stored(declared, 2, pa.list_, pa.decimal128)


def _stored(declared: str, system: int, array, decimal):
    """`declared`'s type in `_STORED`'s column `system`: an array of its item's, a decimal of
    its precision and scale, else the scalar's."""
    item = array_item(declared)
    if item is not None:
        return array(_stored(item, system, array, decimal))
    shape = decimal_shape(declared)
    return decimal(*shape) if shape else _STORED[declared][system]
