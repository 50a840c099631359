"""One masked-sum round played in memory by every participant, for tests and benchmarks.

:func:`simulate_round` builds a :class:`~secure_agg.protocol.peer.SecAggPeer` per
participant, passes every message through its bytes to every recipient, lets chosen
orgs go silent at a chosen stage (and an org's ShareKeys reach only some of its
holders), and returns a :class:`RoundResult`;
:func:`run_round` returns the agreed sum alone. The randomness is fixed by a seed
(numpy's generator): never use these for a real round.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from secure_agg.errors import ConfigError
from secure_agg.messages import Stage, decode
from secure_agg.protocol.config import ProtocolConfig, SignFn, VerifyFn
from secure_agg.protocol.errors import InconsistentView, RoundAborted
from secure_agg.protocol.peer import SecAggPeer
from secure_agg.ring import ring_dtype, ring_sum

__all__ = ["RoundResult", "run_round", "simulate_round"]


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

_T = TypeVar("_T")
Aggregate = Callable[[Mapping[str, np.ndarray]], np.ndarray]


class _Simulation:
    """The peers of one simulated round, what each received and why any aborted."""

    def __init__(
        self,
        config: ProtocolConfig,
        peers: dict[str, SecAggPeer],
        drop: Mapping[str, Stage],
        reach: Mapping[str, frozenset[str]],
    ) -> None:
        self.config = config
        self.peers = peers
        self.drop = drop
        self.reach = reach
        self.received: dict[str, list[bytes]] = {org: [] for org in peers}
        self.committed: dict[str, frozenset[str]] = {}
        self.aborted: dict[str, str] = {}

    def alive(self, stage: Stage) -> list[str]:
        """The orgs still taking part at ``stage``: not aborted, not dropped by then."""
        drop = self.drop
        return [
            o
            for o in self.config.participants
            if o not in self.aborted and (o not in drop or drop[o].value > stage.value)
        ]

    def deliver(self, wire: bytes, to: Iterable[str]) -> None:
        msg = decode(wire)  # once per message; every recipient verifies it itself
        for org in to:
            if org in self.aborted:
                continue
            self.received[org].append(wire)
            self.peers[org].receive(msg)

    def attempt(self, org: str, fn: Callable[..., _T], *args: object) -> _T | None:
        """``fn(*args)`` for ``org``; an abort is recorded (``None``) instead of raised."""
        try:
            return fn(*args)
        except RoundAborted as exc:
            self.aborted[org] = self.peers[org].abort_reason or str(exc)
            return None

    def advertise(self) -> None:
        for org in self.alive(Stage.ADVERTISE_KEYS):
            wire = self.peers[org].advertise_keys().to_bytes()
            self.deliver(wire, [o for o in self.alive(Stage.ADVERTISE_KEYS) if o != org])
        for org in self.alive(Stage.SHARE_KEYS):
            self.attempt(org, self.peers[org].close_advertise)

    def share(self) -> None:
        for org in self.alive(Stage.SHARE_KEYS):
            reach = self.reach.get(org)
            for recipient, m in self.peers[org].share_keys().items():
                if recipient in self.alive(Stage.SHARE_KEYS) and (
                    reach is None or recipient in reach
                ):
                    self.deliver(m.to_bytes(), [recipient])
        for org in self.alive(Stage.SHARE_KEYS):
            self.attempt(org, self.peers[org].close_shares)

    def mask(
        self, inputs: Mapping[str, np.ndarray], aggregate: Aggregate | None
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The survivors' masked inputs and their sum. Each masked input comes with its
        sender's U2 (:attr:`committed`), the orgs whose pairwise masks it carries."""
        alive = self.alive(Stage.MASKED_INPUT)
        masked = {org: self.peers[org].masked_input(inputs[org]) for org in alive}
        self.committed = {org: frozenset(self.peers[org].u2 or ()) for org in masked}
        if not masked:
            total = np.zeros(self.config.vector_length, dtype=ring_dtype(self.config.bits))
        elif aggregate is not None:
            total = aggregate(masked)
        else:
            total = ring_sum(masked[o] for o in sorted(masked))
        return masked, total

    def unmask(self, survivors: frozenset[str], total: np.ndarray) -> dict[str, np.ndarray]:
        """Every finisher's unmasked sum, after the releases went to every other one."""
        released: dict[str, bytes] = {}
        for org in self.alive(Stage.UNMASK):
            msg = self.attempt(org, self.peers[org].unmask, survivors, self.committed)
            if msg is not None:
                released[org] = msg.to_bytes()
        finishers = self.alive(Stage.UNMASK)
        for org, wire in released.items():
            self.deliver(wire, [o for o in finishers if o != org])
        sums: dict[str, np.ndarray] = {}
        for org in self.alive(Stage.UNMASK):
            out = self.attempt(org, self.peers[org].finalize, total)
            if out is not None:
                sums[org] = out
        return sums


def _check_round(
    config: ProtocolConfig,
    inputs: Mapping[str, np.ndarray],
    drop: Mapping[str, Stage],
    reach: Mapping[str, frozenset[str]],
) -> None:
    for org, holders in reach.items():
        strangers = sorted(holders - set(config.participants))
        if org not in config.participants or strangers:
            raise ConfigError(f"reach: {org!r} and its holders must be participants")
    for org, st in drop.items():
        if org not in config.participants:
            raise ConfigError(f"drop: {org!r} is not a participant")
        if st not in _DROP_STAGES:
            raise ConfigError(f"drop: {org!r} must drop at one of {[s.name for s in _DROP_STAGES]}")
    for org in config.participants:
        if org not in inputs:
            raise ConfigError(f"inputs: missing the input of {org!r}")


def simulate_round(
    config: ProtocolConfig,
    inputs: Mapping[str, np.ndarray],
    drop: Mapping[str, Stage] | None = None,
    seed: int = 0,
    *,
    aggregate: Aggregate | None = None,
    identities: tuple[Mapping[str, SignFn], VerifyFn] | None = None,
    reach: Mapping[str, Iterable[str]] | None = None,
) -> RoundResult:
    """Run one round for every participant in memory, every message through its bytes.

    drop: org -> the stage at which it goes silent (it sends nothing from that stage
        on and does not finish): ADVERTISE_KEYS, SHARE_KEYS, MASKED_INPUT or UNMASK.
    seed: fixes every key, seed, coefficient and nonce (numpy's generator: for tests
        and benchmarks only, never for a real round) and the Ed25519 identities.
    aggregate: adds the survivors' masked vectors (default: ring sum in ring order);
        tests pass one that sums in random order and chunks.
    identities: (signer per org, verify); default: Ed25519 keys derived from ``seed``.
    reach: org -> the holders its ShareKeys reach; the others are lost. With
        ``drop[org] = MASKED_INPUT`` it is an org that went silent half-way through
        sending its shares.

    The survivors unmask with U3 and their U2 views, which the simulation carries
    with the masked inputs, as the overlay carries what the survivors agree on.
    """
    drop = dict(drop or {})
    holders = {org: frozenset(h) for org, h in (reach or {}).items()}
    _check_round(config, inputs, drop, holders)
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
    sim = _Simulation(config, peers, drop, holders)
    sim.advertise()
    sim.share()
    masked, total = sim.mask(inputs, aggregate)
    survivors = frozenset(masked)
    sums = sim.unmask(survivors, total)
    return RoundResult(
        sums=sums,
        survivors=survivors,
        masked=masked,
        views=sim.received,
        aborted=sim.aborted,
        peers=peers,
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
