"""The federation manifest: who the members are, as a chain of signed versions.

There is no federation admin. The founding orgs create version 0 and every one of them
signs it. Each later version changes one member (``add``, ``remove``, or ``update`` of
its endpoint, name or certificate), names the SHA-256 of the previous version, and
carries the signatures of a quorum of the previous version's members (by default a
strict majority). An added member signs as well, proving that it holds its key, but
does not count towards the quorum. Every node verifies the whole chain
(:meth:`Manifest.verify_chain`) before trusting a version; any missing quorum, broken
link, forged signature or foreign signer is a :class:`~coordinator_free.errors.ManifestError`.

Encoding: canonical JSON (keys sorted, no whitespace, UTF-8, integers and strings only,
bytes as lowercase hex). A version's ``digest`` is the SHA-256 of its body (everything
but the signatures); signatures are Ed25519 over ``b"fedweave/manifest/v1\\x00" + body``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from coordinator_free.address import PeerAddress
from coordinator_free.errors import IdentityError, ManifestError, Refused
from coordinator_free.identity import (
    OrgIdentity,
    certificate_fingerprint,
    certificate_org_id,
    load_certificate,
    verify_signature,
)
from coordinator_free.peer_json import loads_bounded
from cryptography.hazmat.primitives import serialization

__all__ = [
    "QUORUM_RULES",
    "Action",
    "Manifest",
    "Member",
    "Proposal",
    "canonical_json",
    "dump_chain",
    "load_chain",
]

SIGNING_DOMAIN = b"fedweave/manifest/v1\x00"
QUORUM_RULES = ("majority", "two_thirds", "all")
Action = Literal["found", "add", "remove", "update"]
_ACTIONS = ("found", "add", "remove", "update")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def canonical_json(value: Any) -> bytes:
    """Canonical JSON: sorted keys, no whitespace, UTF-8 (floats are not allowed)."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def _check_floats(value: Any) -> None:
    if isinstance(value, float):
        raise ManifestError("manifest values are strings and integers, not floats")
    if isinstance(value, dict):
        for item in value.values():
            _check_floats(item)
    elif isinstance(value, list):
        for item in value:
            _check_floats(item)


def _expect(obj: Mapping[str, Any], keys: set[str], what: str) -> None:
    if set(obj) != keys:
        missing, extra = keys - set(obj), set(obj) - keys
        raise ManifestError(f"{what}: missing {sorted(missing)}, unknown {sorted(extra)}")


def _str(obj: Mapping[str, Any], key: str) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise ManifestError(f"{key} must be a string")
    return value


def _int(obj: Mapping[str, Any], key: str) -> int:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ManifestError(f"{key} must be an integer")
    return value


def _hex(value: str, what: str) -> bytes:
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ManifestError(f"{what} is not hex") from None


@dataclass(frozen=True)
class Member:
    """One member org, as every other member knows it."""

    org_id: str
    display_name: str
    endpoint: str
    """Peer port base URL, ``https://host:port``."""
    certificate_pem: str
    """The org's TLS certificate (self-signed or CA-issued) for the identity key."""
    fingerprint: str
    """SHA-256 of the DER certificate, lowercase hex: what peers pin."""
    public_key: bytes
    """Raw Ed25519 identity key (32 bytes); it signs messages and manifest versions."""

    def __post_init__(self) -> None:
        if not isinstance(self.public_key, bytes):
            raise ManifestError("member public key must be bytes")
        if not self.org_id or not self.display_name:
            raise ManifestError("member org id and display name must not be empty")
        try:
            PeerAddress(self.endpoint, self.fingerprint)
        except ValueError as exc:
            raise ManifestError(f"member {self.org_id!r}: {exc}") from None
        pem = self.certificate_pem.encode("ascii", "replace")
        try:
            cert = load_certificate(pem)
        except IdentityError:
            raise ManifestError(f"member {self.org_id!r}: unreadable certificate") from None
        if certificate_fingerprint(pem) != self.fingerprint:
            raise ManifestError(f"member {self.org_id!r}: fingerprint does not match")
        try:
            named = certificate_org_id(pem)
        except (IdentityError, UnicodeDecodeError):
            named = ""
        if named != self.org_id:
            raise ManifestError(f"member {self.org_id!r}: certificate names another org")
        try:
            raw = cert.public_key().public_bytes(
                serialization.Encoding.Raw, serialization.PublicFormat.Raw
            )
        except ValueError:
            raise ManifestError(f"member {self.org_id!r}: not an Ed25519 certificate") from None
        if raw != self.public_key:
            raise ManifestError(f"member {self.org_id!r}: certificate is for another key")

    @classmethod
    def from_identity(cls, identity: OrgIdentity, display_name: str, endpoint: str) -> Member:
        """The member record of ``identity``."""
        return cls(
            org_id=identity.org_id,
            display_name=display_name,
            endpoint=endpoint,
            certificate_pem=identity.certificate_pem.decode("ascii"),
            fingerprint=identity.fingerprint,
            public_key=identity.public_key,
        )

    @property
    def address(self) -> PeerAddress:
        """Where to reach this member and which certificate to pin."""
        return PeerAddress(self.endpoint, self.fingerprint)

    def to_obj(self) -> dict[str, Any]:
        return {
            "org_id": self.org_id,
            "display_name": self.display_name,
            "endpoint": self.endpoint,
            "certificate_pem": self.certificate_pem,
            "fingerprint": self.fingerprint,
            "public_key": self.public_key.hex(),
        }

    @classmethod
    def from_obj(cls, obj: Any) -> Member:
        if not isinstance(obj, dict):
            raise ManifestError("a member must be an object")
        _expect(
            obj,
            {"org_id", "display_name", "endpoint", "certificate_pem", "fingerprint", "public_key"},
            "member",
        )
        return cls(
            org_id=_str(obj, "org_id"),
            display_name=_str(obj, "display_name"),
            endpoint=_str(obj, "endpoint"),
            certificate_pem=_str(obj, "certificate_pem"),
            fingerprint=_str(obj, "fingerprint"),
            public_key=_hex(_str(obj, "public_key"), "public_key"),
        )


