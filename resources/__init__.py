"""Dagster resources: the Kafka cluster, the Spark session and the lake's storage."""

from resources.kafka import KafkaResource
from resources.lake import LakeResource
from resources.spark import SparkResource

__all__ = ["KafkaResource", "LakeResource", "SparkResource"]
