"""Developer tooling: local services for development, the demo and the tests."""
