"""Asset checks: the pipeline's own invariants (and, later, great-expectations suites)."""
