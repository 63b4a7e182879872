"""The mirrors' hours run outside Dagster, on EMR (or spark-submit here), through Dagster Pipes:
the Pipes mirror asset and its launch resources, the partition job, and the code location."""
