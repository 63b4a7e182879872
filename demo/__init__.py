"""The demo shop: an in-memory source database that emits Debezium change events into Kafka.

`demo.source` simulates the database and its Debezium connector (including the connector's
bad habits: duplicates, late timestamps, malformed records), `demo.produce` writes the events
to a real broker, and `demo.reference` is an independent replay that says what each mirror
table must contain.
"""
