"""What a signed envelope costs beyond its signature, by payload size.

Run ``python -m bench.envelope [--quick] [--json PATH]``. Every message between orgs is
an envelope (``coordinator-free/wire.py``): the sender builds it, signs its encoding and
puts it on the wire; the receiver parses the wire bytes and checks them
(``MessageGuard.check``: format, federation, recipient, membership, signature,
staleness, replay). One round trip of that path, sender and receiver in one process,
is timed for payloads of 100 B (a token, a view), 4 KB (a ready record, a small ring
chunk), 64 KB and 4 MB (ring chunks of 1M and 100M parameters).

Rows ``envelope_vs_signature[payload=...]``: the median seconds of one envelope built,
signed, encoded, parsed and checked, against the baseline measured in the same run:
Ed25519's signature and verification of the payload's bytes alone, the floor any
signed message pays. The ratio is what the envelope's encoding, its copies and the
checks add (no target: a report of where a message's CPU goes).

Rows ``ready_record_parse_vs_verification[blobs=24, parse=own|all]``: from 32 members
on every node takes every member's relayed ready record (``rounds/ready_relay.py``),
and from 33 on each record carries its author's shares sealed to its ``k`` holders (24
at 256 members), signed by their digests in the ready's core and travelling beside it
towards their holders. Besides checking the author's signature, a holder reads the
record from the relayed batch, parses the ready's core, decodes the advertisement and
takes its blob (matched against its digest): that work is timed against the baseline
in the same run, the Ed25519 verification of the record. Here the copy carries every
holder's blob; ``own`` reads this holder's alone, as the node does, ``all`` reads
every one, for comparison.

Row ``ready_record_tag_vs_verification[blobs=24, members=256]``: from its second
relayed round on, a node checks each record by its author's MAC tag for it
(``rounds/record_keys.py``): the signing bytes rebuilt, hashed, and this receiver's
entry found among the 256 members' and compared. Timed against the Ed25519
verification of the same record, in the same run.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from collections.abc import Callable, Sequence

from coordinator_free.identity import OrgIdentity, verify_signature
from coordinator_free.rounds.ahead import Ahead, Blob, Ready, encode_blobs, read_blobs
from coordinator_free.rounds.ready_relay import (
    ReadyRecord,
    decode_batch,
    encode_batch,
    record_signing_bytes,
)
from coordinator_free.rounds.record_keys import RecordKeys
from coordinator_free.rounds.wire import HASH_BYTES
from coordinator_free.transport import MessageGuard, SequenceCounter
from coordinator_free.wire import Envelope

from bench.common import Report, best_of, run_main
from secure_agg.keys import RoundContext
from secure_agg.messages import AdvertiseKeys, Header, Stage

__all__ = ["BLOBS", "SIZES", "main", "ready_record", "round_trip"]

SIZES: tuple[tuple[str, int], ...] = (
    ("100B", 100),
    ("4KB", 4 << 10),
    ("64KB", 64 << 10),
    ("4MB", 4 << 20),
)
"""Row label and payload bytes."""
BLOBS = 24
"""Sealed blobs in a ready record: an org's SecAgg+ holders at 256 members."""
_SEALED_BYTES = 160  # one holder's two shares, sealed (AES-GCM)


def round_trip(payload: bytes) -> tuple[Callable[[], None], Callable[[], None]]:
    """One envelope sent and checked, and the bare signature and verification of the
    same payload (the baseline), each as a call to time."""
    sender, receiver = OrgIdentity.generate("org-a"), OrgIdentity.generate("org-b")
    keys = {sender.org_id: sender.public_key}
    guard = MessageGuard(
        "fed", receiver.org_id, lambda: keys, max_size=len(payload) + 4096, max_skew_s=60.0
    )
    sequence = SequenceCounter()

    def envelope() -> None:
        env = Envelope(
            federation="fed",
            run="run-1",
            round=7,
            stage="reduce",
            kind="agg.chunk",
            sender=sender.org_id,
            recipient=receiver.org_id,
            seq=sequence.next(),
            sent_at=time.time(),
            payload=payload,
        )
        wire = env.with_signature(sender.sign(env.signing_bytes())).to_wire()
        if guard.check(wire).payload != payload:
            raise RuntimeError("the envelope's payload did not come through")

    public = sender.public_key

    def signature() -> None:
        if not verify_signature(public, payload, sender.sign(payload)):
            raise RuntimeError("the signature did not verify")

    return envelope, signature


