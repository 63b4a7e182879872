"""The Dagster code location: every package put together (definitions.py)."""
