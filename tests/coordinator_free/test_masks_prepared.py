"""Masks prepared a round ahead: each ready advertises the masking key of its org's next
round of the run, every node expands that round's masks once the round before it
completed, and the round adds its input to them. The masked input is the one the round
would have made without them, bit for bit; faults only cost the saving."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import numpy as np
import pytest
from coordinator_free.rounds import RoundConfig
from coordinator_free.rounds.ahead import AheadKeys
from coordinator_free.rounds.prepared import MaskPreparer, PreparedMasks, correction
from coordinator_free.rounds.session import (
    MaskedSum,
    SecAggSession,
    SessionContext,
    SessionFactory,
)
from coordinator_free.sim import Fault, FaultSpec, RoundOutcome, SimConfig, Simulation
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from secure_agg import prg
from secure_agg.codec import FixedPointCodec
from secure_agg.protocol import MaskingSecrets
from tests.coordinator_free.test_rounds import FAST, KILL_STAGES

ORGS = ("org-0", "org-1", "org-2", "org-3")


def _rounds(
    peers: int, count: int, faults: list[FaultSpec] | None = None, config: RoundConfig = FAST
) -> tuple[list[RoundOutcome], list[dict[str, bytes]]]:
    """``count`` simulated rounds; each round's outcome, and the ``s`` key each org's
    session of that round advertised."""
    keys: list[dict[str, bytes]] = []

    async def scenario() -> list[RoundOutcome]:
        sim_config = SimConfig(peers=peers, length=64, seed=11, round_config=config)
        async with Simulation(sim_config, faults or []) as sim:
            sessions: dict[str, list[SecAggSession]] = {o: [] for o in sim.orgs}
            for org, engine in sim.engines.items():
                factory = engine._ready.session_factory

                def kept(
                    ctx: SessionContext, org: str = org, factory: SessionFactory = factory
                ) -> MaskedSum:
                    session = factory(ctx)
                    assert isinstance(session, SecAggSession)
                    sessions[org].append(session)
                    return session

                engine._ready.session_factory = kept
            outcomes = []
            for r in range(1, count + 1):
                outcomes.append(await sim.round(r))
                await asyncio.gather(
                    *(e.masks_prepared(sim_config.run) for e in sim.engines.values())
                )
                keys.append(
                    {
                        o: s[-1].peer._own().s.public
                        for o, s in sessions.items()
                        if s and s[-1].peer._secrets
                    }
                )
            return outcomes

    return asyncio.run(scenario()), keys


def test_a_round_takes_the_masks_prepared_after_the_one_before_and_its_sums_stay_exact() -> None:
    outcomes, _ = _rounds(4, 3)
    for outcome in outcomes:
        assert outcome.problems() == [] and len(outcome.results) == 4
    # the first round knows no masking key of its peers; every later one does
    assert not any(r.masks_prepared for r in outcomes[0].results.values())
    for outcome in outcomes[1:]:
        assert all(r.masks_prepared for r in outcome.results.values())


def test_no_masks_are_prepared_when_the_config_says_never() -> None:
    outcomes, _ = _rounds(4, 2, config=dataclasses.replace(FAST, prepared_masks_bytes=None))
    assert all(o.problems() == [] for o in outcomes)
    assert not any(r.masks_prepared for o in outcomes for r in o.results.values())


def test_each_round_advertises_a_masking_key_of_its_own() -> None:
    """A key drawn ahead is handed to one round only: no two rounds of an org share one."""
    outcomes, keys = _rounds(4, 4)
    assert all(o.problems() == [] for o in outcomes)
    for org in ORGS:
        used = [k[org] for k in keys]
        assert len(set(used)) == len(used) == 4


@pytest.mark.parametrize("stage, victim_in_sum", KILL_STAGES, ids=[s for s, _ in KILL_STAGES])
def test_a_peer_killed_at_each_stage_of_a_round_with_prepared_masks(
    stage: str, victim_in_sum: bool
) -> None:
    """Round 2's masks were prepared with the victim ready; it dies at ``stage``. The
    survivors' sums are exact, and round 3 (its masks prepared without the victim's
    pair after round 2) too."""
    victim = "org-3"
    outcomes, _ = _rounds(5, 3, [FaultSpec(victim, Fault.KILL, stage, round=2)])
    first, second, third = outcomes
    assert first.problems() == [] and second.problems() == [] and third.problems() == []
    assert set(second.results) == {"org-0", "org-1", "org-2", "org-4"}
    for res in second.results.values():
        assert (victim in res.survivors) is victim_in_sum
        assert res.masks_prepared
    assert set(third.results) == {"org-0", "org-1", "org-2", "org-4"}


def test_prepared_masks_corrected_by_the_helper_process_give_exact_sums() -> None:
    """A member missing from round 2 leaves a mask to take off the prepared ones: the
    helper process streams that correction into the ring."""
    config = dataclasses.replace(FAST, mask_helper="process")
    outcomes, _ = _rounds(5, 2, [FaultSpec("org-3", Fault.KILL, "ready", round=2)], config)
    assert [o.problems() for o in outcomes] == [[], []]
    assert all(r.masks_prepared for r in outcomes[1].results.values())


# -- the session: the masked input is the same bit for bit ----------------------------


def _sessions(
    round: int,
    ready: tuple[str, ...],
    masking: dict[str, MaskingSecrets],
    x: np.ndarray,
    codec: FixedPointCodec | None = None,
) -> dict[str, SecAggSession]:
    """Sessions of ``ORGS`` for ``round`` (every org in ``ready`` advertises, takes the
    others' advertisements and shares), each org's own input ``x + i`` (a float input
    encoded by ``codec``, its rounding drawn from a generator seeded by the org)."""
    signers = {
        o: Ed25519PrivateKey.from_private_bytes(bytes([i + 1]) * 32) for i, o in enumerate(ORGS)
    }
    out = {}
    for i, org in enumerate(ready):
        mine = x + x.dtype.type(i) if codec is None else x + np.float32(i / 8)
        ctx = SessionContext("fed", "run", round, org, ORGS, 2, mine, masking=masking[org])
        rng = np.random.default_rng(i)
        out[org] = SecAggSession(
            ctx, signers[org].sign, lambda *a: True, codec=codec, encode_rng=rng
        )
    adverts = {o: s.advertise() for o, s in out.items()}
    for org, session in out.items():
        for other, advert in adverts.items():
            if other != org:
                session.receive_advert(other, advert)
    view = frozenset(ready)
    sent = {o: s.share_keys(view) for o, s in out.items()}
    for org, messages in sent.items():
        for holder, data in messages.items():
            out[holder].receive_share(org, data)
    return out


def _masked(session: SecAggSession, prepared: PreparedMasks | None) -> tuple[np.ndarray, bool]:
    work = session.premask(prepared)
    work()
    return session.masked_input().copy(), work.prepared


@pytest.mark.parametrize(
    "ready, predicted_round, encoded",
    [
        (ORGS, 5, False),
        (ORGS[:3], 5, False),
        (ORGS, 6, False),
        (ORGS, 5, True),
        (ORGS[:3], 5, True),
    ],
    ids=[
        "as-predicted",
        "a-member-not-ready",
        "another-round",
        "encoded-as-predicted",
        "encoded-a-member-not-ready",
    ],
)
def test_the_masked_input_from_prepared_masks_is_the_one_without_them(
    ready: tuple[str, ...], predicted_round: int, encoded: bool
) -> None:
    codec = FixedPointCodec(bits=64, clip=1.0, max_summands=4) if encoded else None
    if codec is None:
        x = np.arange(1000, dtype=np.uint32) * np.uint32(2654435761)
    else:
        x = np.linspace(-0.5, 0.5, 1000, dtype=np.float32)
    masking = {o: MaskingSecrets.draw(os.urandom(32), os.urandom(32)) for o in ORGS}
    s_pks = {o: m.s.public for o, m in masking.items()}
    # what each org expands after round 4: the masks of round ``predicted_round`` with
    # every member ready
    earlier = {o: MaskingSecrets.draw(os.urandom(32), os.urandom(32)) for o in ORGS}
    before = _sessions(4, ORGS, earlier, x, codec)
    prepared = {}
    for org, session in before.items():
        masks, dtype, length = session.masks_for(predicted_round, masking[org], s_pks)
        array = np.zeros(length, dtype)
        prg.add_masks(array, masks)
        prepared[org] = PreparedMasks(predicted_round, tuple(masks), array)
    with_ = _sessions(5, ready, masking, x, codec)
    without = _sessions(5, ready, masking, x, codec)
    for org in ready:
        mine, took = _masked(with_[org], prepared[org])
        theirs, _ = _masked(without[org], None)
        assert np.array_equal(mine, theirs)
        # a guess for another round shares no mask with the round's: not taken
        assert took is (predicted_round == 5)


def test_the_correction_adds_what_the_guess_lacks_and_takes_off_what_it_has_too_many_of() -> None:
    a, b, c, d = (bytes([i]) * 32 for i in range(4))
    assert correction([(a, 1), (b, -1), (c, 1)], [(a, 1), (b, -1), (c, 1)]) == []
    assert correction([(a, 1), (b, -1), (c, 1)], [(a, 1), (b, -1)]) == [(c, -1)]
    assert correction([(a, 1), (b, -1)], [(a, 1), (b, -1), (d, 1)]) == [(d, 1)]
    # a sign the guess got wrong: that mask taken off twice
    assert correction([(a, 1), (b, 1), (c, 1)], [(a, 1), (b, -1), (c, 1)]) == [(b, -1), (b, -1)]
    # as many masks to fix as to make: the guess is no use
    assert correction([(c, 1), (d, 1)], [(a, 1), (b, 1)]) is None


def test_a_masking_key_drawn_ahead_is_handed_out_once() -> None:
    keys = AheadKeys()
    public = keys.rotate_masking("run", os.urandom(32), os.urandom(32))
    held = keys.masking("run")
    assert held is not None and held.s.public == public
    assert keys.take_masking("run") is held
    assert keys.take_masking("run") is None and keys.masking("run") is None
    # a peer's key is kept per run; one that is not a usable X25519 key drops it
    keys.learn_masking("run", "org-1", public)
    assert keys.masking_keys("run", ["org-1", "org-2"]) == {"org-1": public}
    assert keys.masking_keys("other", ["org-1"]) == {}
    keys.learn_masking("run", "org-1", bytes(32))
    assert keys.masking_keys("run", ["org-1"]) == {}
    keys.learn_masking("run", "org-1", public)
    keys.forget_run("run")
    assert keys.masking_keys("run", ["org-1"]) == {}


def test_a_preparation_for_another_round_is_not_handed_out() -> None:
    async def scenario() -> None:
        preparer = MaskPreparer()
        masks = [(b"\x01" * 32, 1)]

        def make() -> tuple[list[tuple[bytes, int]], np.dtype, int]:
            return masks, np.dtype(np.uint32), 16

        preparer.start("run", 7, make, 64)
        await preparer.settled("run")
        assert preparer.pending("run") == 7
        assert await preparer.take("run", 6) is None
        assert preparer.pending("run") is None  # handed out once, or dropped
        preparer.start("run", 7, make, 64)
        got = await preparer.take("run", 7)
        assert got is not None and got.masks == tuple(masks)
        expected = np.zeros(16, np.uint32)
        prg.add_masks(expected, masks)
        assert np.array_equal(got.array, expected)
        # an array over the cap is not made
        preparer.start("run", 7, make, 63)
        assert await preparer.take("run", 7) is None

    asyncio.run(scenario())


def test_a_caller_that_times_rounds_starts_the_preparation_itself() -> None:
    """With ``prepare_on_done`` off, nothing is expanded until the caller asks; then
    the next round takes the masks as before."""

    async def scenario() -> None:
        sim_config = SimConfig(peers=4, length=64, seed=12, round_config=FAST)
        async with Simulation(sim_config) as sim:
            for engine in sim.engines.values():
                engine.prepare_on_done = False
            first = await sim.round(1)
            assert first.problems() == []
            pending = [await e.masks_prepared(sim_config.run) for e in sim.engines.values()]
            assert pending == [None] * 4
            for engine in sim.engines.values():
                engine.prepare_masks(sim_config.run)
            pending = [await e.masks_prepared(sim_config.run) for e in sim.engines.values()]
            assert pending == [2] * 4
            second = await sim.round(2)
            assert second.problems() == []
            assert all(r.masks_prepared for r in second.results.values())

    asyncio.run(scenario())
