"""JSON from peers, decoded only when its nesting is shallow: :func:`loads_bounded`.

Python's :func:`json.loads` recurses once per nested array or object, so a few
thousand ``[`` in a peer's payload raise :class:`RecursionError` out of a handler (an
answer of 500 rather than a refusal). Every payload a peer sends as JSON (SWIM,
checkpoint shards, shard-set headers, gossiped manifests, run proposals, audit heads)
goes through :func:`loads_bounded`, which measures the nesting with one flat pass
over the bytes first and refuses deeper documents as ``Refused(MALFORMED)`` without
decoding them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from coordinator_free.errors import RefusalReason, Refused

__all__ = ["MAX_JSON_DEPTH", "json_depth", "loads_bounded"]

MAX_JSON_DEPTH = 32
"""The deepest nesting of arrays and objects a peer's JSON may have (ours uses <= 4)."""

# a JSON string, escapes included (the unrolled loop: no backtracking state per byte)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_CHUNK = 1 << 20
_SMALL = 1 << 16
"""Up to this many brackets the depth is summed in Python (no numpy import: the CLI
reads manifests through here and must start fast); above it, a MiB at a time in numpy."""
_OPEN_SQUARE, _OPEN_CURLY = ord("["), ord("{")


def json_depth(data: bytes | str, limit: int = 1 << 62) -> int:
    """The deepest nesting of ``data``'s arrays and objects, strings left out; once it
    passes ``limit`` the count stops there (a value above ``limit``, not the depth).

    No recursion, whatever the input: the strings are cut out and the brackets kept
    (both in C), then the depth is a running sum over the brackets (a short loop for a
    small document, numpy a MiB at a time for a large one).
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if raw.count(b"[") + raw.count(b"{") == 0:
        return 0
    if b'"' in raw:
        raw = _STRING.sub(b"", raw)
    brackets = raw.translate(None, _NOT_BRACKETS)
    if len(brackets) <= _SMALL:
        return _small_depth(brackets, limit)
    import numpy as np  # on use only: large documents

    deepest = depth = 0
    for start in range(0, len(brackets), _CHUNK):
        codes = np.frombuffer(brackets, np.uint8, min(_CHUNK, len(brackets) - start), start)
        # only brackets are left: each one opens (+1) or closes (-1)
        steps = ((codes == _OPEN_SQUARE) | (codes == _OPEN_CURLY)).astype(np.int32) * 2 - 1
        running = np.cumsum(steps, dtype=np.int64)
        deepest = max(deepest, depth + int(running.max()))
        if deepest > limit:
            return deepest
        depth += int(running[-1])
    return deepest


def _small_depth(brackets: bytes, limit: int) -> int:
    deepest = depth = 0
    for code in brackets:  # only brackets are left: each one opens or closes
        depth += 1 if code in (_OPEN_SQUARE, _OPEN_CURLY) else -1
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                break
    return deepest


def loads_bounded(data: bytes | str, *, max_depth: int = MAX_JSON_DEPTH, what: str = "JSON") -> Any:
    """``json.loads(data)`` when ``data`` nests at most ``max_depth`` deep.

    Raises ``Refused(MALFORMED)`` naming ``what`` for deeper nesting, for bytes that
    are not UTF-8 and for text that is not JSON; never :class:`RecursionError`.
    """
    if json_depth(data, max_depth) > max_depth:
        raise Refused(RefusalReason.MALFORMED, f"{what} nests deeper than {max_depth} levels")
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Refused(RefusalReason.MALFORMED, f"{what} is not JSON: {exc}") from None