@dataclass(frozen=True)
class Proposal:
    """What a version changes, and when it was proposed (unix seconds)."""

    action: Action
    org_id: str
    """The member added, removed or updated; ``""`` for ``found``."""
    created_at: int
    note: str = ""

    def __post_init__(self) -> None:
        if self.action not in _ACTIONS:
            raise ManifestError(f"unknown proposal action {self.action!r}")
        if (self.action == "found") != (self.org_id == ""):
            raise ManifestError("only a founding proposal has no org id")
        if isinstance(self.created_at, bool) or not isinstance(self.created_at, int):
            raise ManifestError("created_at must be an integer")

    def to_obj(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "org_id": self.org_id,
            "created_at": self.created_at,
            "note": self.note,
        }

    @classmethod
    def from_obj(cls, obj: Any) -> Proposal:
        if not isinstance(obj, dict):
            raise ManifestError("a proposal must be an object")
        _expect(obj, {"action", "org_id", "created_at", "note"}, "proposal")
        action = _str(obj, "action")
        if action not in _ACTIONS:
            raise ManifestError(f"unknown proposal action {action!r}")
        return cls(action, _str(obj, "org_id"), _int(obj, "created_at"), _str(obj, "note"))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Manifest:
    """One version of the federation manifest (see the module docstring)."""

    federation: str
    version: int
    previous: str
    """Digest of the previous version; ``""`` for version 0."""
    quorum: str
    members: tuple[Member, ...]
    proposal: Proposal
    signatures: tuple[tuple[str, bytes], ...] = field(default=())
    """``(org_id, Ed25519 signature)`` pairs, sorted by org id."""

    def __post_init__(self) -> None:
        if not self.federation:
            raise ManifestError("federation id must not be empty")
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ManifestError("version must be a non-negative integer")
        if (self.version == 0) != (self.previous == ""):
            raise ManifestError("exactly version 0 has no previous digest")
        if self.previous and not _HEX64.fullmatch(self.previous):
            raise ManifestError("previous must be a SHA-256 hex digest")
        if self.quorum not in QUORUM_RULES:
            raise ManifestError(f"quorum must be one of {QUORUM_RULES}")
        ids = [m.org_id for m in self.members]
        if not ids:
            raise ManifestError("a manifest needs at least one member")
        if ids != sorted(set(ids)):
            raise ManifestError("members must be sorted by org id, without duplicates")
        signers = [s for s, _ in self.signatures]
        if signers != sorted(set(signers)):
            raise ManifestError("signatures must be sorted by org id, one per signer")

    # --- encoding ---------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        """Everything but the signatures, as a JSON object."""
        return {
            "federation": self.federation,
            "version": self.version,
            "previous": self.previous,
            "quorum": self.quorum,
            "members": [m.to_obj() for m in self.members],
            "proposal": self.proposal.to_obj(),
        }

    def body_bytes(self) -> bytes:
        """Canonical JSON of the body."""
        return canonical_json(self.body())

    def signing_bytes(self) -> bytes:
        """What members sign: the domain tag and the canonical body."""
        return SIGNING_DOMAIN + self.body_bytes()

    @property
    def digest(self) -> str:
        """SHA-256 of the canonical body, hex: the next version's ``previous``."""
        return hashlib.sha256(self.body_bytes()).hexdigest()

    def to_obj(self) -> dict[str, Any]:
        return self.body() | {"signatures": {org: sig.hex() for org, sig in self.signatures}}

    def to_json(self) -> bytes:
        """Canonical JSON of the whole version, signatures included."""
        return canonical_json(self.to_obj())

    @classmethod
    def from_obj(cls, obj: Any) -> Manifest:
        if not isinstance(obj, dict):
            raise ManifestError("a manifest version must be a JSON object")
        _expect(
            obj,
            {"federation", "version", "previous", "quorum", "members", "proposal", "signatures"},
            "manifest",
        )
        members, signatures = obj["members"], obj["signatures"]
        if not isinstance(members, list) or not isinstance(signatures, dict):
            raise ManifestError("members must be a list and signatures an object")
        sigs = []
        for org, sig in sorted(signatures.items()):
            if not isinstance(sig, str):
                raise ManifestError("signatures must be hex strings")
            sigs.append((org, _hex(sig, "signature")))
        return cls(
            federation=_str(obj, "federation"),
            version=_int(obj, "version"),
            previous=_str(obj, "previous"),
            quorum=_str(obj, "quorum"),
            members=tuple(Member.from_obj(m) for m in members),
            proposal=Proposal.from_obj(obj["proposal"]),
            signatures=tuple(sigs),
        )

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse one version; any malformed input is a ``ManifestError``."""
        try:
            obj = loads_bounded(data, what="manifest")
        except Refused as exc:
            raise ManifestError(exc.detail) from None
        _check_floats(obj)
        return cls.from_obj(obj)

    # --- building versions ------------------------------------------------------

    @classmethod
    def found(
        cls,
        federation: str,
        members: Iterable[Member],
        *,
        created_at: int,
        quorum: str = "majority",
        note: str = "",
    ) -> Manifest:
        """Version 0, unsigned: every founding member must then :meth:`sign` it."""
        return cls(
            federation=federation,
            version=0,
            previous="",
            quorum=quorum,
            members=_sorted_members(members),
            proposal=Proposal("found", "", created_at, note),
        )

    def _next(
        self, members: Iterable[Member], action: Action, org_id: str, created_at: int, note: str
    ) -> Manifest:
        return Manifest(
            federation=self.federation,
            version=self.version + 1,
            previous=self.digest,
            quorum=self.quorum,
            members=_sorted_members(members),
            proposal=Proposal(action, org_id, created_at, note),
        )

    def propose_add(self, member: Member, *, created_at: int, note: str = "") -> Manifest:
        """The next version with ``member`` added (unsigned)."""
        if member.org_id in self.member_ids:
            raise ManifestError(f"{member.org_id!r} is already a member")
        return self._next((*self.members, member), "add", member.org_id, created_at, note)

    def propose_remove(self, org_id: str, *, created_at: int, note: str = "") -> Manifest:
        """The next version without ``org_id`` (unsigned)."""
        if org_id not in self.member_ids:
            raise ManifestError(f"{org_id!r} is not a member")
        rest = [m for m in self.members if m.org_id != org_id]
        return self._next(rest, "remove", org_id, created_at, note)

    def propose_update(self, member: Member, *, created_at: int, note: str = "") -> Manifest:
        """The next version with ``member``'s record replaced (unsigned)."""
        if member.org_id not in self.member_ids:
            raise ManifestError(f"{member.org_id!r} is not a member")
        rest = [m for m in self.members if m.org_id != member.org_id]
        return self._next((*rest, member), "update", member.org_id, created_at, note)

    def sign(self, identity: OrgIdentity) -> Manifest:
        """A copy carrying ``identity``'s signature too."""
        others = [s for s in self.signatures if s[0] != identity.org_id]
        signature = (identity.org_id, identity.sign(self.signing_bytes()))
        return replace(self, signatures=tuple(sorted((*others, signature))))

    def with_signatures(self, signatures: Mapping[str, bytes]) -> Manifest:
        """A copy carrying these extra signatures (e.g. collected from peers)."""
        merged = dict(self.signatures) | dict(signatures)
        return replace(self, signatures=tuple(sorted(merged.items())))

    # --- queries ----------------------------------------------------------------

    @property
    def member_ids(self) -> tuple[str, ...]:
        return tuple(m.org_id for m in self.members)

    def member(self, org_id: str) -> Member:
        for m in self.members:
            if m.org_id == org_id:
                return m
        raise KeyError(org_id)

    def public_keys(self) -> dict[str, bytes]:
        """Org id → Ed25519 key: the ``members`` mapping of an Endpoint."""
        return {m.org_id: m.public_key for m in self.members}

    def peer_addresses(self) -> dict[str, PeerAddress]:
        """Org id → :class:`PeerAddress`: the ``peers`` mapping of a TlsTransport."""
        return {m.org_id: m.address for m in self.members}

    def certificates(self) -> list[bytes]:
        """The members' certificates, for the peer port's trust bundle."""
        return [m.certificate_pem.encode("ascii") for m in self.members]

    def required_signatures(self) -> int:
        """How many current members must sign the next version."""
        n = len(self.members)
        if self.quorum == "majority":
            return n // 2 + 1
        if self.quorum == "two_thirds":
            return -(-2 * n // 3)
        return n

    # --- verification -----------------------------------------------------------

    def _valid_signers(self, keys: Mapping[str, bytes], allowed: set[str]) -> set[str]:
        message = self.signing_bytes()
        valid = set()
        for org, signature in self.signatures:
            if org not in allowed:
                raise ManifestError(f"version {self.version}: {org!r} signed but is not a member")
            if not verify_signature(keys[org], message, signature):
                raise ManifestError(f"version {self.version}: forged signature of {org!r}")
            valid.add(org)
        return valid

    def verify_genesis(self) -> None:
        """Check version 0: signed by every founding member."""
        if self.version != 0 or self.proposal.action != "found":
            raise ManifestError("the chain must start with a founding version 0")
        keys = self.public_keys()
        signers = self._valid_signers(keys, set(keys))
        missing = set(keys) - signers
        if missing:
            raise ManifestError(f"version 0: founding members {sorted(missing)} did not sign")

    def verify_successor(self, candidate: Manifest) -> None:
        """Check that ``candidate`` is a valid next version of this (verified) version."""
        v = candidate.version
        if candidate.federation != self.federation:
            raise ManifestError(f"version {v}: belongs to another federation")
        if v != self.version + 1 or candidate.previous != self.digest:
            raise ManifestError(
                f"version {v}: does not follow version {self.version} (broken chain)"
            )
        if candidate.quorum != self.quorum:
            raise ManifestError(f"version {v}: the quorum rule cannot change")
        proposal = candidate.proposal
        before = {m.org_id: m for m in self.members}
        after = {m.org_id: m for m in candidate.members}
        org = proposal.org_id
        if proposal.action == "add":
            expected = before | ({org: after[org]} if org in after else {})
            ok = org not in before and org in after and after == expected
        elif proposal.action == "remove":
            ok = org in before and after == {k: m for k, m in before.items() if k != org}
        elif proposal.action == "update":
            ok = (
                org in before
                and set(after) == set(before)
                and all(after[k] == before[k] for k in before if k != org)
                and after[org] != before[org]
            )
        else:
            ok = False
        if not ok:
            raise ManifestError(
                f"version {v}: members do not match the {proposal.action!r} proposal"
            )
        keys = dict(self.public_keys())
        allowed = set(before)
        if proposal.action == "add":
            keys[org] = after[org].public_key
            allowed.add(org)
        elif proposal.action == "update":
            # A changed identity key must consent too; the old key counts for the quorum.
            keys[org] = before[org].public_key
        signers = candidate._valid_signers(keys, allowed)
        if proposal.action == "add" and org not in signers:
            raise ManifestError(f"version {v}: the new member {org!r} did not sign")
        counted = len(signers & set(before))
        needed = self.required_signatures()
        if counted < needed:
            raise ManifestError(
                f"version {v}: {counted} of {needed} required member signatures (no quorum)"
            )

    @classmethod
    def verify_chain(cls, versions: Sequence[Manifest], *, genesis: str | None = None) -> Manifest:
        """Verify a whole chain from version 0 and return its latest version.

        ``genesis``, when given, is the digest of the version 0 this node trusts (from
        its configuration), so a chain founded by strangers is refused.
        """
        if not versions:
            raise ManifestError("an empty chain")
        first = versions[0]
        first.verify_genesis()
        if genesis is not None and first.digest != genesis:
            raise ManifestError("version 0 is not the trusted genesis")
        current = first
        for candidate in versions[1:]:
            current.verify_successor(candidate)
            current = candidate
        return current


def _sorted_members(members: Iterable[Member]) -> tuple[Member, ...]:
    ordered = tuple(sorted(members, key=lambda m: m.org_id))
    ids = [m.org_id for m in ordered]
    if len(set(ids)) != len(ids):
        raise ManifestError("duplicate member org id")
    return ordered


def dump_chain(versions: Sequence[Manifest]) -> bytes:
    """A chain as canonical JSON (a list of versions)."""
    return canonical_json([v.to_obj() for v in versions])


def load_chain(data: bytes) -> list[Manifest]:
    """Parse a chain written by :func:`dump_chain` (not verified: call ``verify_chain``)."""
    try:
        obj = loads_bounded(data, what="manifest chain")
    except Refused as exc:
        raise ManifestError(exc.detail) from None
    if not isinstance(obj, list):
        raise ManifestError("a chain is a JSON list")
    _check_floats(obj)
    return [Manifest.from_obj(v) for v in obj]
