"""The round engine's configuration: timing, thresholds, SecAgg+ and owner unmasking.

:class:`RoundConfig` holds what every node of a federation must set alike (the
thresholds, the graph, when owner unmasking starts) and what each may tune (the
timeouts); ``docs/ARCHITECTURE.md``, "A round", says where each field acts.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

__all__ = ["MASK_HELPERS", "RoundConfig", "StageHook", "patience"]

StageHook = Callable[[str, str, int, str], Awaitable[None]]
"""``hook(org_id, run, round, stage)``, awaited as each stage (and ring step) begins."""


MASK_HELPERS = ("auto", "process", "thread")
"""The values of :attr:`RoundConfig.mask_helper`."""


@dataclass(frozen=True)
class RoundConfig:
    """Timing and thresholds of the round engine.

    ready_timeout: seconds the ready stage waits when ``run_round`` gets no deadline.
    stage_timeout: seconds a stage waits for the other participants' messages.
    step_timeout: seconds one ring step waits for the predecessor's chunk.
    send_timeout: seconds one send waits for its reply.
    threshold: the Shamir threshold ``t``, the fewest survivors a round can finish
        with; ``None`` means a majority of the members, ``|U0| // 2 + 1`` (``t`` must
        exceed half the members for the "never both shares" argument of
        :class:`secure_agg.protocol.ProtocolConfig` to hold).
    min_participants: the fewest participants a round starts with (at least 2).
    max_view_attempts: how many times one view agreement is retried.
    max_reduce_attempts: how many times the ring runs, the first time included.
    lookahead_rounds: how many rounds ahead of its last one a node buffers messages.
    ring_min_chunk: vectors shorter than ``n * ring_min_chunk`` elements are summed
        along the ring as a chain (few messages) rather than chunked (see ``ring``).
    topology: ``"ring"``, or ``"star"`` (every masked vector through the first member
        of the ring order: the baseline the overlay benchmark compares against).
    owner_unmask_from: with at least this many members and a vector long enough to be
        cut in chunks (``n * ring_min_chunk`` elements), each member unmasks only the
        two chunks of the masked sum it holds after the reduce-scatter (its own and
        its predecessor's copy) and the ring's all-gather carries the unmasked sum:
        ``2 L`` of mask expansion per member instead of ``n L`` (every self mask over
        the whole vector), for one agreement token after the reduce-scatter (``2 n``
        small messages, ``n`` of them one after another). ``None``: every member
        unmasks the whole sum (the fewest messages one after another; see
        ``docs/ARCHITECTURE.md``, "A round").
    ready_relay_from: with at least this many members, the readies are not exchanged
        by one request per pair but signed once as records and relayed by recursive
        doubling over the round's ring order (``round.readies``,
        :mod:`~coordinator_free.rounds.ready_relay`): ``ceil(log2 n)`` requests per node
        instead of about ``(n - 1) / 2``, each carrying every record its sender holds;
        a member whose record did not come through is then asked directly. ``None``:
        always one request per pair.
    secagg_plus_above: with more members than this, the masked sum runs as SecAgg+
        (Bell et al., CCS'20, §3): each org sends ShareKeys to, masks with and has its
        secrets reconstructed by only its :meth:`neighbours_for` neighbours of the
        round's graph (:mod:`secure_agg.graph`), so the share stage costs ``O(n k)``
        messages instead of ``O(n^2)`` and masking and unmasking ``O(k)`` work per
        secret; ``None`` always uses the complete graph of Bonawitz et al.
    shares_ahead_from: with at least this many members, every ready advertises a key
        for a later round, and each org's shares ride with its next ready, sealed to
        the keys its holders advertised (:mod:`~coordinator_free.rounds.ahead`): the
        share exchange runs only for the pairs where that did not work (a first
        round, a restarted node), and the participants ``U1`` are agreed by the token,
        which a steady round leaves out (``ring_first``: the ring's completion
        settles ``U1``). The default, 3, seals ahead in every federation: a steady
        round then sends no share message and no message for ``U1`` (below it, the
        shares travel in the share exchange, whose view hashes settle ``U1``).
        ``None``: never. Every member of a federation must use the same setting.
    ring_first: where ``U1`` is agreed by the token, a node whose proposal
        holds every member masks with them and starts its ring at once, ``U1``
        pending (:mod:`~coordinator_free.rounds.early`): the ring's completion settles
        ``U1`` as every member, with no message; the node joins the token only when
        another member runs it or its ring breaks, and a smaller decision drops the
        ring (nothing was released from it) and runs it again over the decided set.
        ``False``: the node runs the token and its ring waits for the decision. Each
        member may choose its own (the early ring is the ring the others start after
        the decision).
    mask_helper: where this node expands the masks of the usual case
        (:mod:`~coordinator_free.rounds.mask_stream`): ``"process"``, in the helper
        process of its interpreter, streamed into the ring's first attempt;
        ``"thread"``, in a worker thread before the ring; ``"auto"`` (the default),
        the helper process on a machine with at least
        :data:`~coordinator_free.rounds.mask_stream.AUTO_MIN_CORES` cores. The sum is
        the same either way: each member may choose its own.
    prepared_masks_bytes: when a round of a run completes, this node expands the masks
        of its next round of the run (every member ready, each with the masking key
        its ready advertised: :mod:`~coordinator_free.rounds.prepared`) off its loop
        while the caller computes the next update, into one ring array of at most this
        many bytes (held until that round); the round adds its input to it instead of
        expanding the masks. ``None``: never. Each member may choose its own.
    """

    ready_timeout: float = 5.0
    stage_timeout: float = 10.0
    step_timeout: float = 10.0
    send_timeout: float = 10.0
    threshold: int | None = None
    min_participants: int = 2
    max_view_attempts: int = 3
    max_reduce_attempts: int = 3
    lookahead_rounds: int = 2
    ring_min_chunk: int = 1024
    topology: str = "ring"
    owner_unmask_from: int | None = 8
    secagg_plus_above: int | None = 32
    ready_relay_from: int | None = 32
    attempts_per_round: int | None = None
    max_open_rounds: int | None = None
    shares_ahead_from: int | None = 3
    ring_first: bool = True
    mask_helper: str = "auto"
    prepared_masks_bytes: int | None = 1 << 26

    def __post_init__(self) -> None:
        for name in (
            "ready_timeout",
            "stage_timeout",
            "step_timeout",
            "send_timeout",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"RoundConfig.{name} must be a positive number, got {value!r}")
        if self.threshold is not None and (
            not isinstance(self.threshold, int) or self.threshold < 2
        ):
            raise ValueError(f"RoundConfig.threshold must be None or >= 2, got {self.threshold!r}")
        if self.min_participants < 2:
            raise ValueError("RoundConfig.min_participants must be at least 2")
        for name in (
            "max_view_attempts",
            "max_reduce_attempts",
            "lookahead_rounds",
            "ring_min_chunk",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"RoundConfig.{name} must be at least 1")

        for name, low in (
            ("prepared_masks_bytes", 0),
            ("attempts_per_round", 1),
            ("max_open_rounds", 2),
            ("secagg_plus_above", 3),
            ("owner_unmask_from", 3),
            ("ready_relay_from", 3),
            ("shares_ahead_from", 3),
        ):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < low
            ):
                raise ValueError(
                    f"RoundConfig.{name} must be None or an int >= {low}, got {value!r}"
                )
        if not isinstance(self.ring_first, bool):
            raise ValueError(
                f"RoundConfig.ring_first must be true or false, got {self.ring_first!r}"
            )
        if self.mask_helper not in MASK_HELPERS:
            raise ValueError(
                "RoundConfig.mask_helper must be 'auto', 'process' or 'thread', got "
                f"{self.mask_helper!r}"
            )
        if self.topology not in ("ring", "star"):
            raise ValueError(
                f"RoundConfig.topology must be 'ring' or 'star', got {self.topology!r}"
            )

    def open_rounds_limit(self) -> int:
        """How many rounds one member may hold open here that this node does not run
        (see ``max_open_rounds``)."""
        if self.max_open_rounds is not None:
            return self.max_open_rounds
        return 2 * self.lookahead_rounds + 2

    def attempts_end(self, round: int) -> int:
        """The protocol round after the last attempt of ``round``'s training round
        (``round + 1`` when rounds are unrelated)."""
        a = self.attempts_per_round
        return round + 1 if a is None else (round // a + 1) * a

    def threshold_for(self, n_participants: int) -> int:
        """``t`` for a round with ``n_participants`` agreed participants."""
        return self.threshold if self.threshold is not None else n_participants // 2 + 1

    def neighbours_for(self, n_members: int) -> int | None:
        """SecAgg+'s ``k`` for ``n_members`` members, or ``None`` for the complete graph.

        ``k = ceil(3 log2 n)`` rounded up to even (an even ``k`` gives a ``k``-regular
        Harary graph for every ``n``). Bell et al., CCS'20, Thm. 3.6 / §3.2 show that
        ``k = O(log n)`` neighbours keep the round correct and private with
        overwhelming probability when a bounded fraction of the members drop out or
        are corrupt, because a random ``O(log n)``-regular graph stays connected after
        removing them and each org's secrets remain reconstructable by a majority of
        its neighbourhood; the constant 3 keeps ``k >= 16`` from about 40 members on.
        ``None`` at or below :attr:`secagg_plus_above` members (or when ``k`` would
        reach ``n - 1``: the graph would be complete anyway).
        """
        if self.secagg_plus_above is None or n_members <= self.secagg_plus_above:
            return None
        k = math.ceil(3 * math.log2(n_members))
        k += k % 2
        return k if k < n_members - 1 else None

    def share_threshold_for(self, n_members: int) -> int:
        """The Shamir threshold of each org's secrets: :meth:`threshold_for` with the
        complete graph; with SecAgg+ a majority of the closed neighbourhood,
        ``k // 2 + 1 > (k + 1) / 2``, so the "never both shares" argument of
        :class:`secure_agg.protocol.ProtocolConfig` holds within every neighbourhood."""
        k = self.neighbours_for(n_members)
        if k is None:
            return self.threshold_for(n_members)
        return k // 2 + 1

    def seals_ahead(self, n_members: int) -> bool:
        """Whether a round of ``n_members`` seals its shares ahead (``shares_ahead_from``)."""
        return self.shares_ahead_from is not None and n_members >= self.shares_ahead_from

    def relays_readies(self, n_members: int) -> bool:
        """Whether a round of ``n_members`` relays its readies (``ready_relay_from``)."""
        return self.ready_relay_from is not None and n_members >= self.ready_relay_from


def patience(config: RoundConfig) -> float:
    """How long a node waits for the messages its peers send first in a pairwise
    exchange before it sends its own to those still silent."""
    return min(config.send_timeout, config.stage_timeout) / 8
