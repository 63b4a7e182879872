"""The demo shop: a real Postgres database captured by Debezium (`demo.shop`), and generated
Debezium events for the tests (`demo.source`, written to Kafka by `demo.produce`) with the
independent replay that says what each mirror table must contain (`demo.reference`).
"""
