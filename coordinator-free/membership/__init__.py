"""SWIM membership: failure detection and infection-style dissemination.

This module implements the protocol of Das, Gupta and Motivala, *SWIM: Scalable
Weakly-consistent Infection-style Process Group Membership Protocol* (DSN 2002),
with a few refinements from HashiCorp memberlist:

* **Failure detector (SWIM §3.1).** Every protocol period ``T'`` (``period_s``) a
  member pings one target. Without an ack within the target's ping timeout it asks
  ``indirect_k`` other members to ``ping-req`` the target; if none of them reports an
  ack by the end of the period, the target becomes SUSPECT.
* **Timeouts that follow the network** (:mod:`.timing`). The ping timeout of each
  peer follows its measured round trip (``srtt + 4 * rttvar`` as in TCP, at least
  twice ``srtt``, Karn's backoff after a missed ack, never below ``ping_timeout_s``
  nor above ``max_ping_timeout_s``); an ack that comes after the probe gave up is
  still measured. Lifeguard's local health multiplier (up to ``local_health_max``) grows when
  a probe fails with no helper to ask, when a ping-req helper does not answer at all
  and when this member must refute a suspicion, shrinks with each successful probe, and scales the period, the ping
  timeouts and the suspicion timeout. A slow link is thus not a dead peer.
* **Round-robin probe order (SWIM §4.3).** Targets are probed in a random
  permutation that is re-drawn at the end of every cycle, so each member is probed
  once per cycle and detection time is bounded, not only expected.
* **Suspicion (SWIM §4.2).** A SUSPECT member is declared DEAD when its suspicion
  times out (``suspicion_mult * max(1, log10 n) * period_s``, memberlist's rule, at
  least ``suspicion_mult`` measured ping timeouts of the suspect, times the health)
  unless it refutes first. Every member that hears of a suspicion runs its own timer.
  The suspect refutes by raising its incarnation number and spreading ``alive``.
* **Dissemination (SWIM §4.1).** Updates ride piggy-backed on ping, ack and
  ping-req payloads, at most ``piggyback_max`` per message, each one sent at most
  ``retransmit_mult * ceil(log10(n + 1))`` times (memberlist's retransmit limit),
  least-sent first.
* **Precedence.** An update ``(status, incarnation)`` replaces the current one when
  ``(incarnation, rank)`` is larger, with ranks ALIVE < SUSPECT < DEAD < LEFT. This
  is SWIM's rule set: a suspicion overrides ``alive`` of the same incarnation, only a
  higher incarnation overrides a suspicion, death or departure, and a confirmation
  of death at an incarnation is final for that incarnation.
* **Healing partitions and rejoining.** Every message carries the sender's own
  incarnation (signed by the envelope), and a message to a member we hold SUSPECT,
  DEAD or LEFT leads with that belief so the member can refute at once (a restarted
  member starts at incarnation 0 and so learns which incarnation to exceed). Every
  ``dead_probe_periods`` periods a member pings one random DEAD member, so two
  sides of a healed partition (or a restarted member) find each other again.

Members of the federation are fixed by the manifest (``update_members`` follows its
changes); this protocol only says which of them are up. Message kinds are
``swim.ping`` (reply: ack) and ``swim.ping_req`` (reply: the indirect probe's
outcome), in stage ``"swim"``. Payloads are canonical JSON; a payload that does not
decode is refused with ``RefusalReason.MALFORMED`` and counted, never a crash.

Threat model: peers are honest-but-curious (``docs/SECURITY.md``); a member's claims
about *other* members are trusted as in SWIM, while its claims about itself are
authenticated by the envelope signature.

Modules, each importing only those listed before it (besides asyncio and
``coordinator_free``'s errors, envelope, endpoint, checks and periodic loop; nothing of
``secure_agg``, of the round engine or of the layers above):

* :mod:`.timing`: the round-trip estimator and the local health (no other module).
* :mod:`.messages`: the kinds, statuses, updates and their precedence, the payloads.
* :mod:`.state`: events, member states, ``SwimConfig``, the piggy-back queue.
* :mod:`.swim`: ``Membership``, the protocol.
"""

from coordinator_free.membership.messages import (
    PING,
    PING_REQ,
    STAGE,
    MemberStatus,
    SwimMessage,
    Update,
    decode_message,
    encode_message,
)
from coordinator_free.membership.state import (
    EventKind,
    MembershipEvent,
    MemberState,
    SwimConfig,
)
from coordinator_free.membership.swim import Membership

__all__ = [
    "PING",
    "PING_REQ",
    "STAGE",
    "EventKind",
    "MemberState",
    "MemberStatus",
    "Membership",
    "MembershipEvent",
    "SwimConfig",
    "SwimMessage",
    "Update",
    "decode_message",
    "encode_message",
]
