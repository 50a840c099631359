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
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence

from coordinator_free.identity import OrgIdentity, verify_signature
from coordinator_free.transport import MessageGuard, SequenceCounter
from coordinator_free.wire import Envelope

from bench.common import Report, best_of, run_main

__all__ = ["SIZES", "main", "round_trip"]

SIZES: tuple[tuple[str, int], ...] = (
    ("100B", 100),
    ("4KB", 4 << 10),
    ("64KB", 64 << 10),
    ("4MB", 4 << 20),
)
"""Row label and payload bytes."""


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


def body(report: Report) -> None:
    for label, size in SIZES:
        envelope, signature = round_trip(os.urandom(size))
        repeats = max(9, (2000 if report.quick else 20000) // max(1, size >> 10))
        # interleaved in blocks, so that a slow spell of the machine weighs on both
        env_s, sig_s = [], []
        for _ in range(3):
            env_s.append(best_of(envelope, repeats, stat="median"))
            sig_s.append(best_of(signature, repeats, stat="median"))
        report.add(
            f"envelope_vs_signature[payload={label}]",
            statistics.median(env_s),
            "s",
            statistics.median(sig_s),
            note=f"median of {repeats} round trips, three blocks; baseline: Ed25519 "
            "sign and verify of the payload alone",
        )


def main(argv: Sequence[str] | None = None) -> Report:
    """``python -m bench.envelope [--quick] [--json PATH]``."""
    return run_main("envelope", body, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    main()
