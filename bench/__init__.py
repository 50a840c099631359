"""Benchmarks, one module per subsystem: ``python -m bench.NAME [--quick] [--json PATH]``.

Each module measures fedweave against a baseline taken in the same run and reports
rows of ``{name, value, unit, baseline, ratio}`` through :mod:`bench.common`.
"""

__all__: list[str] = []
