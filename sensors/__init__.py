"""Sensors: the offset-progress sensor of each mirror (offset_progress) launches every hour once
Kafka shows it closed, and the automation sensor (downstream) builds the downstream assets."""
