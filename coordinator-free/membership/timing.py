"""Timeouts that follow the network: per-peer round-trip estimates and local health.

A slow link is not a dead peer. Two mechanisms keep SWIM from mistaking one for the
other:

* :class:`RttEstimator` measures each peer's round trip from its acks, the way TCP
  does (Jacobson and Karels, *Congestion Avoidance and Control*, 1988; RFC 6298): a
  smoothed RTT ``srtt`` and its mean deviation ``rttvar``, updated with gains 1/8 and
  1/4, give a retransmission timeout ``srtt + 4 * rttvar``. On a steady link
  ``rttvar`` shrinks towards nothing and any jitter would then miss the timeout (why
  TCP keeps a minimum RTO), so the deviation counted is at least a quarter of ``srtt``:
  the timeout is at least twice the smoothed round trip. Before the first sample the
  timeout is 1 s (RFC 6298's initial value: no accusation before a measurement). The
  ping timeout for the peer is that, never below the configured floor and never above
  the configured cap.
  An ack that never came doubles the timeout for the next ping (Karn's backoff, up to
  the cap) until a new sample resets it, so a peer whose link got slower is measured
  again instead of being suspected round after round.
* :class:`LocalHealth` is Lifeguard's local health multiplier (Dadgar, Phillips and
  Currey, *Lifeguard: Local Health Awareness for More Accurate Failure Detection*,
  2018; memberlist's ``awareness``): a score in ``[0, max - 1]`` that grows when a
  probe of this member fails with no helper to ask, for each ping-req helper that does
  not answer at all (Lifeguard's missed nacks; a helper's nack vouches for us) and when
  it must refute a suspicion about itself, and shrinks with every successful direct
  probe. Probe timeouts, the protocol period and suspicion timeouts are multiplied by
  ``score + 1``: a member that is itself slow (a loaded CPU, a stalled loop) gives
  others longer before it accuses them.

Both are plain state machines without clocks: the caller hands in measured seconds,
so they are tested deterministically.
"""

from __future__ import annotations

import math

__all__ = ["INITIAL_TIMEOUT_S", "LocalHealth", "RttEstimator"]

_ALPHA = 1 / 8  # gain of the smoothed RTT (RFC 6298)
_BETA = 1 / 4  # gain of the RTT variation (RFC 6298)
_K = 4  # deviations added to the smoothed RTT for the timeout
_MIN_DEVIATION = 1 / 4  # of srtt: the timeout is at least 2 * srtt

INITIAL_TIMEOUT_S = 1.0
"""The timeout before any round trip was measured (RFC 6298), within floor and cap."""


class RttEstimator:
    """One peer's smoothed round-trip time and the ping timeout derived from it.

    floor_s: the smallest timeout handed out (the configured ping timeout).
    cap_s: the largest timeout handed out, backoff included.
    initial_s: the timeout before the first sample.
    """

    def __init__(self, floor_s: float, cap_s: float, initial_s: float = INITIAL_TIMEOUT_S) -> None:
        if not (math.isfinite(floor_s) and math.isfinite(cap_s)) or not 0 < floor_s <= cap_s:
            raise ValueError(f"need 0 < floor ({floor_s}) <= cap ({cap_s})")
        self.floor_s = floor_s
        self.cap_s = cap_s
        self.initial_s = min(max(initial_s, floor_s), cap_s)
        self.srtt: float | None = None
        """Smoothed round-trip time in seconds; None before the first sample."""
        self.rttvar: float = 0.0
        """Smoothed mean deviation of the round-trip time, in seconds."""
        self.samples = 0
        self._backoff = 1.0

    def sample(self, rtt_s: float) -> None:
        """Take in one measured round trip (seconds; negative or non-finite ignored)."""
        if not math.isfinite(rtt_s) or rtt_s < 0:
            return
        if self.srtt is None:
            self.srtt, self.rttvar = rtt_s, rtt_s / 2
        else:
            self.rttvar = (1 - _BETA) * self.rttvar + _BETA * abs(self.srtt - rtt_s)
            self.srtt = (1 - _ALPHA) * self.srtt + _ALPHA * rtt_s
        self.samples += 1
        self._backoff = 1.0

    def missed(self) -> None:
        """An ack did not come in time: double the next timeout (up to the cap)."""
        self._backoff = min(self._backoff * 2, self.cap_s / self.floor_s)

    @property
    def measured(self) -> float | None:
        """``max(floor, srtt + 4 * max(rttvar, srtt / 4))``, capped, without backoff;
        None before the first sample."""
        if self.srtt is None:
            return None
        deviation = max(self.rttvar, _MIN_DEVIATION * self.srtt)
        return min(max(self.floor_s, self.srtt + _K * deviation), self.cap_s)

    @property
    def rto(self) -> float:
        """The timeout of the next ping: :attr:`measured` (``initial_s`` before any
        sample) times the backoff, capped."""
        measured = self.measured
        base = self.initial_s if measured is None else measured
        return min(base * self._backoff, self.cap_s)


class LocalHealth:
    """Lifeguard's local health: a score in ``[0, max_multiplier - 1]``.

    ``multiplier`` (``score + 1``) scales this member's probe timeouts, protocol period
    and suspicion timeouts; ``max_multiplier = 1`` turns the mechanism off.
    """

    def __init__(self, max_multiplier: int) -> None:
        if max_multiplier < 1:
            raise ValueError(f"max_multiplier must be at least 1, not {max_multiplier}")
        self.max_multiplier = max_multiplier
        self.score = 0

    def apply(self, delta: int) -> None:
        """Add ``delta`` (positive: a sign of trouble here; negative: a success)."""
        self.score = min(max(self.score + delta, 0), self.max_multiplier - 1)

    @property
    def multiplier(self) -> int:
        return self.score + 1

    def scale(self, seconds: float) -> float:
        """``seconds`` times the multiplier."""
        return seconds * self.multiplier
