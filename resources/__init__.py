"""Dagster resources: the Kafka cluster, the Spark session, the lake's storage, the masking key."""

from resources.kafka import KafkaResource
from resources.lake import LakeResource
from resources.masking import MaskingResource
from resources.spark import SparkResource

__all__ = ["KafkaResource", "LakeResource", "MaskingResource", "SparkResource"]
