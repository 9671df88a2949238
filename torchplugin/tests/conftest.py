"""Checks the suite's own markers at collection."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """torch_independent takes the reason, one line: a test runs on fewer
    torch versions (ci/torch-suite.sh) only with the reason beside it."""
    for item in items:
        for mark in item.iter_markers("torch_independent"):
            reason = mark.args[0] if len(mark.args) == 1 and not mark.kwargs else None
            if not isinstance(reason, str) or not reason.strip() or "\n" in reason:
                raise pytest.UsageError(
                    f"{item.nodeid}: torch_independent needs one argument, the one-line reason "
                    f"(got args={mark.args!r}, kwargs={mark.kwargs!r})"
                )
