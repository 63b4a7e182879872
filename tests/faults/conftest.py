"""The fault suite saves what its scenarios measured for the report command."""

from __future__ import annotations

from tests.faults import figures


def pytest_sessionfinish(session, exitstatus):
    figures.save()
