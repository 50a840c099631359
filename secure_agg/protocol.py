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
    MASKED_INPUT    masked_input(x) -> y                          unmask(U3)        -> UnmaskShares
    UNMASK          self_seed() -> b      receive(UnmaskShares)   finalize(sum)     -> sum of x over U3
                                          receive_seed(owner, b)
    DONE | ABORTED

``y_i = x_i + PRG(b_i) + sum_{j in U2, j ~ i} sign(i, j) PRG(s_ij)`` with
``sign(i, j) = +1`` when i precedes j in the ring order and ``-1`` otherwise, so the
pairwise masks of two survivors cancel in any sum, added in any order or by chunks.

Without a server nobody hands out one U2: each peer's U2 is the set of orgs whose
ShareKeys reached it, and an org that dropped half-way through sending its shares
leaves views that differ. UnmaskShares therefore carries its sender's U2 view, and
finalize removes a dropped org's pairwise mask exactly for the survivors that report
holding its shares. A survivor that stays silent in UNMASK is assumed to share the
reporters' view; when the reporters disagree about that dropped org, finalize aborts
rather than guess. (A partial send that reached only silent survivors goes
undetected: the overlay should deliver each ShareKeys batch whole or not at all.)

Every input is validated completely before any state changes: a rejected message or
call raises a specific :class:`~secure_agg.errors.ProtocolError` and leaves the peer
exactly as it was. A round that can no longer finish with at least ``t`` orgs moves
to ``ABORTED`` (raising :class:`RoundAborted`) and releases nothing further.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from secure_agg import prg, shamir
from secure_agg.errors import ConfigError, ProtocolError, RingError, SecAggError
from secure_agg.graph import NeighbourGraph, graph_seed
from secure_agg.keys import (
    KeyPair,
    RoundContext,
    agree,
    decrypt,
    encrypt,
    generate_keypair,
    pairwise_mask_seed,
    share_encryption_key,
)
from secure_agg.messages import (
    AdvertiseKeys,
    Header,
    MalformedMessage,
    Message,
    ShareKeys,
    Stage,
    UnmaskShares,
    decode,
)
from secure_agg.ring import check_ring, ring_dtype, ring_sum
from secure_agg.shamir import Share

__all__ = [
    "BadSignature",
    "BadVector",
    "DoubleRelease",
    "DuplicateMessage",
    "InconsistentView",
    "InvalidShare",
    "MalformedMessage",
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
]

SignFn = Callable[[bytes], bytes]
VerifyFn = Callable[[str, bytes, bytes], bool]
RandomBytes = Callable[[int], bytes]
ShareKind = Literal["b", "s"]

_SEED_BYTES = 32
_SHARE_AAD_LABEL = b"fedweave/secagg/share-keys/v1"
_PLAINTEXT_BYTES = 2 * shamir.SHARE_BYTES


# --------------------------------------------------------------------------- errors


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


# --------------------------------------------------------------------------- config


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


def share_aad(ctx: RoundContext, sender: str, recipient: str) -> bytes:
    """AAD of a ShareKeys ciphertext: binds the round and the ordered (sender, recipient)."""
    parts = [_SHARE_AAD_LABEL, ctx.to_bytes(), sender.encode(), recipient.encode()]
    return b"".join(struct.pack(">I", len(p)) + p for p in parts)


_PROBE = generate_keypair(hashlib.sha256(b"fedweave/secagg/key-probe").digest())


@functools.lru_cache(maxsize=4096)
def _usable_public_key(key: bytes) -> bool:
    """Whether ``key`` is a valid X25519 public key that is not of low order (RFC 7748 §6.1)."""
    try:
        agree(_PROBE.private, key)
    except ConfigError:
        return False
    return True


# --------------------------------------------------------------------------- peer


@dataclass
class _OwnSecrets:
    c: KeyPair
    s: KeyPair
    b: bytes


