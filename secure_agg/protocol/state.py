"""What one participant of a masked-sum round holds, and the checks it runs first.

:class:`PeerState` is the base of :class:`~secure_agg.protocol.peer.SecAggPeer`: its
own secrets, the adverts, shares, survivor sets and releases of the round, read-only
views of them, and the checks every call and every received message goes through
before anything changes (stage, sender, signature, round). Moving to ``ABORTED``
happens here too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from secure_agg.errors import ConfigError
from secure_agg.keys import KeyPair
from secure_agg.messages import (
    AdvertiseKeys,
    Header,
    MalformedMessage,
    Message,
    Stage,
    UnmaskShares,
)
from secure_agg.protocol.config import ProtocolConfig, RandomBytes, ShareKind, SignFn, VerifyFn
from secure_agg.protocol.errors import (
    BadSignature,
    DuplicateMessage,
    OutOfStage,
    RoundAborted,
    UnknownSender,
    WrongRound,
)
from secure_agg.protocol.prepared import MaskingSecrets
from secure_agg.protocol.unmasking import Mask
from secure_agg.shamir import Share

__all__ = ["OwnSecrets", "PeerState"]


@dataclass
class OwnSecrets:
    """The round's key pairs (``c`` for the share channel, ``s`` for masks) and the
    self-mask seed ``b``."""

    c: KeyPair
    s: KeyPair
    b: bytes


class PeerState:
    """What one participant ``me`` holds in a round, and the checks every call makes.

    Built through :class:`~secure_agg.protocol.peer.SecAggPeer`, which documents the
    arguments.
    """

    def __init__(
        self,
        config: ProtocolConfig,
        me: str,
        sign: SignFn,
        verify: VerifyFn,
        *,
        rng: RandomBytes | None = None,
        masking: MaskingSecrets | None = None,
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
        self._secrets: OwnSecrets | None = None
        # the s pair and b drawn ahead for this round, if any (advertise_keys takes them)
        self._masking = masking
        self._adverts: dict[str, AdvertiseKeys] = {}
        self._u1: frozenset[str] | None = None
        self._shared = False
        # b and s_sk Shamir-shared once per round (SecAggPeer._split)
        self._splits: tuple[list[Share], list[Share]] | None = None
        self._held: dict[str, tuple[Share, Share]] = {}
        self._u2: frozenset[str] | None = None
        # the participants agreed after the shares (close_shares), if any: every
        # survivor's U2 is then its neighbourhood among them
        self._participants: frozenset[str] | None = None
        self._masked = False
        # the neighbours whose pairwise masks ``premask`` handed out before U2, if any
        self._premasked: frozenset[str] | None = None
        self._u3: frozenset[str] | None = None
        # the survivors' agreed U2 views for U3 (unmask), if any
        self._views: dict[str, frozenset[str]] | None = None
        self._released: dict[str, ShareKind] = {}
        self._unmasks: dict[str, UnmaskShares] = {}
        # self-mask seeds of survivors revealed by their owners, checked against the
        # owner's advertised commitment (``self_seed`` / ``receive_seed``)
        self._seeds: dict[str, bytes] = {}
        self._removal_masks: list[Mask] | None = None

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
    def participants(self) -> frozenset[str] | None:
        """The participants agreed after the shares (:meth:`close_shares`), if given."""
        return self._participants

    @property
    def views(self) -> Mapping[str, frozenset[str]] | None:
        """The survivors' agreed U2 views for U3 (:meth:`unmask`), if any."""
        return None if self._views is None else dict(self._views)

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
            self._participants,
            self._masked,
            self._premasked,
            self._u3,
            None if self._views is None else tuple(sorted(self._views.items())),
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

    def _own(self) -> OwnSecrets:
        if self._secrets is None:
            raise OutOfStage("advertise_keys() has not been called")
        return self._secrets

    def _need_threshold(self, count: int, what: str) -> None:
        """Abort unless ``count`` (orgs that ``what``) reaches the threshold."""
        t = self.config.threshold
        if count < t:
            raise self._abort(f"only {count} {what}, threshold is {t}")

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
