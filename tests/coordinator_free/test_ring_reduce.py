"""Ring all-reduce over signed endpoints on the in-memory network."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from coordinator_free.endpoint import Endpoint
from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.identity import OrgIdentity
from coordinator_free.memory import InMemoryNetwork
from coordinator_free.ring import (
    KIND_ABORT,
    KIND_CHUNK,
    KIND_SUM,
    RingBroken,
    RingReducer,
    RingStats,
    Scattered,
    chunk_bounds,
    ring_id,
    ring_order,
)
from coordinator_free.ring.wire import NARROW_BITS, pack_narrow, packed_bytes, unpack_narrow
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FED = "fed-test"
_IDS: dict[str, OrgIdentity] = {}


def identity(org: str) -> OrgIdentity:
    if org not in _IDS:
        _IDS[org] = OrgIdentity.generate(org, private_bytes=bytes([len(_IDS) + 1]) * 32)
    return _IDS[org]


async def make_ring(
    orgs: list[str], network: InMemoryNetwork
) -> tuple[dict[str, Endpoint], dict[str, RingReducer]]:
    keys = {o: identity(o).public_key for o in orgs}
    endpoints = {o: Endpoint(identity(o), FED, network.transport(o), lambda: keys) for o in orgs}
    reducers = {o: RingReducer(e) for o, e in endpoints.items()}
    for e in endpoints.values():
        await e.start()
    return endpoints, reducers


def test_chunk_bounds_cover_and_balance() -> None:
    for length in (0, 1, 7, 100):
        for n in (1, 2, 3, 8):
            b = chunk_bounds(length, n)
            assert b[0][0] == 0 and b[-1][1] == length
            assert all(b[i][1] == b[i + 1][0] for i in range(n - 1))
            sizes = [hi - lo for lo, hi in b]
            assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError):
        chunk_bounds(5, 0)


def test_ring_order_is_deterministic_and_round_dependent() -> None:
    orgs = [f"org-{i}" for i in range(10)]
    a = ring_order(orgs, 3)
    assert a == ring_order(list(reversed(orgs)), 3)
    assert sorted(a) == sorted(orgs)
    assert any(ring_order(orgs, r) != a for r in range(4, 10))
    assert ring_id(a, 0) != ring_id(a, 1)
    assert ring_id(a, 0) != ring_id(list(reversed(a)), 0)


def test_a_round_makes_the_ring_order_of_a_set_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import coordinator_free.rounds.state as state_module
    from coordinator_free.rounds.state import RoundState

    orgs = [f"org-{i}" for i in range(10)]
    made: list[frozenset[str]] = []

    def counted(members: frozenset[str], round: int) -> list[str]:
        made.append(frozenset(members))
        return ring_order(members, round)

    monkeypatch.setattr(state_module, "ring_order", counted)
    state = RoundState("org-0", "run", 3)
    order = state.ring_order(orgs)
    assert order == ring_order(orgs, 3)
    order.reverse()  # a caller's copy: the round's order stays as it was
    assert state.ring_order(reversed(orgs)) == ring_order(orgs, 3)
    assert state.ring_order(orgs[:5]) == ring_order(orgs[:5], 3)
    assert made == [frozenset(orgs), frozenset(orgs[:5])]


async def _allreduce(
    n: int, length: int, dtype: type[np.unsignedinteger], seed: int, min_chunk: int = 1
) -> tuple[list[np.ndarray], np.ndarray, dict[str, RingStats], InMemoryNetwork]:
    network = InMemoryNetwork()
    orgs = [f"o{i}" for i in range(n)]
    endpoints, reducers = await make_ring(orgs, network)
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    inputs = {o: rng.integers(0, info.max, size=length, dtype=dtype, endpoint=True) for o in orgs}
    order = ring_order(orgs, 1)
    stats = {o: RingStats() for o in orgs}
    outs = await asyncio.gather(
        *(
            reducers[o].allreduce(
                order, inputs[o], run="r", round=1, stats=stats[o], timeout=5, min_chunk=min_chunk
            )
            for o in orgs
        )
    )
    expected = np.zeros(length, dtype=dtype)
    for v in inputs.values():
        np.add(expected, v, out=expected)
    for e in endpoints.values():
        await e.close()
    return list(outs), expected, stats, network


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 6),
    length=st.integers(0, 40),
    dtype=st.sampled_from([np.uint16, np.uint32, np.uint64]),
    chain=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_allreduce_equals_modular_sum(
    n: int, length: int, dtype: type[np.unsignedinteger], chain: bool, seed: int
) -> None:
    outs, expected, _, _ = asyncio.run(
        _allreduce(n, length, dtype, seed, min_chunk=10**6 if chain else 1)
    )
    for out in outs:
        assert out.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(out, expected)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(2, 6),
    length=st.integers(0, 40),
    wide=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_reduce_scatter_leaves_two_holders_per_chunk_and_the_sum_gathers(
    n: int, length: int, wide: bool, seed: int
) -> None:
    # the owner path: each member holds its own complete chunk and its predecessor's,
    # transforms them (the engine unmasks them; here: adds 1), and the all-gather of
    # the transformed chunks gives every member the whole transformed sum
    dtype = np.uint64 if wide else np.uint32

    async def scenario() -> tuple[dict[str, Scattered], list[np.ndarray], np.ndarray, int]:
        network = InMemoryNetwork()
        orgs = [f"o{i}" for i in range(n)]
        endpoints, reducers = await make_ring(orgs, network)
        rng = np.random.default_rng(seed)
        info = np.iinfo(dtype)
        inputs = {o: rng.integers(0, info.max, size=length, dtype=dtype) for o in orgs}
        order = ring_order(orgs, 1)
        stats = {o: RingStats() for o in orgs}
        scattered = dict(
            zip(
                orgs,
                await asyncio.gather(
                    *(
                        reducers[o].reduce_scatter(
                            order, inputs[o], run="r", round=1, stats=stats[o], timeout=5
                        )
                        for o in orgs
                    )
                ),
                strict=True,
            )
        )
        for sc in scattered.values():
            for index in {sc.own, sc.held}:
                lo, hi = sc.bounds[index]
                sc.acc[lo:hi] += dtype(1)
        outs = await asyncio.gather(
            *(
                reducers[o].all_gather_sum(
                    order, scattered[o], run="r", round=1, stats=stats[o], timeout=5
                )
                for o in orgs
            )
        )
        expected = np.zeros(length, dtype=dtype)
        for v in inputs.values():
            np.add(expected, v, out=expected)
        for e in endpoints.values():
            await e.close()
        return scattered, list(outs), expected, max(s.messages_sent for s in stats.values())

    scattered, outs, expected, most = asyncio.run(scenario())
    plus_one = expected + dtype(1)
    owners = [sc.own for sc in scattered.values()]
    assert sorted(owners) == list(range(n))  # every chunk has one owner...
    assert sorted(sc.held for sc in scattered.values()) == list(range(n))  # ...and one copy
    for out in outs:
        np.testing.assert_array_equal(out, plus_one)
    assert all(sc.filled == set(range(n)) for sc in scattered.values())
    assert most == 2 * (n - 1)  # as many messages as the all-reduce


def test_a_sum_chunk_must_come_as_agg_sum_and_a_masked_one_as_agg_chunk() -> None:
    async def scenario() -> list[RefusalReason]:
        network = InMemoryNetwork()
        endpoints, reducers = await make_ring(["a", "b"], network)
        reducers["b"].open("r", 1)
        reasons = []
        for kind, phase in ((KIND_SUM, 1), (KIND_CHUNK, 7)):
            header = struct.pack(">BBBIIII16s", 1, phase, 32, 0, 0, 0, 1, bytes(16))
            with pytest.raises(Refused) as info:
                await endpoints["a"].send("b", kind, header + bytes(4), run="r", round=1)
            reasons.append(info.value.reason)
        for e in endpoints.values():
            await e.close()
        return reasons

    assert asyncio.run(scenario()) == [RefusalReason.MALFORMED] * 2


def test_each_node_sends_about_two_payloads() -> None:
    n, length = 8, 80_000
    _, _, stats, network = asyncio.run(_allreduce(n, length, np.uint32, 0))
    payload = length * 4
    for org, s in stats.items():
        assert s.messages_sent == 2 * (n - 1)
        # the ring's share: 2 (n-1)/n of the payload plus headers
        assert 2 * (n - 1) / n * payload <= s.bytes_sent <= 2 * (n - 1) / n * payload + 1024
        # what the transport counted: the same plus envelopes, replies and signatures
        assert network.bytes_sent[org] < 2.2 * payload


def test_short_vectors_take_the_chain_with_few_messages() -> None:
    n, length = 6, 50
    outs, expected, stats, _ = asyncio.run(_allreduce(n, length, np.uint32, 3, min_chunk=1024))
    for out in outs:
        np.testing.assert_array_equal(out, expected)
    # 2 (n - 1) messages in all; no node sends more than two vectors
    assert sum(s.messages_sent for s in stats.values()) == 2 * (n - 1)
    assert max(s.messages_sent for s in stats.values()) <= 2


@pytest.mark.parametrize(
    "min_chunk, phase, step", [(1, "scatter", 1), (1, "gather", 1), (10**6, "gather", 0)]
)
def test_dead_member_breaks_the_ring_for_everyone(min_chunk: int, phase: str, step: int) -> None:
    orgs = [f"o{i}" for i in range(4)]
    order = ring_order(orgs, 2)
    victim = order[2]

    async def scenario() -> list[object]:
        network = InMemoryNetwork()
        endpoints, reducers = await make_ring(orgs, network)

        class Killed(Exception):
            pass

        def hook(org: str) -> Callable[[str, int], Awaitable[None]]:
            async def on_step(ph: str, st_: int) -> None:
                if org == victim and (ph, st_) == (phase, step):
                    network.kill(victim)
                    raise Killed

            return on_step

        vec = np.arange(100, dtype=np.uint32)
        results = await asyncio.gather(
            *(
                reducers[o].allreduce(
                    order,
                    vec,
                    run="r",
                    round=2,
                    timeout=1.0,
                    on_step=hook(o),
                    min_chunk=min_chunk,
                )
                for o in orgs
            ),
            return_exceptions=True,
        )
        results = [r for o, r in zip(orgs, results, strict=True) if o != victim]
        for e in endpoints.values():
            await e.close()
        return list(results)

    results = asyncio.run(scenario())
    broken = [r for r in results if isinstance(r, RingBroken)]
    assert broken, results
    # a member past the failure may already hold the whole sum (the victim's input
    # had travelled on): never a partial one
    full = np.arange(100, dtype=np.uint32) * 4
    for r in results:
        assert isinstance(r, RingBroken) or (isinstance(r, np.ndarray) and np.array_equal(r, full))
    # the aborts carry the blame: every member whose ring broke knows whom to leave out
    for r in broken:
        assert r.suspects == {victim}, r


async def _gather_kill(
    orgs: list[str], victim: str, step: int, owner: bool = False
) -> tuple[dict[str, object], int]:
    """A ring all-reduce of ``orgs`` in which ``victim`` dies as the all-gather's step
    ``step`` begins: each survivor's result (or error), and the aborts sent. With
    ``owner``, the owner path's: the reduce-scatter, then the all-gather of the sum
    (``agg.sum``, steps 1 to ``n - 2``)."""
    network = InMemoryNetwork()
    endpoints, reducers = await make_ring(orgs, network)
    order = ring_order(orgs, 2)
    aborts = 0
    for e in endpoints.values():
        inner = e.send

        async def counted(dest: str, kind: str, *a: Any, inner: Any = inner, **k: Any) -> Any:
            nonlocal aborts
            aborts += kind == KIND_ABORT
            return await inner(dest, kind, *a, **k)

        e.send = counted  # type: ignore[method-assign,assignment]

    def hook(org: str) -> Callable[[str, int], Awaitable[None]]:
        async def on_step(ph: str, st_: int) -> None:
            if org == victim and (ph, st_) == ("gather", step):
                network.kill(victim)
                raise RuntimeError("killed")

        return on_step

    vec = np.arange(600, dtype=np.uint32)

    async def owner_path(o: str) -> np.ndarray:
        options: Any = {"run": "r", "round": 2, "timeout": 1.0, "on_step": hook(o)}
        scattered = await reducers[o].reduce_scatter(order, vec, **options)
        return await reducers[o].all_gather_sum(order, scattered, **options)

    got = await asyncio.gather(
        *(
            owner_path(o)
            if owner
            else reducers[o].allreduce(
                order, vec, run="r", round=2, timeout=1.0, on_step=hook(o), min_chunk=1
            )
            for o in orgs
        ),
        return_exceptions=True,
    )
    for e in endpoints.values():
        await e.close()
    return {o: r for o, r in zip(orgs, got, strict=True) if o != victim}, aborts


@pytest.mark.parametrize("owner", [False, True], ids=["all-reduce", "owner-path"])
@pytest.mark.parametrize("step", [1, 2, 3, 4])
def test_a_death_in_the_all_gather_stops_only_the_members_it_cuts_off(
    step: int, owner: bool
) -> None:
    """The victim dies as the all-gather's step ``s`` begins (``n = 6``), in the
    all-reduce or in the owner path's all-gather of the sum. The chunks of the
    ``n - 1 - s`` members after it had to pass through it: they, and only they, stop,
    each blaming the victim; the rest (its predecessor, whose send failed, included)
    complete with the whole sum. At most one abort reaches each member stopped, none
    any other: no member that stopped on an abort sends one."""
    orgs = [f"o{i}" for i in range(6)]
    n, order = len(orgs), ring_order(orgs, 2)
    at = 2
    victim = order[at]
    results, aborts = asyncio.run(_gather_kill(orgs, victim, step, owner))
    cut_off = {order[(at + d) % n] for d in range(1, n - step)}
    full = np.arange(600, dtype=np.uint32) * n
    for org, r in results.items():
        if org in cut_off:
            assert isinstance(r, RingBroken) and r.suspects == {victim}, (org, r)
        else:
            assert isinstance(r, np.ndarray) and np.array_equal(r, full), (org, r)
    assert aborts <= len(cut_off)


def test_a_silent_dead_predecessor_is_pinged_once_membership_drops_it() -> None:
    # the victim dies after its predecessor handed it its last chunk (so no send
    # failed and nobody aborted) and before it sends its own last one: its successor
    # would wait a whole step timeout (300 s here) before pinging it, but pings it
    # as soon as the membership view (here: the network's dead list) drops it
    orgs = [f"o{i}" for i in range(4)]
    order = ring_order(orgs, 2)
    pred, victim, succ = order[1], order[2], order[3]

    async def scenario() -> dict[str, object]:
        network = InMemoryNetwork()
        endpoints, reducers = await make_ring(orgs, network)
        pred_done = asyncio.Event()
        asked: list[str] = []
        dead: set[str] = set()

        def alive(org: str) -> bool:
            asked.append(org)
            return org not in dead

        async def on_step(ph: str, st_: int) -> None:
            if (ph, st_) == ("gather", len(orgs) - 2):
                await pred_done.wait()
                network.kill(victim)
                dead.add(victim)
                raise asyncio.CancelledError

        async def run(o: str) -> np.ndarray:
            try:
                return await reducers[o].allreduce(
                    order,
                    np.arange(100, dtype=np.uint32),
                    run="r",
                    round=2,
                    timeout=300.0,
                    on_step=on_step if o == victim else None,
                    min_chunk=1,
                    alive=alive,
                )
            finally:
                if o == pred:
                    pred_done.set()

        tasks = {o: asyncio.ensure_future(run(o)) for o in orgs if o != victim}
        killed = asyncio.ensure_future(run(victim))
        done = await asyncio.wait_for(asyncio.gather(*tasks.values(), return_exceptions=True), 60)
        killed.cancel()
        for e in endpoints.values():
            await e.close()
        assert victim in asked, done
        return dict(zip(tasks, done, strict=True))

    results = asyncio.run(scenario())
    full = np.arange(100, dtype=np.uint32) * 4
    for o in (order[0], pred):  # they received everything before the death
        assert np.array_equal(results[o], full)  # type: ignore[arg-type]
    broken = results[succ]
    assert isinstance(broken, RingBroken) and broken.suspect == victim
    assert "is gone" in str(broken)


def test_chunks_for_a_round_not_open_are_refused() -> None:
    async def scenario() -> None:
        network = InMemoryNetwork()
        orgs = ["a", "b"]
        endpoints, reducers = await make_ring(orgs, network)
        reducers["b"].close("r", 9)
        with pytest.raises(RingBroken):
            # b never opens round 9 while a sends: refused, a gives up at once
            await reducers["a"].allreduce(
                ["a", "b"], np.zeros(4, np.uint32), run="r", round=9, timeout=0.5
            )
        for e in endpoints.values():
            await e.close()

    asyncio.run(scenario())


def test_rejects_bad_arguments() -> None:
    async def scenario() -> None:
        network = InMemoryNetwork()
        endpoints, reducers = await make_ring(["a", "b"], network)
        r = reducers["a"]
        with pytest.raises(ValueError, match="not in the ring"):
            await r.allreduce(["b", "c"], np.zeros(2, np.uint32), run="r", round=1)
        with pytest.raises(ValueError, match="uint32 or uint64"):
            await r.allreduce(["a", "b"], np.zeros(2, np.float32), run="r", round=1)
        with pytest.raises(ValueError, match="distinct"):
            await r.allreduce(["a", "a"], np.zeros(2, np.uint32), run="r", round=1)
        for e in endpoints.values():
            await e.close()

    asyncio.run(scenario())


def test_star_baseline_gives_the_same_sum_with_a_busy_hub() -> None:
    async def scenario() -> tuple[list[np.ndarray], np.ndarray, dict[str, RingStats], str]:
        network = InMemoryNetwork()
        orgs = [f"o{i}" for i in range(5)]
        endpoints, reducers = await make_ring(orgs, network)
        rng = np.random.default_rng(4)
        inputs = {o: rng.integers(0, 2**32, 1000, dtype=np.uint32) for o in orgs}
        order = ring_order(orgs, 3)
        stats = {o: RingStats() for o in orgs}
        outs = await asyncio.gather(
            *(
                reducers[o].star_allreduce(order, inputs[o], run="r", round=3, stats=stats[o])
                for o in orgs
            )
        )
        expected = np.zeros(1000, np.uint32)
        for v in inputs.values():
            np.add(expected, v, out=expected)
        for e in endpoints.values():
            await e.close()
        return list(outs), expected, stats, order[0]

    outs, expected, stats, hub = asyncio.run(scenario())
    for out in outs:
        np.testing.assert_array_equal(out, expected)
    # the hub sends the total to each of the 4 others
    assert stats[hub].messages_sent == 4
    assert stats[hub].bytes_sent >= 4 * 4000
    assert all(s.bytes_sent < 4000 + 64 for o, s in stats.items() if o != hub)


def test_large_chunks_travel_in_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    import coordinator_free.ring.wire as ring_module

    monkeypatch.setattr(ring_module, "MAX_FRAME_BYTES", 400)  # 100 uint32 per message
    n, length = 3, 3000  # chunks of 1000 elements: 10 frames each
    outs, expected, stats, _ = asyncio.run(_allreduce(n, length, np.uint32, 5))
    for out in outs:
        np.testing.assert_array_equal(out, expected)
    assert all(s.messages_sent == 2 * (n - 1) * 10 for s in stats.values())


# -- a ring narrower than its uint16 storage ------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from(NARROW_BITS),
    values=st.lists(st.integers(0, 2**16 - 1), max_size=70),
)
def test_packing_keeps_the_low_bits_of_every_element(bits: int, values: list[int]) -> None:
    v = np.array(values, dtype=np.uint16)
    packed = pack_narrow(v, bits)
    assert packed.shape[0] == packed_bytes(len(values), bits)
    np.testing.assert_array_equal(
        unpack_narrow(packed.tobytes(), len(values), bits), v & ((1 << bits) - 1)
    )


def test_packing_fixed_vector_and_sizes() -> None:
    # 10 bits: 4 elements in 5 bytes, little-endian (element i at bit 10 i), then a
    # last group padded with zeros
    v = np.array([1, 2, 3, 1023, 5], dtype=np.uint16)
    assert pack_narrow(v, 10).tobytes().hex() == "010830c0ff0500000000"
    assert pack_narrow(np.array([0xABCD, 0x12], dtype=np.uint16), 8).tobytes() == b"\xcd\x12"
    assert [packed_bytes(1000, b) for b in NARROW_BITS] == [1000, 1250, 1500, 1750]
    with pytest.raises(ValueError, match="do not pack"):
        unpack_narrow(bytes(6), 5, 10)
    with pytest.raises(ValueError, match="bits wide"):
        pack_narrow(v, 11)


@pytest.mark.parametrize("chain", [False, True])
def test_a_narrow_ring_sums_modulo_its_width_and_sends_its_bits_only(chain: bool) -> None:
    n, length, bits = 4, 40_000, 10

    async def scenario() -> tuple[list[np.ndarray], list[np.ndarray], dict[str, RingStats]]:
        network = InMemoryNetwork()
        orgs = [f"o{i}" for i in range(n)]
        endpoints, reducers = await make_ring(orgs, network)
        rng = np.random.default_rng(5)
        inputs = [rng.integers(0, 2**16, length, dtype=np.uint16) for _ in orgs]
        order = ring_order(orgs, 1)
        stats = {o: RingStats() for o in orgs}
        outs = await asyncio.gather(
            *(
                reducers[o].allreduce(
                    order,
                    inputs[i],
                    run="r",
                    round=1,
                    stats=stats[o],
                    timeout=5,
                    bits=bits,
                    min_chunk=10**6 if chain else 1,
                )
                for i, o in enumerate(orgs)
            )
        )
        for e in endpoints.values():
            await e.close()
        return list(outs), inputs, stats

    outs, inputs, stats = asyncio.run(scenario())
    expected = np.zeros(length, dtype=np.uint16)
    for v in inputs:
        np.add(expected, v, out=expected)
    for out in outs:  # every member holds the same elements, each below 2^bits
        np.testing.assert_array_equal(out, expected & ((1 << bits) - 1))
    # a ring all-reduce sends 2 (n - 1) / n of the vector per node, here at 10 bits
    # an element; the chain sends at most two whole vectors
    vector = packed_bytes(length, bits)
    share = 2 * vector if chain else 2 * (n - 1) / n * vector
    assert max(s.bytes_sent for s in stats.values()) <= share + 2 * n * 64
    assert max(s.bytes_sent for s in stats.values()) < (share * 16 / bits) * 0.7


def test_a_narrow_ring_refuses_chunks_of_another_width_and_bad_widths() -> None:
    async def scenario() -> None:
        network = InMemoryNetwork()
        endpoints, reducers = await make_ring(["a", "b"], network)
        order = ring_order(["a", "b"], 1)
        x = np.ones(4096, dtype=np.uint16)
        # one member runs the 10-bit ring, the other the 16-bit one: chunks are refused
        with pytest.raises(RingBroken, match="malformed"):
            await asyncio.gather(
                reducers["a"].allreduce(order, x, run="r", round=1, timeout=2, bits=10),
                reducers["b"].allreduce(order, x, run="r", round=1, timeout=2),
            )
        with pytest.raises(ValueError, match="cannot be 10 bits"):
            await reducers["a"].allreduce(
                order, np.ones(8, dtype=np.uint32), run="r", round=2, timeout=2, bits=10
            )
        for e in endpoints.values():
            await e.close()

    asyncio.run(scenario())