class SecAggPeer:
    """The state machine of one participant ``me`` (module docstring: stages and calls).

    sign: signs bytes with ``me``'s identity key.
    verify: ``verify(sender, data, signature)`` checks a participant's signature.
    rng: ``rng(k) -> k random bytes`` for keys, seeds, Shamir coefficients and nonces;
        default ``os.urandom``. Pass a deterministic one only for test vectors.
    """

    def __init__(
        self,
        config: ProtocolConfig,
        me: str,
        sign: SignFn,
        verify: VerifyFn,
        *,
        rng: RandomBytes | None = None,
    ) -> None:
        if not isinstance(config, ProtocolConfig):
            raise ConfigError("config must be a ProtocolConfig")
        if me not in config.participants:
            raise ConfigError(f"me={me!r} is not among the participants")
        self.config = config
        self.me = me
        self._sign = sign
        self._verify = verify
        self._rng: RandomBytes = os.urandom if rng is None else rng
        self._stage = Stage.ADVERTISE_KEYS
        self._abort_reason: str | None = None
        self._secrets: _OwnSecrets | None = None
        self._adverts: dict[str, AdvertiseKeys] = {}
        self._u1: frozenset[str] | None = None
        self._shared = False
        self._held: dict[str, tuple[Share, Share]] = {}
        self._u2: frozenset[str] | None = None
        self._masked = False
        self._u3: frozenset[str] | None = None
        self._released: dict[str, ShareKind] = {}
        self._unmasks: dict[str, UnmaskShares] = {}
        # self-mask seeds of survivors revealed by their owners, checked against the
        # owner's advertised commitment (``self_seed`` / ``receive_seed``)
        self._seeds: dict[str, bytes] = {}
        self._removal_masks: list[tuple[bytes, int]] | None = None

    # ---------------------------------------------------------------- inspection

    @property
    def stage(self) -> Stage:
        return self._stage

    @property
    def abort_reason(self) -> str | None:
        return self._abort_reason

    @property
    def neighbours(self) -> frozenset[str]:
        return self.config.graph.neighbours(self.me)

    @property
    def u1(self) -> frozenset[str] | None:
        return self._u1

    @property
    def u2(self) -> frozenset[str] | None:
        return self._u2

    @property
    def u3(self) -> frozenset[str] | None:
        return self._u3

    @property
    def released(self) -> Mapping[str, ShareKind]:
        """For every org whose share this peer released: which kind ("b" or "s")."""
        return dict(self._released)

    def snapshot(self) -> tuple[object, ...]:
        """A comparable picture of the whole state (tests: a rejection changes nothing)."""
        return (
            self._stage,
            self._abort_reason,
            None
            if self._secrets is None
            else (self._secrets.c.public, self._secrets.s.public, self._secrets.b),
            tuple(sorted((k, v.to_bytes()) for k, v in self._adverts.items())),
            self._u1,
            self._shared,
            tuple(sorted(self._held.items(), key=lambda kv: kv[0])),
            self._u2,
            self._masked,
            self._u3,
            tuple(sorted(self._released.items())),
            tuple(sorted((k, v.to_bytes()) for k, v in self._unmasks.items())),
            tuple(sorted(self._seeds.items())),
        )

    # ---------------------------------------------------------------- helpers

    def _abort(self, reason: str) -> RoundAborted:
        self._stage = Stage.ABORTED
        self._abort_reason = reason
        return RoundAborted(f"round aborted at {self.me}: {reason}")

    def _require_stage(self, *stages: Stage, action: str) -> None:
        if self._stage is Stage.ABORTED:
            raise RoundAborted(f"round already aborted: {self._abort_reason}")
        if self._stage not in stages:
            names = " or ".join(s.name for s in stages)
            raise OutOfStage(
                f"{action} needs stage {names}; peer {self.me} is in {self._stage.name}"
            )

    def _own(self) -> _OwnSecrets:
        if self._secrets is None:
            raise OutOfStage("advertise_keys() has not been called")
        return self._secrets

    def _header(self, stage: Stage) -> Header:
        return Header(ctx=self.config.ctx, stage=stage, sender=self.me)

    def _rand(self, k: int) -> bytes:
        out = self._rng(k)
        if not isinstance(out, bytes) or len(out) != k:
            raise ConfigError(f"rng({k}) must return {k} bytes")
        return out

    def _authenticate(self, msg: Message, authenticated: bool = False) -> None:
        """Sender, signature and round checks shared by every message type.

        ``authenticated``: the caller already verified, under ``msg.sender``'s identity
        key, a signature over the exact bytes this message was decoded from (the round
        engine's signed envelope, whose sender it checked to be ``msg.sender``); the
        message's own signature then proves nothing more and is not verified again.
        Every other check still runs.
        """
        if not isinstance(msg, Message):
            raise MalformedMessage(f"expected a protocol message, got {type(msg).__name__}")
        sender = msg.sender
        if sender not in self.config.participants:
            raise UnknownSender(f"{sender!r} is not a participant of this round")
        if sender == self.me:
            raise DuplicateMessage(f"{self.me} received its own {type(msg).__name__} back")
        if authenticated:
            ok = True
        else:
            try:
                ok = bool(self._verify(sender, msg.signed_payload(), msg.signature))
            except Exception:  # a verifier that raises is a failed verification
                ok = False
        if not ok:
            raise BadSignature(f"{type(msg).__name__} from {sender!r}: signature does not verify")
        if msg.ctx != self.config.ctx:
            raise WrongRound(
                f"{type(msg).__name__} from {sender!r} is for {msg.ctx}, this round is {self.config.ctx}"
            )

    # ---------------------------------------------------------------- dispatch

    def receive(self, msg: Message | bytes) -> None:
        """Take in one message (decoded or raw bytes); ProtocolError leaves the state unchanged."""
        if isinstance(msg, bytes | bytearray | memoryview):
            msg = decode(bytes(msg))
        if isinstance(msg, AdvertiseKeys):
            self.receive_advertise(msg)
        elif isinstance(msg, ShareKeys):
            self.receive_shares(msg)
        elif isinstance(msg, UnmaskShares):
            self.receive_unmask(msg)
        else:
            raise MalformedMessage(f"expected a protocol message, got {type(msg).__name__}")

    # ---------------------------------------------------------------- stage 0

    def advertise_keys(self) -> AdvertiseKeys:
        """Round 0: draw the round's c and s key pairs and the self-mask seed b; advertise."""
        self._require_stage(Stage.ADVERTISE_KEYS, action="advertise_keys()")
        if self._secrets is not None:
            raise OutOfStage(f"{self.me} already advertised its keys this round")
        c = generate_keypair(self._rand(_SEED_BYTES))
        s = generate_keypair(self._rand(_SEED_BYTES))
        b = self._rand(_SEED_BYTES)
        if c.public == s.public:
            raise ConfigError("rng returned the same bytes for both key pairs")
        msg = AdvertiseKeys(
            self._header(Stage.ADVERTISE_KEYS),
            c_pk=c.public,
            s_pk=s.public,
            b_commitment=shamir.commitment(b),
        ).signed(self._sign)
        self._secrets = _OwnSecrets(c=c, s=s, b=b)
        self._adverts[self.me] = msg
        return msg

    def receive_advertise(self, msg: AdvertiseKeys, *, authenticated: bool = False) -> None:
        self._authenticate(msg, authenticated)
        self._require_stage(Stage.ADVERTISE_KEYS, action="receiving AdvertiseKeys")
        if msg.sender in self._adverts:
            raise DuplicateMessage(f"second AdvertiseKeys from {msg.sender!r}")
        if msg.sender in self.neighbours:  # the keys this peer agrees with before finalize
            for name, key in (("c_pk", msg.c_pk), ("s_pk", msg.s_pk)):
                if not _usable_public_key(key):
                    raise MalformedMessage(f"{name} of {msg.sender!r} is not a usable X25519 key")
        self._adverts[msg.sender] = msg

    def close_advertise(self) -> frozenset[str]:
        """The AdvertiseKeys deadline passed: fix U1 (every advertiser, this peer included)."""
        self._require_stage(Stage.ADVERTISE_KEYS, action="close_advertise()")
        self._own()
        u1 = frozenset(self._adverts)
        holders = self.config.graph.closed(self.me) & u1
        t = self.config.threshold
        if len(holders) < t:
            raise self._abort(
                f"only {len(holders)} of {self.me}'s share holders advertised keys, threshold is {t}"
            )
        self._u1 = u1
        self._stage = Stage.SHARE_KEYS
        return u1

    # ---------------------------------------------------------------- stage 1

    def _holders(self) -> list[str]:
        assert self._u1 is not None
        return sorted(self.config.graph.neighbours(self.me) & self._u1)

    def share_keys(self) -> dict[str, ShareKeys]:
        """Round 1: Shamir-share b and s_sk t-of-(holders), encrypt each pair to its holder."""
        self._require_stage(Stage.SHARE_KEYS, action="share_keys()")
        if self._shared:
            raise OutOfStage(f"{self.me} already sent its shares this round")
        own = self._own()
        cfg = self.config
        holders = self._holders()
        top = max(cfg.index(h) for h in [*holders, self.me]) + 1
        s_sk = own.s.private.private_bytes_raw()
        b_shares = shamir.split(own.b, cfg.threshold, top, rng=self._rand)
        s_shares = shamir.split(s_sk, cfg.threshold, top, rng=self._rand)
        out: dict[str, ShareKeys] = {}
        for h in holders:
            i = cfg.index(h)
            shared = agree(own.c.private, self._adverts[h].c_pk)
            key = share_encryption_key(shared, cfg.ctx, self.me, h)
            plaintext = b_shares[i].to_bytes() + s_shares[i].to_bytes()
            blob = encrypt(key, plaintext, share_aad(cfg.ctx, self.me, h), nonce=self._rand(12))
            out[h] = ShareKeys(self._header(Stage.SHARE_KEYS), recipient=h, ciphertext=blob).signed(
                self._sign
            )
        mine = cfg.index(self.me)
        self._held[self.me] = (b_shares[mine], s_shares[mine])
        self._shared = True
        return out

    def receive_shares(self, msg: ShareKeys, *, authenticated: bool = False) -> None:
        self._authenticate(msg, authenticated)
        self._require_stage(Stage.SHARE_KEYS, action="receiving ShareKeys")
        sender = msg.sender
        assert self._u1 is not None
        if sender not in self._u1:
            raise UnknownSender(
                f"{sender!r} did not advertise keys before the deadline (not in U1)"
            )
        if sender not in self.neighbours:
            raise UnknownSender(f"{sender!r} is not a neighbour of {self.me} in the SecAgg+ graph")
        if msg.recipient != self.me:
            raise WrongRecipient(
                f"ShareKeys from {sender!r} is addressed to {msg.recipient!r}, not {self.me}"
            )
        if sender in self._held:
            raise DuplicateMessage(f"second ShareKeys from {sender!r}")
        own = self._own()
        cfg = self.config
        key = share_encryption_key(
            agree(own.c.private, self._adverts[sender].c_pk), cfg.ctx, sender, self.me
        )
        try:
            plaintext = decrypt(key, msg.ciphertext, share_aad(cfg.ctx, sender, self.me))
        except SecAggError:
            raise InvalidShare(f"shares from {sender!r} do not decrypt") from None
        if len(plaintext) != _PLAINTEXT_BYTES:
            raise InvalidShare(
                f"shares from {sender!r} are {len(plaintext)} bytes, expected {_PLAINTEXT_BYTES}"
            )
        try:
            b_share = Share.from_bytes(plaintext[: shamir.SHARE_BYTES])
            s_share = Share.from_bytes(plaintext[shamir.SHARE_BYTES :])
        except SecAggError as exc:
            raise InvalidShare(f"shares from {sender!r} do not parse: {exc}") from None
        x = cfg.share_x(self.me)
        if b_share.x != x or s_share.x != x:
            raise InvalidShare(
                f"shares from {sender!r} carry x={b_share.x}/{s_share.x}, expected {x}"
            )
        self._held[sender] = (b_share, s_share)

    def close_shares(self) -> frozenset[str]:
        """The ShareKeys deadline passed: fix U2, the orgs whose shares this peer holds."""
        self._require_stage(Stage.SHARE_KEYS, action="close_shares()")
        if not self._shared:
            raise OutOfStage("share_keys() must be called before close_shares()")
        u2 = frozenset(self._held)
        t = self.config.threshold
        if len(u2) < t:
            raise self._abort(
                f"only {len(u2)} orgs of {self.me}'s neighbourhood shared keys, threshold is {t}"
            )
        self._u2 = u2
        self._stage = Stage.MASKED_INPUT
        return u2

    # ---------------------------------------------------------------- stage 2

    def masked_input(self, x: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
        """Round 2: ``y = x + PRG(b) + sum_j sign PRG(s_ij)`` over neighbours j in U2.

        ``y`` is a new array unless ``out`` is given: a C-contiguous, writeable ring
        array of ``x``'s dtype and length (``x`` itself masks in place), which receives
        ``y`` and is returned. A caller that owns its encoded vector (the round engine
        does) saves the allocation and first-touch of a vector-sized array that way.
        """
        self._require_stage(Stage.MASKED_INPUT, action="masked_input()")
        if self._masked:
            raise OutOfStage(f"{self.me} already produced its masked input this round")
        cfg = self.config
        try:
            check_ring(x, cfg.bits, cfg.vector_length)
            if out is not None:
                check_ring(out, cfg.bits, cfg.vector_length)
        except RingError as exc:
            raise BadVector(f"input of {self.me}: {exc}") from None
        in_place = False
        if out is not None:
            if out.dtype != x.dtype or not out.flags.c_contiguous or not out.flags.writeable:
                raise BadVector(
                    f"out for {self.me} must be a C-contiguous, writeable {x.dtype} array"
                )
            in_place = out is x or (
                out.__array_interface__["data"][0] == x.__array_interface__["data"][0]
                and out.strides == x.strides
            )
            if not in_place and np.may_share_memory(out, x):
                raise BadVector(f"out for {self.me} overlaps the input without being it")
        own = self._own()
        assert self._u2 is not None
        masks: list[tuple[bytes, int]] = [(own.b, 1)]
        for j in sorted(self._u2 - {self.me}):
            seed = pairwise_mask_seed(
                agree(own.s.private, self._adverts[j].s_pk), cfg.ctx, self.me, j
            )
            masks.append((seed, cfg.mask_sign(self.me, j)))
        y = np.empty_like(x) if out is None else out
        prg.add_masks(y, masks, base=None if in_place else x)
        self._masked = True
        return y

    # ---------------------------------------------------------------- stage 3

    def unmask(self, survivors: Iterable[str]) -> UnmaskShares:
        """Round 4: release b-shares of survivors U3 and s_sk-shares of dropped holders-of-shares.

        May be called again in UNMASK with a revised survivor set; it then refuses
        (:class:`DoubleRelease`) to release the other kind of share for any org.
        """
        self._require_stage(Stage.MASKED_INPUT, Stage.UNMASK, action="unmask()")
        cfg = self.config
        u3 = frozenset(survivors)
        assert self._u1 is not None and self._u2 is not None
        unknown = sorted(u3 - self._u1)
        if unknown:
            raise InconsistentView(f"survivors {unknown} never advertised keys (not in U1)")
        if self.me in u3:
            if not self._masked:
                raise InconsistentView(
                    f"{self.me} is listed as a survivor but produced no masked input"
                )
            missing = sorted((u3 & self.neighbours) - self._u2)
            if missing:
                raise InconsistentView(
                    f"survivors {missing} sent no shares to {self.me}: their masks with it would not cancel"
                )
        if self._seeds and u3 != self._u3:
            raise DoubleRelease(
                f"{self.me} refuses another survivor set: the self-mask seeds of "
                f"{sorted(self._seeds)} were revealed for the agreed one"
            )
        t = cfg.threshold
        release: dict[str, ShareKind] = {}
        for owner in self._held:
            release[owner] = "b" if owner in u3 else "s"
        for owner, kind in release.items():
            earlier = self._released.get(owner)
            if earlier is not None and earlier != kind:
                raise DoubleRelease(
                    f"{self.me} refuses to release the {'b' if kind == 'b' else 's_sk'}-share of {owner!r}: "
                    f"its {'b' if earlier == 'b' else 's_sk'}-share was already released"
                )
        if len(u3) < t:
            raise self._abort(
                f"only {len(u3)} survivors, threshold is {t}: the sum would expose too few orgs"
            )
        msg = UnmaskShares(
            self._header(Stage.UNMASK),
            survivors=tuple(sorted(u3)),
            received_from=tuple(sorted(self._u2)),
            b_shares=tuple((o, self._held[o][0]) for o in sorted(release) if release[o] == "b"),
            s_shares=tuple((o, self._held[o][1]) for o in sorted(release) if release[o] == "s"),
        ).signed(self._sign)
        self._released.update(release)
        if self._u3 != u3:
            self._unmasks = {}
        self._u3 = u3
        self._unmasks[self.me] = msg
        self._stage = Stage.UNMASK
        return msg

    def receive_unmask(self, msg: UnmaskShares, *, authenticated: bool = False) -> None:
        self._authenticate(msg, authenticated)
        self._require_stage(Stage.UNMASK, action="receiving UnmaskShares")
        cfg = self.config
        sender = msg.sender
        assert self._u1 is not None and self._u3 is not None
        if sender not in self._u1:
            raise UnknownSender(f"{sender!r} did not advertise keys (not in U1)")
        if frozenset(msg.survivors) != self._u3:
            raise InconsistentView(f"UnmaskShares from {sender!r} answers another survivor set")
        if sender in self._unmasks:
            raise DuplicateMessage(f"second UnmaskShares from {sender!r}")
        view = frozenset(msg.received_from)
        if sender not in view or not view <= (cfg.graph.closed(sender) & self._u1):
            raise InconsistentView(f"{sender!r} reports an impossible U2 view {sorted(view)}")
        if sender in self._u3:
            missing = sorted((self._u3 & cfg.graph.neighbours(sender)) - view)
            if missing:
                raise InconsistentView(
                    f"survivor {sender!r} holds no shares of survivors {missing}: masks would not cancel"
                )
        x = cfg.share_x(sender)
        for owner, share in msg.b_shares:
            if owner not in self._u3 or owner not in view:
                raise InconsistentView(
                    f"{sender!r} released a b-share of {owner!r}, not a survivor it holds"
                )
            if share.x != x:
                raise InvalidShare(f"{sender!r} released a share with x={share.x}, its x is {x}")
        for owner, share in msg.s_shares:
            if owner in self._u3 or owner not in view:
                raise InconsistentView(
                    f"{sender!r} released an s_sk-share of {owner!r}, not a dropped org it holds"
                )
            if share.x != x:
                raise InvalidShare(f"{sender!r} released a share with x={share.x}, its x is {x}")
        self._unmasks[sender] = msg

    def self_seed(self) -> bytes:
        """This survivor's own self-mask seed ``b``, to reveal to the other survivors.

        Bonawitz et al. reconstruct ``b_i`` of every survivor from ``t`` released
        shares; the owner revealing ``b_i`` itself gives every survivor the same value
        (checked against the commitment advertised in round 0) for one message instead
        of ``t``, and no reconstruction. It is allowed only in UNMASK, after
        :meth:`unmask` fixed a survivor set that contains this peer: from then on no
        honest holder releases this peer's ``s_sk``-share, and :meth:`unmask` refuses
        any other survivor set (:class:`DoubleRelease`), so ``b_i`` and ``s_sk_i`` are
        never both known, as with released shares.
        """
        self._require_stage(Stage.UNMASK, action="self_seed()")
        assert self._u3 is not None
        if self.me not in self._u3:
            raise InconsistentView(f"{self.me} is not a survivor: its self mask is not removed")
        b = self._own().b
        self._seeds[self.me] = b
        return b

    def receive_seed(self, owner: str, seed: bytes) -> bool:
        """Take a survivor's revealed self-mask seed; ``False`` when already held.

        The seed may come relayed by any survivor: it is checked against the
        commitment ``owner`` advertised in round 0 (:class:`InvalidShare` otherwise),
        which binds it. Raises :class:`InconsistentView` for an owner that is not a
        survivor. A refused seed changes nothing.
        """
        self._require_stage(Stage.UNMASK, action="receiving a self-mask seed")
        assert self._u3 is not None
        if not isinstance(seed, bytes) or len(seed) != _SEED_BYTES:
            raise MalformedMessage(f"a self-mask seed is {_SEED_BYTES} bytes")
        if owner not in self._u3:
            raise InconsistentView(f"a self-mask seed of {owner!r}, which is not a survivor")
        held = self._seeds.get(owner)
        if held is not None:
            if held != seed:
                raise InvalidShare(f"a second, different self-mask seed of {owner!r}")
            return False
        if shamir.commitment(seed) != self._adverts[owner].b_commitment:
            raise InvalidShare(f"the self-mask seed of {owner!r} does not match its commitment")
        self._seeds[owner] = seed
        return True

    @property
    def seeds(self) -> Mapping[str, bytes]:
        """The survivors' self-mask seeds held so far (revealed, never reconstructed)."""
        return dict(self._seeds)

    def _plan(self) -> tuple[dict[str, list[Share]], dict[str, list[Share]], dict[str, list[str]]]:
        """Which secrets to reconstruct and which (survivor, dropped) masks to remove."""
        assert self._u3 is not None
        cfg = self.config
        u3 = self._u3
        views = {s: frozenset(m.received_from) for s, m in self._unmasks.items()}
        # a survivor's own seed and the revealed ones need no reconstruction
        b_shares: dict[str, list[Share]] = {
            j: [] for j in u3 if j not in self._seeds and j != self.me
        }
        s_shares: dict[str, list[Share]] = {}
        for m in self._unmasks.values():
            for owner, share in m.b_shares:
                if owner in b_shares:
                    b_shares[owner].append(share)
            for owner, share in m.s_shares:
                s_shares.setdefault(owner, []).append(share)
        dropped = sorted({k for v in views.values() for k in v} - u3)
        pairs: dict[str, list[str]] = {}
        for k in dropped:
            near = cfg.graph.neighbours(k)
            have = [r for r, v in sorted(views.items()) if r in near and k in v]
            lack = [r for r, v in sorted(views.items()) if r in near and k not in v]
            silent = sorted((u3 & near) - views.keys())
            if have and lack and silent:
                raise InconsistentView(
                    f"dropped {k!r} shared keys with only some of its neighbours, and survivors "
                    f"{silent} did not report whether they hold its shares: their masks with it "
                    "cannot be removed"
                )
            pairs[k] = sorted({j for j in have if j in u3} | (set() if lack else set(silent)))
        return b_shares, s_shares, pairs

    def missing_shares(self) -> dict[str, int]:
        """Per org whose secret finalize needs: how many more shares must still arrive."""
        self._require_stage(Stage.UNMASK, action="missing_shares()")
        b_shares, s_shares, pairs = self._plan()
        t = self.config.threshold
        need = {j: t - len(v) for j, v in b_shares.items()}
        need.update({k: t - len(s_shares.get(k, [])) for k, js in pairs.items() if js})
        return {org: n for org, n in sorted(need.items()) if n > 0}

    def finalize(self, masked_sum: np.ndarray, *, in_place: bool = False) -> np.ndarray:
        """Remove every mask from the sum of the survivors' masked inputs; return sum x over U3.

        Takes b_j for j in U3 as revealed (:meth:`receive_seed`) or reconstructs it,
        and s_sk_k for each dropped k some survivor masked with, checks them against
        the advertised commitment and public key, then
        subtracts ``PRG(b_j)`` and each dangling ``sign PRG(s_jk)`` with
        :func:`secure_agg.prg.add_masks` (chunked, no full-size temporary). A missing
        share or a reconstruction that fails its check aborts the round.
        """
        self._require_stage(Stage.UNMASK, action="finalize()")
        cfg = self.config
        try:
            check_ring(masked_sum, cfg.bits, cfg.vector_length)
        except RingError as exc:
            raise BadVector(f"masked sum: {exc}") from None
        masks = self._removal()
        if in_place:
            z = masked_sum
            prg.add_masks(z, masks)
        else:  # one pass from the sum into a fresh array: no copy first
            z = np.empty_like(masked_sum)
            prg.add_masks(z, masks, base=masked_sum)
        self._stage = Stage.DONE
        return z

    def finalize_part(self, masked_part: np.ndarray, offset: int) -> np.ndarray:
        """Elements ``[offset, offset + len(masked_part))`` of the unmasked sum, a new array.

        The same masks as :meth:`finalize` removes, expanded from ``offset`` on only
        (:func:`secure_agg.prg.add_masks`), so each org of a ring can unmask the chunk
        of the masked sum it holds for ``len / n`` of the work of the whole vector and
        the plain chunks travel on (``coordinator_free.rounds``). It may be called for
        several parts, before or after :meth:`finalize`; the secrets are reconstructed
        once, from the releases taken by the first call.
        """
        self._require_stage(Stage.UNMASK, Stage.DONE, action="finalize_part()")
        cfg = self.config
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise BadVector(f"offset must be a non-negative int, got {offset!r}")
        try:
            check_ring(masked_part, cfg.bits)
        except RingError as exc:
            raise BadVector(f"masked part: {exc}") from None
        if offset + masked_part.shape[0] > cfg.vector_length:
            raise BadVector(
                f"part [{offset}, {offset + masked_part.shape[0]}) runs past the "
                f"vector's {cfg.vector_length} elements"
            )
        z = np.empty_like(masked_part)
        prg.add_masks(z, self._removal(), base=np.ascontiguousarray(masked_part), offset=offset)
        return z

    def _removal(self) -> list[tuple[bytes, int]]:
        """The ``(seed, sign)`` of every mask the sum still carries, reconstructed from
        the releases taken so far and checked; computed once per round."""
        if self._removal_masks is not None:
            return self._removal_masks
        cfg = self.config
        try:
            b_shares, s_shares, pairs = self._plan()
        except InconsistentView as exc:
            raise self._abort(str(exc)) from None
        t = cfg.threshold
        b_seeds = dict(self._seeds)
        if self._u3 is not None and self.me in self._u3:
            b_seeds[self.me] = self._own().b
        for j, shares in sorted(b_shares.items()):
            try:
                b_seeds[j] = shamir.combine(shares, t, _SEED_BYTES, self._adverts[j].b_commitment)
            except SecAggError as exc:
                raise self._abort(
                    f"cannot reconstruct the self-mask seed of {j!r}: {exc}"
                ) from None
        s_keys: dict[str, KeyPair] = {}
        for k, js in sorted(pairs.items()):
            if not js:
                continue
            try:
                raw = shamir.combine(s_shares.get(k, []), t, _SEED_BYTES)
                pair = generate_keypair(raw)
            except SecAggError as exc:
                raise self._abort(
                    f"cannot reconstruct the mask key of dropped {k!r}: {exc}"
                ) from None
            if pair.public != self._adverts[k].s_pk:
                raise self._abort(
                    f"reconstructed mask key of dropped {k!r} does not match its s_pk"
                )
            s_keys[k] = pair
        dangling: list[tuple[bytes, int]] = []
        for k, pair in sorted(s_keys.items()):
            for j in pairs[k]:
                try:
                    shared = agree(pair.private, self._adverts[j].s_pk)
                except ConfigError:
                    raise self._abort(f"survivor {j!r} advertised an unusable s_pk") from None
                dangling.append((pairwise_mask_seed(shared, cfg.ctx, j, k), -cfg.mask_sign(j, k)))
        masks = [(b_seeds[j], -1) for j in sorted(b_seeds)] + dangling
        self._removal_masks = masks
        return masks


# --------------------------------------------------------------------------- driver


@dataclass
class RoundResult:
    """What an in-process round produced.

    sums: the sum each finishing peer computed (all equal on success).
    survivors: U3, the orgs whose masked inputs are in the sum.
    masked: each survivor's masked input y_i.
    views: per peer, the encoded messages it received, in order.
    aborted: per peer that aborted, its reason.
    peers: every participant's state machine as the round left it.
    """

    sums: dict[str, np.ndarray]
    survivors: frozenset[str]
    masked: dict[str, np.ndarray]
    views: dict[str, list[bytes]]
    aborted: dict[str, str]
    peers: dict[str, SecAggPeer]

    @property
    def total(self) -> np.ndarray:
        """The agreed sum; RoundAborted when no peer finished, InconsistentView on disagreement."""
        if not self.sums:
            reasons = "; ".join(f"{o}: {r}" for o, r in sorted(self.aborted.items()))
            raise RoundAborted(
                f"no participant finished the round ({reasons or 'everyone dropped'})"
            )
        first, *rest = self.sums.values()
        for other in rest:
            if not np.array_equal(first, other):
                raise InconsistentView("participants finished with different sums")
        return first


def _ed25519_identities(orgs: Iterable[str], seed: int) -> tuple[dict[str, SignFn], VerifyFn]:
    signers: dict[str, SignFn] = {}
    publics: dict[str, Ed25519PublicKey] = {}
    for org in orgs:
        raw = hashlib.sha256(f"fedweave/secagg/test-identity/{seed}/{org}".encode()).digest()
        key = Ed25519PrivateKey.from_private_bytes(raw)
        signers[org] = key.sign
        publics[org] = Ed25519PublicKey.from_public_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.Raw, serialization.PublicFormat.Raw
            )
        )

    def verify(sender: str, data: bytes, signature: bytes) -> bool:
        pub = publics.get(sender)
        if pub is None:
            return False
        try:
            pub.verify(signature, data)
        except InvalidSignature:
            return False
        return True

    return signers, verify


