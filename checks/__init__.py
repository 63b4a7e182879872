"""Asset checks: the pipeline's own invariants and the great-expectations suites."""
