"""What every participant of one masked-sum round agrees on before it starts.

:class:`ProtocolConfig` (the round, U0, the threshold, the vector, the ring width and
the SecAgg+ graph), the callables a peer is given (:data:`SignFn`, :data:`VerifyFn`,
:data:`RandomBytes`), the associated data that binds a ShareKeys ciphertext to its
round and its two ends (:func:`share_aad`), and the check that an advertised X25519
key is usable (:func:`usable_public_key`).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from secure_agg.errors import ConfigError
from secure_agg.graph import NeighbourGraph, graph_seed
from secure_agg.keys import RoundContext, agree, generate_keypair
from secure_agg.protocol.errors import UnknownSender
from secure_agg.ring import ring_dtype

__all__ = [
    "SEED_BYTES",
    "ProtocolConfig",
    "RandomBytes",
    "ShareKind",
    "SignFn",
    "VerifyFn",
    "share_aad",
    "usable_public_key",
]

SignFn = Callable[[bytes], bytes]
VerifyFn = Callable[[str, bytes, bytes], bool]
RandomBytes = Callable[[int], bytes]
ShareKind = Literal["b", "s"]

SEED_BYTES = 32
"""Bytes of a self-mask seed ``b`` and of the private half of a key pair."""
_SHARE_AAD_LABEL = b"fedweave/secagg/share-keys/v1"
_AHEAD_AAD_LABEL = b"fedweave/secagg/share-ahead/v1"


@dataclass(frozen=True)
class ProtocolConfig:
    """Everything every participant of one round must agree on.

    ctx: the round (federation, run, round number); bound into every key and message.
    participants: U0, the unique org ids invited to the round. Stored sorted: an org's
        ring index is its position in that order, its Shamir x is index + 1.
    threshold: t, ``2 <= t <= n`` (``<= k + 1`` with ``neighbours=k``). Any t holders
        can reconstruct an org's secrets, so fewer than t survivors abort the round.
        Choose ``t > n / 2`` (``> (k + 1) / 2``): each honest holder releases, per org,
        one kind of share only, so two disjoint groups of t releasers, one for ``b_i``
        and one for ``s_sk_i`` (a split view of who survived, engineered by the network
        or by colluders), cannot both exist among ``n`` holders when ``2t > n``.
    vector_length: length of every input and masked vector.
    bits: ring width, 32 or 64 (``Z_2^bits``).
    neighbours: k for SecAgg+ (each org masks and shares with k neighbours of a graph
        seeded by ctx and U0); None for the complete graph.
    graph: derived, not passed: the round's :class:`~secure_agg.graph.NeighbourGraph`.
    """

    ctx: RoundContext
    participants: tuple[str, ...]
    threshold: int
    vector_length: int
    bits: int = 32
    neighbours: int | None = None
    graph: NeighbourGraph = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.ctx, RoundContext):
            raise ConfigError(f"ctx must be a RoundContext, got {type(self.ctx).__name__}")
        parts = self.participants
        if isinstance(parts, str) or not isinstance(parts, tuple | list):
            raise ConfigError("participants must be a tuple of org ids")
        for p in parts:
            if not isinstance(p, str) or not p:
                raise ConfigError(f"participants: every org id must be a non-empty str, got {p!r}")
        if len(set(parts)) != len(parts):
            raise ConfigError("participants: org ids must be unique")
        n = len(parts)
        if not 2 <= n <= 0xFFFF:
            raise ConfigError(f"participants: need 2 to 65535 orgs, got {n}")
        object.__setattr__(self, "participants", tuple(sorted(parts)))
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, int) or not 2 <= t <= n:
            raise ConfigError(f"threshold must be an int in [2, {n}], got {t!r}")
        if isinstance(self.vector_length, bool) or not isinstance(self.vector_length, int):
            raise ConfigError(f"vector_length must be an int, got {self.vector_length!r}")
        if self.vector_length < 1:
            raise ConfigError(f"vector_length must be >= 1, got {self.vector_length}")
        ring_dtype(self.bits)  # ConfigError naming bits
        graph = NeighbourGraph(
            self.participants, self.neighbours, graph_seed(self.ctx.to_bytes(), self.participants)
        )
        if self.neighbours is not None and t > self.neighbours + 1:
            raise ConfigError(
                f"threshold {t} exceeds neighbours + 1 = {self.neighbours + 1}, the holders of each "
                "org's shares; lower threshold or raise neighbours"
            )
        object.__setattr__(self, "graph", graph)

    @property
    def n(self) -> int:
        return len(self.participants)

    def index(self, org: str) -> int:
        """Ring index of ``org`` (its position in sorted U0)."""
        try:
            return self.participants.index(org)
        except ValueError:
            raise UnknownSender(f"{org!r} is not a participant of this round") from None

    def share_x(self, org: str) -> int:
        """Shamir x of the shares ``org`` holds: index + 1."""
        return self.index(org) + 1

    def mask_sign(self, owner: str, other: str) -> int:
        """The sign with which ``owner`` adds ``PRG(s_{owner,other})`` to its input."""
        return 1 if self.index(owner) < self.index(other) else -1


def share_aad(ctx: RoundContext, sender: str, recipient: str, *, ahead: bool = False) -> bytes:
    """AAD of a ShareKeys ciphertext: binds the round and the ordered (sender, recipient),
    and whether it was sealed ahead (to a key the recipient advertised in an earlier
    round, :meth:`~secure_agg.protocol.peer.SecAggPeer.seal_ahead`) or in round 1."""
    label = _AHEAD_AAD_LABEL if ahead else _SHARE_AAD_LABEL
    parts = [label, ctx.to_bytes(), sender.encode(), recipient.encode()]
    return b"".join(struct.pack(">I", len(p)) + p for p in parts)


_PROBE = generate_keypair(hashlib.sha256(b"fedweave/secagg/key-probe").digest())


@functools.lru_cache(maxsize=4096)
def usable_public_key(key: bytes) -> bool:
    """Whether ``key`` is a valid X25519 public key that is not of low order (RFC 7748 §6.1)."""
    try:
        agree(_PROBE.private, key)
    except ConfigError:
        return False
    return True