_DROP_STAGES = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASK)


def simulate_round(
    config: ProtocolConfig,
    inputs: Mapping[str, np.ndarray],
    drop: Mapping[str, Stage] | None = None,
    seed: int = 0,
    *,
    aggregate: Callable[[Mapping[str, np.ndarray]], np.ndarray] | None = None,
    identities: tuple[Mapping[str, SignFn], VerifyFn] | None = None,
) -> RoundResult:
    """Run one round for every participant in memory, every message through its bytes.

    drop: org -> the stage at which it goes silent (it sends nothing from that stage
        on and does not finish): ADVERTISE_KEYS, SHARE_KEYS, MASKED_INPUT or UNMASK.
    seed: fixes every key, seed, coefficient and nonce (numpy's generator: for tests
        and benchmarks only, never for a real round) and the Ed25519 identities.
    aggregate: adds the survivors' masked vectors (default: ring sum in ring order);
        tests pass one that sums in random order and chunks.
    identities: (signer per org, verify); default: Ed25519 keys derived from ``seed``.
    """
    drop = dict(drop or {})
    for org, st in drop.items():
        if org not in config.participants:
            raise ConfigError(f"drop: {org!r} is not a participant")
        if st not in _DROP_STAGES:
            raise ConfigError(f"drop: {org!r} must drop at one of {[s.name for s in _DROP_STAGES]}")
    for org in config.participants:
        if org not in inputs:
            raise ConfigError(f"inputs: missing the input of {org!r}")
    signers, verify = identities or _ed25519_identities(config.participants, seed)
    peers = {
        org: SecAggPeer(
            config,
            org,
            signers[org],
            verify,
            rng=np.random.default_rng([seed, config.index(org)]).bytes,
        )
        for org in config.participants
    }
    views: dict[str, list[bytes]] = {org: [] for org in peers}
    aborted: dict[str, str] = {}

    def alive(stage: Stage) -> list[str]:
        return [
            o
            for o in config.participants
            if o not in aborted and (o not in drop or drop[o].value > stage.value)
        ]

    def deliver(wire: bytes, to: Iterable[str]) -> None:
        msg = decode(wire)  # once per message; every recipient verifies it itself
        for org in to:
            if org in aborted:
                continue
            views[org].append(wire)
            peers[org].receive(msg)

    def close(org: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except RoundAborted as exc:
            aborted[org] = peers[org].abort_reason or str(exc)

    for org in alive(Stage.ADVERTISE_KEYS):
        wire = peers[org].advertise_keys().to_bytes()
        deliver(wire, [o for o in alive(Stage.ADVERTISE_KEYS) if o != org])
    for org in alive(Stage.SHARE_KEYS):
        close(org, peers[org].close_advertise)

    for org in alive(Stage.SHARE_KEYS):
        for recipient, m in peers[org].share_keys().items():
            if recipient in alive(Stage.SHARE_KEYS):
                deliver(m.to_bytes(), [recipient])
    for org in alive(Stage.SHARE_KEYS):
        close(org, peers[org].close_shares)

    masked = {org: peers[org].masked_input(inputs[org]) for org in alive(Stage.MASKED_INPUT)}
    survivors = frozenset(masked)
    if not masked:
        total = np.zeros(config.vector_length, dtype=ring_dtype(config.bits))
    elif aggregate is not None:
        total = aggregate(masked)
    else:
        total = ring_sum(masked[o] for o in sorted(masked))

    released: dict[str, bytes] = {}
    for org in alive(Stage.UNMASK):
        try:
            released[org] = peers[org].unmask(survivors).to_bytes()
        except RoundAborted as exc:
            aborted[org] = peers[org].abort_reason or str(exc)
    finishers = [o for o in alive(Stage.UNMASK)]
    for org, wire in released.items():
        deliver(wire, [o for o in finishers if o != org])
    sums: dict[str, np.ndarray] = {}
    for org in alive(Stage.UNMASK):
        try:
            sums[org] = peers[org].finalize(total)
        except RoundAborted as exc:
            aborted[org] = peers[org].abort_reason or str(exc)
    return RoundResult(
        sums=sums, survivors=survivors, masked=masked, views=views, aborted=aborted, peers=peers
    )


def run_round(
    config: ProtocolConfig,
    inputs: Mapping[str, np.ndarray],
    drop: Mapping[str, Stage] | None = None,
    seed: int = 0,
) -> np.ndarray:
    """The sum (mod 2^bits) over the survivors' inputs, as every finishing peer computed it.

    See :func:`simulate_round`; raises :class:`RoundAborted` when the round aborts.
    """
    return simulate_round(config, inputs, drop, seed).total
