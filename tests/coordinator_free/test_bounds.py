"""Bounded peers (issue 20, finding 4): what one member can make another node hold.

Round slots only for admitted runs and their participants, a quota of open rounds per
member, byte caps on what rounds, rings and CKKS sums keep, JSON nesting refused
before decoding, and a replay window a far-future sequence number cannot poison. The
attacker is a federation member ``m`` with a real signing key, on the in-memory
network; its messages pass every envelope check.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from coordinator_free.checkpoints import ShardStore
from coordinator_free.checkpoints.service import LIST, STAGE, ShardService
from coordinator_free.endpoint import Endpoint
from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.membership.messages import decode_message
from coordinator_free.memory import InMemoryNetwork
from coordinator_free.peer_json import json_depth, loads_bounded
from coordinator_free.ring.wire import HEADER, KIND_CHUNK, PHASE_SCATTER, VERSION
from coordinator_free.rounds import KIND_PERMIT, KIND_READY, KIND_SEED, RoundConfig, RoundEngine
from coordinator_free.rounds.ckks import KIND_CKKS_PARTIAL, CkksAggregator
from coordinator_free.rounds.inbox import ENTRY_OVERHEAD, Inbox, InboxLimits
from coordinator_free.rounds.state import Admission
from coordinator_free.transport import SEQUENCE_SLACK_US
from coordinator_free.wire import Envelope
from hypothesis import given
from hypothesis import strategies as st

from tests.coordinator_free.transport_support import FEDERATION, identity, signed

FAST = RoundConfig(
    ready_timeout=2.0, stage_timeout=4.0, step_timeout=2.0, send_timeout=4.0, ring_min_chunk=1
)
RUN = "real-run"


@dataclass
class Scene:
    """Honest ``a`` and ``b`` (participants of ``RUN``) and the member ``m``."""

    a: RoundEngine
    b: RoundEngine
    m: Endpoint
    net: InMemoryNetwork


def _admit(participants: Collection[str]) -> Admission:
    def admit(run: str) -> Collection[str] | None:
        return participants if run.partition(":")[0] == RUN else None

    return admit


async def _scene(participants: Collection[str] = ("a", "b")) -> Scene:
    net = InMemoryNetwork()
    ids = {o: identity(o) for o in ("a", "b", "m")}
    keys = {o: i.public_key for o, i in ids.items()}
    eps = {o: Endpoint(ids[o], FEDERATION, net.transport(o), lambda: keys) for o in ids}
    engines = {
        o: RoundEngine.secure(eps[o], lambda: ["a", "b"], FAST, admit=_admit(participants))
        for o in ("a", "b")
    }
    for ep in eps.values():
        await ep.start()
    return Scene(engines["a"], engines["b"], eps["m"], net)


async def _refusal(send: Awaitable[bytes]) -> RefusalReason:
    with pytest.raises(Refused) as info:
        await send
    return info.value.reason


async def _round(s: Scene, round: int) -> None:
    va, vb = np.arange(8, dtype=np.uint32), np.full(8, 5, dtype=np.uint32)
    ra, rb = await asyncio.gather(s.a.run_round(RUN, round, va), s.b.run_round(RUN, round, vb))
    assert np.array_equal(ra.sum, va + vb) and np.array_equal(rb.sum, va + vb)


def test_finding_4_invented_runs_cannot_take_round_slots() -> None:
    async def main() -> None:
        s = await _scene()
        for i in range(80):
            reason = await _refusal(
                s.m.send("a", KIND_READY, b"x" * 40, run=f"invented-{i}", round=1, timeout=2.0)
            )
            assert reason is RefusalReason.NOT_ADMITTED
        assert s.a.open_rounds() == []
        # a member that is not among the run's participants opens nothing of it either
        reason = await _refusal(s.m.send("a", KIND_PERMIT, bytes(32), run=RUN, round=1))
        assert reason is RefusalReason.NOT_ADMITTED
        await _round(s, 1)

    asyncio.run(main())


def test_finding_4_a_participant_holds_at_most_its_quota_of_open_rounds() -> None:
    async def main() -> None:
        s = await _scene(("a", "b", "m"))
        quota = s.a._table.member_quota()
        reasons = [
            await _refusal(s.m.send("a", KIND_PERMIT, bytes(32), run=RUN, round=r))
            if r >= 100 + quota
            else await s.m.send("a", KIND_PERMIT, bytes(32), run=RUN, round=r)
            for r in range(100, 100 + quota + 20)
        ]
        assert reasons[quota:] == [RefusalReason.QUOTA] * 20
        assert len(s.a.open_rounds()) == quota
        # the victim's own rounds still start, and b can still open them at a
        await _round(s, 1)
        await _round(s, 2)

    asyncio.run(main())


def test_finding_4_seeds_memory_is_bounded_per_member() -> None:
    async def main() -> None:
        s = await _scene(("a", "b", "m"))
        limit = InboxLimits().per_sender
        mib = 1 << 20
        kept = refused = 0
        for i in range(20):
            payload = i.to_bytes(32, "big") + b"\x00" + bytes(34 * (mib // 34))
            try:
                await s.m.send("a", KIND_SEED, payload, run=RUN, round=1)
                kept += 1
            except Refused as exc:
                assert exc.reason is RefusalReason.OVERSIZED
                refused += 1
        state = s.a._table.get(RUN, 1)
        assert state is not None
        assert state.inbox.held("m") <= limit
        # about 8 of the 20 MiB are kept, the rest refused and dropped
        assert kept == limit // (len(payload) - 33 + ENTRY_OVERHEAD) and refused == 20 - kept
        await _round(s, 1)

    asyncio.run(main())


def test_a_round_keeps_at_most_its_limit_from_all_peers_together() -> None:
    # each sender under its own limit, the round's total over its own: the message that
    # would pass it is refused and nothing of it kept; this node's own are not counted
    cost = 1000 + ENTRY_OVERHEAD
    inbox = Inbox("me", InboxLimits(per_sender=10 * cost, per_round=3 * cost))
    for i in range(3):
        assert inbox.put(("seed",), f"p{i}", bytes(1000))
    assert inbox.put(("seed",), "me", bytes(5000))
    with pytest.raises(Refused) as refused:
        inbox.put(("seed",), "p3", bytes(1000))
    assert refused.value.reason is RefusalReason.OVERSIZED
    assert inbox.item(("seed",), "p3") is None and inbox.held("p3") == 0
    assert inbox.held() == 3 * cost == sum(inbox.held(f"p{i}") for i in range(3))
    assert not inbox.put(("seed",), "p0", bytes(1))  # a second message is not filed
    assert inbox.held() == 3 * cost


def test_finding_4_ckks_partial_is_refused_at_a_masked_backend_node() -> None:
    async def main() -> None:
        net = InMemoryNetwork()
        ids = {o: identity(o) for o in ("a", "m")}
        keys = {o: i.public_key for o, i in ids.items()}
        ea = Endpoint(ids["a"], FEDERATION, net.transport("a"), lambda: keys)
        em = Endpoint(ids["m"], FEDERATION, net.transport("m"), lambda: keys)
        engine = RoundEngine.secure(ea, lambda: ["a", "m"], FAST)
        # a masked-backend node admits no CKKS run at all
        masked = CkksAggregator(ea, model_hashes=engine.model_hashes, admit=lambda run: None)
        await ea.start()
        big = bytes(8 << 20)
        for r in range(4):
            reason = await _refusal(em.send("a", KIND_CKKS_PARTIAL, big, run=RUN, round=r))
            assert reason is RefusalReason.NOT_ADMITTED
        assert masked.held("m") == 0 and masked._inbox == {}

    asyncio.run(main())


def test_finding_4_ckks_memory_is_bounded_per_member() -> None:
    async def main() -> None:
        net = InMemoryNetwork()
        ids = {o: identity(o) for o in ("a", "m")}
        keys = {o: i.public_key for o, i in ids.items()}
        ea = Endpoint(ids["a"], FEDERATION, net.transport("a"), lambda: keys)
        em = Endpoint(ids["m"], FEDERATION, net.transport("m"), lambda: keys)
        engine = RoundEngine.secure(ea, lambda: ["a", "m"], FAST)
        ckks = CkksAggregator(
            ea,
            model_hashes=engine.model_hashes,
            admit=lambda run: {"a", "m"} if run == RUN else None,
            member_bytes=5 << 20,
        )
        await ea.start()
        for r in range(2):
            await em.send("a", KIND_CKKS_PARTIAL, bytes(2 << 20), run=RUN, round=r)
        reason = await _refusal(em.send("a", KIND_CKKS_PARTIAL, bytes(2 << 20), run=RUN, round=2))
        assert reason is RefusalReason.OVERSIZED
        assert ckks.held("m") == 4 << 20

    asyncio.run(main())


def test_finding_4_ring_chunks_are_bounded_per_member() -> None:
    async def main() -> None:
        s = await _scene(("a", "b", "m"))
        s.a._table.state(RUN, 1)  # a runs the round: its ring box is open
        s.a.ring.expect(RUN, 1, vector_bytes=1 << 16, attempts=1)
        cap = 4 * (1 << 16) + (1 << 20)
        frame = bytes(1 << 18)
        sent = 0
        with pytest.raises(Refused) as info:
            for f in range(64):
                header = HEADER.pack(
                    VERSION, PHASE_SCATTER, 32, 0, 0, f, len(frame) // 4, bytes(16)
                )
                await s.m.send("a", KIND_CHUNK, header + frame, run=RUN, round=1)
                sent += len(header) + len(frame)
        assert info.value.reason is RefusalReason.OVERSIZED
        assert sent <= cap < sent + len(frame) + HEADER.size

    asyncio.run(main())


def test_finding_4_nested_json_is_refused_not_a_recursion_error(tmp_path: Path) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    assert json_depth(deep) == 100_000
    with pytest.raises(Refused) as info:
        loads_bounded(deep)
    assert info.value.reason is RefusalReason.MALFORMED
    # strings do not count, and shallow documents decode as json.loads does
    assert loads_bounded(b'{"a": "[[[[{{{{", "b": [[1]]}') == {"a": "[[[[{{{{", "b": [[1]]}
    with pytest.raises(Refused) as info:
        decode_message(b'{"i": 1, "u": ' + deep + b"}")
    assert info.value.reason is RefusalReason.MALFORMED

    async def main() -> None:
        net = InMemoryNetwork()
        ids = {o: identity(o) for o in ("a", "m")}
        keys = {o: i.public_key for o, i in ids.items()}
        ea = Endpoint(ids["a"], FEDERATION, net.transport("a"), lambda: keys)
        em = Endpoint(ids["m"], FEDERATION, net.transport("m"), lambda: keys)
        ShardService(ea, ShardStore(tmp_path / "shards"), lambda: keys)
        await ea.start()
        nested = b'{"owner": ' + deep + b"}"
        reason = await _refusal(em.send("a", LIST, nested, stage=STAGE))
        assert reason is RefusalReason.MALFORMED
        # the service still answers a well-formed request
        assert await em.send("a", LIST, b'{"owner": "m"}', stage=STAGE)

    asyncio.run(main())


def test_finding_4_far_future_sequence_does_not_poison_the_replay_window() -> None:
    async def main() -> None:
        net = InMemoryNetwork()
        alice, bob = identity("a"), identity("b")
        members = {"a": alice.public_key, "b": bob.public_key}
        honest = Endpoint(bob, FEDERATION, net.transport("b"), lambda: members)

        async def echo(env: Envelope) -> bytes:
            return b"ok"

        honest.on("echo", echo)
        await honest.start()
        raw = net.transport("a")
        now = time.time()
        for seq in (2**64 - 1, int(now * 1e6) + SEQUENCE_SLACK_US + 10**9):
            with pytest.raises(Refused) as info:
                await raw.request("b", signed(alice, "b", seq, sent_at=now).to_wire(), timeout=1)
            assert info.value.reason is RefusalReason.STALE
        # the window did not move: the sender's next message is fresh
        await raw.request("b", signed(alice, "b", 10_000).to_wire(), timeout=1)
        # and a restarted sender (its counter seeded from the clock) is not locked out
        restarted = time.time_ns() // 1000
        await raw.request("b", signed(alice, "b", restarted).to_wire(), timeout=1)
        assert honest.guard.refusals == {RefusalReason.STALE: 2}

    asyncio.run(main())


def _depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab'),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=12,
)


@given(_JSON)
def test_json_depth_is_the_nesting_of_the_decoded_value(value: object) -> None:
    text = json.dumps(value)
    assert json_depth(text) == json_depth(text.encode()) == _depth(value)
    assert loads_bounded(text) == value


def test_json_depth_is_the_same_summed_in_python_or_in_numpy() -> None:
    """Small documents are summed in a loop (no numpy import for the CLI), large ones by
    numpy a MiB at a time: both give the nesting of the document."""
    from coordinator_free.peer_json import _SMALL, _small_depth

    doc = "[" + ",".join(['[[1],{"a":[2,[3]]}]'] * (_SMALL // 4)) + "]"
    brackets = bytes(c for c in doc.encode() if c in b"[]{}")
    assert len(brackets) > _SMALL
    assert json_depth(doc) == _small_depth(brackets, 1 << 62) == 5
    assert json_depth('{"x": "[[[[[["}') == 1  # brackets inside strings do not count
