"""The in-memory network: delivery, accounting, faults and partitions."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from coordinator_free.errors import (
    PeerUnreachable,
    RefusalReason,
    Refused,
    RemoteError,
    RequestTimeout,
)
from coordinator_free.memory import InMemoryNetwork, InMemoryTransport
from coordinator_free.transport import Transport


async def _upper(data: bytes) -> bytes:
    return data.upper()


async def _network(
    orgs: str, **kwargs: Any
) -> tuple[InMemoryNetwork, dict[str, InMemoryTransport]]:
    net = InMemoryNetwork(**kwargs)
    transports = {org: net.transport(org) for org in orgs}
    for transport in transports.values():
        await transport.start(_upper)
    return net, transports


def test_request_reply_and_accounting() -> None:
    async def main() -> None:
        net, t_net = await _network("ab")
        a = t_net["a"]
        assert isinstance(a, Transport)
        assert await a.request("b", b"hello", timeout=1.0) == b"HELLO"
        assert net.bytes_sent == {"a": 5, "b": 5}
        assert net.messages_sent == {"a": 1, "b": 1}

    asyncio.run(main())


@pytest.mark.parametrize(
    "kwargs",
    [{"latency_s": -1.0}, {"bandwidth_bps": 0.0}, {"loss": 1.0}, {"loss": -0.1}],
)
def test_invalid_configuration_is_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        InMemoryNetwork(**kwargs)


def test_one_open_transport_per_org() -> None:
    async def main() -> None:
        net = InMemoryNetwork()
        first = net.transport("a")
        with pytest.raises(ValueError, match="already"):
            net.transport("a")
        await first.close()
        second = net.transport("a")
        await second.start(_upper)
        assert await second.request("a", b"x", timeout=1.0) == b"X"

    asyncio.run(main())


def test_unknown_and_closed_peers_are_unreachable() -> None:
    async def main() -> None:
        _net, t_net = await _network("ab")
        a = t_net["a"]
        with pytest.raises(PeerUnreachable):
            await a.request("nobody", b"x", timeout=1.0)
        await t_net["b"].close()
        with pytest.raises(PeerUnreachable):
            await a.request("b", b"x", timeout=1.0)

    asyncio.run(main())


def test_partition_and_heal() -> None:
    async def main() -> None:
        net, t_net = await _network("abcd")
        a, c = t_net["a"], t_net["c"]
        net.partition({"a", "b"}, {"c"})
        assert await a.request("b", b"in", timeout=1.0) == b"IN"
        with pytest.raises(PeerUnreachable):
            await a.request("c", b"across", timeout=1.0)
        with pytest.raises(PeerUnreachable):
            await c.request("a", b"across", timeout=1.0)
        with pytest.raises(PeerUnreachable):
            await a.request("d", b"ungrouped", timeout=1.0)
        net.heal()
        assert await a.request("c", b"healed", timeout=1.0) == b"HEALED"

    asyncio.run(main())


def test_partition_groups_must_be_disjoint() -> None:
    with pytest.raises(ValueError, match="more than one"):
        InMemoryNetwork().partition({"a", "b"}, {"b"})


def test_kill_and_revive() -> None:
    async def main() -> None:
        net, t_net = await _network("ab")
        a, b = t_net["a"], t_net["b"]
        net.kill("b")
        with pytest.raises(PeerUnreachable):
            await a.request("b", b"x", timeout=1.0)
        with pytest.raises(PeerUnreachable):
            await b.request("a", b"x", timeout=1.0)
        net.revive("b")
        assert await a.request("b", b"x", timeout=1.0) == b"X"

    asyncio.run(main())


def test_loss_is_seeded_and_partial() -> None:
    async def outcomes(seed: int) -> list[bool]:
        _net, t_net = await _network("ab", loss=0.3, seed=seed)
        result = []
        for _ in range(60):
            try:
                await t_net["a"].request("b", b"x", timeout=1.0)
                result.append(True)
            except PeerUnreachable:
                result.append(False)
        return result

    first = asyncio.run(outcomes(1))
    assert first == asyncio.run(outcomes(1))
    assert any(first) and not all(first)
    assert first != asyncio.run(outcomes(2))


def test_latency_and_bandwidth_cause_timeouts() -> None:
    async def main() -> None:
        _slow, t_slow = await _network("ab", latency_s=0.5)
        with pytest.raises(RequestTimeout):
            await t_slow["a"].request("b", b"x", timeout=0.05)
        _narrow, t_narrow = await _network("ab", bandwidth_bps=8_000.0)
        with pytest.raises(RequestTimeout):
            await t_narrow["a"].request("b", b"x" * 10_000, timeout=0.05)
        assert await t_narrow["a"].request("b", b"x", timeout=1.0) == b"X"

    asyncio.run(main())


def test_handler_refusal_and_failure_reach_the_caller() -> None:
    async def refuse(data: bytes) -> bytes:
        raise Refused(RefusalReason.STALE, "secret detail")

    async def crash(data: bytes) -> bytes:
        raise RuntimeError("bug")

    async def main() -> None:
        net = InMemoryNetwork()
        a = net.transport("a")
        await net.transport("r").start(refuse)
        await net.transport("c").start(crash)
        with pytest.raises(Refused) as info:
            await a.request("r", b"x", timeout=1.0)
        assert info.value.reason is RefusalReason.STALE
        assert "secret detail" not in str(info.value)
        with pytest.raises(RemoteError):
            await a.request("c", b"x", timeout=1.0)

    asyncio.run(main())


def test_timeout_must_be_positive() -> None:
    async def main() -> None:
        _net, t_net = await _network("ab")
        with pytest.raises(ValueError):
            await t_net["a"].request("b", b"x", timeout=0.0)

    asyncio.run(main())
