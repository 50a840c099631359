"""What one member knows of the others: events, states, the protocol's timing, and
the updates waiting to be piggy-backed.

:class:`SwimConfig` holds the periods, timeouts and dissemination limits (with
memberlist's rules for the suspicion timeout and the retransmit limit);
:class:`Member` is the mutable entry of the local view that :class:`MemberState`
snapshots; :class:`Broadcasts` is memberlist's transmit-limited queue.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from coordinator_free.membership.messages import MemberStatus, Update
from coordinator_free.membership.timing import RttEstimator
from coordinator_free.validate import check_integer, check_keys, check_number, field_error

__all__ = [
    "Broadcasts",
    "EventKind",
    "Member",
    "MemberState",
    "MembershipEvent",
    "SwimConfig",
]


class EventKind(StrEnum):
    """A change in one member's status, as seen by the local view."""

    JOIN = "join"  # added to the federation, or back from DEAD/LEFT
    ALIVE = "alive"  # a suspicion was refuted
    SUSPECT = "suspect"
    DEAD = "dead"
    LEAVE = "leave"  # left gracefully


@dataclass(frozen=True)
class MemberState:
    """One member in the local view.

    org_id: the member.
    status: ALIVE, SUSPECT, DEAD or LEFT.
    incarnation: the member's incarnation number the status refers to.
    last_seen: ``clock()`` time of the last message received from the member, or None.
    rtt: the member's smoothed round-trip time in seconds (from the acks of direct
        pings, :class:`~coordinator_free.membership.timing.RttEstimator`), or None.
    since: ``clock()`` time of the last status change.
    """

    org_id: str
    status: MemberStatus
    incarnation: int
    last_seen: float | None
    rtt: float | None
    since: float


@dataclass(frozen=True)
class MembershipEvent:
    """A status change delivered to subscribers (``Membership.subscribe``)."""

    kind: EventKind
    org_id: str
    incarnation: int
    at: float


_bad = field_error(ValueError)
_mistyped = field_error(TypeError)


@dataclass(frozen=True)
class SwimConfig:
    """Timing and dissemination parameters of the SWIM protocol.

    period_s: the protocol period T' (SWIM §3.1); one probe per period, scaled by the
        local health multiplier.
    ping_timeout_s: the floor of a direct ping's wait for its ack; at most
        ``period_s / 2`` so the indirect probes fit in the rest of the period. The wait
        actually used follows the peer's measured round trip (``srtt + 4 * rttvar``, at
        least ``2 * srtt``), doubled after each missed ack, times the local health
        multiplier, never below this floor nor above ``max_ping_timeout_s``.
    max_ping_timeout_s: the cap of every ping's adaptive wait.
    local_health_max: Lifeguard's largest local health multiplier (1 turns it off).
    indirect_k: how many members are asked to ping-req a target that missed its ack.
    suspicion_mult: suspicion timeout, in periods, per ``max(1, log10 n)``; never
        shorter than ``suspicion_mult`` measured ping timeouts of the suspect, scaled by
        the local health multiplier.
    retransmit_mult: each update is piggy-backed at most
        ``retransmit_mult * ceil(log10(n + 1))`` times by each member (lambda log n).
    piggyback_max: most updates carried by one message.
    dead_probe_periods: every that many periods, one random DEAD member is pinged so
        healed partitions and restarted members converge; 0 disables it.
    """

    period_s: float = 1.0
    ping_timeout_s: float = 0.3
    max_ping_timeout_s: float = 5.0
    local_health_max: int = 8
    indirect_k: int = 3
    suspicion_mult: float = 4.0
    retransmit_mult: int = 4
    piggyback_max: int = 8
    dead_probe_periods: int = 3

    def __post_init__(self) -> None:
        for name in ("period_s", "ping_timeout_s", "max_ping_timeout_s", "suspicion_mult"):
            check_number(f"SwimConfig.{name}", getattr(self, name), _bad, type_error=_mistyped)
        for name, low in (
            ("indirect_k", 0),
            ("retransmit_mult", 1),
            ("piggyback_max", 1),
            ("dead_probe_periods", 0),
            ("local_health_max", 1),
        ):
            check_integer(
                f"SwimConfig.{name}", getattr(self, name), _bad, low=low, type_error=_mistyped
            )
        if self.ping_timeout_s * 2 > self.period_s:
            raise ValueError(
                f"SwimConfig.ping_timeout_s ({self.ping_timeout_s}) must be at most half of "
                f"period_s ({self.period_s}) so that indirect probes fit in the period"
            )
        if self.max_ping_timeout_s < self.ping_timeout_s:
            raise ValueError(
                f"SwimConfig.max_ping_timeout_s ({self.max_ping_timeout_s}) must be at least "
                f"ping_timeout_s ({self.ping_timeout_s})"
            )

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> SwimConfig:
        """Build a config from a mapping, refusing unknown keys."""
        return cls(**check_keys(cls, values, "SwimConfig", _bad))

    def suspicion_timeout(self, n: int) -> float:
        """Seconds a suspicion lasts before the member is declared DEAD, for n members."""
        return self.suspicion_mult * max(1.0, math.log10(max(n, 1))) * self.period_s

    def max_suspicion_timeout(self, n: int) -> float:
        """The longest a suspicion can last for n members: the suspect's ping timeout at
        its cap and this member's local health at its worst."""
        longest = max(self.suspicion_timeout(n), self.suspicion_mult * self.max_ping_timeout_s)
        return longest * self.local_health_max

    def retransmit_limit(self, n: int) -> int:
        """How many times each member piggy-backs one update, for n members."""
        return self.retransmit_mult * max(1, math.ceil(math.log10(n + 1)))


@dataclass
class Member:
    """Another member in the local view, as the protocol updates it (see
    :class:`MemberState`; ``rtt``: the estimator of its round trip and ping timeout;
    ``suspect_deadline``: when a suspicion turns into DEAD)."""

    status: MemberStatus
    incarnation: int
    since: float
    rtt: RttEstimator
    last_seen: float | None = None
    suspect_deadline: float | None = None


class Broadcasts:
    """Updates waiting to be piggy-backed, least-transmitted first (memberlist's
    TransmitLimitedQueue). A newer update about a member replaces the older one."""

    def __init__(self) -> None:
        self._items: dict[str, list[Any]] = {}  # org -> [Update, transmits]

    def __len__(self) -> int:
        return len(self._items)

    def put(self, update: Update) -> None:
        self._items[update.org_id] = [update, 0]

    def take(self, max_n: int, limit: int) -> list[Update]:
        if not self._items:
            return []
        chosen = sorted(self._items.values(), key=lambda item: item[1])[:max_n]
        out: list[Update] = []
        for item in chosen:
            update: Update = item[0]
            out.append(update)
            item[1] += 1
            if item[1] >= limit:
                del self._items[update.org_id]
        return out
