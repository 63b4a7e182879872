"""The batch decoder's fast pass against its exact pass alone (`cdc_assets.batch_decode`).

Batches of records are drawn from parts that each stress one rule: good changes and deletes,
tombstones, values of the wrong JSON kind, out of range or with too many decimal places,
placeholders, absent and undeclared columns, keys naming another row, wrapped records under
two schemas, truncates, JSON the fast parser refuses (NaN, numbers past a double) or reads the
way the exact one does (duplicate keys). Each batch is decoded twice, with a fresh decoder each
time: column at a time, and record by record; the two Arrow batches, the tally and the source
shape included, must be equal. Pure Python: no Spark.
"""

from __future__ import annotations

import json
from decimal import Decimal

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_assets.config import TableSpec
from cdc_assets.decode import ERROR
from tests.cdc_assets.decoder_records import (
    assert_same,
    batch_of,
    debezium_record,
    decode_both,
    spec_for,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    decimal_handling=st.sampled_from(["string", "precise"]),
    records=st.data(),
    added=st.booleans(),
    raw=st.booleans(),
)
def test_the_fast_pass_gives_the_exact_passs_batch(decimal_handling, records, added, raw):
    spec = spec_for(decimal_handling)
    if raw:  # a hard expectation keeps every record's bytes
        hard = {"column": "n", "expect": "not_null", "hard": True}
        spec = TableSpec.model_validate({**spec.model_dump(), "expectations": [hard]})
    drawn = records.draw(st.lists(debezium_record(decimal_handling), min_size=0, max_size=40))
    plan = {"added_columns": {"extra": "bigint"}} if added else {}
    assert_same(*decode_both(spec, batch_of(drawn), **plan))


def test_a_batch_of_good_changes_takes_the_fast_pass_and_bad_ones_keep_their_reasons():
    spec = spec_for("string")
    good = {
        "id": 1,
        "n": 2,
        "amount": "12.30",
        "price": 1.5,
        "flag": True,
        "note": "x",
        "at": 5,
        "day": 3,
        "blob": None,
    }
    records = []
    for n in range(1, 101):
        row = {**good, "id": n}
        if n == 50:
            row["amount"] = "12.345"
        value = json.dumps(
            {"before": None, "after": row, "source": {"lsn": n, "ts_ms": 1}, "op": "u"}
        ).encode()
        records.append((b'{"id":%d}' % n, value, None))
    fast, exact = decode_both(spec, batch_of(records))
    assert_same(fast, exact)
    errors = fast.column(ERROR).to_pylist()
    assert errors.count(None) == 99
    assert "more than 2 decimal places" in errors[49]
    assert fast.column("amount").to_pylist()[0] == Decimal("12.30")
