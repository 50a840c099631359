"""The leaderless round engine: agree on a round, run the masked sum, reduce along a ring.

Every org node runs one :class:`RoundEngine`. There is no coordinator: each stage is a
signed exchange among the participants, and every decision that must be shared (who
takes part, who dropped) is made by **view agreement**: each node sends the others its
view (the sorted set, a flag and their SHA-256, inside its Ed25519-signed envelope);
when every view it receives equals its own, the set is settled; otherwise it retries
with the intersection of the views it got, up to ``max_view_attempts`` times, and a
view that still differs fails the round — a split view is retried, never silently
summed. A node that settled answers later views of the same stage with its settled
one, so a peer that heard less can converge. That exchange costs ``n (n - 1)``
messages per attempt; where every node runs the agreement (the outcome of a ring
that broke, and ``U1`` under SecAgg+) it first runs as a **token** instead: passed
once along the ring of a set every node shares, it collects each member's proposal and returns to
its starter, which decides the intersection for all and sends it with the proposals
to every member, ``2 n`` messages (:meth:`RoundEngine._token_agree`); a token that
stalls falls back to the exchange above. A round of :meth:`RoundEngine.run_round`
(``docs/ARCHITECTURE.md``, "A round", steps 1, 3-5; Bonawitz et al., CCS'17, §4):

1. **ready** — the node exchanges with every member a signed ``round.ready`` carrying
   the hash of the member list ``U0`` and its ``AdvertiseKeys`` (§4 round 0), retrying
   peers it cannot reach, and collects the others' until the ready deadline (or until
   all answered). Like the share and release exchanges below, it costs **one request
   per pair**: a hash of the pair (:func:`_initiator`) says which of the two sends, and
   the reply carries the other's own message; a member that had none yet when the
   request came sends it once it has (:meth:`RoundEngine._targets`), and one that
   sends two different messages of an exchange is left out of the receiver's view.
2. **share keys** — to every org it saw ready, the Shamir shares of its self-mask
   seed and mask key, encrypted to the holder (§4 round 1), each message prefixed by
   the hash of the sender's ready view. When every share arrives with this node's own
   view hash, the participants ``U1`` are settled at no extra message; otherwise the
   node runs the view agreement on ``U1``. The orgs whose shares it holds form ``U2``.
3. **mask, reduce** — the node masks its input (§4 round 2); the masked vectors are
   summed along the ring ordered by ``SHA-256(round || org_id)`` with
   :class:`~coordinator_free.ring.RingReducer` (chunked reduce-scatter + all-gather,
   or a chain for short vectors; the ring's id binds its members, so rings built
   from different views never mix). A node whose ring **completed** holds the masked
   sum of every member of the attempt, and that sum settles the attempt for all: it
   moves on to the unmask at once, with no message, keeps a copy of the masked sum,
   and answers any token or probe of the attempt's agreement with ``completed``.
   A node whose ring **broke** (a member died, stalled or sent garbage) runs the
   agreement on ``(members, completed)``, by the token (each member proposes the
   members less those it blames; a member that completed adds its proposal, which
   decides) or when the token stalls by the view agreement (where a view flagged
   completed decides the same way). When the outcome is completed, it takes the
   masked sum from a member that holds it (``round.total``, piece by piece) and
   unmasks like the others; when no member completed, the ring runs again over the
   agreed survivors' masked vectors, which each still holds. So a fault-free ring
   costs no agreement message at all, and a death late in the all-gather costs one
   fetch instead of a second ring. Privacy does not rest on this agreement: releases
   are once per round per node and ``t`` exceeds half the members (step 4).
   **Owner unmasking** (from ``RoundConfig.owner_unmask_from`` members on, when the
   vector is cut in chunks): the ring stops after the reduce-scatter and one more
   step that copies each member's complete chunk to its successor
   (:meth:`~coordinator_free.ring.RingReducer.reduce_scatter`); the members agree by
   the token (tag ``scatter:N``) that every reduce-scatter and copy completed (the
   AND of the flags; otherwise the ring runs again over the intersection), release
   as in step 4, and each unmasks only the two chunks it holds (``2 L`` of mask
   expansion instead of ``n L``); the all-gather then carries the unmasked sum
   (``agg.sum``). A member whose all-gather broke (a death after the agreement)
   takes each chunk it lacks from its owner, else from the successor that holds its
   copy (``round.part``), so one death loses nothing; two neighbours on the ring
   dying after the agreement lose a chunk and fail the round with that reason.
4. **unmask** — with owner unmasking, when nobody dropped since ``U1`` (``U3 =
   U1``) and at least ``t`` members settled the survivors on one token decision (its
   starter's ``round.permit``, :meth:`RoundEngine._permitted`), each survivor reveals
   its own self-mask seed, checked against the commitment of its ``AdvertiseKeys``,
   and the seeds spread by recursive doubling (``round.seed``,
   :meth:`RoundEngine._spread_seeds`): ``n ceil(log2 n)`` messages in all and no
   reconstruction. Otherwise, or when a seed does not arrive (its owner died), for
   the agreed survivors ``U3`` each node releases the self-mask shares of survivors
   and the mask-key shares of the dropped (§4 round 4), once per round, so one honest
   node never releases both kinds of share for one org; every node removes the masks
   from the same sum as soon as it holds ``t`` releases, and keeps its release after
   the round for a survivor that still needs it. Every survivor ends with the same
   sum. Fewer than ``t`` orgs at any stage fail the round
   with :class:`RoundFailed`, its stage and a reason; a node whose round fails tells
   the others (``round.leave``) so that none waits out a timeout for it.

The cost per node is about ``(n - 1) / 2`` small signed requests (and as many
replies) for each of the ready and share stages (the pairwise shares of Bonawitz et
al. make ``O(n)`` inherent), ``ceil(log2 n)`` for the seeds (or ``(n - 1) / 2`` for
the releases), plus about
``2 (n - 1) / n`` times the vector along the ring. Above
``RoundConfig.secagg_plus_above`` members the masked sum runs as SecAgg+ (Bell et
al., CCS'20, §3): ShareKeys go to the ``k = O(log n)`` graph neighbours only, each
node masks with ``k`` pairwise seeds and reconstructs each secret from ``k // 2 + 1``
neighbourhood shares, so the share stage costs ``O(k)`` messages per node and the
cryptography ``O(n k)`` instead of ``O(n^2)``; ``U1`` is then always settled by the
view agreement (matching hashes from the neighbours alone prove nothing about the
rest; the token, which carries every member's proposal, does), and the sum stays exact: every survivor's pairwise masks cancel or are
removed from its neighbours' reconstructed keys. After the strategy steps,
:meth:`RoundEngine.check_model_hash` sends the digest of the next model to the
participants and raises :class:`ModelHashMismatch` when any differs, stopping the run
loudly.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import logging
import math
import struct
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Set
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from coordinator_free.endpoint import Endpoint, Handler
from coordinator_free.errors import (
    CoordinatorFreeError,
    PeerUnreachable,
    RefusalReason,
    Refused,
    TransportError,
)
from coordinator_free.identity import verify_signature
from coordinator_free.ring import (
    LIVENESS_POLL_S,
    RingBroken,
    RingReducer,
    RingStats,
    Scattered,
    ring_order,
)
from coordinator_free.wire import Envelope

from secure_agg.codec import FixedPointCodec
from secure_agg.errors import SecAggError
from secure_agg.keys import RoundContext
from secure_agg.messages import AdvertiseKeys, Message, ShareKeys, UnmaskShares
from secure_agg.protocol import ProtocolConfig, SecAggPeer

__all__ = [
    "KIND_COMMIT",
    "KIND_LEAVE",
    "KIND_MODEL",
    "KIND_PART",
    "KIND_PERMIT",
    "KIND_READY",
    "KIND_SEED",
    "KIND_SHARE",
    "KIND_TOTAL",
    "KIND_UNMASK",
    "KIND_VIEW",
    "OBSERVATION_KINDS",
    "MaskedSum",
    "ModelHashMismatch",
    "RoundConfig",
    "RoundEngine",
    "RoundFailed",
    "RoundObservation",
    "RoundObserver",
    "RoundProgress",
    "RoundResult",
    "SecAggSession",
    "SessionContext",
    "SessionFactory",
    "StageHook",
    "View",
    "endpoint_signer",
    "secagg_sessions",
    "view_hash",
]

logger = logging.getLogger(__name__)

KIND_READY = "round.ready"
KIND_VIEW = "round.view"
KIND_SHARE = "round.share"
KIND_UNMASK = "round.unmask"
KIND_COMMIT = "round.commit"
KIND_LEAVE = "round.leave"
KIND_MODEL = "round.model"
KIND_TOTAL = "round.total"
KIND_PART = "round.part"
KIND_SEED = "round.seed"
KIND_PERMIT = "round.permit"

_HASH = 32
# the reply of a member whose ring attempt completed to a token or probe of that
# attempt's agreement: it holds the masked sum, which settles the attempt for all
_COMPLETED = b"completed"
# the reply of a member to the token's decision when it settles on it (it had not given
# up on the token): the starter counts these before it permits revealing seeds
_SETTLED = b"settled"
# the largest piece of a masked sum one ``round.total`` reply carries
_TOTAL_PIECE_BYTES = 8 << 20
_TOTAL_REQUEST = struct.Struct(">IQQ")
# attempt, chunk index, [lo, hi) of the elements wanted (within that chunk)
_PART_REQUEST = struct.Struct(">IIQQ")
# one revealed self-mask seed: the owner's index among the sorted survivors, the seed
_SEED_ENTRY = struct.Struct(">H32s")


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


RoundObserver = Callable[[RoundObservation], None]
"""Called synchronously on the engine's loop with each :class:`RoundObservation`; an
observer that raises is logged and never affects the round."""


class RoundFailed(CoordinatorFreeError):
    """The round could not complete; ``stage`` is where, ``reason`` says why."""

    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(f"round failed at {stage}: {reason}")
        self.stage = stage
        self.reason = reason


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
    secagg_plus_above: with more members than this, the masked sum runs as SecAgg+
        (Bell et al., CCS'20, §3): each org sends ShareKeys to, masks with and has its
        secrets reconstructed by only its :meth:`neighbours_for` neighbours of the
        round's graph (:mod:`secure_agg.graph`), so the share stage costs ``O(n k)``
        messages instead of ``O(n^2)`` and masking and unmasking ``O(k)`` work per
        secret; ``None`` always uses the complete graph of Bonawitz et al.
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

        if self.secagg_plus_above is not None and (
            isinstance(self.secagg_plus_above, bool)
            or not isinstance(self.secagg_plus_above, int)
            or self.secagg_plus_above < 3
        ):
            raise ValueError(
                "RoundConfig.secagg_plus_above must be None or an int >= 3, "
                f"got {self.secagg_plus_above!r}"
            )
        if self.owner_unmask_from is not None and (
            isinstance(self.owner_unmask_from, bool)
            or not isinstance(self.owner_unmask_from, int)
            or self.owner_unmask_from < 3
        ):
            raise ValueError(
                "RoundConfig.owner_unmask_from must be None or an int >= 3, "
                f"got {self.owner_unmask_from!r}"
            )
        if self.topology not in ("ring", "star"):
            raise ValueError(
                f"RoundConfig.topology must be 'ring' or 'star', got {self.topology!r}"
            )

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
    dropped: participants whose inputs are not in ``sum``, sorted.
    threshold: the ``t`` the round ran with.
    bytes_sent: payload bytes this node's engine sent (envelopes not counted).
    messages_sent: messages this node's engine sent.
    ring_bytes_sent: payload bytes of ring chunks among ``bytes_sent``.
    ring_attempts: how many times the ring ran.
    stage_times: seconds spent in each stage.
    neighbours: SecAgg+'s ``k`` the round ran with; ``None``: the complete graph.
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


@dataclass(frozen=True)
class SessionContext:
    """What a masked-sum session is built from.

    participants: ``U0``, every org invited to the round, sorted (the same on every
    node: the federation's members); threshold: ``t`` of each org's Shamir sharing;
    vector: this org's input; neighbours: SecAgg+'s ``k`` (``None``: complete graph).
    """

    federation: str
    run: str
    round: int
    org_id: str
    participants: tuple[str, ...]
    threshold: int
    vector: np.ndarray
    neighbours: int | None = None


class MaskedSum(Protocol):
    """One org's side of a masked-sum protocol for one round.

    The engine calls the methods in this order and moves their bytes over the
    network; ``receive_*`` raise :class:`~secure_agg.errors.SecAggError` or
    ``ValueError`` on a message they refuse and leave the session as it was, so the
    engine leaves that sender out of its view. The engine hands ``receive_*`` only
    the payload of an envelope whose Ed25519 signature the transport verified, with
    the envelope's sender as ``sender``. :class:`SecAggSession` adapts
    :class:`secure_agg.protocol.SecAggPeer` to it.
    """

    def advertise(self) -> bytes:
        """This org's public keys for the round (carried by ``round.ready``)."""
        ...

    def receive_advert(self, sender: str, data: bytes) -> None:
        """Take another participant's advertisement."""
        ...

    def share_keys(self, participants: frozenset[str]) -> Mapping[str, bytes]:
        """Given this node's view of the ready orgs, the share message for each one that
        holds this org's shares (every other one, or only its SecAgg+ neighbours)."""
        ...

    def receive_share(self, sender: str, data: bytes) -> None:
        """Take the share message another participant sent this org."""
        ...

    def masked_input(self) -> np.ndarray:
        """This org's masked input (a ring array)."""
        ...

    def unmask(self, survivors: frozenset[str]) -> bytes:
        """The shares this org releases, given the agreed survivors ``U3``."""
        ...

    def receive_release(self, sender: str, data: bytes) -> None:
        """Take the shares another survivor released."""
        ...

    def self_seed(self) -> bytes:
        """After :meth:`unmask` with a survivor set that holds this org: its own
        self-mask seed, which it reveals to the other survivors instead of having its
        holders release shares of it (see :meth:`secure_agg.protocol.SecAggPeer.self_seed`)."""
        ...

    def receive_seed(self, owner: str, seed: bytes) -> bool:
        """Take a survivor's revealed self-mask seed, from whoever relayed it (it is
        checked against the owner's commitment); ``False`` when already held."""
        ...

    def can_finish(self) -> bool:
        """Whether the seeds and releases taken so far suffice for :meth:`unmasked_sum`."""
        ...

    def unmasked_sum(self, masked_sum: np.ndarray) -> np.ndarray:
        """The sum of the survivors' inputs, in a new array, from the ring's sum of
        masked inputs, which it leaves as it is (the engine keeps it, see
        ``RoundEngine._keep_total``)."""
        ...

    def unmask_part(self, masked_part: np.ndarray, offset: int) -> np.ndarray:
        """Elements ``[offset, offset + len(masked_part))`` of the sum, still a ring
        array (see :meth:`decode`), from that part of the masked sum; once
        :meth:`can_finish`, as often as the engine needs (one call per chunk it holds)."""
        ...

    def decode(self, total: np.ndarray) -> np.ndarray:
        """The sum as :meth:`unmasked_sum` returns it, from the ring array that the
        parts of :meth:`unmask_part` make up."""
        ...


SessionFactory = Callable[[SessionContext], MaskedSum]
SignFn = Callable[[bytes], bytes]
VerifyFn = Callable[[str, bytes, bytes], bool]
RandomBytes = Callable[[int], bytes]


class SecAggSession:
    """:class:`MaskedSum` over :class:`secure_agg.protocol.SecAggPeer` (Bonawitz §4).

    The peer's stage machine does the cryptography and refuses anything out of order
    or malformed; this adapter only decodes messages and closes each stage when the
    engine has agreed on it. A float input is encoded with ``codec`` (clip, scale,
    stochastic rounding; ``codec.max_summands`` must cover the participants) and the
    sum decoded back; a ring input (``uint32`` / ``uint64``) is summed as it is.

    A message whose signer (``msg.sender``) is not the envelope's sender is refused;
    one that is has been authenticated by the envelope's signature over these very
    bytes, so the peer does not verify the message's own signature a second time
    (``authenticated=True``): one Ed25519 verification per message instead of two.
    """

    def __init__(
        self,
        ctx: SessionContext,
        sign: SignFn,
        verify: VerifyFn,
        *,
        codec: FixedPointCodec | None = None,
        rng: RandomBytes | None = None,
        encode_rng: np.random.Generator | None = None,
    ) -> None:
        x = np.asarray(ctx.vector)
        self.codec: FixedPointCodec | None = None
        if np.issubdtype(x.dtype, np.floating):
            if codec is None:
                raise ValueError("a float input needs a FixedPointCodec to enter the ring")
            if codec.max_summands < len(ctx.participants):
                raise ValueError(
                    f"codec.max_summands={codec.max_summands} is below the "
                    f"{len(ctx.participants)} participants: the sum could wrap"
                )
            self.codec = codec
            x = codec.encode(x, encode_rng if encode_rng is not None else np.random.default_rng())
            bits = codec.bits
        elif x.dtype == np.dtype(np.uint32) or x.dtype == np.dtype(np.uint64):
            bits = x.dtype.itemsize * 8
        else:
            raise ValueError(f"inputs are float arrays or ring arrays, not {x.dtype}")
        config = ProtocolConfig(
            ctx=RoundContext(ctx.federation, ctx.run, ctx.round),
            participants=ctx.participants,
            threshold=ctx.threshold,
            vector_length=int(x.shape[0]),
            bits=bits,
            neighbours=ctx.neighbours,
        )
        self._x = x
        self.peer = SecAggPeer(config, ctx.org_id, sign, verify, rng=rng)

    @staticmethod
    def _decode(kind: type[Message], sender: str, data: bytes) -> Message:
        msg = kind.from_bytes(data)
        if msg.sender != sender:
            raise ValueError(f"a {kind.__name__} signed as {msg.sender!r} came from {sender!r}")
        return msg

    def advertise(self) -> bytes:
        return self.peer.advertise_keys().to_bytes()

    def receive_advert(self, sender: str, data: bytes) -> None:
        msg = self._decode(AdvertiseKeys, sender, data)
        assert isinstance(msg, AdvertiseKeys)
        self.peer.receive_advertise(msg, authenticated=True)

    def share_keys(self, participants: frozenset[str]) -> Mapping[str, bytes]:
        self.peer.close_advertise()
        return {o: m.to_bytes() for o, m in self.peer.share_keys().items() if o in participants}

    def receive_share(self, sender: str, data: bytes) -> None:
        msg = self._decode(ShareKeys, sender, data)
        assert isinstance(msg, ShareKeys)
        self.peer.receive_shares(msg, authenticated=True)

    def masked_input(self) -> np.ndarray:
        self.peer.close_shares()
        if self.codec is not None:  # the encoded vector is this session's own: mask in place
            return self.peer.masked_input(self._x, out=self._x)
        return self.peer.masked_input(self._x)

    def unmask(self, survivors: frozenset[str]) -> bytes:
        return self.peer.unmask(survivors).to_bytes()

    def receive_release(self, sender: str, data: bytes) -> None:
        msg = self._decode(UnmaskShares, sender, data)
        assert isinstance(msg, UnmaskShares)
        self.peer.receive_unmask(msg, authenticated=True)

    def self_seed(self) -> bytes:
        return self.peer.self_seed()

    def receive_seed(self, owner: str, seed: bytes) -> bool:
        return self.peer.receive_seed(owner, seed)

    def can_finish(self) -> bool:
        return not self.peer.missing_shares()

    def unmasked_sum(self, masked_sum: np.ndarray) -> np.ndarray:
        return self.decode(self.peer.finalize(masked_sum))

    def unmask_part(self, masked_part: np.ndarray, offset: int) -> np.ndarray:
        return self.peer.finalize_part(masked_part, offset)

    def decode(self, total: np.ndarray) -> np.ndarray:
        return self.codec.decode(total) if self.codec is not None else total


def endpoint_signer(endpoint: Endpoint) -> tuple[SignFn, VerifyFn]:
    """Sign with the endpoint's org identity; verify against the federation's member keys."""

    def verify(sender: str, data: bytes, signature: bytes) -> bool:
        key = endpoint.guard.members().get(sender)
        return key is not None and verify_signature(key, data, signature)

    return endpoint.identity.sign, verify


def secagg_sessions(
    sign: SignFn,
    verify: VerifyFn,
    *,
    codec: FixedPointCodec | None = None,
    seed: int | None = None,
) -> SessionFactory:
    """A :data:`SessionFactory` of :class:`SecAggSession`.

    ``seed`` makes every key, mask seed, Shamir coefficient and rounding draw a
    deterministic function of ``(seed, org, round)``; for test vectors and the
    simulator only, never in a deployment.
    """

    def factory(ctx: SessionContext) -> MaskedSum:
        rng: RandomBytes | None = None
        encode_rng: np.random.Generator | None = None
        if seed is not None:
            material = hashlib.sha256(
                f"{seed}\x00{ctx.run}\x00{ctx.round}\x00{ctx.org_id}".encode()
            ).digest()
            gen = np.random.default_rng(list(material))
            encode_rng = np.random.default_rng(list(material[::-1]))

            def rng(k: int) -> bytes:
                return gen.bytes(k)

        return SecAggSession(ctx, sign, verify, codec=codec, rng=rng, encode_rng=encode_rng)

    return factory


StageHook = Callable[[str, str, int, str], Awaitable[None]]
"""``hook(org_id, run, round, stage)``, awaited as each stage (and ring step) begins."""


@dataclass(frozen=True)
class View:
    """One node's proposal for a set agreed in a stage: the members and a flag."""

    tag: str
    attempt: int
    members: frozenset[str]
    flag: bool = True

    def digest(self) -> bytes:
        return view_hash(self.tag, self.members, self.flag)

    def to_bytes(self) -> bytes:
        tag = self.tag.encode("utf-8")
        parts = [
            struct.pack(">H", len(tag)),
            tag,
            struct.pack(">IBI", self.attempt, self.flag, len(self.members)),
        ]
        for org in sorted(self.members):
            raw = org.encode("utf-8")
            parts += [struct.pack(">H", len(raw)), raw]
        parts.append(self.digest())
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> View:
        """Decode a view; ``ValueError`` on anything but a canonical encoding."""
        try:
            pos = 0
            (n,) = struct.unpack_from(">H", data, pos)
            pos += 2
            tag = data[pos : pos + n].decode("utf-8")
            pos += n
            attempt, flag, count = struct.unpack_from(">IBI", data, pos)
            pos += 9
            if flag > 1 or count > len(data):
                raise ValueError("bad flag or count")
            members: list[str] = []
            for _ in range(count):
                (n,) = struct.unpack_from(">H", data, pos)
                pos += 2
                members.append(data[pos : pos + n].decode("utf-8"))
                pos += n
            digest = data[pos:]
        except (struct.error, UnicodeDecodeError) as exc:
            raise ValueError(f"malformed view: {exc}") from None
        if members != sorted(set(members)):
            raise ValueError("view members must be sorted and distinct")
        view = cls(tag, attempt, frozenset(members), bool(flag))
        if digest != view.digest():
            raise ValueError("view digest does not match its members")
        return view


@functools.lru_cache(maxsize=1024)
def _decode_view(data: bytes) -> View:
    """:meth:`View.from_bytes`, remembered: in an agreement every node receives nearly
    the same view from each of ``n`` peers, and decoding one (parsing and hashing its
    ``n`` members) costs ``O(n)``, so without this an attempt costs ``O(n^3)`` CPU in
    all. A :class:`View` is immutable; a malformed view raises and is not remembered."""
    return View.from_bytes(data)


_TOKEN_PROBE = 0
_TOKEN_COLLECT = 1
_TOKEN_DECIDE = 2


@dataclass(frozen=True)
class _Token:
    """The agreement token of one stage (see :meth:`RoundEngine._token_agree`).

    ``phase``: 0 asks whether the receiver runs the round (no entries), 1 collects
    the proposals along the ring, 2 carries the starter's decision (the collected
    proposals) to every member that proposed. ``base`` is the hash of the ring the token travels (the set every node
    agrees from); ``starter`` the member that started it; ``entries`` each member's
    ``(org, proposal, flag)`` in ring order. The member sets are written once each, as
    most members propose the same set.
    """

    phase: int
    tag: str
    base: bytes
    starter: str
    entries: tuple[tuple[str, frozenset[str], bool], ...] = ()

    def decision(self) -> tuple[frozenset[str], bool]:
        """The intersection of the proposals (of members that made one) and the AND of
        the flags: the same on every node that holds the same token. For a ring
        attempt's outcome (``reduce:N``) a member whose ring completed (flag set)
        decides alone: its proposal, completed (see :func:`_decisive`)."""
        if _decisive(self.tag):
            for _, proposal, flag in self.entries:
                if flag:
                    return proposal, True
        members = frozenset(org for org, _, _ in self.entries)
        ok = True
        for _, proposal, flag in self.entries:
            members &= proposal
            ok = ok and flag
        return members, ok

    def to_bytes(self) -> bytes:
        def text(value: str) -> bytes:
            raw = value.encode("utf-8")
            return struct.pack(">H", len(raw)) + raw

        sets: dict[frozenset[str], int] = {}
        for _, proposal, _ in self.entries:
            sets.setdefault(proposal, len(sets))
        parts = [struct.pack(">B", self.phase), text(self.tag), self.base, text(self.starter)]
        parts.append(struct.pack(">H", len(sets)))
        for members in sets:
            parts.append(struct.pack(">H", len(members)))
            parts.extend(text(o) for o in sorted(members))
        parts.append(struct.pack(">H", len(self.entries)))
        for org, proposal, flag in self.entries:
            parts += [text(org), struct.pack(">HB", sets[proposal], flag)]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> _Token:
        """Decode a token; ``ValueError`` on anything malformed."""
        pos = 0

        def take(fmt: str) -> tuple[int, ...]:
            nonlocal pos
            values = struct.unpack_from(fmt, data, pos)
            pos += struct.calcsize(fmt)
            return values

        def text() -> str:
            nonlocal pos
            (n,) = take(">H")
            raw = data[pos : pos + n]
            if len(raw) != n:
                raise ValueError("truncated")
            pos += n
            return raw.decode("utf-8")

        try:
            (phase,) = take(">B")
            tag = text()
            base = data[pos : pos + _HASH]
            pos += _HASH
            starter = text()
            sets: list[frozenset[str]] = []
            for _ in range(take(">H")[0]):
                sets.append(frozenset(text() for _ in range(take(">H")[0])))
            entries = []
            seen: set[str] = set()
            for _ in range(take(">H")[0]):
                org = text()
                index, flag = take(">HB")
                if org in seen or index >= len(sets) or flag > 1:
                    raise ValueError("a repeated member, an unknown set or a bad flag")
                seen.add(org)
                entries.append((org, sets[index], bool(flag)))
        except (struct.error, UnicodeDecodeError) as exc:
            raise ValueError(f"malformed token: {exc}") from None
        if phase not in (_TOKEN_PROBE, _TOKEN_COLLECT, _TOKEN_DECIDE) or len(base) != _HASH:
            raise ValueError("unknown token phase or short base hash")
        if pos != len(data):
            raise ValueError("trailing bytes after the token")
        return cls(phase, tag, base, starter, tuple(entries))


def _patience(config: RoundConfig) -> float:
    """How long a node waits for the messages its peers send first in a pairwise
    exchange before it sends its own to those still silent."""
    return min(config.send_timeout, config.stage_timeout) / 8


def _decisive(tag: str) -> bool:
    """Whether one flagged proposal decides the agreement of ``tag`` on its own.

    So it is for the outcome of a ring attempt (``reduce:N``): the flag says the
    proposer's ring completed, so it holds the masked sum of every member of the
    attempt, and that sum is the attempt's outcome for all: a member whose ring broke
    takes the sum from one that completed (``round.total``) rather than having the
    ring run again. A member whose ring completed therefore settles at once, with no
    message, and releases its shares for the attempt's members.
    """
    return tag.startswith("reduce:")


def view_hash(tag: str, members: Iterable[str], flag: bool = True) -> bytes:
    """SHA-256 over a stage tag, the sorted member set and a flag (the signed view hash)."""
    h = hashlib.sha256(b"fedweave/view\x00")
    for part in (tag, *sorted(members)):
        raw = part.encode("utf-8")
        h.update(struct.pack(">H", len(raw)) + raw)
    h.update(b"\x01" if flag else b"\x00")
    return h.digest()


_EMPTY: dict[str, bytes] = {}


class _Inbox:
    """Messages of one round by key and sender; first message per (key, sender) wins."""

    def __init__(self) -> None:
        self._items: dict[tuple[str, ...], dict[str, bytes]] = {}
        self._events: dict[tuple[str, ...], asyncio.Event] = {}
        # what the round waits for now: an inbox key and whose message under it
        self.awaiting: tuple[tuple[str, ...], frozenset[str]] | None = None

    def missing(self) -> tuple[str, ...]:
        """The senders the current wait still expects (sorted); () when none."""
        if self.awaiting is None:
            return ()
        key, wanted = self.awaiting
        return tuple(sorted(wanted - self.senders(key)))

    def put(self, key: tuple[str, ...], sender: str, payload: bytes) -> bool:
        box = self._items.setdefault(key, {})
        if sender in box:
            return False
        box[sender] = payload
        self._events.setdefault(key, asyncio.Event()).set()
        return True

    def get(self, key: tuple[str, ...]) -> dict[str, bytes]:
        return dict(self._items.get(key, {}))

    def item(self, key: tuple[str, ...], sender: str) -> bytes | None:
        return self._items.get(key, _EMPTY).get(sender)

    def since(self, key: tuple[str, ...], start: int) -> list[tuple[str, bytes]]:
        """The messages filed under ``key`` after the first ``start``, in arrival order."""
        return list(itertools.islice(self._items.get(key, _EMPTY).items(), start, None))

    def senders(self, key: tuple[str, ...]) -> Set[str]:
        """The senders filed under ``key`` so far: a live view, not a copy (checks run
        on every arrival, so copying the box each time would cost ``O(n)`` apiece)."""
        return self._items.get(key, _EMPTY).keys()

    async def wait_any(
        self,
        keys: Iterable[tuple[str, ...]],
        done: Callable[[], bool],
        deadline: float,
        expect: tuple[tuple[str, ...], Iterable[str]] | None = None,
    ) -> None:
        """Wait until ``done()`` holds, checked whenever one of ``keys`` gets a message;
        ``expect`` (an inbox key and its senders) is what :meth:`missing` reports."""
        if expect is not None:
            self.awaiting = (expect[0], frozenset(expect[1]))
        events = [self._events.setdefault(k, asyncio.Event()) for k in keys]
        loop = asyncio.get_running_loop()
        while True:
            for event in events:
                event.clear()
            remaining = deadline - loop.time()
            if done() or remaining <= 0:
                return
            waiters = [asyncio.ensure_future(e.wait()) for e in events]
            try:
                await asyncio.wait(waiters, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()

    async def wait(
        self, key: tuple[str, ...], senders: Iterable[str], deadline: float
    ) -> dict[str, bytes]:
        """What ``senders`` posted under ``key`` once all did, or at ``deadline`` (loop time)."""
        wanted = set(senders)
        self.awaiting = (key, frozenset(wanted))
        event = self._events.setdefault(key, asyncio.Event())
        loop = asyncio.get_running_loop()
        while True:
            event.clear()
            box = self._items.get(key, {})
            if wanted <= box.keys():
                break
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), remaining)
        box = self._items.get(key, {})
        return {s: box[s] for s in wanted if s in box}


