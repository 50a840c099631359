"""The org's runtime: local trainer, strategies, run engine, audit, persistence, CLI.

It may import ``coordinator_free`` and ``secure_agg`` (the layers below it) and any
third-party library (torch included); never ``api``, the layer above it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    __version__: str

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    """``__version__``, read from the installed metadata on first use (importing
    ``importlib.metadata`` costs a client command of the CLI more than it runs)."""
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        value = version("fedweave")
    except PackageNotFoundError:  # running from a source tree without an install
        value = "0.0.0+unknown"
    globals()["__version__"] = value
    return value
