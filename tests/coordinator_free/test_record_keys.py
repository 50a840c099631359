"""The record keys' MAC tags (``rounds/record_keys.py``): a tag made by an author for a
receiver checks there and nowhere else, binds the record's digest and the author's
record key, and no third member can make one; a fixed vector pins the construction."""

from __future__ import annotations

import hashlib
import hmac
import struct

from coordinator_free.rounds.record_keys import (
    ENTRY_BYTES,
    TAG_BYTES,
    RecordKeys,
    kept_entries,
    key_id,
)
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import given, settings
from hypothesis import strategies as st

FED = "fed-test"


def _keys(*orgs: str) -> dict[str, RecordKeys]:
    """Record keys for ``orgs``, each having learned every other one's."""
    keys = {o: RecordKeys(FED, o) for o in orgs}
    for a in keys.values():
        for b in keys.values():
            a.learn(b.me, b.public)
    return keys


@settings(max_examples=40, deadline=None)
@given(digest=st.binary(min_size=32, max_size=32), n=st.integers(2, 6), data=st.data())
def test_a_tag_checks_at_its_receiver_only_and_for_that_digest_only(
    digest: bytes, n: int, data: st.DataObject
) -> None:
    orgs = [f"org-{i}" for i in range(n)]
    keys = _keys(*orgs)
    author = data.draw(st.sampled_from(orgs))
    receivers = data.draw(st.lists(st.sampled_from(orgs), unique=True))
    tags = keys[author].tags(digest, receivers)
    assert len(tags) == ENTRY_BYTES * len(set(receivers) - {author})
    other = bytes([digest[0] ^ 1]) + digest[1:]
    for org in orgs:
        if org == author:
            continue
        checks = keys[org].check(author, keys[author].public, digest, tags)
        assert checks == (org in receivers)
        assert not keys[org].check(author, keys[author].public, other, tags)


def test_a_third_member_cannot_make_a_tag_for_an_author() -> None:
    keys = _keys("a", "b", "relay")
    digest = hashlib.sha256(b"a's record").digest()
    # the relay tags with its own keys, naming a's record key: b refuses it
    forged = keys["relay"].tags(digest, ["b"])
    assert not keys["b"].check("a", keys["a"].public, digest, forged)
    # the genuine tag checks
    assert keys["b"].check("a", keys["a"].public, digest, keys["a"].tags(digest, ["b"]))


def test_a_tag_under_a_record_key_not_learned_for_the_author_does_not_check() -> None:
    keys = _keys("a", "b")
    digest = hashlib.sha256(b"record").digest()
    tags = keys["a"].tags(digest, ["b"])
    # a restarted: a new record key, which b has not learned from a signed record
    restarted = RecordKeys(FED, "a")
    restarted.learn("b", keys["b"].public)
    assert not keys["b"].check("a", restarted.public, digest, restarted.tags(digest, ["b"]))
    # and the old key named for an author it was not learned for does not check
    assert not keys["b"].check("c", keys["a"].public, digest, tags)
    assert not keys["b"].check("a", b"", digest, tags)


def test_a_misaligned_or_cut_tag_list_does_not_check() -> None:
    keys = _keys("a", "b", "c")
    digest = hashlib.sha256(b"record").digest()
    tags = keys["a"].tags(digest, ["c", "b"])
    pub = keys["a"].public
    assert keys["b"].check("a", pub, digest, tags)
    for bad in (tags[:-1], b"\x00" + tags, tags[:ENTRY_BYTES] + tags[ENTRY_BYTES + 1 :] + b"x"):
        assert not keys["b"].check("a", pub, digest, bad)


def test_an_author_tags_no_receiver_whose_key_is_unknown_or_of_low_order() -> None:
    a = RecordKeys(FED, "a")
    digest = hashlib.sha256(b"record").digest()
    assert a.tags(digest, ["b", "a"]) == b""
    a.learn("b", bytes(32))  # the all-zero point: no key agreement with it
    assert a.tags(digest, ["b"]) == b""
    low = RecordKeys(FED, "b")
    low.learn("a", a.public)
    assert not low.check("a", a.public, digest, b"")


def test_the_tag_construction_matches_a_fixed_vector() -> None:
    a = RecordKeys(FED, "org-a", private=bytes(range(32)))
    b = RecordKeys(FED, "org-b", private=bytes(range(32, 64)))
    a.learn("org-b", b.public)
    b.learn("org-a", a.public)
    digest = hashlib.sha256(b"fedweave record").digest()
    tags = a.tags(digest, ["org-b"])

    # recomputed from the primitives: X25519, HKDF-SHA-256 over the sorted ends, HMAC
    def text(value: str) -> bytes:
        return struct.pack(">H", len(value)) + value.encode()

    shared = X25519PrivateKey.from_private_bytes(bytes(range(32))).exchange(
        X25519PublicKey.from_public_bytes(b.public)
    )
    info = b"fedweave/record-mac/v1\x00" + text(FED)
    info += text("org-a") + a.public + text("org-b") + b.public
    mac_key = HKDF(hashes.SHA256(), 32, salt=None, info=info).derive(shared)
    tag = hmac.digest(mac_key, text("org-b") + digest, "sha256")[:TAG_BYTES]
    assert tags == key_id(b.public) + tag
    assert tags.hex() == "16dc445722f52dff1b2d2a1a6a39dfcfef1563eb"
    assert b.check("org-a", a.public, digest, tags)


def test_each_start_makes_a_new_record_key() -> None:
    # made at random, never derived from the org's identity nor written anywhere
    assert RecordKeys(FED, "a").public != RecordKeys(FED, "a").public


def test_a_relay_keeps_the_entries_of_the_members_after_it_and_those_it_cannot_place() -> None:
    keys = _keys("a", "b", "c", "d")
    digest = hashlib.sha256(b"a's record").digest()
    tags = keys["a"].tags(digest, ["b", "c", "d"])
    stranger = b"\xff" * ENTRY_BYTES  # an id no member's key has
    relay = keys["d"]
    known = relay.ids(["a", "b", "c"]) | {relay.id}
    kept = kept_entries([tags + stranger], relay.ids(["c"]), known)
    # c's entry and the stranger's stay; b's and d's (the relay's own) go
    assert kept == keys["a"].tags(digest, ["c"]) + stranger
    assert keys["c"].check("a", keys["a"].public, digest, kept)
    assert not keys["b"].check("a", keys["a"].public, digest, kept)
    # the copies of one record pool their entries, each once
    assert kept_entries([tags, tags], relay.ids(["b", "c"]), known) == keys["a"].tags(
        digest, ["b", "c"]
    )
    # a cut entry at the end is dropped, not passed on
    assert kept_entries([tags[:-1]], relay.ids(["b", "c", "d"]), known) == tags[:-ENTRY_BYTES]