class _BadPiece(ValueError):
    """A member answered a piece request with the wrong number of bytes."""


def _keep_latest(
    store: dict[tuple[str, int], Any],
    events: dict[tuple[str, int], asyncio.Event],
    run: str,
    round: int,
    value: Any,
) -> None:
    """Keep ``value`` for ``(run, round)``, dropping the other rounds of ``run`` and all
    but the four newest entries, and wake whoever waits for it."""
    for key in [k for k in store if k[0] == run and k[1] != round]:
        del store[key]
        events.pop(key, None)
    store[(run, round)] = value
    events.setdefault((run, round), asyncio.Event()).set()
    while len(store) > 4:
        oldest = next(iter(store))
        del store[oldest]
        events.pop(oldest, None)


@dataclass
class _Parts:
    """The chunks of a round's unmasked sum a node holds (owner unmasking)."""

    attempt: int
    members: frozenset[str]
    scattered: Scattered

    def holds(self, index: int) -> bool:
        return index in self.scattered.filled


@dataclass
class _Offer:
    """This node's own message of one pairwise exchange (ready, share, release): a
    peer's message of that exchange is answered with it, which spares this node the
    request of its own to that peer (see :meth:`RoundEngine._targets`)."""

    payload: bytes | Mapping[str, bytes]  # one for every peer, or per peer
    served: set[str] = field(default_factory=set)  # the peers answered with it

    def for_peer(self, peer: str) -> bytes | None:
        if isinstance(self.payload, bytes):
            return self.payload
        return self.payload.get(peer)


