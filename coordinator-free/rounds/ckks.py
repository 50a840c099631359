"""CKKS sums over the endpoint: the :class:`~coordinator_free.rounds.SecureSum` of
``backend = "ckks"``.

The round engine (:class:`~coordinator_free.rounds.RoundEngine`) adds masked ring
arrays along its ring; CKKS ciphertexts need another path. :class:`CkksAggregator` runs the chain of
:mod:`secure_agg.ckks` (``docs/SECURITY.md``, "CKKS backend (TenSEAL)") over the org's
signed :class:`~coordinator_free.endpoint.Endpoint`, with three message kinds, all of
privacy class ``ciphertext`` in the audit log: ``ckks.context`` (public CKKS
contexts), ``ckks.partial`` (running sums along the chain, the aggregate last) and
``ckks.result`` (the sum, encrypted under the recipient's own key).

What peers make it keep is bounded: with an ``admit`` callable (the node's runs whose
backend is CKKS, and their participants) a message of any other run, or from a
non-participant, is refused before its payload is kept (``Refused(NOT_ADMITTED)``:
so a node whose runs use the masked backend keeps no ciphertext at all), and each
sender may have at most ``member_bytes`` kept (``Refused(OVERSIZED)``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import numpy as np
from coordinator_free.endpoint import Endpoint
from coordinator_free.errors import RefusalReason, Refused, TransportError
from coordinator_free.rounds.model_hash import ModelHashes
from coordinator_free.rounds.results import RoundFailed
from coordinator_free.rounds.secure_sum import SumResult
from coordinator_free.rounds.state import Admission
from coordinator_free.wire import Envelope

from secure_agg.ckks import (
    CkksBundle,
    CkksKeyHolder,
    CkksParams,
    CkksPublicContext,
    ckks_add,
    ckks_encrypt,
    ring_order,
)
from secure_agg.errors import SecAggError
from secure_agg.keys import RoundContext

__all__ = [
    "KIND_CKKS_CONTEXT",
    "KIND_CKKS_PARTIAL",
    "KIND_CKKS_RESULT",
    "RESULT_GRID_BITS",
    "CkksAggregator",
]


KIND_CKKS_CONTEXT = "ckks.context"
KIND_CKKS_PARTIAL = "ckks.partial"
KIND_CKKS_RESULT = "ckks.result"
RESULT_GRID_BITS = 12
"""The key holder rounds the decrypted sum to multiples of ``2^-12`` before sending it
on: re-encryption adds noise far below half a step (about ``3e-6`` at the default
parameters), so every participant rounds back to the very same sum."""


class CkksAggregator:
    """CKKS sums over the endpoint (``docs/SECURITY.md``, "CKKS backend (TenSEAL)").

    Per round, :func:`secure_agg.ckks.ring_order` fixes the chain, key holder first.
    Every participant makes its own CKKS key pair (:class:`~secure_agg.ckks.CkksKeyHolder`)
    and sends its public context to the key holder; the key holder sends its context
    to everyone (``ckks.context``). Each participant encrypts its vector under the key
    holder's context, adds it to the running sum from its predecessor and hands it on
    (``ckks.partial``); the last one delivers the aggregate to the key holder, which
    decrypts it once (only a sum of at least ``threshold`` contributors), rounds it to
    the grid of :data:`RESULT_GRID_BITS` and sends it to each participant encrypted under
    that participant's own key (``ckks.result``): every message that leaves an org is a
    public key or a ciphertext, and every participant ends with the same sum.

    Every participant must take part: a missing one fails the round
    (:class:`~coordinator_free.rounds.RoundFailed`), and the engine retries it. The
    next model's hash is compared through ``model_hashes``, the round engine's
    (:attr:`~coordinator_free.rounds.RoundEngine.model_hashes`), as after a masked sum.
    """

    name = "CKKS"

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        model_hashes: ModelHashes,
        params: CkksParams | None = None,
        timeout: float = 30.0,
        admit: Admission | None = None,
        member_bytes: int = 192 << 20,
    ) -> None:
        self.endpoint = endpoint
        self.model_hashes = model_hashes
        self.params = params or CkksParams()
        self.timeout = timeout
        self.admit = admit
        self.member_bytes = member_bytes
        self._inbox: dict[tuple[str, int, str], dict[str, bytes]] = {}
        self._events: dict[tuple[str, int, str], asyncio.Event] = {}
        for kind in (KIND_CKKS_CONTEXT, KIND_CKKS_PARTIAL, KIND_CKKS_RESULT):
            endpoint.on(kind, self._receive)

    def held(self, sender: str) -> int:
        """The bytes of ``sender``'s messages this aggregator keeps."""
        return sum(len(box.get(sender, b"")) for box in self._inbox.values())

    def _check_admitted(self, env: Envelope) -> None:
        if self.admit is None:
            return
        participants = self.admit(env.run)
        if participants is None:
            raise Refused(RefusalReason.NOT_ADMITTED, f"no CKKS run {env.run!r} here")
        if env.sender not in participants:
            raise Refused(
                RefusalReason.NOT_ADMITTED, f"{env.sender!r} is not a participant of {env.run!r}"
            )

    async def _receive(self, env: Envelope) -> bytes:
        self._check_admitted(env)
        key = (env.run, env.round, env.kind)
        box = self._inbox.get(key, {})
        if env.sender in box:
            raise Refused(RefusalReason.REPLAY, f"second {env.kind} for this round")
        if self.held(env.sender) + len(env.payload) > self.member_bytes:
            raise Refused(
                RefusalReason.OVERSIZED,
                f"{env.sender!r} would have more than {self.member_bytes} bytes kept",
            )
        self._inbox.setdefault(key, box)[env.sender] = env.payload
        self._events.setdefault(key, asyncio.Event()).set()
        while len(self._inbox) > 64:  # bound what peers can make this node hold
            oldest = next(iter(self._inbox))  # the first filed, not the lowest round
            del self._inbox[oldest]
            self._events.pop(oldest, None)
        return b""

    def members_removed(self) -> None:
        """The federation removed members (a manifest installed here): every wait looks
        again, and one for a removed member fails its round at once."""
        for event in self._events.values():
            event.set()

    async def _wait(self, run: str, round: int, kind: str, sender: str) -> bytes:
        key = (run, round, kind)
        loop = asyncio.get_running_loop()
        end = loop.time() + self.timeout
        while True:
            got = self._inbox.get(key, {}).get(sender)
            if got is not None:
                return got
            if not self.endpoint.is_member(sender):
                # removed from the federation: its messages are refused here
                raise RoundFailed(kind, f"{sender} is no longer a member")
            remaining = end - loop.time()
            if remaining <= 0:
                raise RoundFailed(kind, f"nothing from {sender} within {self.timeout:g} s")
            event = self._events.setdefault(key, asyncio.Event())
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                continue

    async def _send(self, peer: str, kind: str, payload: bytes, run: str, round: int) -> None:
        try:
            await self.endpoint.send(
                peer, kind, payload, run=run, round=round, stage="ckks", timeout=self.timeout
            )
        except TransportError as exc:
            raise RoundFailed(kind, f"{peer}: {exc}") from None

    def _forget(self, run: str, round: int) -> None:
        for key in [k for k in self._inbox if k[0] == run and k[1] <= round]:
            del self._inbox[key]
            self._events.pop(key, None)

    # -- SecureSum ----------------------------------------------------------------------

    @property
    def org_id(self) -> str:
        return self.endpoint.org_id

    def bound_per_participant(self, participants: int) -> float:
        """The CKKS sum's range (``params.max_abs_sum``) shared among ``participants``."""
        return self.params.max_abs_sum / participants

    def encode(self, vector: np.ndarray) -> np.ndarray:
        """The vector as it is (float64): CKKS encodes it per round, under the key
        holder's context."""
        return np.asarray(vector, np.float64)

    async def run_round(
        self,
        run: str,
        round: int,
        contribution: np.ndarray,
        *,
        participants: tuple[str, ...],
        threshold: int,
        deadline: float | None = None,
        ring_bits: int = 0,
    ) -> SumResult:
        """This org's part of one CKKS sum: the (grid-rounded) float64 sum, with every
        participant a survivor. ``deadline`` is not used: each message waits up to
        ``timeout``; ``ring_bits`` neither (no ring)."""
        try:
            total = await self._run(
                run, round, np.asarray(contribution, np.float64), participants, threshold
            )
        except SecAggError as exc:
            raise RoundFailed("ckks", str(exc)) from None
        finally:
            self._forget(run, round)
        return SumResult(total, participants, (), 0)

    async def check_model_hash(
        self, run: str, round: int, digest: bytes, peers: Iterable[str], *, timeout: float
    ) -> frozenset[str]:
        """Compare the next model's hash with ``peers``' (``round.model``)."""
        return await self.model_hashes.check(run, round, digest, peers, timeout=timeout)

    async def _run(
        self, run: str, round: int, x: np.ndarray, participants: tuple[str, ...], t: int
    ) -> np.ndarray:
        me = self.endpoint.org_id
        ctx = RoundContext(self.endpoint.federation, run, round)
        order = ring_order(ctx, participants)
        holder = order[0]
        own = CkksKeyHolder(self.params, threshold=t, participants=participants)
        others = [p for p in order if p != me]
        if me == holder:
            await asyncio.gather(
                *(
                    self._send(p, KIND_CKKS_CONTEXT, own.public_context_bytes(), run, round)
                    for p in others
                )
            )
            public = own.public
        else:
            await self._send(holder, KIND_CKKS_CONTEXT, own.public_context_bytes(), run, round)
            public = CkksPublicContext.from_bytes(
                await self._wait(run, round, KIND_CKKS_CONTEXT, holder)
            )
        mine = await asyncio.to_thread(ckks_encrypt, public, x, contributor=me)
        i = order.index(me)
        nxt = order[(i + 1) % len(order)]
        if i == 0:
            await self._send(nxt, KIND_CKKS_PARTIAL, mine, run, round)
        else:
            partial = await self._wait(run, round, KIND_CKKS_PARTIAL, order[i - 1])
            total = await asyncio.to_thread(ckks_add, public, partial, mine)
            await self._send(nxt, KIND_CKKS_PARTIAL, total, run, round)
        if me != holder:
            result = await self._wait(run, round, KIND_CKKS_RESULT, holder)
            return _grid(await asyncio.to_thread(own.decrypt_sum, result))
        aggregate = await self._wait(run, round, KIND_CKKS_PARTIAL, order[-1])
        contributors = CkksBundle.from_bytes(aggregate).contributors
        summed = _grid(await asyncio.to_thread(own.decrypt_sum, aggregate))

        async def deliver(peer: str) -> None:
            theirs = CkksPublicContext.from_bytes(
                await self._wait(run, round, KIND_CKKS_CONTEXT, peer)
            )
            enc = CkksBundle.from_bytes(
                await asyncio.to_thread(ckks_encrypt, theirs, summed, contributor=me)
            )
            # the result stands for the aggregate of these contributors, so the
            # recipient's key holder opens it as a sum (and only once)
            bundle = CkksBundle(enc.fingerprint, enc.length, contributors, enc.chunks)
            await self._send(peer, KIND_CKKS_RESULT, bundle.to_bytes(), run, round)

        await asyncio.gather(*(deliver(p) for p in others))
        return summed


def _grid(values: np.ndarray) -> np.ndarray:
    step = 2.0**RESULT_GRID_BITS
    return np.round(np.asarray(values, np.float64) * step) / step
