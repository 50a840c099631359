"""Signed epidemic gossip: vectors, codec properties, and dissemination outcomes.

Dissemination is measured in gossip periods counted by the origin, never wall time.
``python -m tests.coordinator_free.test_gossip`` rewrites ``tests/vectors/gossip_records.json``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.gossip import (
    PUSH,
    Gossip,
    GossipConfig,
    RecordConflict,
    SignedRecord,
    decode_records,
    encode_records,
    record_signing_bytes,
)
from coordinator_free.identity import OrgIdentity
from hypothesis import given
from hypothesis import strategies as st

from bench.overlay_membership import FEDERATION, SimCluster, swim_config

VECTORS = Path(__file__).resolve().parents[1] / "vectors" / "gossip_records.json"
PERIOD = 0.05


def run(coro: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(coro(), timeout=60))


def vectors() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(VECTORS.read_text())
    return data


# ---------------------------------------------------------------------- vectors


@pytest.mark.parametrize("case", vectors()["valid"], ids=lambda c: c["id"])
def test_record_vectors(case: dict[str, str]) -> None:
    identity = OrgIdentity.generate(case["origin"], bytes.fromhex(case["private_seed_hex"]))
    assert identity.public_key.hex() == case["public_key_hex"]
    record = bytes.fromhex(case["record_hex"])
    args = (case["federation"], case["origin"], case["topic"], case["key"], record)
    assert record_signing_bytes(*args).hex() == case["signing_bytes_hex"]
    signed = SignedRecord.sign(identity, case["federation"], case["topic"], case["key"], record)
    assert signed.signature.hex() == case["signature_hex"]
    assert signed.digest.hex() == case["digest_hex"]
    payload = bytes.fromhex(case["push_payload_hex"])
    assert encode_records([signed]).hex() == case["push_payload_hex"]
    [decoded] = decode_records(payload, max_record_bytes=1 << 16)
    assert decoded == signed
    assert decoded.with_digest(case["federation"]).digest == signed.digest
    assert decoded.verify(case["federation"], identity.public_key)
    assert not decoded.verify(case["federation"] + "-other", identity.public_key)


@pytest.mark.parametrize("case", vectors()["invalid"], ids=lambda c: c["id"])
def test_invalid_payload_vectors_are_refused(case: dict[str, str]) -> None:
    with pytest.raises(Refused) as info:
        decode_records(bytes.fromhex(case["payload_hex"]), max_record_bytes=1 << 16)
    assert info.value.reason is RefusalReason.MALFORMED


# ---------------------------------------------------------------------- codec properties

names = st.text(min_size=1, max_size=12)
records = st.builds(
    SignedRecord, names, names, names, st.binary(max_size=64), st.binary(max_size=80)
)


@given(st.lists(records, max_size=8))
def test_push_payload_round_trips(items: list[SignedRecord]) -> None:
    assert decode_records(encode_records(items), max_record_bytes=64) == items


@given(st.binary(max_size=300))
def test_decoding_garbage_only_refuses(data: bytes) -> None:
    try:
        decode_records(data, max_record_bytes=64)
    except Refused as exc:
        assert exc.reason is RefusalReason.MALFORMED


small = st.text(alphabet="ab", min_size=1, max_size=3)
fields_ = st.tuples(small, small, small, small, st.binary(max_size=3))


@given(fields_, fields_)
def test_signing_bytes_are_injective(
    a: tuple[str, str, str, str, bytes], b: tuple[str, str, str, str, bytes]
) -> None:
    assert (record_signing_bytes(*a) == record_signing_bytes(*b)) is (a == b)


@pytest.mark.parametrize(
    ("values", "error"),
    [
        ({"fanout": 0}, ValueError),
        ({"period_s": -1.0}, ValueError),
        ({"retransmit_mult": float("inf")}, ValueError),
        ({"max_conflicts": 1}, ValueError),
        ({"max_topics": 2.0}, TypeError),
        ({"max_records_per_message": 70000}, ValueError),
        ({"push_fanout": 3}, ValueError),
    ],
    ids=[
        "zero-fanout",
        "negative-period",
        "inf-mult",
        "one-conflict",
        "float-topics",
        "too-many-per-message",
        "unknown-key",
    ],
)
def test_config_rejects_invalid_values(values: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        GossipConfig.from_mapping(values)


# ---------------------------------------------------------------------- dissemination


def gossip_config(**overrides: Any) -> GossipConfig:
    base: dict[str, Any] = {"period_s": PERIOD, "push_timeout_s": 1.0}
    base.update(overrides)
    return GossipConfig(**base)


def test_record_reaches_all_50_members_in_logarithmic_periods() -> None:
    async def body() -> None:
        n, c = 50, 3
        period = 0.1
        cluster = await SimCluster.start(
            n, seed=11, swim=swim_config(0.2), gossip=gossip_config(period_s=period)
        )
        try:
            origin = cluster.gossips["org-017"]
            start = origin.periods
            queue = cluster.gossips["org-042"].subscribe("ready")
            origin.publish("ready", "run-1/1", b"ephemeral-key")
            bound = math.ceil(c * math.log2(n))
            while not all(g.get("ready", "run-1/1") for g in cluster.gossips.values()):
                assert origin.periods - start <= bound, f"not all reached in {bound} periods"
                await asyncio.sleep(period / 5)
            assert all(
                g.get("ready", "run-1/1") == {"org-017": b"ephemeral-key"}
                for g in cluster.gossips.values()
            )
            got = queue.get_nowait()
            assert (got.origin, got.key, got.record) == ("org-017", "run-1/1", b"ephemeral-key")
            assert not any(g.counters["forged"] for g in cluster.gossips.values())
        finally:
            await cluster.close()

    run(body)


def test_forged_and_tampered_records_are_refused_and_counted() -> None:
    async def body() -> None:
        cluster = await SimCluster.start(
            4, seed=12, swim=swim_config(10.0), gossip=gossip_config(period_s=10.0)
        )
        try:
            mallory = cluster.identities["org-003"]
            # org-003 signs a record but claims org-001 published it
            fake = SignedRecord.sign(mallory, FEDERATION, "model", "r1", b"evil")
            forged = SignedRecord("org-001", "model", "r1", b"evil", fake.signature)
            genuine = SignedRecord.sign(cluster.identities["org-002"], FEDERATION, "m", "r", b"x")
            tampered = SignedRecord("org-002", "m", "r", b"y", genuine.signature)
            unknown = SignedRecord("org-999", "m", "r", b"x", genuine.signature)
            payload = encode_records([forged, tampered, unknown])
            await cluster.endpoints["org-003"].send("org-000", PUSH, payload, stage="gossip")
            victim = cluster.gossips["org-000"]
            assert victim.counters["forged"] == 3
            assert victim.get("model", "r1") == {}
            assert victim.get("m", "r") == {}
            # the genuine record is still accepted after its forged twin was dropped
            await cluster.endpoints["org-003"].send(
                "org-000", PUSH, encode_records([genuine]), stage="gossip"
            )
            assert victim.get("m", "r") == {"org-002": b"x"}
        finally:
            await cluster.close()

    run(body)


def test_equivocation_is_kept_as_evidence_and_spread() -> None:
    async def body() -> None:
        cluster = await SimCluster.start(
            6, seed=13, swim=swim_config(PERIOD), gossip=gossip_config()
        )
        try:
            liar = cluster.identities["org-005"]
            one = SignedRecord.sign(liar, FEDERATION, "view", "run/2", b"view-A")
            two = SignedRecord.sign(liar, FEDERATION, "view", "run/2", b"view-B")
            send = cluster.endpoints["org-005"].send
            await send("org-000", PUSH, encode_records([one]), stage="gossip")
            await send("org-001", PUSH, encode_records([two]), stage="gossip")
            honest = [o for o in cluster.orgs if o != "org-005"]
            origin = cluster.gossips["org-000"]
            start = origin.periods
            while not all(cluster.gossips[o].equivocations() for o in honest):
                assert origin.periods - start <= 60, "equivocation not spread in 60 periods"
                await asyncio.sleep(PERIOD / 5)
            for o in honest:
                [ev] = cluster.gossips[o].equivocations("view")
                assert (ev.origin, ev.topic, ev.key) == ("org-005", "view", "run/2")
                assert {r.record for r in ev.records} == {b"view-A", b"view-B"}
                assert cluster.gossips[o].get("view", "run/2")["org-005"] in (b"view-A", b"view-B")
        finally:
            await cluster.close()

    run(body)


def test_member_back_from_a_partition_catches_up() -> None:
    async def body() -> None:
        cluster = await SimCluster.start(
            6, seed=17, swim=swim_config(PERIOD), gossip=gossip_config()
        )
        try:
            away, rest = "org-005", [o for o in cluster.orgs if o != "org-005"]
            cluster.network.partition(rest, [away])
            origin = cluster.gossips["org-000"]
            origin.publish("heads", "r7", b"chain-head")
            start = origin.periods
            # wait until the record is spread and every push round for it is spent
            while any(cluster.gossips[o]._pending for o in rest) or not all(
                cluster.gossips[o].get("heads", "r7") for o in rest
            ):
                assert origin.periods - start <= 100, "record not spread in 100 periods"
                await asyncio.sleep(PERIOD / 5)
            assert cluster.gossips[away].get("heads", "r7") == {}
            cluster.network.heal()
            start = origin.periods
            while not cluster.gossips[away].get("heads", "r7"):
                assert origin.periods - start <= 200, "record not caught up in 200 periods"
                await asyncio.sleep(PERIOD / 5)
            assert cluster.gossips[away].get("heads", "r7") == {"org-000": b"chain-head"}
        finally:
            await cluster.close()

    run(body)


def test_publish_is_idempotent_and_refuses_own_conflicts() -> None:
    async def body() -> None:
        cluster = await SimCluster.start(
            2, seed=14, swim=swim_config(10.0), gossip=gossip_config(period_s=10.0)
        )
        try:
            g = cluster.gossips["org-000"]
            first = g.publish("heads", "r1", b"h1")
            assert g.publish("heads", "r1", b"h1") == first
            with pytest.raises(RecordConflict):
                g.publish("heads", "r1", b"h2")
            with pytest.raises(ValueError):
                g.publish("heads", "r2", b"x" * (g.config.max_record_bytes + 1))
            with pytest.raises(ValueError):
                g.publish("", "r2", b"x")
            assert g.get("heads", "r1") == {"org-000": b"h1"}
            assert g.records("heads") == [first]
            assert g.counters["accepted"] == 1
        finally:
            await cluster.close()

    run(body)


def test_memory_is_bounded_per_topic_and_by_ttl() -> None:
    async def body() -> None:
        now = [1000.0]
        cluster = await SimCluster.start(2, seed=15, swim=swim_config(10.0))
        try:
            g = await Gossip.create(
                cluster.endpoints["org-000"],
                cluster.memberships["org-000"],
                GossipConfig(period_s=PERIOD, max_records_per_topic=2, ttl_s=5.0),
                clock=lambda: now[0],
            )
            for i in range(3):
                now[0] += 1
                g.publish("t", f"k{i}", b"v")
            assert sorted(r.key for r in g.records("t")) == ["k1", "k2"]
            assert g.counters["evicted"] == 1
            now[0] += 10
            start = g.periods
            while g.records("t"):
                assert g.periods - start <= 20, "entries did not expire"
                await asyncio.sleep(PERIOD / 2)
            assert g.counters["expired"] == 2
            await g.stop()
        finally:
            await cluster.close()

    run(body)


def test_malformed_push_is_refused_and_counted() -> None:
    async def body() -> None:
        cluster = await SimCluster.start(
            2, seed=16, swim=swim_config(10.0), gossip=gossip_config(period_s=10.0)
        )
        try:
            with pytest.raises(Refused) as info:
                await cluster.endpoints["org-001"].send("org-000", PUSH, b"\x00\x05zz")
            assert info.value.reason is RefusalReason.MALFORMED
            assert cluster.gossips["org-000"].counters["malformed"] == 1
        finally:
            await cluster.close()

    run(body)


def _regenerate() -> None:
    """Rewrite the vector file from the code (fixed seeds; Ed25519 is deterministic)."""
    specs = [
        ("ready", "fed-a", "org-a", "ready/run-1", "1", b"\x01" * 32 + b"x25519-public"),
        ("model-hash", "fed-a", "org-b", "model", "run-1/3", hashlib.sha256(b"model").digest()),
        ("empty-record-unicode", "féd", "org-ü", "audit-head", "r/0", b""),
    ]
    valid = []
    for cid, fed, org, topic, key, record in specs:
        seed = hashlib.sha256(("vector/" + org).encode()).digest()
        identity = OrgIdentity.generate(org, seed)
        signed = SignedRecord.sign(identity, fed, topic, key, record)
        valid.append(
            {
                "id": cid,
                "federation": fed,
                "origin": org,
                "private_seed_hex": seed.hex(),
                "public_key_hex": identity.public_key.hex(),
                "topic": topic,
                "key": key,
                "record_hex": record.hex(),
                "signing_bytes_hex": record_signing_bytes(fed, org, topic, key, record).hex(),
                "signature_hex": signed.signature.hex(),
                "digest_hex": signed.digest.hex(),
                "push_payload_hex": encode_records([signed]).hex(),
            }
        )
    one = "0001" + b"a".hex()
    invalid = [
        {"id": "empty", "payload_hex": ""},
        {"id": "count-without-records", "payload_hex": "0001"},
        {"id": "truncated-origin", "payload_hex": "00010005" + b"org".hex()},
        {"id": "empty-topic", "payload_hex": "0001" + one + "0000" + one + "00000000" + "0000"},
        {"id": "origin-not-utf8", "payload_hex": "0001" + "0001ff" + one + one + "000000000000"},
        {"id": "trailing-byte", "payload_hex": "000000"},
        {"id": "record-length-overflow", "payload_hex": "0001" + one * 3 + "ffffffff"},
    ]
    doc = {
        "description": "Gossip record signing bytes, Ed25519 signatures (deterministic), "
        "digests and gossip.push payloads; invalid payloads must be refused as malformed.",
        "valid": valid,
        "invalid": invalid,
    }
    VECTORS.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    _regenerate()