def _initiator(run: str, round: int, a: str, b: str) -> str:
    """Which of two orgs sends first in their pairwise exchanges of a round (the
    other answers with its own message in the reply): a hash of the pair, so each
    org initiates with about half of the others, and both compute the same."""
    lo, hi = sorted((a, b))
    digest = hashlib.sha256(
        b"fedweave/pair\0%s\0%d\0%s\0%s" % (run.encode(), round, lo.encode(), hi.encode())
    ).digest()
    return lo if digest[0] & 1 else hi


@dataclass
class _RoundState:
    run: str
    round: int
    inbox: _Inbox = field(default_factory=_Inbox)
    # per exchange (its inbox key): this node's own message, once it has one; the
    # peers whose message of it is being held until then; and the wake-up for them
    offers: dict[tuple[str, ...], _Offer] = field(default_factory=dict)
    deferred: dict[tuple[str, ...], set[str]] = field(default_factory=dict)
    offered: dict[tuple[str, ...], asyncio.Event] = field(default_factory=dict)
    # the peers that sent two different messages of one exchange
    equivocal: set[str] = field(default_factory=set)
    # the agreement tags whose token this node gave up on (it fell back to views), and,
    # where it started the token, the members that settled on its decision (itself too)
    stalled: set[str] = field(default_factory=set)
    settled_by: dict[str, frozenset[str]] = field(default_factory=dict)
    released_for: frozenset[str] | None = None
    # per stage tag, the set (and flag) this node settled on, and the views it has sent
    decided: dict[str, tuple[frozenset[str], bool]] = field(default_factory=dict)
    # the loop time this node started running the round (None while only buffering)
    started: float | None = None
    # the stage this node is in and since when (clock time), for :meth:`progress`
    stage: str = ""
    stage_since: float | None = None

    def gone(self) -> set[str]:
        """The members that said they left this round (it failed for them)."""
        return set(self.inbox.senders(("gone",)))

    views_sent: set[tuple[str, int, str]] = field(default_factory=set)
    # per stage tag, the starter of the agreement token this node takes part in
    joined: dict[str, str] = field(default_factory=dict)
    # per ring attempt's tag, the members known to hold its completed masked sum
    completers: dict[str, set[str]] = field(default_factory=dict)


@dataclass
class _Counters:
    bytes_sent: int = 0
    messages_sent: int = 0
    ring: RingStats = field(default_factory=RingStats)


