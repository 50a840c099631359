"""Dataset paths confined to the configured roots, and their content hash.

The functions live in :mod:`org_node.datasets` (the node checks a bound dataset's hash
too); this module keeps the API's import path.
"""

from __future__ import annotations

from org_node.datasets import PathRefused, confine, content_hash

__all__ = ["PathRefused", "confine", "content_hash"]
