"""The signed endpoint over the in-memory network: dispatch, replies, errors."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping

import pytest
from coordinator_free.endpoint import OFF_LOOP_BYTES, Endpoint
from coordinator_free.errors import (
    PeerUnreachable,
    RefusalReason,
    Refused,
    RemoteError,
)
from coordinator_free.identity import OrgIdentity
from coordinator_free.memory import InMemoryNetwork
from coordinator_free.transport import SequenceCounter
from coordinator_free.wire import Envelope

from tests.coordinator_free.transport_support import FEDERATION, identity


def _federation(orgs: str, net: InMemoryNetwork) -> dict[str, Endpoint]:
    ids = {org: identity(org) for org in orgs}
    keys = {org: ident.public_key for org, ident in ids.items()}

    def members() -> Mapping[str, bytes]:
        return keys

    return {org: Endpoint(ids[org], FEDERATION, net.transport(org), members) for org in orgs}


def test_send_reaches_the_handler_with_context_and_returns_its_reply() -> None:
    seen: list[Envelope] = []

    async def handler(env: Envelope) -> bytes:
        seen.append(env)
        return b"ack:" + env.payload

    async def main() -> None:
        eps = _federation("ab", InMemoryNetwork())
        eps["b"].on("round.ready", handler)
        for ep in eps.values():
            await ep.start()
        reply = await eps["a"].send(
            "b", "round.ready", b"key", run="run-1", round=3, stage="advertise"
        )
        assert reply == b"ack:key"
        (env,) = seen
        assert (env.federation, env.run, env.round, env.stage) == (
            FEDERATION,
            "run-1",
            3,
            "advertise",
        )
        assert (env.kind, env.sender, env.recipient, env.payload) == (
            "round.ready",
            "a",
            "b",
            b"key",
        )

    asyncio.run(main())


def test_none_reply_is_empty_bytes_and_seqs_increase() -> None:
    seqs: list[int] = []

    async def handler(env: Envelope) -> None:
        seqs.append(env.seq)

    async def main() -> None:
        eps = _federation("ab", InMemoryNetwork())
        eps["b"].on("gossip.push", handler)
        await eps["b"].start()
        await eps["a"].start()
        for _ in range(5):
            assert await eps["a"].send("b", "gossip.push", b"") == b""

    asyncio.run(main())
    assert seqs == sorted(seqs) and len(set(seqs)) == 5


def test_concurrent_sends_all_succeed() -> None:
    async def handler(env: Envelope) -> bytes:
        await asyncio.sleep(0)
        return env.payload

    async def main() -> None:
        eps = _federation("abc", InMemoryNetwork(latency_s=0.001))
        for ep in eps.values():
            ep.on("echo", handler)
            await ep.start()
        replies = await asyncio.gather(
            *(
                eps[s].send(r, "echo", f"{s}{r}{i}".encode())
                for s in "abc"
                for r in "abc"
                if s != r
                for i in range(10)
            )
        )
        assert len(replies) == 60
        assert all(ep.guard.refusals.total() == 0 for ep in eps.values())

    asyncio.run(main())


def test_handler_refusal_and_crash_reach_the_sender() -> None:
    async def refuse(env: Envelope) -> bytes:
        raise Refused(RefusalReason.STALE, "round 3 is over")

    async def crash(env: Envelope) -> bytes:
        raise RuntimeError("bug")

    async def main() -> None:
        eps = _federation("ab", InMemoryNetwork())
        eps["b"].on("late", refuse)
        eps["b"].on("crash", crash)
        await eps["b"].start()
        with pytest.raises(Refused) as info:
            await eps["a"].send("b", "late", b"")
        assert info.value.reason is RefusalReason.STALE
        with pytest.raises(RemoteError):
            await eps["a"].send("b", "crash", b"")

    asyncio.run(main())


def test_closed_endpoint_is_unreachable() -> None:
    async def main() -> None:
        eps = _federation("ab", InMemoryNetwork())
        await eps["b"].start()
        await eps["b"].close()
        with pytest.raises(PeerUnreachable):
            await eps["a"].send("b", "x", b"")

    asyncio.run(main())


def test_registration_rules() -> None:
    ep = _federation("a", InMemoryNetwork())["a"]

    async def handler(env: Envelope) -> None:
        return None

    ep.on("k", handler)
    with pytest.raises(ValueError, match="already"):
        ep.on("k", handler)
    with pytest.raises(ValueError, match="reserved"):
        ep.on("k.reply", handler)


def test_identity_and_transport_must_agree() -> None:
    net = InMemoryNetwork()
    with pytest.raises(ValueError, match="transport is for"):
        Endpoint(identity("a"), FEDERATION, net.transport("b"), lambda: {})


def test_sequence_counter_is_strictly_increasing_and_seeded_from_time() -> None:
    counter = SequenceCounter()
    values = [counter.next() for _ in range(100)]
    assert values == sorted(set(values))
    assert values[0] > 1_600_000_000 * 10**6
    later = SequenceCounter()
    assert later.next() >= values[0]
    assert [SequenceCounter(5).next() for _ in range(2)] == [5, 5]
    with pytest.raises(ValueError):
        SequenceCounter(-1)


def test_membership_is_read_on_every_message() -> None:
    async def handler(env: Envelope) -> bytes:
        return b"ok"

    async def main() -> None:
        net = InMemoryNetwork()
        a, b = identity("a"), identity("b")
        members = {"a": a.public_key, "b": b.public_key}
        ep_a = Endpoint(a, FEDERATION, net.transport("a"), lambda: members)
        ep_b = Endpoint(b, FEDERATION, net.transport("b"), lambda: members)
        ep_b.on("k", handler)
        await ep_b.start()
        assert await ep_a.send("b", "k", b"") == b"ok"
        del members["a"]
        with pytest.raises(Refused) as info:
            await ep_a.send("b", "k", b"")
        assert info.value.reason is RefusalReason.NOT_MEMBER

    asyncio.run(main())


# -- large messages: signed, checked and hashed off the event loop ------------------------


def test_a_large_message_is_signed_hooked_and_checked_off_the_loop_a_small_one_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where each step of a send and its receipt ran: the loop's thread for a small
    payload, a worker thread for one of ``OFF_LOOP_BYTES`` (both round trips succeed)."""
    where: dict[str, list[str]] = {"sign": [], "hook": [], "check": []}

    async def handler(env: Envelope) -> bytes:
        return b"%d" % len(env.payload)

    async def main() -> None:
        loop_thread = threading.get_ident()

        def mark(step: str) -> None:
            where[step].append("loop" if threading.get_ident() == loop_thread else "worker")

        eps = _federation("ab", InMemoryNetwork())
        a, b = eps["a"], eps["b"]
        sign = OrgIdentity.sign
        check = b.guard.check

        def signing(me: OrgIdentity, data: bytes) -> bytes:
            mark("sign")
            return sign(me, data)

        def checking(data: bytes) -> Envelope:
            mark("check")
            return check(data)

        monkeypatch.setattr(OrgIdentity, "sign", signing)
        b.guard.check = checking  # type: ignore[method-assign]
        a.on_egress = lambda env, wire: mark("hook")
        b.on("ring.chunk", handler)
        for ep in eps.values():
            await ep.start()
        assert await a.send("b", "ring.chunk", b"x" * 100) == b"100"
        assert await a.send("b", "ring.chunk", bytes(OFF_LOOP_BYTES)) == b"%d" % OFF_LOOP_BYTES

    asyncio.run(main())
    # a signs the requests, b the replies (small ones: on b's loop)
    assert where == {
        "sign": ["loop", "loop", "worker", "loop"],
        "hook": ["loop", "worker"],
        "check": ["loop", "worker"],
    }


