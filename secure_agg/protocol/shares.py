"""Shamir shares in transit: sealed in ShareKeys (round 1), released in UnmaskShares (round 4).

:func:`seal_shares` encrypts the pair ``(b-share, s_sk-share)`` an org gives one of its
holders, under a key agreed from the two orgs' ``c`` keys and bound to the round and
the ordered pair (:func:`~secure_agg.protocol.config.share_aad`); :func:`open_shares`
is the holder's side and refuses anything but its own two shares. :func:`check_release`
checks a received UnmaskShares against the receiver's view of the round before it is
kept. Each function only reads its arguments: a refusal changes nothing.
"""

from __future__ import annotations

from collections.abc import Container, Mapping

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from secure_agg import shamir
from secure_agg.errors import SecAggError
from secure_agg.keys import agree, decrypt, encrypt, share_encryption_key
from secure_agg.messages import UnmaskShares
from secure_agg.protocol.config import ProtocolConfig, share_aad
from secure_agg.protocol.errors import (
    DuplicateMessage,
    InconsistentView,
    InvalidShare,
    UnknownSender,
)
from secure_agg.shamir import Share

__all__ = ["PLAINTEXT_BYTES", "check_release", "open_shares", "seal_shares"]

PLAINTEXT_BYTES = 2 * shamir.SHARE_BYTES
"""A sealed pair: the b-share, then the s_sk-share."""


def _pair_key(
    config: ProtocolConfig, own: X25519PrivateKey, peer_c_pk: bytes, sender: str, recipient: str
) -> bytes:
    return share_encryption_key(agree(own, peer_c_pk), config.ctx, sender, recipient)


def seal_shares(
    config: ProtocolConfig,
    sender: str,
    recipient: str,
    c_private: X25519PrivateKey,
    recipient_c_pk: bytes,
    shares: tuple[Share, Share],
    nonce: bytes,
    *,
    ahead: bool = False,
) -> bytes:
    """The ShareKeys ciphertext of ``sender``'s ``(b-share, s_sk-share)`` for ``recipient``
    (``ahead``: sealed to a key the recipient advertised in an earlier round)."""
    key = _pair_key(config, c_private, recipient_c_pk, sender, recipient)
    plaintext = shares[0].to_bytes() + shares[1].to_bytes()
    aad = share_aad(config.ctx, sender, recipient, ahead=ahead)
    return encrypt(key, plaintext, aad, nonce=nonce)


def open_shares(
    config: ProtocolConfig,
    sender: str,
    recipient: str,
    c_private: X25519PrivateKey,
    sender_c_pk: bytes,
    ciphertext: bytes,
    *,
    ahead: bool = False,
) -> tuple[Share, Share]:
    """The two shares ``sender`` sealed for ``recipient``; :class:`InvalidShare` when they
    do not decrypt, do not parse, or carry another holder's x."""
    key = _pair_key(config, c_private, sender_c_pk, sender, recipient)
    try:
        aad = share_aad(config.ctx, sender, recipient, ahead=ahead)
        plaintext = decrypt(key, ciphertext, aad)
    except SecAggError:
        raise InvalidShare(f"shares from {sender!r} do not decrypt") from None
    if len(plaintext) != PLAINTEXT_BYTES:
        raise InvalidShare(
            f"shares from {sender!r} are {len(plaintext)} bytes, expected {PLAINTEXT_BYTES}"
        )
    try:
        b_share = Share.from_bytes(plaintext[: shamir.SHARE_BYTES])
        s_share = Share.from_bytes(plaintext[shamir.SHARE_BYTES :])
    except SecAggError as exc:
        raise InvalidShare(f"shares from {sender!r} do not parse: {exc}") from None
    x = config.share_x(recipient)
    if b_share.x != x or s_share.x != x:
        raise InvalidShare(f"shares from {sender!r} carry x={b_share.x}/{s_share.x}, expected {x}")
    return b_share, s_share


def check_release(
    config: ProtocolConfig,
    msg: UnmaskShares,
    *,
    u1: frozenset[str],
    u3: frozenset[str],
    heard: Container[str],
    views: Mapping[str, frozenset[str]] | None = None,
) -> None:
    """Refuse an UnmaskShares that does not fit the round: a sender outside U1 or already
    ``heard``, another survivor set, an impossible U2 view or, for a survivor, another
    than its agreed one (``views``), or a share of the wrong kind, owner or x."""
    sender = msg.sender
    if sender not in u1:
        raise UnknownSender(f"{sender!r} did not advertise keys (not in U1)")
    if frozenset(msg.survivors) != u3:
        raise InconsistentView(f"UnmaskShares from {sender!r} answers another survivor set")
    if sender in heard:
        raise DuplicateMessage(f"second UnmaskShares from {sender!r}")
    view = frozenset(msg.received_from)
    if sender not in view or not view <= (config.graph.closed(sender) & u1):
        raise InconsistentView(f"{sender!r} reports an impossible U2 view {sorted(view)}")
    if views is not None and sender in views and view != views[sender]:
        raise InconsistentView(f"{sender!r} reports another U2 view than the agreed one")
    if sender in u3:
        missing = sorted((u3 & config.graph.neighbours(sender)) - view)
        if missing:
            raise InconsistentView(
                f"survivor {sender!r} holds no shares of survivors {missing}: masks would not cancel"
            )
    x = config.share_x(sender)
    for kind, released in (("b", msg.b_shares), ("s_sk", msg.s_shares)):
        for owner, share in released:
            if (owner in u3) != (kind == "b") or owner not in view:
                raise InconsistentView(_wrong_owner(sender, kind, owner))
            if share.x != x:
                raise InvalidShare(f"{sender!r} released a share with x={share.x}, its x is {x}")


def _wrong_owner(sender: str, kind: str, owner: str) -> str:
    if kind == "b":
        return f"{sender!r} released a b-share of {owner!r}, not a survivor it holds"
    return f"{sender!r} released an s_sk-share of {owner!r}, not a dropped org it holds"
