"""The refusals of the masked-sum protocol: one :class:`~secure_agg.errors.ProtocolError`
subclass for each way a message or a call can be wrong.

Every one of them leaves the peer that raised it exactly as it was, except
:class:`RoundAborted`, which the peer raises once it has moved to ``ABORTED``.
"""

from __future__ import annotations

from secure_agg.errors import ProtocolError, RingError

__all__ = [
    "BadSignature",
    "BadVector",
    "DoubleRelease",
    "DuplicateMessage",
    "InconsistentView",
    "InvalidShare",
    "OutOfStage",
    "RoundAborted",
    "UnknownSender",
    "WrongRecipient",
    "WrongRound",
]


class BadSignature(ProtocolError):
    """The message's signature does not verify under its sender's identity key."""


class WrongRound(ProtocolError):
    """The message belongs to another federation, run or round."""


class OutOfStage(ProtocolError):
    """A message or a call that the peer's current stage does not accept."""


class UnknownSender(ProtocolError):
    """A sender that is not a participant, did not advertise keys, or is not a neighbour."""


class DuplicateMessage(ProtocolError):
    """A second message of the same stage from one sender (a replay or an equivocation)."""


class WrongRecipient(ProtocolError):
    """A ShareKeys message addressed to another participant."""


class InvalidShare(ProtocolError):
    """Shares that do not decrypt, do not parse, or carry another holder's index."""


class InconsistentView(ProtocolError):
    """Survivor or U2 sets that disagree with this peer's own view of the round."""


class DoubleRelease(ProtocolError):
    """A request to release both the b-share and the s_sk-share of one org.

    Bonawitz et al. §4 (round 4): an honest holder releases for each org either a
    share of its self-mask seed (the org survived) or of its mask key (the org
    dropped), never both, since both together unmask that org's individual input.
    """


class BadVector(ProtocolError, RingError):
    """A vector of the wrong dtype, shape, length or ring width."""


class RoundAborted(ProtocolError):
    """The round cannot finish with at least ``t`` orgs; nothing more is released."""
