"""What SWIM members say to each other: statuses, updates and their precedence, payloads.

Message kinds ``swim.ping`` (reply: an ack) and ``swim.ping_req`` (reply: the indirect
probe's outcome), in stage ``"swim"``. An :class:`Update` claims a member's status at an
incarnation; :meth:`Update.supersedes` is SWIM's precedence rule. Payloads are
canonical JSON (:func:`encode_message`); :func:`decode_message` refuses anything
unexpected with ``RefusalReason.MALFORMED``, never a crash.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.peer_json import loads_bounded

__all__ = [
    "PING",
    "PING_REQ",
    "STAGE",
    "MemberStatus",
    "SwimMessage",
    "Update",
    "decode_message",
    "encode_message",
]

PING = "swim.ping"
PING_REQ = "swim.ping_req"
STAGE = "swim"


class MemberStatus(StrEnum):
    """What a member's view says about another member (SWIM §4.2)."""

    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


_RANK: dict[MemberStatus, int] = {
    MemberStatus.ALIVE: 0,
    MemberStatus.SUSPECT: 1,
    MemberStatus.DEAD: 2,
    MemberStatus.LEFT: 3,
}
_BY_RANK: dict[int, MemberStatus] = {rank: status for status, rank in _RANK.items()}


@dataclass(frozen=True)
class Update:
    """A disseminated claim: ``org_id`` has ``status`` at ``incarnation``."""

    org_id: str
    status: MemberStatus
    incarnation: int

    def supersedes(self, status: MemberStatus, incarnation: int) -> bool:
        """SWIM's precedence rules as one lexicographic comparison (package docstring)."""
        return (self.incarnation, _RANK[self.status]) > (incarnation, _RANK[status])


@dataclass(frozen=True)
class SwimMessage:
    """A decoded SWIM payload.

    incarnation: the sender's own incarnation (it is alive at least at this one).
    updates: piggy-backed updates.
    target: the member to probe (``swim.ping_req`` only).
    ok: whether the indirect probe got an ack (``swim.ping_req`` replies only).
    """

    incarnation: int
    updates: tuple[Update, ...]
    target: str | None = None
    ok: bool | None = None


def encode_message(
    incarnation: int,
    updates: Iterable[Update],
    *,
    target: str | None = None,
    ok: bool | None = None,
) -> bytes:
    """Canonical JSON payload of a SWIM message (see :func:`decode_message`)."""
    body: dict[str, Any] = {
        "i": incarnation,
        "u": [[u.org_id, _RANK[u.status], u.incarnation] for u in updates],
    }
    if target is not None:
        body["t"] = target
    if ok is not None:
        body["ok"] = ok
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def _is_uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63


def decode_message(payload: bytes, *, max_updates: int = 1024) -> SwimMessage:
    """Decode a SWIM payload; raise ``Refused(MALFORMED)`` on anything unexpected.

    Payload: canonical JSON ``{"i": incarnation, "u": [[org, rank, incarnation], ...],
    "t": target?, "ok": outcome?}`` with ranks 0 alive, 1 suspect, 2 dead, 3 left.
    """
    body = loads_bounded(payload, what="SWIM payload")
    if not isinstance(body, dict) or not set(body) <= {"i", "u", "t", "ok"}:
        raise Refused(RefusalReason.MALFORMED, "SWIM payload has unexpected fields")
    incarnation, raw_updates = body.get("i"), body.get("u")
    if not _is_uint(incarnation) or not isinstance(raw_updates, list):
        raise Refused(RefusalReason.MALFORMED, "SWIM payload lacks incarnation or updates")
    if len(raw_updates) > max_updates:
        raise Refused(RefusalReason.MALFORMED, "too many SWIM updates")
    updates: list[Update] = []
    for item in raw_updates:
        if (
            not isinstance(item, list)
            or len(item) != 3
            or not isinstance(item[0], str)
            or item[1] not in _BY_RANK
            or isinstance(item[1], bool)
            or not _is_uint(item[2])
        ):
            raise Refused(RefusalReason.MALFORMED, "bad SWIM update")
        updates.append(Update(item[0], _BY_RANK[item[1]], item[2]))
    target, ok = body.get("t"), body.get("ok")
    if target is not None and not isinstance(target, str):
        raise Refused(RefusalReason.MALFORMED, "bad ping-req target")
    if ok is not None and not isinstance(ok, bool):
        raise Refused(RefusalReason.MALFORMED, "bad ping-req outcome")
    assert isinstance(incarnation, int)
    return SwimMessage(incarnation, tuple(updates), target, ok)
