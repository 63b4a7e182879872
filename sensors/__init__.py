"""The offset-progress sensor: launches every mirror's hours once Kafka shows them closed."""
