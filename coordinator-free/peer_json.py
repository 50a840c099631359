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
from typing import Any

from coordinator_free.errors import RefusalReason, Refused

__all__ = ["MAX_JSON_DEPTH", "json_depth", "loads_bounded"]

MAX_JSON_DEPTH = 32
"""The deepest nesting of arrays and objects a peer's JSON may have (ours uses <= 4)."""

_OPEN = frozenset(b"[{")
_CLOSE = frozenset(b"]}")
_QUOTE = ord('"')
_BACKSLASH = ord("\\")


def json_depth(data: bytes | str, limit: int = MAX_JSON_DEPTH) -> int:
    """The deepest nesting of ``data``'s arrays and objects, counting outside strings;
    it stops counting at ``limit + 1`` (a loop, no recursion, whatever the input)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == _BACKSLASH:
                escaped = True
            elif byte == _QUOTE:
                in_string = False
        elif byte == _QUOTE:
            in_string = True
        elif byte in _OPEN:
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif byte in _CLOSE:
            depth -= 1
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
