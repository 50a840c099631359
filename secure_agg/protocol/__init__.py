"""Serverless masked-sum secure aggregation: one state machine per participant.

This is the protocol of Bonawitz et al., *Practical Secure Aggregation for
Privacy-Preserving Machine Learning*, CCS'17, §4 (Fig. 4), with two changes:

* **No server.** Every participant plays the server's part for itself: it collects
  every other participant's messages, and any party (the overlay, along a ring) adds
  the masked vectors. Every survivor ends with the same sum of the inputs of U3.
* **SecAgg+ neighbourhoods** (Bell et al., CCS'20, §3): with ``neighbours=k`` a
  participant agrees pairwise masks with, and Shamir-shares ``b_i`` and ``s_sk_i``
  among, only its ``k`` neighbours of a deterministic graph seeded by the round
  (:mod:`secure_agg.graph`). ``neighbours=None`` is the complete graph of Bonawitz.

Stages (``Stage``), each closed explicitly when the overlay's deadline passes::

    ADVERTISE_KEYS  advertise_keys()      receive(AdvertiseKeys)  close_advertise() -> U1
    SHARE_KEYS      share_keys()          receive(ShareKeys)      close_shares()    -> U2
    MASKED_INPUT    masked_input(x) -> y                          unmask(U3, views) -> UnmaskShares
    UNMASK          self_seed() -> b      receive(UnmaskShares)   finalize(sum)     -> sum of x over U3
                                          receive_seed(owner, b)
    DONE | ABORTED

``y_i = x_i + PRG(b_i) + sum_{j in U2, j ~ i} sign(i, j) PRG(s_ij)`` with
``sign(i, j) = +1`` when i precedes j in the ring order and ``-1`` otherwise, so the
pairwise masks of two survivors cancel in any sum, added in any order or by chunks.

Without a server nobody hands out one U2: each peer's U2 is the set of orgs whose
ShareKeys reached it, and an org that dropped half-way through sending its shares
leaves views that differ. So the survivors agree on every survivor's U2 before any
share is released, and finalize removes a dropped org's pairwise masks exactly for
the survivors whose agreed U2 holds it, silent ones included:

* ``unmask(U3, views)`` takes them as the masked inputs committed to them (the
  simulation carries each one's U2 with its masked input), or
* ``close_shares(participants)`` fixes U2 to the peer's neighbourhood among the
  participants the overlay agreed after the shares (refusing to mask without all of
  their shares), and every survivor's view follows from that same set: what the round
  engine does.

A dropped org some survivor masked with whose mask key fewer than ``t`` survivors
hold shares of can never be removed: ``unmask`` aborts naming it, before releasing
anything. A release reporting another U2 than its sender's agreed one is refused.
Without agreed views only the releases' reports are known, and a survivor that
stays silent next to a dropped org is never guessed at: finalize aborts.

Every input is validated completely before any state changes: a rejected message or
call raises a specific :class:`~secure_agg.errors.ProtocolError` and leaves the peer
exactly as it was. A round that can no longer finish with at least ``t`` orgs moves
to ``ABORTED`` (raising :class:`~.errors.RoundAborted`) and releases nothing further.

Modules, each importing only those listed before it (and the rest of
:mod:`secure_agg`, numpy and cryptography: no I/O, no networking):

* :mod:`.errors`: the refusal of each kind (``ProtocolError`` subclasses).
* :mod:`.config`: :class:`ProtocolConfig`, the round everyone agrees on; ``share_aad``.
* :mod:`.unmasking`: the secrets finalize reconstructs and the masks it removes.
* :mod:`.shares`: ShareKeys sealed and opened, UnmaskShares checked.
* :mod:`.prepared`: the ``s`` pair and ``b`` drawn ahead (:class:`MaskingSecrets`),
  and the masks of the usual case they give (:func:`usual_masks`).
* :mod:`.state`: what a peer holds and the checks every call and message meets first.
* :mod:`.peer`: :class:`SecAggPeer`, the stages.
* :mod:`.simulate`: a whole round in memory (:func:`simulate_round`, :func:`run_round`),
  for tests and benchmarks.
"""

from secure_agg.messages import MalformedMessage, Stage
from secure_agg.protocol.config import (
    ProtocolConfig,
    RandomBytes,
    SignFn,
    VerifyFn,
    share_aad,
)
from secure_agg.protocol.errors import (
    BadSignature,
    BadVector,
    DoubleRelease,
    DuplicateMessage,
    InconsistentView,
    InvalidShare,
    OutOfStage,
    RoundAborted,
    UnknownSender,
    WrongRecipient,
    WrongRound,
)
from secure_agg.protocol.peer import SecAggPeer
from secure_agg.protocol.prepared import MaskingSecrets, usual_masks
from secure_agg.protocol.simulate import RoundResult, run_round, simulate_round

__all__ = [
    "BadSignature",
    "BadVector",
    "DoubleRelease",
    "DuplicateMessage",
    "InconsistentView",
    "InvalidShare",
    "MalformedMessage",
    "MaskingSecrets",
    "OutOfStage",
    "ProtocolConfig",
    "RandomBytes",
    "RoundAborted",
    "RoundResult",
    "SecAggPeer",
    "SignFn",
    "Stage",
    "UnknownSender",
    "VerifyFn",
    "WrongRecipient",
    "WrongRound",
    "run_round",
    "share_aad",
    "simulate_round",
    "usual_masks",
]
