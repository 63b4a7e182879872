"""Sensors that watch Kafka offset progress and launch closed hours (issue 4; none yet).

Until they land, hours are materialized from the Dagster UI or `dg.materialize`.
"""
