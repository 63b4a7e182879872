"""Debezium records → typed change rows; anything that can't be applied → an error reason.

What a record is, stated once (what the mirror then does with the changes is the CDC rule,
`cdc_assets/rule.py`):

- A record's value is a Debezium envelope, with or without the Kafka Connect `schema`/`payload`
  wrapper. `op` is `c` (insert), `r` (snapshot read), `u` (update), `d` (delete) or `t`
  (truncate). Each column value is read in the encoding the record's own Connect schema names,
  or, without a schema, the table's config (`values.py` states that rule).
- c/r/u carry the row in `after`. A column it lacks did not exist at the source when the change
  was written (the record's own Connect schema does not name it; without a schema, the JSON
  converter writes every column the row has): the change gives it the column's declared
  `default`, null when none (`absent_at_the_time`). A delete needs only its primary key and
  sequence: the key comes from `before`, or from the Kafka key when `before` lacks it
  (Postgres' default replica identity); its other `before` values are kept where they convert,
  null otherwise.
- A null value is a Kafka tombstone (log compaction's marker after a delete): counted, skipped.
- Each change carries its sequence (the table's `sequence` fields, then Kafka partition and
  offset), by which the CDC rule orders changes of one key (`cdc_assets/rule.py`: newest per
  key, newer wins, deletes). A `binlog` sequence field (MySQL's `source.file`) is read as the
  file's number, not its name.
- A record is an error, kept with its raw bytes and the reason, when: its value is not JSON,
  it is larger than the table's `max_record_bytes`, `op` is missing or unknown, the primary key
  or a sequence field is missing, the Kafka key names another primary key than the row, a change
  lacks a column its own schema names, or a value is not in its column's encoding or does not
  fit the declared type exactly. Reasons never quote record values. Errors never stop the run (I7).
- A truncate (`op` `t`) needs only its sequence; `hour_run` applies it or stops the run, as the
  table's `on_truncate` says. It is never silently dropped.
- Debezium's `__debezium_unavailable_value` (a TOASTed value the change does not carry because
  it did not change) is "no value" in a column listed under `toasted_columns`, an error in any
  other. A primary-key update moves the row: Debezium deletes the old key and creates the new
  one, naming the old key in the create's `__debezium.oldkey` header; the create is tagged
  with it (`MOVED_FROM`) so the MERGE can carry the unchanged TOASTed values over.

The decoder is plain Python over Arrow batches: Spark runs it in its Python workers
(`spark.decode`), and it is tested as a pure function on records a real connector wrote. Its
modules, each importing only those above it:

    types.py          declared types → their Spark and Arrow types (the one type table)
    values.py         a value's Debezium/Connect encoding and its exact converter
    envelope.py       the record's frame: Connect wrapper, op, sequence, source time, headers
    cells.py          one value of a change or a delete, the placeholder included
    column_values.py  a whole column converted at once, where its rule is a plain check
    shape.py          what the records told of the source's columns (`SourceShape`)
    plan.py           what the decoder needs of a table (`DecodePlan`), a schema's `RowPlan`
    tally.py          what a batch's records add up to (`Tally`, the key range)
    parts.py          the batch as read, and the decoded parts both passes return
    exact.py          the exact pass: one record at a time (`RecordDecoder`)
    fast.py           the fast pass: the common records a column at a time
    batch.py          a batch: the fast pass, then the exact pass on what it left out
    spark.py          the decoder in Spark (`decode`) or in the driver (`decode_locally`)

Both passes read values by `cells` and `column_values` (which converts a column only when the
result equals `values`' per-value rule), frames by `envelope`, and rows by one `RowPlan` per
schema; tests/cdc_assets/test_batch_decode.py draws records of every encoding and holds the two
passes to the same rows and reasons.
"""