class RoundEngine:
    """Runs leaderless secure-aggregation rounds for one org over its :class:`Endpoint`.

    peers: the federation's members (the manifest's list, the same on every node: it
    is ``U0`` of the masked sum); this org may be among them. session_factory builds
    this org's masked-sum session for a round. live: optionally, the members believed
    alive (the membership layer's view): the ready stage stops waiting once all of
    them are ready instead of waiting out the deadline for a member known dead, and
    a ring step pings a predecessor it waits on as soon as that one leaves the view.
    hook: the simulator's fault-injection seam. observer: called with each
    :class:`RoundObservation` (stage times, arrivals, refusals, dropouts); more can be
    added with :meth:`add_observer`.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        peers: Callable[[], Iterable[str]],
        session_factory: SessionFactory,
        config: RoundConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        hook: StageHook | None = None,
        live: Callable[[], Iterable[str]] | None = None,
        observer: RoundObserver | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.observers: list[RoundObserver] = [observer] if observer is not None else []
        self.peers = peers
        self.session_factory = session_factory
        self.config = config or RoundConfig()
        self.clock = clock
        self.hook = hook
        self.live = live
        self.ring = RingReducer(endpoint)
        self._states: dict[tuple[str, int], _RoundState] = {}
        self._last_done: dict[str, int] = {}
        self._model_hashes: dict[tuple[str, int], dict[str, bytes]] = {}
        self._model_events: dict[tuple[str, int], asyncio.Event] = {}
        self._background: set[asyncio.Future[Any]] = set()
        self._running: set[tuple[str, int]] = set()
        # the masked sum of this node's latest completed ring attempt, kept for the
        # members whose ring broke (``round.total``)
        self._totals: dict[tuple[str, int], tuple[int, frozenset[str], np.ndarray]] = {}
        self._total_events: dict[tuple[str, int], asyncio.Event] = {}
        # with owner unmasking: the chunks of the unmasked sum this node holds, kept
        # for the members whose all-gather broke (``round.part``)
        self._parts: dict[tuple[str, int], _Parts] = {}
        self._part_events: dict[tuple[str, int], asyncio.Event] = {}
        # per (run, round): this node's release (view hash, survivors, message), kept
        # after the round for a survivor that still needs it (see _on_unmask)
        self._releases: dict[tuple[str, int], tuple[bytes, frozenset[str], bytes]] = {}
        self._release_events: dict[tuple[str, int], asyncio.Event] = {}
        for kind, handler in (
            (KIND_READY, self._on_ready),
            (KIND_VIEW, self._on_view),
            (KIND_SHARE, self._on_share),
            (KIND_UNMASK, self._on_unmask),
            (KIND_COMMIT, self._on_commit),
            (KIND_LEAVE, self._on_leave),
            (KIND_MODEL, self._on_model),
            (KIND_TOTAL, self._on_total),
            (KIND_PART, self._on_part),
            (KIND_SEED, self._on_seed),
            (KIND_PERMIT, self._on_permit),
        ):
            endpoint.on(kind, self._observed(kind, handler))

    @classmethod
    def secure(
        cls,
        endpoint: Endpoint,
        peers: Callable[[], Iterable[str]],
        config: RoundConfig | None = None,
        *,
        codec: FixedPointCodec | None = None,
        hook: StageHook | None = None,
        live: Callable[[], Iterable[str]] | None = None,
    ) -> RoundEngine:
        """An engine running :mod:`secure_agg`'s masked sum, signed with the endpoint's
        identity; ``codec`` encodes float inputs (``codec.max_summands`` >= members)."""
        return cls(
            endpoint,
            peers,
            secagg_sessions(*endpoint_signer(endpoint), codec=codec),
            config,
            hook=hook,
            live=live,
        )

    @property
    def org_id(self) -> str:
        return self.endpoint.org_id

    # -- observation --------------------------------------------------------------------

    def add_observer(self, observer: RoundObserver) -> None:
        """Also call ``observer`` with every :class:`RoundObservation` from now on."""
        self.observers.append(observer)

    def _observe(
        self,
        kind: str,
        run: str,
        round: int,
        stage: str,
        *,
        peer: str = "",
        seconds: float = 0.0,
        bytes: int = 0,
        detail: str = "",
    ) -> None:
        if not self.observers:
            return
        obs = RoundObservation(kind, run, round, stage, peer, seconds, bytes, detail)
        for observer in list(self.observers):
            try:
                observer(obs)
            except Exception:  # an observer never affects the round
                logger.exception("%s: round observer failed on %s", self.org_id, kind)

    def _observed(self, kind: str, handler: Handler) -> Handler:
        """``handler``, reporting each message's arrival time and each refusal."""
        stage = kind.partition(".")[2]

        async def observed(env: Envelope) -> bytes | None:
            arrived = asyncio.get_running_loop().time()  # a share's reply may wait
            try:
                reply = await handler(env)
            except Refused as exc:
                self._observe(
                    _refusal_kind(exc), env.run, env.round, stage, peer=env.sender, detail=str(exc)
                )
                raise
            if self.observers:
                if kind == KIND_LEAVE:
                    self._observe("left", env.run, env.round, stage, peer=env.sender)
                else:
                    self._arrival(env.run, env.round, stage, env.sender, len(env.payload), arrived)
            return reply

        return observed

    def _arrival(
        self, run: str, round: int, stage: str, peer: str, size: int, at: float | None = None
    ) -> None:
        """Report that ``peer``'s message of ``stage`` arrived (by request, or in the
        reply to this node's own), in seconds since this node started the round."""
        if not self.observers:
            return
        state = self._states.get((run, round))
        started = state.started if state is not None else None
        now = asyncio.get_running_loop().time() if at is None else at
        since = 0.0 if started is None else now - started
        self._observe("arrival", run, round, stage, peer=peer, seconds=max(0.0, since), bytes=size)

    # -- round state --------------------------------------------------------------------

    def _state(self, run: str, round: int) -> _RoundState:
        """The state of ``(run, round)``, created on first contact; refuses wrong rounds."""
        key = (run, round)
        state = self._states.get(key)
        if state is not None:
            return state
        last = self._last_done.get(run)
        if last is not None and round <= last:
            raise Refused(RefusalReason.STALE, f"round {round} of {run!r} is over")
        if last is not None and round > last + self.config.lookahead_rounds:
            raise Refused(RefusalReason.STALE, f"round {round} of {run!r} is too far ahead")
        if len(self._states) >= 2 * self.config.lookahead_rounds + 2:
            raise Refused(RefusalReason.STALE, "too many rounds open")
        state = _RoundState(run, round)
        self._states[key] = state
        self.ring.open(run, round)
        return state

    def progress(self, run: str) -> RoundProgress | None:
        """The newest round of ``run`` this node is running now, and what it waits for;
        None when none runs. Call it on the engine's event loop."""
        running = sorted(r for (rn, r) in self._running if rn == run)
        if not running:
            return None
        state = self._states.get((run, running[-1]))
        if state is None or state.stage_since is None:
            return None
        return RoundProgress(
            run, state.round, state.stage, state.stage_since, state.inbox.missing()
        )

    def open_rounds(self) -> list[tuple[str, int]]:
        """The ``(run, round)`` pairs this engine holds state for (buffered or running)."""
        return sorted(self._states)

    def _finish(self, run: str, round: int) -> None:
        last = self._last_done.get(run)
        self._last_done[run] = round if last is None else max(last, round)
        if (run, round) not in self._totals:
            self._total_events.pop((run, round), None)
        if (run, round) not in self._parts:
            self._part_events.pop((run, round), None)
        for key in [k for k in self._states if k[0] == run and k[1] <= round]:
            del self._states[key]
            self.ring.close(*key)

    # -- handlers -----------------------------------------------------------------------

    async def _on_ready(self, env: Envelope) -> bytes:
        state = self._state(env.run, env.round)
        self._file(state, ("ready",), env.sender, env.payload, "ready")
        return self._answer(state, ("ready",), env.sender)

    def _file(
        self, state: _RoundState, key: tuple[str, ...], sender: str, payload: bytes, what: str
    ) -> None:
        """File a peer's message of a pairwise exchange; the same message again (a
        retry whose first reply was lost) is taken, a different one refused."""
        if not self._filed(state, key, sender, payload):
            raise Refused(RefusalReason.REPLAY, f"a second, different {what} for this round")

    @staticmethod
    def _filed(state: _RoundState, key: tuple[str, ...], sender: str, payload: bytes) -> bool:
        """File ``payload`` (a request's or a reply's); ``False`` when ``sender``
        already sent another one: it equivocates, and stays out of this node's views."""
        if state.inbox.put(key, sender, payload) or state.inbox.item(key, sender) == payload:
            return True
        state.equivocal.add(sender)
        return False

    def _answer(self, state: _RoundState, key: tuple[str, ...], peer: str) -> bytes:
        """The reply to ``peer``'s message of an exchange: this node's own message for
        ``peer`` when it has one (``peer`` is then served), else nothing (this node
        sends its own once it has it, see :meth:`_targets`)."""
        offer = state.offers.get(key)
        if offer is None:
            return b""
        data = offer.for_peer(peer)
        if data is None:
            return b""
        offer.served.add(peer)
        return data

    def _offer(
        self, state: _RoundState, key: tuple[str, ...], payload: bytes | Mapping[str, bytes]
    ) -> _Offer:
        offer = state.offers[key] = _Offer(payload)
        event = state.offered.get(key)
        if event is not None:
            event.set()
        return offer

    def _targets(self, state: _RoundState, key: tuple[str, ...], peers: Iterable[str]) -> list[str]:
        """The peers this node sends its message of an exchange to: those it initiates
        with (:func:`_initiator`), and those whose message came before this node had
        its own to answer with; never one already answered with it, or one whose
        message waits for it (:meth:`_on_share`)."""
        offer = state.offers.get(key)
        served = offer.served if offer is not None else set()
        waiting = state.deferred.get(key, set())
        heard = state.inbox.senders(key)
        me, run, rnd = self.org_id, state.run, state.round
        return sorted(
            p
            for p in peers
            if p != me
            and p not in served
            and p not in waiting
            and (p in heard or _initiator(run, rnd, me, p) == me)
        )

    async def _on_view(self, env: Envelope) -> bytes:
        state = self._state(env.run, env.round)
        try:
            view = _decode_view(env.payload)
        except ValueError as exc:
            raise Refused(RefusalReason.MALFORMED, str(exc)) from None
        if not _known_tag(view.tag, self.config) or view.attempt >= self.config.max_view_attempts:
            raise Refused(RefusalReason.MALFORMED, f"unknown view {view.tag!r}/{view.attempt}")
        if not state.inbox.put(("view", view.tag, str(view.attempt)), env.sender, env.payload):
            raise Refused(RefusalReason.REPLAY, "second view for this stage")
        self._answer_view(state, view.tag, view.attempt, env.sender)
        return b""

    def _answer_view(self, state: _RoundState, tag: str, attempt: int, sender: str) -> None:
        """Once this node settled ``tag`` (all it heard agreed, or by the token), a peer
        that heard less and is retrying gets the settled view, so it can converge."""
        settled = state.decided.get(tag)
        if settled is None or (tag, attempt, sender) in state.views_sent:
            return
        state.views_sent.add((tag, attempt, sender))
        answer = View(tag, attempt, settled[0], settled[1]).to_bytes()
        self._spawn(
            self._broadcast(
                _Counters(),
                [sender],
                KIND_VIEW,
                answer,
                run=state.run,
                round=state.round,
                stage=tag,
            )
        )

    async def _on_share(self, env: Envelope) -> bytes:
        state = self._state(env.run, env.round)
        if len(env.payload) < _HASH:
            raise Refused(RefusalReason.MALFORMED, "share without a view hash")
        key = ("share",)
        self._file(state, key, env.sender, env.payload, "share")
        await self._await_offer(state, key, env.sender)
        return self._answer(state, key, env.sender)

    async def _await_offer(self, state: _RoundState, key: tuple[str, ...], sender: str) -> None:
        """When this node runs the round but has no message of the exchange yet (its
        previous stage is still open), the reply to ``sender`` waits a little for it
        rather than go empty and cost a request of its own later; bounded well inside
        the send timeout."""
        if key in state.offers or state.started is None:
            return
        waiting = state.deferred.setdefault(key, set())
        waiting.add(sender)
        event = state.offered.setdefault(key, asyncio.Event())
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), self.config.send_timeout / 4)
        finally:
            waiting.discard(sender)

    async def _on_leave(self, env: Envelope) -> bytes:
        state = self._state(env.run, env.round)
        state.inbox.put(("gone",), env.sender, b"")
        return b""

    async def _on_commit(self, env: Envelope) -> bytes:
        state = self._state(env.run, env.round)
        try:
            token = _Token.from_bytes(env.payload)
        except ValueError as exc:
            raise Refused(RefusalReason.MALFORMED, str(exc)) from None
        if not _known_tag(token.tag, self.config):
            raise Refused(RefusalReason.MALFORMED, f"unknown token stage {token.tag!r}")
        # the sender skips a member that refuses as STALE: one not running this round,
        # one that settled the stage already, one in another token of the stage
        if state.started is None:
            raise Refused(RefusalReason.STALE, "this node is not running the round")
        if token.phase in (_TOKEN_PROBE, _TOKEN_COLLECT) and self._holds_sum(state, token):
            # its ring completed: the token adds its proposal, which settles the stage
            return _COMPLETED
        if token.phase == _TOKEN_PROBE:
            return b""
        joined = state.joined.get(token.tag)
        if token.phase == _TOKEN_COLLECT:
            if token.tag in state.decided:
                raise Refused(RefusalReason.STALE, "this node settled the stage already")
            if joined is not None and joined != token.starter:
                raise Refused(RefusalReason.STALE, "this node is in another token")
            slot = "return" if token.starter == self.org_id else "collect"
        else:
            if joined is not None and joined != token.starter:
                raise Refused(RefusalReason.STALE, "this node is in another token")
            slot = "decide"
        if not state.inbox.put(("token", token.tag, slot), "", env.payload):
            # the same token twice (a send retried after a lost reply): the sender stops
            raise Refused(RefusalReason.REPLAY, "second token")
        if slot == "collect":
            state.joined[token.tag] = token.starter
        if slot == "decide" and token.tag not in state.stalled:
            return _SETTLED  # it still waits for this decision: it settles on it
        return b""

    def _holds_sum(self, state: _RoundState, token: _Token) -> bool:
        """Whether this node settled the ring attempt of ``token`` as completed (over the
        members the token travels), so it holds the attempt's masked sum."""
        settled = state.decided.get(token.tag)
        return (
            _decisive(token.tag)
            and settled is not None
            and settled[1]
            and view_hash(f"{token.tag}/token", ring_order(settled[0], state.round)) == token.base
        )

    async def _on_total(self, env: Envelope) -> bytes:
        """A piece of this node's masked sum of a completed ring attempt, for a member
        whose ring broke: ``(attempt, lo, hi)`` in, the elements ``[lo, hi)`` out."""
        try:
            attempt, lo, hi = _TOTAL_REQUEST.unpack(env.payload)
        except struct.error:
            raise Refused(RefusalReason.MALFORMED, "a sum request is (attempt, lo, hi)") from None
        key = (env.run, env.round)
        held = self._totals.get(key)
        if held is None and (env.run, env.round) in self._running:
            state = self._states.get(key)
            if state is not None and state.decided.get(f"reduce:{attempt}", ((), False))[1]:
                # settled as completed, still taking the sum from another member
                event = self._total_events.setdefault(key, asyncio.Event())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), self.config.step_timeout)
                held = self._totals.get(key)
        if held is None or held[0] != attempt:
            raise Refused(RefusalReason.STALE, f"no completed sum of ring attempt {attempt} here")
        if env.sender not in held[1]:
            raise Refused(
                RefusalReason.NOT_MEMBER, f"{env.sender!r} is not in ring attempt {attempt}"
            )
        total = held[2]
        if not lo < hi <= len(total) or (hi - lo) * total.itemsize > _TOTAL_PIECE_BYTES:
            raise Refused(RefusalReason.MALFORMED, f"sum piece [{lo}, {hi}) out of range")
        return total[lo:hi].tobytes()

    def _keep_total(
        self, run: str, round: int, attempt: int, members: frozenset[str], total: np.ndarray
    ) -> None:
        """Keep a completed attempt's masked sum for its members whose ring broke (the
        session unmasks into a new array and leaves ``total`` as it is): the latest
        round's of each run only, so a node holds one vector more than the round
        itself needs."""
        _keep_latest(self._totals, self._total_events, run, round, (attempt, members, total))

    async def _on_part(self, env: Envelope) -> bytes:
        """A piece of a chunk of this node's unmasked sum (owner unmasking), for a member
        whose all-gather broke: ``(attempt, chunk, lo, hi)`` in, elements ``[lo, hi)``
        of that chunk out. A node still unmasking is waited for, up to a stage."""
        try:
            attempt, index, lo, hi = _PART_REQUEST.unpack(env.payload)
        except struct.error:
            raise Refused(
                RefusalReason.MALFORMED, "a part request is (attempt, chunk, lo, hi)"
            ) from None
        key = (env.run, env.round)
        parts = self._parts.get(key)
        if parts is None and key in self._running:
            event = self._part_events.setdefault(key, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), self.config.stage_timeout)
            parts = self._parts.get(key)
        if parts is None or parts.attempt != attempt:
            raise Refused(RefusalReason.STALE, f"no unmasked sum of ring attempt {attempt} here")
        if env.sender not in parts.members:
            raise Refused(
                RefusalReason.NOT_MEMBER, f"{env.sender!r} is not in ring attempt {attempt}"
            )
        bounds = parts.scattered.bounds
        if index >= len(bounds):
            raise Refused(RefusalReason.MALFORMED, f"no chunk {index} in {len(bounds)}")
        if not parts.holds(index):
            raise Refused(RefusalReason.STALE, f"chunk {index} of the sum is not held here")
        clo, chi = bounds[index]
        acc = parts.scattered.acc
        if not clo <= lo < hi <= chi or (hi - lo) * acc.itemsize > _TOTAL_PIECE_BYTES:
            raise Refused(RefusalReason.MALFORMED, f"part [{lo}, {hi}) is not in chunk {index}")
        return acc[lo:hi].tobytes()

    def _keep_parts(
        self, run: str, round: int, attempt: int, members: frozenset[str], scattered: Scattered
    ) -> None:
        """Serve the unmasked chunks of ``scattered`` (those it holds, growing as the
        all-gather fills it) to the attempt's members: the latest round of each run."""
        _keep_latest(
            self._parts, self._part_events, run, round, _Parts(attempt, members, scattered)
        )

    async def _fetch_parts(
        self,
        state: _RoundState,
        counters: _Counters,
        order: list[str],
        attempt: int,
        scattered: Scattered,
    ) -> None:
        """Fill the chunks of ``scattered`` that a broken all-gather left empty, each from
        its owner, else the successor that holds its copy, else any member that
        gathered it; :class:`RoundFailed` when no member can send one."""
        n = len(order)
        for index in range(n):
            if index in scattered.filled:
                continue
            owner = (index - 1) % n
            holders = [order[(owner + i) % n] for i in range(n)]
            for org in [o for o in holders if o != self.org_id]:
                try:
                    await self._take_pieces(
                        state,
                        counters,
                        org,
                        KIND_PART,
                        functools.partial(_PART_REQUEST.pack, attempt, index),
                        scattered.acc,
                        scattered.bounds[index],
                        "gather",
                    )
                except Refused:
                    continue  # alive, but it does not hold that chunk: no fault of its
                except _BadPiece as exc:
                    self._observe(
                        "refused", state.run, state.round, "gather", peer=org, detail=str(exc)
                    )
                    continue
                except TransportError as exc:
                    self._observe(
                        "unreachable", state.run, state.round, "gather", peer=org, detail=str(exc)
                    )
                    continue
                scattered.filled.add(index)
                self._observe(
                    "retry",
                    state.run,
                    state.round,
                    "gather",
                    peer=org,
                    detail=f"took chunk {index} of the sum from a member that holds it",
                )
                break
            else:
                raise RoundFailed(
                    "gather",
                    f"chunk {index} of the sum is lost: neither its owner {holders[0]} nor "
                    f"{holders[1]}, which held its copy, nor any other member could send it",
                )

    async def _on_unmask(self, env: Envelope) -> bytes:
        if len(env.payload) < _HASH:
            raise Refused(RefusalReason.MALFORMED, "release without a view hash")
        kept = self._releases.get((env.run, env.round))
        if kept is not None and (env.run, env.round) not in self._states:
            # this node finished the round (it needed only some of the releases, or
            # none: the seeds): a survivor that still needs its release gets it
            h3, survivors, data = kept
            if env.sender not in survivors:
                raise Refused(RefusalReason.NOT_MEMBER, f"{env.sender!r} is not a survivor")
            if env.payload[:_HASH] != h3:
                raise Refused(RefusalReason.STALE, "a release for another survivor set")
            return data
        state = self._state(env.run, env.round)
        key = ("unmask", env.payload[:_HASH].hex())
        self._file(state, key, env.sender, env.payload[_HASH:], "release")
        await self._await_offer(state, key, env.sender)
        return self._answer(state, key, env.sender)

    async def _on_permit(self, env: Envelope) -> bytes:
        if len(env.payload) != _HASH:
            raise Refused(RefusalReason.MALFORMED, "a permit is the 32-byte hash of the survivors")
        state = self._state(env.run, env.round)
        state.inbox.put(("permit", env.payload.hex()), env.sender, b"")
        return b""

    async def _on_seed(self, env: Envelope) -> bytes:
        state = self._state(env.run, env.round)
        payload = env.payload
        if len(payload) < _HASH + 1 or (len(payload) - _HASH - 1) % _SEED_ENTRY.size:
            raise Refused(RefusalReason.MALFORMED, "seeds of the wrong size")
        key = ("seed", payload[:_HASH].hex(), str(payload[_HASH]))
        if not state.inbox.put(key, env.sender, payload[_HASH + 1 :]):
            raise Refused(RefusalReason.REPLAY, "second seeds of this step")
        return b""

    async def _on_model(self, env: Envelope) -> bytes:
        if len(env.payload) != _HASH:
            raise Refused(RefusalReason.MALFORMED, "a model hash is 32 bytes")
        last = self._last_done.get(env.run)
        if last is not None and not last - 8 <= env.round <= last + self.config.lookahead_rounds:
            raise Refused(RefusalReason.STALE, f"model hash of round {env.round} is out of range")
        key = (env.run, env.round)
        hashes = self._model_hashes.setdefault(key, {})
        if env.sender in hashes:
            raise Refused(RefusalReason.REPLAY, "second model hash for this round")
        hashes[env.sender] = env.payload
        self._model_events.setdefault(key, asyncio.Event()).set()
        while len(self._model_hashes) > 16:
            oldest = min(self._model_hashes, key=lambda k: k[1])
            del self._model_hashes[oldest]
            self._model_events.pop(oldest, None)
        return b""

    # -- sending ------------------------------------------------------------------------

    async def _send(
        self,
        counters: _Counters,
        peer: str,
        kind: str,
        payload: bytes,
        *,
        run: str,
        round: int,
        stage: str,
        timeout: float | None = None,
    ) -> bytes:
        counters.bytes_sent += len(payload)
        counters.messages_sent += 1
        return await self.endpoint.send(
            peer,
            kind,
            payload,
            run=run,
            round=round,
            stage=stage,
            timeout=timeout or self.config.send_timeout,
        )

    async def _broadcast(
        self,
        counters: _Counters,
        peers: Iterable[str],
        kind: str,
        payload: bytes | Mapping[str, bytes],
        *,
        run: str,
        round: int,
        stage: str,
        timeout: float | None = None,
        on_reply: Callable[[str, bytes], None] | None = None,
    ) -> set[str]:
        """Send to every peer at once; return the peers that failed to take it.
        ``on_reply(peer, data)`` gets each non-empty reply."""
        failed: set[str] = set()

        async def one(peer: str) -> None:
            data = payload if isinstance(payload, bytes) else payload[peer]
            try:
                reply = await self._send(
                    counters, peer, kind, data, run=run, round=round, stage=stage, timeout=timeout
                )
                if reply and on_reply is not None:
                    on_reply(peer, reply)
            except TransportError as exc:
                logger.info("%s: %s to %s failed: %s", self.org_id, kind, peer, exc)
                failed.add(peer)
                self._observe(
                    _refusal_kind(exc) if isinstance(exc, Refused) else "unreachable",
                    run,
                    round,
                    stage,
                    peer=peer,
                    detail=f"{type(exc).__name__}: {exc}",
                )

        await asyncio.gather(*(one(p) for p in peers if p != self.org_id))
        return failed

    # -- agreement ----------------------------------------------------------------------

    async def _agree(
        self,
        state: _RoundState,
        counters: _Counters,
        tag: str,
        proposal: frozenset[str],
        flag: bool = True,
    ) -> tuple[frozenset[str], bool]:
        """Agree on a set with the other members of ``proposal`` (see the module docstring).

        Returns ``(members, flag)`` once every member's view equals this node's; the
        flag of a view is the AND of the flags seen. Raises :class:`RoundFailed` when
        this node is left out or the views do not converge.
        """
        me = self.org_id
        view, ok = proposal, flag
        loop = asyncio.get_running_loop()
        for attempt in range(self.config.max_view_attempts):
            mine = View(tag, attempt, view, ok)
            others = sorted(view - {me})
            state.views_sent.update((tag, attempt, o) for o in others)
            failed = await self._broadcast(
                counters,
                others,
                KIND_VIEW,
                mine.to_bytes(),
                run=state.run,
                round=state.round,
                stage=tag,
            )
            # a peer that could not take this node's view, or that left the round, is
            # out: no waiting for its own
            key = ("view", tag, str(attempt))
            expected = set(others) - failed

            def heard(key: tuple[str, ...] = key, expected: set[str] = expected) -> bool:
                return expected - state.gone() <= state.inbox.senders(key)

            await state.inbox.wait_any(
                [key, ("gone",)],
                heard,
                loop.time() + self.config.stage_timeout,
                expect=(key, expected),
            )
            got = {o: p for o, p in state.inbox.get(key).items() if o in expected}
            views = {o: _decode_view(p) for o, p in got.items()}
            if _decisive(tag):
                # a member whose ring completed decides the attempt (see _decisive)
                holders = {o for o, v in views.items() if v.flag and v.members >= view}
                if holders:
                    return self._settle_held(state, tag, views[min(holders)].members, holders)
            missing = (set(others) - set(views)) | failed
            if not missing and all(v.members == view and v.flag == ok for v in views.values()):
                state.decided[tag] = (view, ok)
                return view, ok
            new = set(view) - missing
            for v in views.values():
                new &= v.members
                ok = ok and v.flag
            logger.info(
                "%s: views of %s differ at attempt %d (missing %s); retrying with %d members",
                me,
                tag,
                attempt,
                sorted(missing),
                len(new),
            )
            if me not in new:
                raise RoundFailed(tag, "the other participants' views leave this node out")
            view = frozenset(new)
        raise RoundFailed(
            tag, f"views did not agree after {self.config.max_view_attempts} attempts (split view)"
        )

    async def _settle(
        self,
        state: _RoundState,
        counters: _Counters,
        tag: str,
        base: Iterable[str],
        proposal: frozenset[str],
        flag: bool = True,
    ) -> tuple[frozenset[str], bool]:
        """Agree on a set with the members of ``base``: by the token, and by the view
        agreement when the token stalls (see :meth:`_token_agree`)."""
        settled = await self._token_agree(state, counters, tag, base, proposal, flag)
        if settled is not None:
            return settled
        state.stalled.add(tag)  # a decision that comes from now on is not settled on
        self._observe("retry", state.run, state.round, tag, detail="token stalled: views")
        return await self._agree(state, counters, tag, proposal, flag)

    async def _token_agree(
        self,
        state: _RoundState,
        counters: _Counters,
        tag: str,
        base: Iterable[str],
        proposal: frozenset[str],
        flag: bool,
    ) -> tuple[frozenset[str], bool] | None:
        """Agree on ``(members, flag)`` by one token passed twice along a ring.

        ``base`` is the same on every node (the federation's members, or the set the
        previous stage settled); each member proposes a subset. The token starts at the
        first member of ``ring_order(base)`` that runs the round, collects every
        member's proposal in ring order (a member that is dead, not running the round or
        already settled refuses or cannot be reached, and is skipped: it made no
        proposal), and returns to its starter, which alone decides: the intersection of
        the proposals and the AND of the flags, and sends the decision, with the
        proposals, to every member that made one. Every node that settles thus holds the
        very same collected proposals, so none can settle on a set another settles
        differently: ``2 n`` messages in all (``n`` of them one after another) where the
        view agreement sends ``n (n - 1)`` per attempt.

        Returns ``None`` — fall back to the view agreement, whose views every node
        settled here answers with its settled set — when the token stalls: a view of
        this stage arrives (someone fell back already), the starter is unreachable,
        or the stage times out. A member that skipped nobody still proposes itself, so
        one left out of the decision fails the round rather than summing apart.
        """
        me, cfg = self.org_id, self.config
        order = ring_order(frozenset(base), state.round)
        if me not in order or len(order) < 2:
            return None
        pos = order.index(me)
        base_hash = view_hash(f"{tag}/token", order)
        loop = asyncio.get_running_loop()
        end = loop.time() + cfg.stage_timeout
        view_key = ("view", tag, "0")
        collect_key = ("token", tag, "collect")
        return_key = ("token", tag, "return")
        decide_key = ("token", tag, "decide")

        async def send(peer: str, token: _Token) -> str:
            """``ok``; ``stop`` (it holds this token already); ``skip`` (no proposal);
            ``completed`` (its ring completed: its proposal decides)."""
            return await self._send_token(state, counters, tag, peer, token)

        holder: list[str] = []

        async def absent(peer: str) -> bool:
            """Whether ``peer`` is dead, gone or not running the round (so no token
            will come from it); one whose ring completed is noted in ``holder``."""
            if peer in state.gone():
                return True
            try:
                reply = await self._send(
                    counters,
                    peer,
                    KIND_COMMIT,
                    _Token(_TOKEN_PROBE, tag, base_hash, me).to_bytes(),
                    run=state.run,
                    round=state.round,
                    stage=tag,
                    timeout=cfg.step_timeout,
                )
            except (Refused, PeerUnreachable):
                return True
            except TransportError:
                return False  # alive, just slow
            if reply == _COMPLETED and _decisive(tag):
                holder.append(peer)
            return False

        def arrived(key: tuple[str, ...]) -> Callable[[], bool]:
            return lambda: bool(state.inbox.senders(key) or state.inbox.senders(view_key))

        async def wait(key: tuple[str, ...], take_over: bool) -> _Token | str:
            """The token filed under ``key``; ``"start"`` when every member before this
            one is absent (``take_over``); ``"completed"`` when a member before this
            one holds the completed sum; ``"stall"`` otherwise."""
            if take_over and _decisive(tag) and not flag:
                # the would-be starter may have completed its ring, and then starts no
                # token: ask it at once rather than after a silence
                await absent(order[0])
                if holder:
                    return "completed"
            while True:
                await state.inbox.wait_any(
                    [key, view_key], arrived(key), min(end, loop.time() + cfg.step_timeout)
                )
                box = state.inbox.get(key)
                if box:
                    try:
                        return _Token.from_bytes(box[""])
                    except ValueError:
                        return "stall"
                if state.inbox.senders(view_key) or loop.time() >= end:
                    return "stall"
                if take_over and state.joined.get(tag) is None:
                    # a long silence: is any member before this one still running?
                    for q in range(pos - 1, -1, -1):
                        if not await absent(order[q]):
                            break
                    else:
                        if not state.inbox.senders(key):
                            return "start"
                    if holder:
                        return "completed"

        # pass 1: collect the proposals
        mine = (me, proposal, flag)
        if pos == 0:
            got: _Token | str = "start"
        else:
            got = await wait(collect_key, take_over=True)
        if got == "stall":
            return None
        if got == "completed":
            return self._settle_held(state, tag, frozenset(order), holder)
        if isinstance(got, _Token):
            if got.base != base_hash or got.phase != _TOKEN_COLLECT:
                return None
            token = _Token(_TOKEN_COLLECT, tag, base_hash, got.starter, (*got.entries, mine))
        else:
            state.joined[tag] = me
            token = _Token(_TOKEN_COLLECT, tag, base_hash, me, (mine,))
        token, outcome = await self._pass_token(state, counters, tag, order, pos, token)
        if outcome == "end":
            if token.starter == me:
                decided: _Token | str = token
            else:
                # back to the starter ("stop": another path brought it back already)
                if await send(token.starter, token) == "skip":
                    return None
                decided = await wait(decide_key, take_over=False)
        elif token.starter == me:
            decided = await wait(return_key, take_over=False)
        else:
            decided = await wait(decide_key, take_over=False)
        if not isinstance(decided, _Token) or decided.base != base_hash:
            return None
        if decided.starter != state.joined.get(tag):
            return None
        # the decision: every member that proposed settles on it
        members, ok = decided.decision()
        if _decisive(tag) and ok:
            state.completers[tag] = {org for org, _, f in decided.entries if f}
        self._settled(state, tag, members, ok)
        if decided.starter == me:
            # the decision goes to every member that proposed at once (one hop, not a
            # second pass round the ring: the others settle together); a member whose
            # ring completed settled on its own
            final = _Token(_TOKEN_DECIDE, tag, base_hash, me, decided.entries)
            told = [org for org, _, f in final.entries if org != me and not (f and _decisive(tag))]
            outcomes = await asyncio.gather(*(send(org, final) for org in told))
            state.settled_by[tag] = frozenset(
                [me, *(org for org, got in zip(told, outcomes, strict=True) if got == "settled")]
            )
        if me not in members:
            raise RoundFailed(tag, "the other participants' proposals leave this node out")
        return members, ok

    def _settled(self, state: _RoundState, tag: str, members: frozenset[str], ok: bool) -> None:
        """Record what this node settled ``tag`` on and answer the views that wait."""
        state.decided[tag] = (members, ok)
        for attempt in range(self.config.max_view_attempts):
            for sender in list(state.inbox.senders(("view", tag, str(attempt)))):
                self._answer_view(state, tag, attempt, sender)

    def _settle_held(
        self, state: _RoundState, tag: str, members: frozenset[str], holders: Iterable[str]
    ) -> tuple[frozenset[str], bool]:
        """Settle a ring attempt as completed over ``members``: ``holders`` have its sum."""
        state.completers.setdefault(tag, set()).update(holders)
        self._settled(state, tag, members, True)
        return members, True

    async def _send_token(
        self, state: _RoundState, counters: _Counters, tag: str, peer: str, token: _Token
    ) -> str:
        """Hand ``token`` to ``peer``: ``ok``; ``stop`` (it holds this token already);
        ``skip`` (it made no proposal); ``completed`` (its ring attempt completed)."""
        if peer in state.gone():
            return "skip"
        try:
            reply = await self._send(
                counters,
                peer,
                KIND_COMMIT,
                token.to_bytes(),
                run=state.run,
                round=state.round,
                stage=tag,
            )
        except Refused as exc:
            return "stop" if exc.reason is RefusalReason.REPLAY else "skip"
        except TransportError as exc:
            self._observe("unreachable", state.run, state.round, tag, peer=peer, detail=str(exc))
            return "skip"
        if reply == _SETTLED:
            return "settled"
        return "completed" if reply == _COMPLETED and _decisive(tag) else "ok"

    async def _pass_token(
        self,
        state: _RoundState,
        counters: _Counters,
        tag: str,
        order: list[str],
        pos: int,
        token: _Token,
    ) -> tuple[_Token, str]:
        """Pass a collecting token on to the first member after ``pos`` in ``order``
        that takes it; a member whose ring completed answers at once, and its proposal
        (every member of the attempt, completed) goes into the token on its behalf.
        Returns the token as last sent and ``"passed"``, or ``"end"`` when no member
        after ``pos`` took it (it goes back to its starter)."""
        for q in range(pos + 1, len(order)):
            outcome = await self._send_token(state, counters, tag, order[q], token)
            if outcome == "completed":
                entry = (order[q], frozenset(order), True)
                token = _Token(token.phase, tag, token.base, token.starter, (*token.entries, entry))
            elif outcome != "skip":
                return token, "passed"
        return token, "end"

    async def _pass_on_held(self, state: _RoundState, tag: str, members: frozenset[str]) -> None:
        """Once this node's ring attempt completed, a token of that attempt that reached
        it before goes on with its proposal (the members, completed)."""
        box = state.inbox.get(("token", tag, "collect"))
        if "" not in box:
            return
        try:
            got = _Token.from_bytes(box[""])
        except ValueError:
            return
        order = ring_order(members, state.round)
        if got.phase != _TOKEN_COLLECT or self.org_id not in order:
            return
        entry = (self.org_id, members, True)
        token = _Token(_TOKEN_COLLECT, tag, got.base, got.starter, (*got.entries, entry))
        counters = _Counters()
        token, outcome = await self._pass_token(
            state, counters, tag, order, order.index(self.org_id), token
        )
        if outcome == "end" and token.starter != self.org_id:
            await self._send_token(state, counters, tag, token.starter, token)

    def _spawn(self, work: Awaitable[object]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _take_pieces(
        self,
        state: _RoundState,
        counters: _Counters,
        org: str,
        kind: str,
        request: Callable[[int, int], bytes],
        into: np.ndarray,
        span: tuple[int, int],
        stage: str,
    ) -> None:
        """Fill ``into[lo:hi]`` (``span``) from ``org``'s answers to ``request(start,
        stop)``, in pieces of at most ``_TOTAL_PIECE_BYTES``; :class:`_BadPiece` when an
        answer has the wrong size, a transport error as it comes."""
        lo, hi = span
        step = max(1, _TOTAL_PIECE_BYTES // into.itemsize)
        for start in range(lo, hi, step):
            stop = min(hi, start + step)
            piece = await self._send(
                counters,
                org,
                kind,
                request(start, stop),
                run=state.run,
                round=state.round,
                stage=stage,
            )
            if len(piece) != (stop - start) * into.itemsize:
                raise _BadPiece(f"{kind}: a piece [{start}, {stop}) of the wrong size")
            into[start:stop] = np.frombuffer(piece, dtype=into.dtype)

    async def _fetch_total(
        self, state: _RoundState, counters: _Counters, tag: str, attempt: int, like: np.ndarray
    ) -> np.ndarray:
        """The masked sum of ring attempt ``attempt`` from a member that holds it (its
        ring completed, or it took the sum already), piece by piece."""
        total = np.empty_like(like)
        for org in sorted(state.completers.get(tag, set()) - {self.org_id}):
            try:
                await self._take_pieces(
                    state,
                    counters,
                    org,
                    KIND_TOTAL,
                    functools.partial(_TOTAL_REQUEST.pack, attempt),
                    total,
                    (0, len(total)),
                    tag,
                )
            except (TransportError, _BadPiece) as exc:
                self._observe(
                    "unreachable", state.run, state.round, "reduce", peer=org, detail=str(exc)
                )
                continue
            self._observe(
                "retry",
                state.run,
                state.round,
                "reduce",
                peer=org,
                detail="took the masked sum from a member whose ring completed",
            )
            return total
        raise RoundFailed(
            "reduce", "the ring completed elsewhere, but no member could send its sum here"
        )

    # -- the round ----------------------------------------------------------------------

    async def _enter(self, run: str, round: int, stage: str) -> None:
        state = self._states.get((run, round))
        if state is not None:
            state.stage, state.stage_since = stage, self.clock()
            state.inbox.awaiting = None
        if self.hook is not None:
            await self.hook(self.org_id, run, round, stage)

    async def run_round(
        self,
        run: str,
        round: int,
        vector: np.ndarray,
        *,
        deadline: float | None = None,
    ) -> RoundResult:
        """Take part in round ``round`` of ``run`` with ``vector``; every survivor gets the same sum.

        ``deadline`` is the clock time (``clock()``) by which ``ready`` messages must
        be seen; ``None`` means ``ready_timeout`` from now. Raises :class:`RoundFailed`
        with the stage and the reason when the round cannot complete. Whatever the
        outcome, the round is closed afterwards: its late messages are refused and the
        next round starts clean.
        """
        if not run:
            raise ValueError("run must be a non-empty string")
        if (run, round) in self._running:
            raise RoundFailed("ready", f"round {round} of {run!r} is already running here")
        # messages of rounds this node will never run (behind this one, or too far
        # ahead of it) are dropped, so wrong-round traffic cannot hold slots
        for key in [
            k
            for k in self._states
            if k[0] == run and not round <= k[1] <= round + self.config.lookahead_rounds
        ]:
            del self._states[key]
            self.ring.close(*key)
        try:
            state = self._state(run, round)
        except Refused as exc:
            raise RoundFailed("ready", f"round {round} of {run!r} cannot start: {exc}") from None
        self._running.add((run, round))
        state.started = asyncio.get_running_loop().time()
        self._observe("round", run, round, "ready")
        try:
            return await self._run(state, vector, deadline)
        except RoundFailed as exc:
            self._observe("failed", run, round, exc.stage, detail=exc.reason)
            # tell the others at once, so that none waits out a timeout for this node
            await self._broadcast(
                _Counters(),
                sorted(set(self.peers()) - {self.org_id}),
                KIND_LEAVE,
                b"",
                run=run,
                round=round,
                stage="leave",
                timeout=self.config.send_timeout / 4,
            )
            raise
        finally:
            self._running.discard((run, round))
            self._finish(run, round)

    async def _run(
        self, state: _RoundState, vector: np.ndarray, deadline: float | None
    ) -> RoundResult:
        me, run, rnd, cfg = self.org_id, state.run, state.round, self.config
        counters = _Counters()
        times: dict[str, float] = {}
        loop = asyncio.get_running_loop()
        t_stage = t_round = time.perf_counter()
        sent_before = 0

        def sent() -> int:
            return counters.bytes_sent + counters.ring.bytes_sent

        def lap(stage: str) -> None:
            nonlocal t_stage, sent_before
            now = time.perf_counter()
            times[stage] = times.get(stage, 0.0) + now - t_stage
            total = sent()
            self._observe(
                "stage", run, rnd, stage, seconds=now - t_stage, bytes=total - sent_before
            )
            t_stage, sent_before = now, total

        # 1. ready
        await self._enter(run, rnd, "ready")
        u0 = tuple(sorted(set(self.peers()) | {me}))
        t = cfg.threshold_for(len(u0))
        if not 2 <= t <= len(u0):
            raise RoundFailed("ready", f"threshold {t} does not fit {len(u0)} members")
        k = cfg.neighbours_for(len(u0))
        session = self.session_factory(
            SessionContext(
                self.endpoint.federation,
                run,
                rnd,
                me,
                u0,
                cfg.share_threshold_for(len(u0)),
                vector,
                k,
            )
        )
        h0 = view_hash("members", u0)
        own_ready = h0 + session.advertise()
        state.inbox.put(("ready",), me, own_ready)
        self._offer(state, ("ready",), own_ready)
        wait_s = (deadline - self.clock()) if deadline is not None else cfg.ready_timeout
        ready_end = loop.time() + max(0.0, wait_s)
        # each pair of members exchanges its readies in one request and its reply: this
        # node sends to the peers it initiates with and to those whose ready came before
        # it had its own (see _targets). A peer not reached (a partition, a peer still
        # starting) is tried again a few times before the deadline, so a partition
        # that heals in time costs nothing
        pending: set[str] = set(self._targets(state, ("ready",), u0))

        def file_ready(peer: str, data: bytes) -> None:
            if self._filed(state, ("ready",), peer, data):
                self._arrival(run, rnd, "ready", peer, len(data))

        retry_s = max(0.05, wait_s / 8)
        # the wait ends early once every member believed alive is ready
        awaited = set(u0) if self.live is None else (set(self.live()) & set(u0)) | {me}
        tries = 0
        while True:
            if tries:
                for org in sorted(pending):
                    self._observe("retry", run, rnd, "ready", peer=org, detail="ready re-sent")
            tries += 1
            pending = await self._broadcast(
                counters,
                sorted(pending),
                KIND_READY,
                own_ready,
                run=run,
                round=rnd,
                stage="ready",
                on_reply=file_ready,
            )
            if not pending or loop.time() + retry_s >= ready_end:
                break
            got = await state.inbox.wait(("ready",), awaited, min(ready_end, loop.time() + retry_s))
            if got.keys() >= awaited:
                break
        await state.inbox.wait(("ready",), awaited, ready_end)
        readies = {o: p for o, p in state.inbox.get(("ready",)).items() if o in u0}
        ready_set = {me}
        for org, payload in sorted(readies.items()):
            if org == me:
                continue
            if payload[:_HASH] != h0:
                logger.warning("%s: %s is ready with another member list; left out", me, org)
                self._observe("mismatch", run, rnd, "ready", peer=org, detail="another member list")
                continue
            if self._accept(
                session.receive_advert, org, payload[_HASH:], "advertisement", run, rnd
            ):
                ready_set.add(org)
        for org in sorted(set(u0) - readies.keys() - {me}):
            self._observe("missing", run, rnd, "ready", peer=org, detail="no ready by the deadline")
        lap("ready")

        # 2. share keys, carrying this node's view of the participants
        await self._enter(run, rnd, "share")
        view1 = frozenset(ready_set)
        if len(view1) < max(t, cfg.min_participants):
            raise RoundFailed(
                "ready",
                f"{len(view1)} participants are ready, fewer than "
                f"{max(t, cfg.min_participants)} (threshold t={t})",
            )
        h1 = view_hash("ready", view1)
        try:
            outgoing = session.share_keys(view1)
        except (SecAggError, ValueError) as exc:
            raise RoundFailed("share", f"cannot share keys: {exc}") from exc
        # the holders of this org's shares, who also send theirs here (the graph is
        # undirected): every other ready org, or only the SecAgg+ neighbours
        holders = frozenset(outgoing) & (view1 - {me})
        sparse = holders != view1 - {me}
        share_end = loop.time() + cfg.stage_timeout
        mine = {o: h1 + outgoing[o] for o in holders}
        # one request and its reply per pair of holders, as for the readies
        self._offer(state, ("share",), mine)
        sent_to = set(self._targets(state, ("share",), holders))

        def file_share(peer: str, data: bytes) -> None:
            if len(data) >= _HASH and self._filed(state, ("share",), peer, data):
                self._arrival(run, rnd, "share", peer, len(data))

        def send_shares(peers: Iterable[str]) -> Awaitable[set[str]]:
            return self._broadcast(
                counters,
                sorted(peers),
                KIND_SHARE,
                mine,
                run=run,
                round=rnd,
                stage="share",
                on_reply=file_share,
            )

        unshared = await send_shares(sent_to)
        expected_shares = holders - unshared

        def shared() -> bool:
            return expected_shares - state.gone() <= state.inbox.senders(("share",))

        # the holders that send first get a moment; a holder whose share still did not
        # come is then sent this node's (a dead one is unreachable, and no longer awaited)
        await state.inbox.wait_any(
            [("share",), ("gone",)],
            shared,
            min(share_end, loop.time() + _patience(cfg)),
            expect=(("share",), expected_shares),
        )
        late = expected_shares - state.inbox.senders(("share",)) - state.gone() - sent_to
        if late:
            unshared |= await send_shares(late)
            expected_shares = holders - unshared
        await state.inbox.wait_any(
            [("share",), ("gone",)], shared, share_end, expect=(("share",), expected_shares)
        )
        shares = {o: p for o, p in state.inbox.get(("share",)).items() if o in expected_shares}
        for org in sorted(expected_shares - shares.keys()):
            why = "it left the round" if org in state.gone() else "no share by the deadline"
            self._observe("missing", run, rnd, "share", peer=org, detail=why)
        lap("share")

        # 3. agree on the participants U1: settled at once when every share came with
        # this node's view hash, by explicit view agreement otherwise. With SecAgg+ the
        # shares come from the neighbours only, so matching hashes prove nothing about
        # the rest: the view agreement always runs, and a node proposes no holder of its
        # shares whose own shares did not reach it (their masks would not cancel)
        await self._enter(run, rnd, "agree-ready")
        if (
            not sparse
            and not state.equivocal & view1
            and shares.keys() == view1 - {me}
            and all(p[:_HASH] == h1 for p in shares.values())
        ):
            u1 = view1
            state.decided["ready"] = (u1, True)
        else:
            # an org that sent this node two different readies or shares is left out
            proposal = view1 - unshared - state.equivocal
            if sparse:
                # every node runs this agreement: the token (O(n) messages) suffices
                proposal -= expected_shares - shares.keys()
                u1, _ = await self._settle(state, counters, "ready", u0, proposal)
            else:
                # others may have settled at no message: they answer views, not tokens
                u1, _ = await self._agree(state, counters, "ready", proposal)
            if len(u1) < t:
                raise RoundFailed("ready", f"{len(u1)} participants agreed, fewer than t={t}")
            shares = state.inbox.get(("share",))
        share_set = {me}
        for org, payload in sorted(shares.items()):
            if org in u1 and self._accept(
                session.receive_share, org, payload[_HASH:], "share", run, rnd
            ):
                share_set.add(org)
        # the ring sums the masked inputs of U1 less the holders whose shares this node
        # refused (with the complete graph: exactly the orgs whose shares it holds)
        members = u1 - ((holders & u1) - share_set)
        if len(members) < t:
            raise RoundFailed("share", f"{len(members)} orgs shared their keys, fewer than t={t}")
        lap("agree-ready")

        # 4. masked input and the ring
        await self._enter(run, rnd, "mask")
        try:
            masked = session.masked_input()
        except (SecAggError, ValueError) as exc:
            raise RoundFailed("mask", f"cannot mask the input: {exc}") from exc
        lap("mask")
        total: np.ndarray | None = None
        scattered: Scattered | None = None  # with owner unmasking, the ring's first half
        agreed_by: str | None = None  # and the tag of the token agreement that settled it
        attempt = 0
        while total is None and scattered is None:
            if attempt >= cfg.max_reduce_attempts:
                raise RoundFailed("reduce", f"the ring broke {attempt} times")
            await self._enter(run, rnd, "reduce")
            if attempt:
                self._observe("retry", run, rnd, "reduce", detail=f"ring attempt {attempt + 1}")
            order = ring_order(members, rnd)
            owners = self._owner_unmask(len(order), masked)
            t_ring, ring_before = time.perf_counter(), counters.ring.bytes_sent
            acc: np.ndarray | None = None
            part: Scattered | None = None
            suspects: frozenset[str] = frozenset()
            try:
                if owners:
                    part = await self.ring.reduce_scatter(
                        order,
                        masked,
                        run=run,
                        round=rnd,
                        attempt=attempt,
                        timeout=cfg.step_timeout,
                        stats=counters.ring,
                        on_step=self._step_hook(run, rnd),
                        start_grace=cfg.stage_timeout,
                        alive=self._believed_alive(),
                    )
                elif cfg.topology == "star":
                    acc = await self.ring.star_allreduce(
                        order,
                        masked,
                        run=run,
                        round=rnd,
                        attempt=attempt,
                        timeout=cfg.step_timeout,
                        stats=counters.ring,
                        start_grace=cfg.stage_timeout,
                    )
                else:
                    acc = await self.ring.allreduce(
                        order,
                        masked,
                        run=run,
                        round=rnd,
                        attempt=attempt,
                        timeout=cfg.step_timeout,
                        stats=counters.ring,
                        on_step=self._step_hook(run, rnd),
                        min_chunk=cfg.ring_min_chunk,
                        start_grace=cfg.stage_timeout,
                        alive=self._believed_alive(),
                    )
            except RingBroken as exc:
                logger.info("%s: ring attempt %d broke: %s", me, attempt, exc)
                suspects = (exc.suspects | self.ring.suspects(run, rnd, order, attempt)) - {me}
                for org in sorted(suspects):
                    self._observe("suspect", run, rnd, "reduce", peer=org, detail=str(exc))
            if (acc is not None or part is not None) and len(order) > 1:
                self._observe(
                    "link",
                    run,
                    rnd,
                    "reduce",
                    peer=order[order.index(me) - 1],
                    seconds=time.perf_counter() - t_ring,
                    bytes=counters.ring.bytes_sent - ring_before,
                )
            lap("reduce")
            await self._enter(run, rnd, "agree-reduce")
            if owners:
                # every member holds a complete chunk only when every reduce-scatter
                # completed, which no single member can see: the members agree on it
                # (the AND of the flags) before anyone releases a share
                tag = f"scatter:{attempt}"
                done = part is not None
                agreed, complete = await self._settle(
                    state, counters, tag, members, members - suspects, done
                )
                if me not in agreed:
                    raise RoundFailed("reduce", "the other members' proposals leave this node out")
                if complete and agreed == members:
                    scattered = part
                    agreed_by = tag
                else:
                    members = agreed
                    if len(members) < t:
                        raise RoundFailed(
                            "reduce", f"{len(members)} survivors, fewer than the threshold t={t}"
                        )
                lap("agree-reduce")
                attempt += 1
                continue
            tag = f"reduce:{attempt}"
            if acc is not None:
                # this node holds the masked sum of every member of the attempt: that
                # settles the attempt for all at no message (see _decisive); a token or
                # view of it that came meanwhile gets this node's proposal
                self._settled(state, tag, members, True)
                self._keep_total(run, rnd, attempt, members, acc)
                self._spawn(self._pass_on_held(state, tag, members))
                total = acc
            else:
                agreed, completed = await self._settle(
                    state, counters, tag, members, members - suspects, False
                )
                if completed:
                    if agreed != members:
                        raise RoundFailed("reduce", "a completed ring over another member set")
                    total = await self._fetch_total(state, counters, tag, attempt, masked)
                    self._keep_total(run, rnd, attempt, members, total)
                else:
                    members = agreed
                    if len(members) < t:
                        raise RoundFailed(
                            "reduce", f"{len(members)} survivors, fewer than the threshold t={t}"
                        )
            lap("agree-reduce")
            attempt += 1

        # 5. unmask
        await self._enter(run, rnd, "unmask")
        u3 = members
        if state.released_for is not None and state.released_for != u3:
            raise RoundFailed("unmask", "shares were already released for another survivor set")
        state.released_for = u3
        try:
            release = session.unmask(u3)
        except (SecAggError, ValueError) as exc:
            raise RoundFailed("unmask", f"cannot release shares: {exc}") from exc
        h3 = view_hash("unmask", u3)
        key3 = ("unmask", h3.hex())
        others3 = u3 - {me}
        self._offer(state, key3, dict.fromkeys(others3, h3 + release))
        _keep_latest(self._releases, self._release_events, run, rnd, (h3, u3, h3 + release))

        def file_release(peer: str, data: bytes) -> None:
            if data[:_HASH] == h3 and self._filed(state, key3, peer, data[_HASH:]):
                self._arrival(run, rnd, "unmask", peer, len(data))

        def send_release(
            peers: Iterable[str],
            sent: _Counters = counters,
            on_reply: Callable[[str, bytes], None] | None = file_release,
        ) -> Awaitable[set[str]]:
            return self._broadcast(
                sent,
                sorted(peers),
                KIND_UNMASK,
                h3 + release,
                run=run,
                round=rnd,
                stage="unmask",
                on_reply=on_reply,
            )

        # nobody dropped since U1 and at least t members settled the survivors by one
        # token (the permit): each survivor reveals its own self-mask seed, and the
        # seeds spread by recursive doubling (no share is reconstructed)
        by_seeds = (
            u3 == u1
            and agreed_by is not None
            and await self._permitted(state, counters, agreed_by, u3, h3, t)
        )
        if by_seeds and await self._spread_seeds(state, counters, session, u3, h3):
            # a survivor short of a seed asked for this node's release before it had
            # one, and the reply waited in vain: it gets the release now
            owed = self._targets(state, key3, state.inbox.senders(key3))
            if owed:
                self._spawn(send_release(owed, _Counters(), None))
            result = await self._unmasked(
                state, counters, session, total, scattered, order, attempt, lap
            )
            return await self._completed(
                state, result, u1, u3, t, k, attempt, counters, times, t_round
            )
        if by_seeds:
            # a seed did not come (its owner died after the agreement, or a relay did):
            # the releases reconstruct it; survivors answer a release with their own
            self._observe("retry", run, rnd, "unmask", detail="seeds missing: releases")
            targets = sorted(others3 - state.inbox.senders(key3))
        else:
            targets = self._targets(state, key3, others3)
        await send_release(targets)
        # finish as soon as the session holds every share it needs (a survivor that
        # died after the reduce is simply not waited for), or at the stage deadline
        unmask_end = loop.time() + cfg.stage_timeout
        accepted: set[str] = set()
        # asking the session whether it can finish costs O(n k) (it plans every
        # reconstruction), so it is asked once t - 1 releases are in, then after each
        # further sixteenth of the survivors or a quiet spell, not on every arrival
        # (which made the stage O(n^3 k) CPU over a simulated federation)
        stride = max(1, len(others3) // 16)
        check_at = t - 1
        quiet = 0.05
        seen = 0
        lull = False
        checked = -1

        def arrivals(count: int) -> Callable[[], bool]:
            return lambda: len(state.inbox.senders(key3)) >= count

        # the survivors that send first get a moment; then those still silent are
        # asked (one that finished by the seeds sends its release only when asked)
        pull_at: float | None = loop.time() + _patience(cfg)
        finished = False
        while not finished:
            if pull_at is not None and loop.time() >= pull_at:
                pull_at = None
                await send_release(
                    others3 - state.inbox.senders(key3) - set(targets) - state.gone()
                )
            # releases are decoded one by one, up to the next check: those still
            # queued when the session can finish are never decoded
            for org, payload in state.inbox.since(key3, seen):
                seen += 1
                if org in others3 and org not in accepted:
                    accepted.add(org)
                    self._accept(session.receive_release, org, payload, "release", run, rnd)
                    if len(accepted) >= check_at:
                        finished = len(accepted) + 1 >= t and session.can_finish()
                        checked, check_at = len(accepted), len(accepted) + stride
                        if finished:
                            break
            if finished:
                break
            last = len(accepted) >= len(others3) or loop.time() >= unmask_end
            if (lull and len(accepted) != checked) or last:
                if len(accepted) + 1 >= t and session.can_finish():
                    break
                checked, check_at = len(accepted), len(accepted) + stride
                if lull:  # each quiet spell that ends in a check doubles the next one
                    quiet = min(2 * quiet, cfg.step_timeout)
            if last:
                break
            wake = arrivals(seen + max(1, check_at - len(accepted)))
            until = min(unmask_end, loop.time() + quiet)
            if pull_at is not None:
                until = min(until, pull_at)
            await state.inbox.wait_any([key3], wake, until, expect=(key3, others3))
            lull = not wake()
        if not session.can_finish() or len(accepted) + 1 < t:
            for org in sorted(u3 - accepted - {me}):
                self._observe(
                    "missing", run, rnd, "unmask", peer=org, detail="no release by the deadline"
                )
        released = len(accepted) + 1
        if released < t:
            raise RoundFailed("unmask", f"{released} orgs released shares, fewer than t={t}")
        result = await self._unmasked(
            state, counters, session, total, scattered, order, attempt, lap
        )
        return await self._completed(state, result, u1, u3, t, k, attempt, counters, times, t_round)

    async def _unmasked(
        self,
        state: _RoundState,
        counters: _Counters,
        session: MaskedSum,
        total: np.ndarray | None,
        scattered: Scattered | None,
        order: list[str],
        attempt: int,
        lap: Callable[[str], None],
    ) -> np.ndarray:
        """The sum, once the session can remove every mask: from the whole masked sum,
        or by owner unmasking of the chunks this node holds (``order``: the ring)."""
        if scattered is not None:
            return await self._gather_sum(
                state, counters, session, scattered, order, attempt - 1, lap
            )
        assert total is not None
        try:
            result = session.unmasked_sum(total)
        except (SecAggError, ValueError) as exc:
            raise RoundFailed("unmask", f"cannot remove the masks: {exc}") from exc
        lap("unmask")
        return result

    async def _completed(
        self,
        state: _RoundState,
        result: np.ndarray,
        u1: frozenset[str],
        u3: frozenset[str],
        t: int,
        k: int | None,
        attempt: int,
        counters: _Counters,
        times: dict[str, float],
        t_round: float,
    ) -> RoundResult:
        run, rnd = state.run, state.round
        await self._enter(run, rnd, "done")
        order1 = tuple(ring_order(u1, rnd))
        for org in sorted(u1 - u3):
            self._observe("dropped", run, rnd, "unmask", peer=org)
        sent = counters.bytes_sent + counters.ring.bytes_sent
        self._observe(
            "completed", run, rnd, "done", seconds=time.perf_counter() - t_round, bytes=sent
        )
        return RoundResult(
            run=run,
            round=rnd,
            sum=result,
            participants=order1,
            survivors=tuple(o for o in order1 if o in u3),
            dropped=tuple(sorted(u1 - u3)),
            threshold=t,
            bytes_sent=sent,
            messages_sent=counters.messages_sent + counters.ring.messages_sent,
            ring_bytes_sent=counters.ring.bytes_sent,
            ring_attempts=attempt,
            stage_times=times,
            neighbours=k,
        )

    async def _permitted(
        self,
        state: _RoundState,
        counters: _Counters,
        tag: str,
        u3: frozenset[str],
        h3: bytes,
        t: int,
    ) -> bool:
        """Whether this survivor may reveal its self-mask seed rather than have its
        holders release shares of it: when at least ``t`` members settled the
        survivors ``u3`` on one token decision (``tag``), fewer than ``t`` can ever
        settle a set without this node and release its mask-key shares, the same bound
        that keeps ``t`` released b-shares safe. The token's starter knows who settled
        on its decision (their replies say so) and tells the survivors
        (``round.permit``); a node that settled otherwise, or hears no permit within a
        step timeout, releases shares instead."""
        me = self.org_id
        starter = state.joined.get(tag)
        if starter is None or tag in state.stalled:
            return False
        if starter == me:
            if len(state.settled_by.get(tag, frozenset()) & u3) < t:
                return False
            await self._broadcast(
                counters,
                sorted(u3 - {me}),
                KIND_PERMIT,
                h3,
                run=state.run,
                round=state.round,
                stage="unmask",
            )
            return True
        deadline = asyncio.get_running_loop().time() + self.config.step_timeout
        got = await self._await_from(
            state, ("permit", h3.hex()), starter, deadline, self._believed_alive()
        )
        return got is not None

    async def _spread_seeds(
        self,
        state: _RoundState,
        counters: _Counters,
        session: MaskedSum,
        u3: frozenset[str],
        h3: bytes,
    ) -> bool:
        """Reveal this survivor's self-mask seed and gather every survivor's, by
        recursive doubling (Bruck et al.) over the ring order of ``u3``: at step ``i``
        a node sends every seed it holds to the member ``2**i`` places before it and
        takes those of the member ``2**i`` places after it, so after ``ceil(log2 n)``
        steps each holds all ``n``, for ``n log2 n`` small messages in all instead of
        the ``n (n - 1)`` releases. Relayed seeds are checked against their owners'
        commitments, so a relay can withhold a seed but not change one. A sender that
        stays silent for a step timeout (or that left, or that membership holds dead)
        is not waited for again: this node sends its remaining steps at once, and
        returns whether it holds every seed; if not, the releases reconstruct the rest.
        """
        me, run, rnd, cfg = self.org_id, state.run, state.round, self.config
        try:
            known = {me: session.self_seed()}
        except (SecAggError, ValueError) as exc:
            raise RoundFailed("unmask", f"cannot reveal the self-mask seed: {exc}") from exc
        order = ring_order(u3, rnd)
        names = sorted(u3)
        index = {o: i for i, o in enumerate(names)}
        n, here = len(order), order.index(me)
        loop = asyncio.get_running_loop()
        alive = self._believed_alive()
        sends: list[asyncio.Future[set[str]]] = []
        waiting = True
        step, distance = 0, 1
        while distance < n:
            payload = b"".join(
                [h3, bytes([step])]
                + [_SEED_ENTRY.pack(index[o], seed) for o, seed in sorted(known.items())]
            )
            dest, src = order[(here - distance) % n], order[(here + distance) % n]
            sends.append(
                asyncio.ensure_future(
                    self._broadcast(
                        counters, [dest], KIND_SEED, payload, run=run, round=rnd, stage="unmask"
                    )
                )
            )
            if waiting:
                key = ("seed", h3.hex(), str(step))
                got = await self._await_from(state, key, src, loop.time() + cfg.step_timeout, alive)
                if got is None:
                    waiting = False
                    self._observe(
                        "missing", run, rnd, "unmask", peer=src, detail=f"no seeds at step {step}"
                    )
                else:
                    for at in range(0, len(got), _SEED_ENTRY.size):
                        i, seed = _SEED_ENTRY.unpack_from(got, at)
                        owner = names[i] if i < n else f"#{i}"
                        if self._accept(session.receive_seed, owner, seed, "seed", run, rnd):
                            known[owner] = seed
            step, distance = step + 1, 2 * distance
        await asyncio.gather(*sends)
        return len(known) == n and session.can_finish()

    async def _await_from(
        self,
        state: _RoundState,
        key: tuple[str, ...],
        sender: str,
        deadline: float,
        alive: Callable[[str], bool] | None,
    ) -> bytes | None:
        """``sender``'s message under ``key`` once it came; ``None`` at ``deadline``,
        or as soon as ``sender`` left the round or membership no longer holds it alive."""
        loop = asyncio.get_running_loop()

        def arrived() -> bool:
            return sender in state.inbox.senders(key) or sender in state.gone()

        while True:
            got = state.inbox.item(key, sender)
            now = loop.time()
            if got is not None:
                return got
            if now >= deadline or sender in state.gone():
                return None
            if alive is not None and not alive(sender):
                return None
            until = deadline if alive is None else min(deadline, now + LIVENESS_POLL_S)
            await state.inbox.wait_any([key, ("gone",)], arrived, until, expect=(key, {sender}))

    def _owner_unmask(self, n: int, masked: np.ndarray) -> bool:
        """Whether a ring of ``n`` members unmasks by chunk owners (see
        :attr:`RoundConfig.owner_unmask_from`): the same on every member of the ring."""
        cfg = self.config
        return (
            cfg.owner_unmask_from is not None
            and cfg.topology == "ring"
            and n >= cfg.owner_unmask_from
            and len(masked) >= n * cfg.ring_min_chunk
        )

    async def _gather_sum(
        self,
        state: _RoundState,
        counters: _Counters,
        session: MaskedSum,
        scattered: Scattered,
        order: list[str],
        attempt: int,
        lap: Callable[[str], None],
    ) -> np.ndarray:
        """Owner unmasking: unmask the two chunks this node holds, serve them, and take
        the rest of the unmasked sum along the ring (``all_gather_sum``), or, when that
        breaks, chunk by chunk from members that hold them (:meth:`_fetch_parts`)."""
        run, rnd, cfg = state.run, state.round, self.config
        acc = scattered.acc
        try:
            for index in sorted({scattered.own, scattered.held}):
                lo, hi = scattered.bounds[index]
                acc[lo:hi] = session.unmask_part(acc[lo:hi], lo)
        except (SecAggError, ValueError) as exc:
            raise RoundFailed("unmask", f"cannot remove the masks: {exc}") from exc
        self._keep_parts(run, rnd, attempt, frozenset(order), scattered)
        lap("unmask")
        await self._enter(run, rnd, "gather")
        try:
            await self.ring.all_gather_sum(
                order,
                scattered,
                run=run,
                round=rnd,
                attempt=attempt,
                timeout=cfg.step_timeout,
                stats=counters.ring,
                on_step=self._step_hook(run, rnd),
                alive=self._believed_alive(),
            )
        except RingBroken as exc:
            logger.info("%s: the all-gather of the sum broke: %s", self.org_id, exc)
            await self._fetch_parts(state, counters, order, attempt, scattered)
        result = session.decode(acc)
        lap("gather")
        # the kept chunks are served to others: the caller gets its own array
        return result.copy() if result is acc else result

    def _accept(
        self,
        receive: Callable[[str, bytes], object],
        sender: str,
        data: bytes,
        what: str,
        run: str = "",
        round: int = -1,
    ) -> bool:
        """Hand one message to the session; a refused one is logged and left out."""
        try:
            receive(sender, data)
        except (SecAggError, ValueError) as exc:
            logger.warning("%s: refused the %s of %s: %s", self.org_id, what, sender, exc)
            self._observe("refused", run, round, what, peer=sender, detail=str(exc))
            return False
        return True

    def _believed_alive(self) -> Callable[[str], bool] | None:
        """Whether the membership layer still believes an org alive (``None``: no such
        layer): a ring step waiting on a predecessor it no longer does pings it at once."""
        live = self.live
        if live is None:
            return None
        return lambda org: org in set(live())

    def _step_hook(self, run: str, round: int) -> Callable[[str, int], Awaitable[None]] | None:
        hook = self.hook
        if hook is None:
            return None

        async def on_step(phase: str, step: int) -> None:
            await hook(self.org_id, run, round, f"reduce.{phase}.{step}")

        return on_step

    # -- the next model's hash ------------------------------------------------------------

    async def publish_model_hash(
        self, run: str, round: int, digest: bytes, peers: Iterable[str]
    ) -> set[str]:
        """Send the SHA-256 of this node's next model to ``peers``; return those not reached."""
        if len(digest) != _HASH:
            raise ValueError("a model hash is a 32-byte SHA-256 digest")
        return await self._broadcast(
            _Counters(), sorted(set(peers)), KIND_MODEL, digest, run=run, round=round, stage="model"
        )

    async def compare_model_hash(
        self, run: str, round: int, digest: bytes, peers: Iterable[str], *, timeout: float
    ) -> frozenset[str]:
        """Wait for ``peers``' model hashes; raise :class:`ModelHashMismatch` on any difference.

        Returns the peers whose hash arrived and matched; a peer that sent nothing
        within ``timeout`` is not a mismatch (it may have dropped out).
        """
        key = (run, round)
        wanted = set(peers) - {self.org_id}
        event = self._model_events.setdefault(key, asyncio.Event())
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            event.clear()
            got = self._model_hashes.get(key, {})
            differing = {o: d for o, d in got.items() if o in wanted and d != digest}
            if differing:
                for org in sorted(differing):
                    self._observe("mismatch", run, round, "model", peer=org, detail="model hash")
                raise ModelHashMismatch(run, round, digest, differing)
            if wanted <= got.keys() or loop.time() >= end:
                return frozenset(o for o in wanted if o in got)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), end - loop.time())

    async def check_model_hash(
        self, run: str, round: int, digest: bytes, peers: Iterable[str], *, timeout: float
    ) -> frozenset[str]:
        """Publish this node's model hash, then compare with the peers' (both above)."""
        peer_set = set(peers) - {self.org_id}
        await self.publish_model_hash(run, round, digest, peer_set)
        return await self.compare_model_hash(run, round, digest, peer_set, timeout=timeout)


def _refusal_kind(exc: Refused) -> str:
    """``stale`` for a message of a round already closed on one side or a second copy
    of one (a send retried after a lost reply), else ``refused``."""
    return "stale" if exc.reason in (RefusalReason.STALE, RefusalReason.REPLAY) else "refused"


def _known_tag(tag: str, config: RoundConfig) -> bool:
    if tag in ("ready", "share"):
        return True
    prefix, _, num = tag.partition(":")
    return (
        prefix in ("reduce", "scatter") and num.isdigit() and int(num) < config.max_reduce_attempts
    )