def ready_record(
    blobs: int = BLOBS, parse_all: bool = False
) -> tuple[Callable[[], None], Callable[[], None]]:
    """What one holder does with a relayed ready record besides checking its signature
    (read it from the batch, parse the ready, decode the advertisement), and that
    check alone (the baseline), each as a call to time."""
    author = OrgIdentity.generate("org-a")
    fed, run, rnd = "fed", "run-1", 7
    header = Header(RoundContext(fed, run, rnd), Stage.ADVERTISE_KEYS, author.org_id)
    advert = AdvertiseKeys(
        header, c_pk=os.urandom(32), s_pk=os.urandom(32), b_commitment=os.urandom(32)
    ).signed(author.sign)
    holders = {7 * i: Blob(os.urandom(8), os.urandom(_SEALED_BYTES)) for i in range(blobs)}
    held = frozenset(os.urandom(8) for _ in range(8))
    ahead = Ahead.sealing(os.urandom(32), held, holders, os.urandom(32))
    ready = Ready(os.urandom(HASH_BYTES), advert.to_bytes(), ahead).core()
    signed = record_signing_bytes(fed, run, rnd, author.org_id, ready)
    signature = author.sign(signed)
    record = ReadyRecord.make(author.org_id, ready, signature, blobs=encode_blobs(holders))
    batch = encode_batch(3, [record.raw])
    public, mine = author.public_key, 7 * (blobs // 2)
    only = None if parse_all else mine

    def parse() -> None:
        (rec,) = decode_batch(batch)[1]
        if record_signing_bytes(fed, run, rnd, rec.author, rec.ready) != signed:
            raise RuntimeError("the record's signed bytes did not come through")
        parsed = Ready.from_bytes(rec.ready, HASH_BYTES)
        if AdvertiseKeys.from_bytes(parsed.advert) != advert or parsed.ahead is None:
            raise RuntimeError("the record's ready did not come through")
        blob = read_blobs(rec.blobs, only=only).get(mine)
        if blob is None or blob.digest() != parsed.ahead.digest_for(mine):
            raise RuntimeError("the holder's blob did not come through")

    def verification() -> None:
        if not verify_signature(public, signed, signature):
            raise RuntimeError("the record's signature did not verify")

    return parse, verification


def record_tag(
    blobs: int = BLOBS, members: int = 256
) -> tuple[Callable[[], None], Callable[[], None]]:
    """A receiver's check of a relayed record by its tag (``members`` tags in the
    record), and the Ed25519 verification of the same record (the baseline)."""
    author = OrgIdentity.generate("org-a")
    fed, run, rnd = "fed", "run-1", 7
    holders = {7 * i: Blob(os.urandom(8), os.urandom(_SEALED_BYTES)) for i in range(blobs)}
    ahead = Ahead.sealing(os.urandom(32), frozenset(), holders, os.urandom(32))
    ready = Ready(os.urandom(HASH_BYTES), os.urandom(200), ahead).core()
    mine = RecordKeys(fed, author.org_id)
    receivers = [RecordKeys(fed, f"org-{i:03d}") for i in range(1, members)]
    for other in receivers:
        mine.learn(other.me, other.public)
        other.learn(author.org_id, mine.public)
    me = receivers[len(receivers) // 2]
    signed = record_signing_bytes(fed, run, rnd, author.org_id, ready, mine.public)
    tags = mine.tags(hashlib.sha256(signed).digest(), [r.me for r in receivers])
    rec = ReadyRecord.make(author.org_id, ready, author.sign(signed), mine.public, tags)
    public = author.public_key

    def tag() -> None:
        signing = record_signing_bytes(fed, run, rnd, rec.author, rec.ready, rec.key)
        if not me.check(rec.author, rec.key, hashlib.sha256(signing).digest(), rec.tags):
            raise RuntimeError("the record's tag did not check")

    def verification() -> None:
        signing = record_signing_bytes(fed, run, rnd, rec.author, rec.ready, rec.key)
        if not verify_signature(public, signing, rec.signature):
            raise RuntimeError("the record's signature did not verify")

    return tag, verification


def _interleaved(
    report: Report,
    name: str,
    timed: Callable[[], None],
    base: Callable[[], None],
    repeats: int,
    note: str,
) -> None:
    # interleaved in blocks, so that a slow spell of the machine weighs on both
    timed_s, base_s = [], []
    for _ in range(3):
        timed_s.append(best_of(timed, repeats, stat="median"))
        base_s.append(best_of(base, repeats, stat="median"))
    report.add(name, statistics.median(timed_s), "s", statistics.median(base_s), note=note)


def body(report: Report) -> None:
    for label, size in SIZES:
        envelope, signature = round_trip(os.urandom(size))
        repeats = max(9, (2000 if report.quick else 20000) // max(1, size >> 10))
        _interleaved(
            report,
            f"envelope_vs_signature[payload={label}]",
            envelope,
            signature,
            repeats,
            f"median of {repeats} round trips, three blocks; baseline: Ed25519 "
            "sign and verify of the payload alone",
        )
    repeats = 2000 if report.quick else 20000
    for parse in ("own", "all"):
        parsed, verification = ready_record(BLOBS, parse_all=parse == "all")
        _interleaved(
            report,
            f"ready_record_parse_vs_verification[blobs={BLOBS}, parse={parse}]",
            parsed,
            verification,
            repeats,
            f"median of {repeats} records, three blocks; baseline: Ed25519 "
            "verification of the record alone",
        )
    tag, verification = record_tag(BLOBS, 256)
    _interleaved(
        report,
        f"ready_record_tag_vs_verification[blobs={BLOBS}, members=256]",
        tag,
        verification,
        repeats,
        f"median of {repeats} records, three blocks; baseline: Ed25519 "
        "verification of the same record (signing bytes rebuilt in both)",
    )


def main(argv: Sequence[str] | None = None) -> Report:
    """``python -m bench.envelope [--quick] [--json PATH]``."""
    return run_main("envelope", body, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    main()