def test_the_loop_runs_other_tasks_while_a_large_message_is_signed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The signature of a large message waits for a task of the loop to run: on the loop
    it could not (the wait would time out and the test fail), off it it does."""
    loop_ran = threading.Event()

    async def main() -> None:
        eps = _federation("ab", InMemoryNetwork())
        a = eps["a"]
        sign = OrgIdentity.sign

        def waiting_sign(me: OrgIdentity, data: bytes) -> bytes:
            if len(data) >= OFF_LOOP_BYTES:
                assert loop_ran.wait(timeout=10), "the loop did not run while signing"
            return sign(me, data)

        monkeypatch.setattr(OrgIdentity, "sign", waiting_sign)
        eps["b"].on("ring.chunk", _ack)
        for ep in eps.values():
            await ep.start()

        async def other_work() -> None:
            await asyncio.sleep(0)
            loop_ran.set()

        other = asyncio.create_task(other_work())
        assert await a.send("b", "ring.chunk", bytes(OFF_LOOP_BYTES)) == b"ok"
        await other

    asyncio.run(main())
    assert loop_ran.is_set()


def test_a_tampered_large_message_is_refused_and_a_refusing_hook_stops_one() -> None:
    async def main() -> None:
        eps = _federation("ab", InMemoryNetwork())
        a, b = eps["a"], eps["b"]
        got: list[int] = []

        async def handler(env: Envelope) -> bytes:
            got.append(len(env.payload))
            return b"ok"

        b.on("ring.chunk", handler)
        for ep in eps.values():
            await ep.start()
        request = a.transport.request

        async def tampering(peer: str, data: bytes, *, timeout: float) -> bytes:
            flipped = bytearray(data)
            flipped[len(flipped) // 2] ^= 1  # a payload byte
            return await request(peer, bytes(flipped), timeout=timeout)

        a.transport.request = tampering  # type: ignore[method-assign]
        with pytest.raises(Refused):
            await a.send("b", "ring.chunk", bytes(OFF_LOOP_BYTES))
        assert b.guard.refusals[RefusalReason.BAD_SIGNATURE] == 1
        a.transport.request = request  # type: ignore[method-assign]

        def refuse(env: Envelope, wire: bytes) -> None:
            raise RuntimeError("not this one")

        a.on_egress = refuse
        with pytest.raises(RuntimeError, match="not this one"):
            await a.send("b", "ring.chunk", bytes(OFF_LOOP_BYTES))
        assert got == []

    asyncio.run(main())


async def _ack(env: Envelope) -> bytes:
    return b"ok"
