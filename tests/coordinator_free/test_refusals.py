"""Every refusal reason on the in-memory path: refused, logged, counted, harmless.

A raw transport plays the attacker (or the confused peer) and sends hand-made bytes to
an honest endpoint. After each refusal the endpoint still serves honest traffic, and a
refused message never advances the sender's replay window.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from coordinator_free.endpoint import Endpoint
from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.identity import OrgIdentity
from coordinator_free.memory import InMemoryNetwork, InMemoryTransport
from coordinator_free.transport import MessageGuard
from coordinator_free.wire import Envelope
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.coordinator_free.transport_support import FEDERATION, identity, signed, tampered

MAX_SIZE = 4096
SEQ = 10_000


@dataclass
class Scene:
    """An honest endpoint ``b`` and a raw transport for ``a`` (a member) and ``m`` (not)."""

    alice: OrgIdentity
    mallory: OrgIdentity
    honest: Endpoint
    raw_a: InMemoryTransport
    raw_m: InMemoryTransport

    async def push(self, data: bytes, via: InMemoryTransport | None = None) -> bytes:
        return await (via or self.raw_a).request("b", data, timeout=1.0)


async def _echo(env: Envelope) -> bytes:
    return env.payload


async def _scene() -> Scene:
    net = InMemoryNetwork()
    alice, bob, mallory = identity("a"), identity("b"), identity("m")
    members = {"a": alice.public_key, "b": bob.public_key}
    honest = Endpoint(bob, FEDERATION, net.transport("b"), lambda: members, max_size=MAX_SIZE)
    honest.on("echo", _echo)
    await honest.start()
    return Scene(alice, mallory, honest, net.transport("a"), net.transport("m"))


Attack = Callable[[Scene], list[tuple[bytes, InMemoryTransport | None]]]


def _replay_identical(s: Scene) -> list[tuple[bytes, InMemoryTransport | None]]:
    wire = signed(s.alice, "b", SEQ).to_wire()
    return [(wire, None), (wire, None)]


def _lower_seq(s: Scene) -> list[tuple[bytes, InMemoryTransport | None]]:
    return [
        (signed(s.alice, "b", SEQ + 10_000).to_wire(), None),
        (signed(s.alice, "b", SEQ).to_wire(), None),
    ]


ATTACKS: dict[RefusalReason, Attack] = {
    RefusalReason.REPLAY: _replay_identical,
    RefusalReason.STALE: lambda s: [
        (signed(s.alice, "b", SEQ, sent_at=time.time() - 3600).to_wire(), None)
    ],
    RefusalReason.NOT_MEMBER: lambda s: [(signed(s.mallory, "b", SEQ).to_wire(), s.raw_m)],
    RefusalReason.BAD_SIGNATURE: lambda s: [
        (tampered(signed(s.alice, "b", SEQ), payload=b"evil").to_wire(), None)
    ],
    RefusalReason.MALFORMED: lambda s: [(b"\x00garbage\xff" * 3, None)],
    RefusalReason.OVERSIZED: lambda s: [
        (signed(s.alice, "b", SEQ, payload=b"x" * MAX_SIZE).to_wire(), None)
    ],
    RefusalReason.WRONG_FEDERATION: lambda s: [
        (signed(s.alice, "b", SEQ, federation="other").to_wire(), None)
    ],
    RefusalReason.WRONG_RECIPIENT: lambda s: [(signed(s.alice, "c", SEQ).to_wire(), None)],
    RefusalReason.NO_HANDLER: lambda s: [
        (signed(s.alice, "b", SEQ, kind="unknown").to_wire(), None)
    ],
}


# refused by the round engine's handlers, not by the envelope checks: their attacks are
# in tests/coordinator_free/test_bounds.py
HANDLER_REASONS = {RefusalReason.NOT_ADMITTED, RefusalReason.QUOTA}


def test_every_reason_has_an_attack() -> None:
    assert set(ATTACKS) | HANDLER_REASONS == set(RefusalReason)


@pytest.mark.parametrize("reason", list(ATTACKS), ids=lambda r: r.value)
def test_refusal_is_raised_logged_counted_and_harmless(
    reason: RefusalReason, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        s = await _scene()
        *setup, (attack, via) = ATTACKS[reason](s)
        for data, sender in setup:
            await s.push(data, sender)
        caplog.clear()
        with (
            caplog.at_level(logging.WARNING, logger="coordinator_free"),
            pytest.raises(Refused) as info,
        ):
            await s.push(attack, via)
        assert info.value.reason is reason
        assert s.honest.guard.refusals == {reason: 1}
        assert [r.levelno for r in caplog.records] == [logging.WARNING]
        assert reason.value in caplog.records[0].getMessage()
        # Honest traffic still flows, at a sequence number the attack did not burn.
        honest = signed(s.alice, "b", SEQ + 20_000, payload=b"fine")
        reply = Envelope.from_wire(await s.push(honest.to_wire()), MAX_SIZE)
        assert (reply.sender, reply.kind, reply.payload[32:]) == ("b", "echo.reply", b"fine")

    asyncio.run(main())


def test_seq_below_the_window_is_a_replay() -> None:
    async def main() -> None:
        s = await _scene()
        first, second = _lower_seq(s)
        await s.push(first[0])
        with pytest.raises(Refused) as info:
            await s.push(second[0])
        assert info.value.reason is RefusalReason.REPLAY
        assert s.honest.guard.refusals == {RefusalReason.REPLAY: 1}

    asyncio.run(main())


def test_out_of_order_within_the_window_is_accepted_once() -> None:
    async def main() -> None:
        s = await _scene()
        for seq in (SEQ + 5, SEQ + 1, SEQ + 3, SEQ + 2):
            await s.push(signed(s.alice, "b", seq).to_wire())
        for seq in (SEQ + 1, SEQ + 5):
            with pytest.raises(Refused):
                await s.push(signed(s.alice, "b", seq).to_wire())
        assert s.honest.guard.refusals == {RefusalReason.REPLAY: 2}

    asyncio.run(main())


def test_refused_message_does_not_advance_the_window() -> None:
    async def main() -> None:
        s = await _scene()
        forged = tampered(signed(s.alice, "b", SEQ + 10**9), payload=b"evil")
        with pytest.raises(Refused):
            await s.push(forged.to_wire())
        await s.push(signed(s.alice, "b", SEQ).to_wire())

    asyncio.run(main())


def test_future_timestamp_is_stale_too() -> None:
    guard = MessageGuard(
        FEDERATION,
        "b",
        lambda: {"a": identity("a").public_key},
        max_size=MAX_SIZE,
        max_skew_s=5.0,
        clock=lambda: 1000.0,
    )
    ok = signed(identity("a"), "b", 1, sent_at=1004.0)
    assert guard.check(ok.to_wire()) == ok
    with pytest.raises(Refused) as info:
        guard.check(signed(identity("a"), "b", 2, sent_at=1006.0).to_wire())
    assert info.value.reason is RefusalReason.STALE


def test_guard_rejects_invalid_limits() -> None:
    with pytest.raises(ValueError):
        MessageGuard(FEDERATION, "b", dict, max_size=0, max_skew_s=1.0)
    with pytest.raises(ValueError):
        MessageGuard(FEDERATION, "b", dict, max_size=1, max_skew_s=0.0)


class _ReplyForger:
    """A transport that answers every request with the reply to an earlier request."""

    def __init__(self, inner: InMemoryTransport) -> None:
        self.inner = inner
        self.org_id = inner.org_id
        self.first_reply: bytes | None = None

    async def start(self, handler: Callable[[bytes], object]) -> None:
        raise NotImplementedError

    async def request(self, peer: str, data: bytes, *, timeout: float) -> bytes:
        reply = await self.inner.request(peer, data, timeout=timeout)
        if self.first_reply is None:
            self.first_reply = reply
        return self.first_reply

    async def close(self) -> None:
        await self.inner.close()


def test_sender_refuses_a_replayed_or_swapped_reply() -> None:
    async def main() -> None:
        s = await _scene()
        members = {"a": s.alice.public_key, "b": identity("b").public_key}
        forger = _ReplyForger(s.raw_a)
        client = Endpoint(s.alice, FEDERATION, forger, lambda: members)
        assert await client.send("b", "echo", b"one") == b"one"
        with pytest.raises(Refused) as info:
            await client.send("b", "echo", b"two")
        assert info.value.reason is RefusalReason.REPLAY
        assert client.guard.refusals == {RefusalReason.REPLAY: 1}

    asyncio.run(main())


def test_sender_refuses_a_reply_that_answers_another_request() -> None:
    async def main() -> None:
        s = await _scene()
        bob = identity("b")
        members = {"a": s.alice.public_key, "b": bob.public_key}

        class Swapper(_ReplyForger):
            async def request(self, peer: str, data: bytes, *, timeout: float) -> bytes:
                await self.inner.request(peer, data, timeout=timeout)
                # A validly signed reply from b, fresh seq, but bound to other bytes.
                return signed(
                    bob, "a", SEQ * 10**9, kind="echo.reply", payload=bytes(32) + b"x"
                ).to_wire()

        client = Endpoint(s.alice, FEDERATION, Swapper(s.raw_a), lambda: members)
        with pytest.raises(Refused) as info:
            await client.send("b", "echo", b"one")
        assert info.value.reason is RefusalReason.MALFORMED

    asyncio.run(main())


_ALICE = identity("a")
_GOOD = signed(_ALICE, "b", 1, sent_at=1000.0).to_wire()


def _guard() -> MessageGuard:
    return MessageGuard(
        FEDERATION,
        "b",
        lambda: {"a": _ALICE.public_key},
        max_size=MAX_SIZE,
        max_skew_s=60.0,
        clock=lambda: 1000.0,
    )


@given(st.binary(max_size=MAX_SIZE + 100))
def test_guard_on_random_bytes_only_refuses(data: bytes) -> None:
    guard = _guard()
    with pytest.raises(Refused) as info:
        guard.check(data)
    assert info.value.reason in (RefusalReason.MALFORMED, RefusalReason.OVERSIZED)
    assert guard.refusals.total() == 1


@settings(max_examples=300)
@given(st.integers(0, len(_GOOD) - 1), st.integers(1, 255))
def test_guard_refuses_every_single_byte_change(index: int, flip: int) -> None:
    data = bytearray(_GOOD)
    data[index] ^= flip
    with pytest.raises(Refused):
        _guard().check(bytes(data))
