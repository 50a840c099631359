"""The suite's order: the long end-to-end tests first, the longest (by their declared
timeout) first among them, every other test after them in the usual order.

Under ``pytest -n`` (``make test``) the workers take their tests a few at a time, in this
order, so the long tests start while the short ones can still fill the other workers,
and no worker is left running a long test alone at the end."""

from __future__ import annotations

import pytest


def _order(item: pytest.Item) -> tuple[int, float]:
    if item.get_closest_marker("e2e") is None:
        return (1, 0.0)
    timeout = item.get_closest_marker("timeout")
    declared = float(timeout.args[0]) if timeout is not None and timeout.args else 0.0
    return (0, -declared)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_order)  # stable: each group keeps the collection's order


@pytest.fixture(autouse=True)
def _masks_in_threads_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """``RoundConfig.mask_helper = "auto"`` picks the helper process from four cores on:
    in this process the suite runs the same on any machine, with ``auto`` meaning worker
    threads; the helper's own tests ask for ``"process"`` by name."""
    from coordinator_free.rounds import mask_stream

    monkeypatch.setattr(mask_stream, "AUTO_MIN_CORES", 1 << 30)
