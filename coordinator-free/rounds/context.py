"""The stage context: one round this node runs, as its stages hand it on.

:class:`~coordinator_free.rounds.RoundEngine` runs a round as a pipeline of stages
(ready → share → agree → mask → reduce → agree → unmask → done) over one
:class:`StageContext`: each stage reads what the stages before it set and sets what
it decides, in the fields grouped below by the stage that sets them. The round's
:class:`~coordinator_free.rounds.state.RoundState` (what the handlers file) is one
of its fields; the context adds what only a running round has: the session, the
counters and clocks, the member sets as the round narrows them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
from coordinator_free.ring import Scattered
from coordinator_free.rounds.config import RoundConfig, StageHook
from coordinator_free.rounds.early import PendingU1
from coordinator_free.rounds.mask_stream import MaskStream
from coordinator_free.rounds.messenger import Messenger
from coordinator_free.rounds.results import RoundFailed
from coordinator_free.rounds.session import MaskedSum
from coordinator_free.rounds.state import Counters, RoundState
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

__all__ = ["StageContext"]


@dataclass
class StageContext:
    """What the stages of one round read and write (see the module docstring)."""

    state: RoundState
    vector: np.ndarray
    deadline: float | None  # clock time by which ``ready`` messages must be seen
    config: RoundConfig
    net: Messenger
    clock: Callable[[], float]
    hook: StageHook | None = None
    live: Callable[[], Iterable[str]] | None = None
    ring_bits: int = 0  # a narrow ring's width (RingCall.bits), 0: the vector's dtype's
    counters: Counters = field(default_factory=Counters)
    times: dict[str, float] = field(default_factory=dict)  # seconds per stage
    t_round: float = field(default_factory=time.perf_counter)
    t_stage: float = 0.0
    sent_before: int = 0
    # ready: the members U0, the thresholds, the session, the orgs seen ready
    u0: tuple[str, ...] = ()
    t: int = 0
    k: int | None = None
    maybe_session: MaskedSum | None = None
    ready_set: frozenset[str] = frozenset()
    closed_without_me: set[str] = field(default_factory=set)  # refused this ready as stale
    # ready, with shares sealed ahead (rounds.ahead): the keys this node held when it
    # made its ready (id -> private half), the key id it sealed each holder's shares
    # to, the orgs whose shares it opened, and the holders whose shares and this
    # node's both travelled ahead (no share exchange between them)
    ahead_keys: dict[bytes, X25519PrivateKey] = field(default_factory=dict)
    ahead_sent: dict[str, bytes] = field(default_factory=dict)
    ahead_in: set[str] = field(default_factory=set)
    ahead_done: frozenset[str] = frozenset()
    # share: this node's view hash, the holders of its shares, whom it could not reach,
    # whose shares it waits for and the shares that came
    h1: bytes = b""
    holders: frozenset[str] = frozenset()
    sparse: bool = False
    by_token: bool = False  # U1 agreed by the token (SecAgg+, or shares sealed ahead)
    unshared: set[str] = field(default_factory=set)
    expected_shares: frozenset[str] = frozenset()
    shares: dict[str, bytes] = field(default_factory=dict)
    # agree: the participants U1; the members of the ring (narrowed by each attempt);
    # with the ring started before U1 is settled, U1 pending (it is then every member
    # until the ring completes or the token decides)
    u1: frozenset[str] = frozenset()
    members: frozenset[str] = frozenset()
    u1_pending: PendingU1 | None = None
    # mask and reduce: the masked input; the masked sum, or with owner unmasking the
    # ring's first half and the tag of the token agreement that settled it; the last
    # ring order and how many ring attempts ran
    masked: np.ndarray | None = None
    premasking: asyncio.Future[None] | None = None  # the session's premask work, off the loop
    mask_stream: MaskStream | None = None  # or its masks, streamed into the first attempt
    masks_prepared: bool = False  # whether the premask took masks prepared before the round
    total: np.ndarray | None = None
    scattered: Scattered | None = None
    agreed_by: str | None = None
    order: list[str] = field(default_factory=list)
    attempt: int = 0
    dropped: int = 0  # rings started with U1 pending and dropped (not attempts)
    left_out: set[str] = field(default_factory=set)  # members of such a ring not in U1

    def __post_init__(self) -> None:
        self.t_stage = self.t_round

    @property
    def me(self) -> str:
        return self.state.me

    @property
    def run(self) -> str:
        return self.state.run

    @property
    def round(self) -> int:
        return self.state.round

    @property
    def session(self) -> MaskedSum:
        """This org's masked-sum session (the ready stage opens it)."""
        assert self.maybe_session is not None, "the ready stage opens the session"
        return self.maybe_session

    def require_threshold(self) -> None:
        """Raise :class:`RoundFailed` when the participants ``U1`` are fewer than ``t``."""
        if len(self.u1) < self.t:
            raise RoundFailed("ready", f"{len(self.u1)} participants agreed, fewer than t={self.t}")

    def masked_input(self) -> np.ndarray:
        """The masked input (the mask stage makes it)."""
        assert self.masked is not None, "the mask stage makes the masked input"
        return self.masked

    async def enter(self, stage: str) -> None:
        """Begin ``stage``: what :meth:`RoundEngine.progress` reports, and the hook."""
        self.state.stage, self.state.stage_since = stage, self.clock()
        self.state.inbox.awaiting = None
        if self.hook is not None:
            await self.hook(self.me, self.run, self.round, stage)

    def lap(self, stage: str) -> None:
        """End ``stage``: its time, and what this node sent in it."""
        now = time.perf_counter()
        self.times[stage] = self.times.get(stage, 0.0) + now - self.t_stage
        total = self.counters.sent()
        self.net.observe(
            "stage",
            self.run,
            self.round,
            stage,
            seconds=now - self.t_stage,
            bytes=total - self.sent_before,
        )
        self.t_stage, self.sent_before = now, total

    def observe(self, kind: str, stage: str, *, peer: str = "", detail: str = "") -> None:
        """Report an observation of this round."""
        self.net.observe(kind, self.run, self.round, stage, peer=peer, detail=detail)

    def believed_alive(self) -> Callable[[str], bool] | None:
        """Whether the membership layer still believes an org alive (``None``: no such
        layer): a ring step waiting on a predecessor it no longer does pings it at once."""
        live = self.live
        if live is None:
            return None
        return lambda org: org in set(live())

    def step_hook(self) -> Callable[[str, int], Awaitable[None]] | None:
        """The hook of each ring step (``reduce.<phase>.<step>``), if any."""
        hook = self.hook
        if hook is None:
            return None

        async def on_step(phase: str, step: int) -> None:
            await hook(self.me, self.run, self.round, f"reduce.{phase}.{step}")

        return on_step
