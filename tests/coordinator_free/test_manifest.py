"""The federation manifest: a signed chain of member sets with quorum changes."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from coordinator_free.errors import ManifestError
from coordinator_free.identity import OrgIdentity
from coordinator_free.manifest import (
    Manifest,
    Member,
    canonical_json,
    dump_chain,
    load_chain,
)
from hypothesis import given, settings
from hypothesis import strategies as st

VECTOR = json.loads(
    (Path(__file__).resolve().parents[1] / "vectors" / "coordinator_free_manifest.json").read_text()
)
T0 = 1_700_000_000


@cache
def ident(org: str) -> OrgIdentity:
    seed = hashlib.sha256(VECTOR["seed_prefix"].encode() + org.encode()).digest()
    return OrgIdentity.generate(org, seed)


def member(org: str, port: int = 9000) -> Member:
    return Member.from_identity(ident(org), org.upper(), f"https://{org}.example:{port}")


def signed(version: Manifest, *orgs: str) -> Manifest:
    for org in orgs:
        version = version.sign(ident(org))
    return version


def genesis(*orgs: str, quorum: str = "majority") -> Manifest:
    base = Manifest.found("fed", [member(o) for o in orgs], created_at=T0, quorum=quorum)
    return signed(base, *orgs)


def vector_chain() -> list[Manifest]:
    return load_chain(json.dumps(VECTOR["chain"]).encode())


# --- vectors and encoding --------------------------------------------------------------


def test_vector_chain_verifies_and_is_byte_exact() -> None:
    chain = vector_chain()
    assert [v.digest for v in chain] == VECTOR["digests"]
    latest = Manifest.verify_chain(chain, genesis=VECTOR["digests"][0])
    assert latest.member_ids == ("org-a", "org-b", "org-d")
    assert latest.member("org-b").endpoint == "https://org-b.example:9443"
    # Rebuilding the chain from the same identities gives the same bytes.
    v0 = signed(
        Manifest.found(
            "fed-vector",
            [
                Member.from_identity(ident(o), o.upper(), f"https://{o}.example:{p}")
                for o, p in [("org-a", 9001), ("org-b", 9002), ("org-c", 9003)]
            ],
            created_at=T0,
        ),
        "org-a",
        "org-b",
        "org-c",
    )
    assert v0.to_json() == chain[0].to_json()
    assert dump_chain(chain) == canonical_json(VECTOR["chain"])


def test_canonical_json_is_sorted_and_compact() -> None:
    assert canonical_json({"b": 1, "a": ["é", 2]}) == '{"a":["é",2],"b":1}'.encode()


def test_version_json_round_trip() -> None:
    for version in vector_chain():
        assert Manifest.from_json(version.to_json()) == version


@given(st.binary(max_size=300))
def test_from_json_on_random_bytes_only_raises_manifest_error(data: bytes) -> None:
    with pytest.raises(ManifestError):
        Manifest.from_json(data)


@settings(max_examples=150)
@given(st.data())
def test_from_json_on_mutated_versions_only_raises_manifest_error(data: st.DataObject) -> None:
    text = bytearray(vector_chain()[1].to_json())
    for _ in range(data.draw(st.integers(1, 4))):
        index = data.draw(st.integers(0, len(text) - 1))
        text[index] = data.draw(st.integers(0x20, 0x7E))
    try:
        version = Manifest.from_json(bytes(text))
    except ManifestError:
        return
    # A mutation that still parses must not verify as the original's successor
    # unless it is byte-identical.
    try:
        vector_chain()[0].verify_successor(version)
    except ManifestError:
        return
    assert version.to_json() == vector_chain()[1].to_json()


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o | {"extra": 1},
        lambda o: {k: v for k, v in o.items() if k != "quorum"},
        lambda o: o | {"version": 1.0},
        lambda o: o | {"version": True},
        lambda o: o | {"members": {}},
        lambda o: o | {"signatures": {"org-a": "zz"}},
        lambda o: o | {"proposal": o["proposal"] | {"action": "crown"}},
        lambda o: o | {"members": [o["members"][0] | {"public_key": "00" * 32}]},
        lambda o: o | {"members": [o["members"][0] | {"fingerprint": "0" * 64}]},
        lambda o: o | {"members": [o["members"][0] | {"endpoint": "http://x:1"}]},
        lambda o: o | {"members": [o["members"][0] | {"org_id": "org-z"}]},
        lambda o: o | {"members": [o["members"][1], o["members"][0]]},
        lambda o: o | {"quorum": "plurality"},
        lambda o: o | {"previous": "abc"},
    ],
    ids=[
        "unknown-key",
        "missing-key",
        "float",
        "bool",
        "members-not-list",
        "bad-hex",
        "bad-action",
        "cert-for-other-key",
        "fingerprint-mismatch",
        "plain-http",
        "cn-mismatch",
        "unsorted-members",
        "unknown-quorum",
        "genesis-with-previous",
    ],
)
def test_invalid_versions_are_rejected(mutate: Any) -> None:
    obj = vector_chain()[0].to_obj()
    with pytest.raises(ManifestError):
        Manifest.from_json(canonical_json(mutate(obj)))


# --- chain rules ---------------------------------------------------------------------


def test_genesis_needs_every_founder() -> None:
    base = Manifest.found("fed", [member("a"), member("b"), member("c")], created_at=T0)
    with pytest.raises(ManifestError, match="did not sign"):
        Manifest.verify_chain([signed(base, "a", "b")])
    assert Manifest.verify_chain([signed(base, "a", "b", "c")]).version == 0


def test_empty_chain_and_foreign_genesis_are_rejected() -> None:
    with pytest.raises(ManifestError, match="empty"):
        Manifest.verify_chain([])
    with pytest.raises(ManifestError, match="trusted genesis"):
        Manifest.verify_chain([genesis("a", "b")], genesis=VECTOR["digests"][0])


def test_add_needs_a_quorum_and_the_new_members_signature() -> None:
    v0 = genesis("a", "b", "c")
    proposal = v0.propose_add(member("d"), created_at=T0 + 1)
    with pytest.raises(ManifestError, match="no quorum"):
        Manifest.verify_chain([v0, signed(proposal, "a", "d")])
    with pytest.raises(ManifestError, match="new member"):
        Manifest.verify_chain([v0, signed(proposal, "a", "b")])
    latest = Manifest.verify_chain([v0, signed(proposal, "a", "b", "d")])
    assert latest.member_ids == ("a", "b", "c", "d")


def test_removed_member_cannot_sign_later_versions() -> None:
    v0 = genesis("a", "b", "c")
    v1 = signed(v0.propose_remove("c", created_at=T0 + 1), "a", "b")
    v2 = signed(v1.propose_add(member("d"), created_at=T0 + 2), "a", "c", "d")
    with pytest.raises(ManifestError, match="'c' signed but is not a member"):
        Manifest.verify_chain([v0, v1, v2])


def test_outsider_signature_is_rejected_even_with_a_quorum() -> None:
    v0 = genesis("a", "b", "c")
    v1 = signed(v0.propose_remove("c", created_at=T0 + 1), "a", "b", "mallory")
    with pytest.raises(ManifestError, match="not a member"):
        Manifest.verify_chain([v0, v1])


def test_forged_signature_is_rejected() -> None:
    v0 = genesis("a", "b", "c")
    v1 = v0.propose_remove("c", created_at=T0 + 1)
    forged = v1.with_signatures({"b": ident("mallory").sign(v1.signing_bytes())})
    with pytest.raises(ManifestError, match="forged signature of 'b'"):
        Manifest.verify_chain([v0, signed(forged, "a")])


def test_tampering_after_signing_breaks_the_signatures() -> None:
    v0 = genesis("a", "b", "c")
    v1 = signed(v0.propose_update(member("b", 9999), created_at=T0 + 1), "a", "b")
    tampered = replace(
        v1, members=tuple(member(o, 1234) if o == "b" else v1.member(o) for o in v1.member_ids)
    )
    with pytest.raises(ManifestError, match="forged"):
        Manifest.verify_chain([v0, tampered])


@pytest.mark.parametrize("defect", ["previous", "skip", "federation", "quorum", "reorder"])
def test_broken_chain_is_rejected(defect: str) -> None:
    v0 = genesis("a", "b", "c")
    v1 = signed(v0.propose_remove("c", created_at=T0 + 1), "a", "b")
    v2 = signed(v1.propose_add(member("d"), created_at=T0 + 2), "a", "b", "d")
    chain = [v0, v1, v2]
    if defect == "previous":
        chain[2] = signed(
            replace(v2, previous=hashlib.sha256(b"x").hexdigest(), signatures=()), "a", "b", "d"
        )
    elif defect == "skip":
        chain = [v0, v2]
    elif defect == "federation":
        chain[1] = signed(replace(v1, federation="other", signatures=()), "a", "b")
    elif defect == "quorum":
        chain[1] = signed(replace(v1, quorum="all", signatures=()), "a", "b")
    else:
        chain = [v0, v2, v1]
    with pytest.raises(ManifestError):
        Manifest.verify_chain(chain)


def test_members_must_match_the_proposal() -> None:
    v0 = genesis("a", "b", "c")
    sneaky = v0.propose_add(member("d"), created_at=T0 + 1)
    sneaky = replace(sneaky, members=(*sneaky.members, member("e")))
    with pytest.raises(ManifestError, match="do not match"):
        Manifest.verify_chain([v0, signed(sneaky, "a", "b", "c", "d", "e")])
    swap = v0.propose_remove("c", created_at=T0 + 1)
    swap = replace(swap, members=(member("a"), member("b", 1)))
    with pytest.raises(ManifestError, match="do not match"):
        Manifest.verify_chain([v0, signed(swap, "a", "b", "c")])


def test_proposal_builders_refuse_impossible_changes() -> None:
    v0 = genesis("a", "b")
    with pytest.raises(ManifestError):
        v0.propose_add(member("a"), created_at=T0)
    with pytest.raises(ManifestError):
        v0.propose_remove("z", created_at=T0)
    with pytest.raises(ManifestError):
        v0.propose_update(member("z"), created_at=T0)
    with pytest.raises(ManifestError):
        Manifest.found("fed", [member("a"), member("a")], created_at=T0)


@pytest.mark.parametrize(
    ("rule", "n", "needed"),
    [
        ("majority", 1, 1),
        ("majority", 4, 3),
        ("majority", 5, 3),
        ("two_thirds", 3, 2),
        ("two_thirds", 4, 3),
        ("all", 4, 4),
    ],
)
def test_quorum_rules(rule: str, n: int, needed: int) -> None:
    orgs = [f"o{i}" for i in range(n)]
    assert genesis(*orgs, quorum=rule).required_signatures() == needed


@settings(max_examples=25, deadline=None)
@given(
    st.sets(st.sampled_from(["a", "b", "c", "d", "e"])),
    st.sampled_from(["majority", "two_thirds", "all"]),
)
def test_a_change_verifies_iff_a_quorum_signed(signers: set[str], rule: str) -> None:
    v0 = genesis("a", "b", "c", "d", "e", quorum=rule)
    v1 = signed(v0.propose_remove("e", created_at=T0 + 1), *sorted(signers))
    if len(signers) >= v0.required_signatures():
        assert Manifest.verify_chain([v0, v1]).member_ids == ("a", "b", "c", "d")
    else:
        with pytest.raises(ManifestError, match="no quorum"):
            Manifest.verify_chain([v0, v1])


def test_views_for_endpoint_and_transport() -> None:
    latest = Manifest.verify_chain(vector_chain())
    keys = latest.public_keys()
    assert keys == {o: ident(o).public_key for o in ("org-a", "org-b", "org-d")}
    addresses = latest.peer_addresses()
    assert addresses["org-b"].url == "https://org-b.example:9443"
    assert addresses["org-d"].fingerprint == ident("org-d").fingerprint
    assert latest.certificates() == [ident(o).certificate_pem for o in ("org-a", "org-b", "org-d")]


def test_load_chain_rejects_non_lists() -> None:
    with pytest.raises(ManifestError):
        load_chain(b'{"a": 1}')
    with pytest.raises(ManifestError):
        load_chain(b"[1.5]")
