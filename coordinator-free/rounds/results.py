"""What a round gives back: its result, its progress, its observations and its errors.

:class:`RoundResult` is what a completed round hands the org node;
:class:`RoundObservation` is what the engine reports as it goes (stage times,
arrivals, refusals, dropouts), for metrics, logs and fault localization;
:class:`RoundProgress` is what a running round waits for now. A round that cannot
complete raises :class:`RoundFailed`; a next model that differs between participants
raises :class:`ModelHashMismatch`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
from coordinator_free.errors import CoordinatorFreeError
from coordinator_free.ring import RingStats

__all__ = [
    "OBSERVATION_KINDS",
    "Counters",
    "ModelHashMismatch",
    "RoundFailed",
    "RoundObservation",
    "RoundObserver",
    "RoundProgress",
    "RoundResult",
]

OBSERVATION_KINDS = frozenset(
    {
        "round",  # this node's round started (seconds 0) at ``stage`` "ready"
        "stage",  # this node finished ``stage`` after ``seconds``, sending ``bytes``
        "arrival",  # ``peer``'s message of ``stage`` arrived ``seconds`` into this node's round
        "missing",  # ``peer``'s message of ``stage`` had not arrived when the stage ended
        "unreachable",  # a send to ``peer`` failed (``detail``: the transport error)
        "refused",  # this node refused ``peer``'s message of ``stage`` (``detail``: why)
        "stale",  # a late message (round closed) or a second copy: normal under retries
        "mismatch",  # ``peer`` disagreed on a hash (member list, model) at ``stage``
        "suspect",  # the ring of ``stage`` broke and ``peer`` was blamed
        "left",  # ``peer`` said it left the round
        "retry",  # ``stage`` was tried again (``peer``: the peer re-sent to, if one)
        "link",  # the ring from predecessor ``peer`` carried ``bytes`` in ``seconds``
        "dropped",  # ``peer`` is not among the round's survivors
        "completed",  # the round completed after ``seconds``, this node sending ``bytes``
        "failed",  # the round failed at ``stage`` (``detail``: the reason)
    }
)


@dataclass(frozen=True)
class RoundObservation:
    """One thing this node's round engine saw, for metrics, logs and fault localization.

    ``kind`` is one of :data:`OBSERVATION_KINDS`; ``peer`` is the other org the
    observation is about (empty for this node's own stages); ``seconds`` and ``bytes``
    are the measured quantities the kind defines; ``detail`` is readable text.
    """

    kind: str
    run: str
    round: int
    stage: str
    peer: str = ""
    seconds: float = 0.0
    bytes: int = 0
    detail: str = ""


MASKS_PREPARED = "masks prepared"
"""The ``detail`` of a ``completed`` observation whose round took masks prepared
before it (:mod:`~coordinator_free.rounds.prepared`)."""

RoundObserver = Callable[[RoundObservation], None]
"""Called synchronously on the engine's loop with each :class:`RoundObservation`; an
observer that raises is logged and never affects the round."""


class RoundFailed(CoordinatorFreeError):
    """The round could not complete; ``stage`` is where, ``reason`` says why;
    ``missing``: the members this node waited for in vain, when it knows them."""

    def __init__(self, stage: str, reason: str, missing: tuple[str, ...] = ()) -> None:
        super().__init__(f"round failed at {stage}: {reason}")
        self.stage = stage
        self.reason = reason
        self.missing = missing


class ModelHashMismatch(CoordinatorFreeError):
    """Some participants hold a different next model than this node: stop the run."""

    def __init__(self, run: str, round: int, mine: bytes, differing: Mapping[str, bytes]) -> None:
        names = ", ".join(f"{o}={d.hex()[:12]}" for o, d in sorted(differing.items()))
        super().__init__(
            f"model hash mismatch after {run!r} round {round}: mine {mine.hex()[:12]}, {names}"
        )
        self.run = run
        self.round = round
        self.mine = mine
        self.differing = dict(differing)


@dataclass(frozen=True)
class RoundProgress:
    """What a running round of ``run`` is doing now (:meth:`RoundEngine.progress`):
    its protocol ``round``, its ``stage`` (``ready``, ``share``, ``agree-ready``,
    ``mask``, ``reduce``, ``agree-reduce``, ``unmask``, ``gather``, ``done``), since
    when (clock time), and the members whose message of that stage it still waits for
    (empty while it computes, or where the stage waits on no one in particular)."""

    run: str
    round: int
    stage: str
    since: float
    waiting_for: tuple[str, ...]


@dataclass(frozen=True)
class RoundResult:
    """What one completed round gives the org node.

    sum: the unmasked sum of the survivors' inputs, as the session returns it.
    participants: the agreed participants ``U1``, in ring order.
    survivors: the orgs whose inputs are in ``sum`` (``U3``), in ring order.
    dropped: participants whose inputs are not in ``sum`` (their mask keys rebuilt from
        their shares), sorted. A member left out of the participants after the ring
        started (``RoundConfig.ring_first``) is no participant: it is only observed as
        ``dropped``.
    threshold: the ``t`` the round ran with.
    bytes_sent: payload bytes this node's engine sent (envelopes not counted).
    messages_sent: messages this node's engine sent.
    ring_bytes_sent: payload bytes of ring chunks among ``bytes_sent``.
    ring_attempts: how many times the ring ran (a ring started with ``U1`` pending
        and dropped for a smaller decision counted).
    stage_times: seconds spent in each stage.
    neighbours: SecAgg+'s ``k`` the round ran with; ``None``: the complete graph.
    masks_prepared: whether this node's masks were expanded before the round
        (:mod:`~coordinator_free.rounds.prepared`) and the round took them.
    """

    run: str
    round: int
    sum: np.ndarray
    participants: tuple[str, ...]
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    threshold: int
    bytes_sent: int
    messages_sent: int
    ring_bytes_sent: int
    ring_attempts: int
    stage_times: dict[str, float]
    neighbours: int | None = None
    masks_prepared: bool = False


@dataclass
class Counters:
    """What this node's engine sent in one round, the ring's chunks apart."""

    bytes_sent: int = 0
    messages_sent: int = 0
    ring: RingStats = field(default_factory=RingStats)

    def sent(self) -> int:
        """Payload bytes sent, the ring's included."""
        return self.bytes_sent + self.ring.bytes_sent
