"""The hash-chain check of an egress log: entries, signed heads, heads held by peers.

``docs/SECURITY.md``, "Privacy audit", item 3. :class:`Chain` walks a log's entries
and heads in order and raises :class:`Broken` at the first fault: an entry out of
order or missing, a ``prev_hash`` that does not link to the previous entry, contents
that do not match ``entry_hash``, another org's entry, a privacy class other than its
kind's or a forbidden one, a head that does not match the chain or is not signed by
the org, and a head held by a peer that the chain disagrees with.
:func:`verify_records` checks a whole log read by
:func:`~org_node.audit.records.read_log`; :mod:`org_node.audit.verify` checks report
segments with the same :class:`Chain`, and :class:`~org_node.audit.log.EgressLog`
checks an existing file before it continues it.

This module imports the records and the privacy classes only, never the log that
writes them nor the report, so that both can use it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from org_node.audit.classes import (
    FORBIDDEN_CLASSES,
    PrivacyClass,
    UnclassifiedKind,
    classify,
    former_classes,
)
from org_node.audit.records import EgressEntry, LogRecords, SignedHead, genesis_hash

__all__ = [
    "Broken",
    "Chain",
    "VerifyResult",
    "check_peer_heads",
    "log_key",
    "lost_in_wipe",
    "verify_records",
]


@dataclass(frozen=True)
class VerifyResult:
    """The outcome: ``summary`` is the one line the CLI prints."""

    ok: bool
    summary: str
    what: str = "log"
    org: str = ""
    entries: int = 0
    heads: int = 0
    peer_heads: int = 0
    index: int | None = None
    location: str = ""

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1


class Broken(Exception):
    """The first fault found: where (``location``), what (``detail``), at which entry."""

    def __init__(self, location: str, detail: str, index: int | None = None) -> None:
        super().__init__(f"{location}: {detail}")
        self.location = location
        self.detail = detail
        self.index = index


_FORBIDDEN = {c.value for c in FORBIDDEN_CLASSES}


class Chain:
    """Walks entries and heads in order, raising :class:`Broken` at the first fault.

    ``prev`` is the hash the next entry must link to (the genesis hash for entry 0)
    and ``next_index`` its index: a report's segment starts in the middle of a log.
    """

    def __init__(
        self, org: str, key: bytes, prev: str, next_index: int, recovered: str | None = None
    ) -> None:
        self.org = org
        self.key = key
        self.prev = prev
        self.next = next_index
        self.hashes: dict[int, str] = {next_index - 1: prev}
        self.entries = 0
        self.heads = 0
        self.recovered = recovered
        """When a recovered node began this log anew (its header's ``recovered``)."""
        self.lost: list[SignedHead] = []
        """Peers' heads of the log lost in that wipe (signed before it)."""

    def entry(self, e: EgressEntry, where: str) -> None:
        at = f"entry {e.index} ({where})"
        if e.index != self.next:
            if e.index < self.next:
                raise Broken(
                    at,
                    f"repeats or is out of order: entry {self.next} was expected here",
                    e.index,
                )
            missing = (
                f"entry {self.next}"
                if e.index == self.next + 1
                else f"entries {self.next}..{e.index - 1}"
            )
            raise Broken(at, f"{missing} missing before it (removed or reordered)", e.index)
        if e.prev_hash != self.prev:
            raise Broken(at, "prev_hash does not link to the previous entry", e.index)
        if e.computed_hash() != e.entry_hash:
            raise Broken(at, "contents do not match entry_hash (a field was changed)", e.index)
        if e.org != self.org:
            raise Broken(at, f"org {e.org!r} is not the log's org {self.org!r}", e.index)
        try:
            PrivacyClass(e.privacy_class)
            expected = classify(e.kind)
        except ValueError:
            raise Broken(at, f"unknown privacy class {e.privacy_class!r}", e.index) from None
        except UnclassifiedKind:
            raise Broken(at, f"kind {e.kind!r} has no privacy class", e.index) from None
        if expected.value != e.privacy_class and e.privacy_class not in former_classes(e.kind):
            raise Broken(
                at, f"kind {e.kind!r} is {expected.value}, recorded as {e.privacy_class}", e.index
            )
        if e.privacy_class in _FORBIDDEN:
            raise Broken(
                at,
                f"a message of forbidden class {e.privacy_class} ({e.kind!r}) was sent to {e.peer!r}",
                e.index,
            )
        self.prev = e.entry_hash
        self.hashes[e.index] = e.entry_hash
        self.next += 1
        self.entries += 1

    def head(self, h: SignedHead, where: str) -> None:
        at = f"signed head of index {h.index} ({where})"
        if h.org != self.org:
            raise Broken(at, f"is of org {h.org!r}, not {self.org!r}")
        if h.index != self.next - 1:
            raise Broken(
                at, f"does not follow entry {h.index}: the chain is at entry {self.next - 1}"
            )
        if h.head_hash != self.prev:
            raise Broken(at, "head_hash does not match the chain")
        if not h.verify(self.key):
            raise Broken(at, "the signature is not valid")
        self.heads += 1

    def check_peer_head(self, h: SignedHead) -> None:
        at = f"head of index {h.index} held by a peer"
        if not h.verify(self.key):
            raise Broken(at, "the signature is not valid")
        lost = self.recovered is not None and h.time < self.recovered
        if lost and self.hashes.get(h.index) != h.head_hash:
            # a head of the log lost with the disk: it proves entries gone, declared
            self.lost.append(h)
            return
        last = self.next - 1
        if h.index > last:
            raise Broken(
                at,
                f"the log ends at entry {last}: entries {last + 1}..{h.index} were removed",
                h.index,
            )
        known = self.hashes.get(h.index)
        if known is None:
            return
        if known != h.head_hash:
            raise Broken(
                f"entry {h.index}",
                "differs from the signed head the peers hold (the log was rewritten)",
                h.index,
            )


def log_key(
    header: Mapping[str, Any], trusted_keys: Mapping[str, bytes] | None
) -> tuple[bytes, bool]:
    """The org's key from a log header, and whether it is pinned by ``trusted_keys``
    (a header naming another key than the pinned one is :class:`Broken`)."""
    key = bytes.fromhex(header["public_key"])
    pinned = trusted_keys.get(header["org"]) if trusted_keys else None
    if pinned is not None and pinned != key:
        raise Broken("log header", f"the key is not the pinned key of {header['org']!r}")
    return key, pinned is not None


def check_peer_heads(chain: Chain, peer_heads: Iterable[SignedHead]) -> int:
    """Check the heads of ``chain``'s org among ``peer_heads``; how many there were."""
    checked = 0
    for h in peer_heads:
        if h.org == chain.org:
            chain.check_peer_head(h)
            checked += 1
    return checked


def verify_records(
    records: LogRecords,
    *,
    trusted_keys: Mapping[str, bytes] | None = None,
    peer_heads: Iterable[SignedHead] = (),
) -> VerifyResult:
    """Verify a log read by :func:`~org_node.audit.records.read_log`: its chain and
    heads, the heads of this org that ``peer_heads`` hold, and, when ``trusted_keys``
    are given, the header's key and the heads of other orgs it holds."""
    org = records.org
    try:
        key, pinned = log_key(records.header, trusted_keys)
        recovered = records.header.get("recovered")
        chain = Chain(org, key, genesis_hash(records.header), 0, recovered)
        held = 0
        repairs: list[str] = []
        for line, kind, value in records.records:
            where = f"line {line}"
            if kind == "entry":
                chain.entry(value, where)
            elif kind == "head":
                chain.head(value, where)
            elif kind == "repair":
                if not value.verify(key):
                    raise Broken(where, "the repair record is not signed by the log's org")
                repairs.append(
                    f"{value.cut_bytes} bytes of a torn record cut after line "
                    f"{value.after_line} at {value.time}"
                )
            else:
                if trusted_keys is not None:
                    other = trusted_keys.get(value.org)
                    if other is None:
                        raise Broken(where, f"holds a head of {value.org!r}, not a known org")
                    if not value.verify(other):
                        raise Broken(where, f"the held head of {value.org!r} is not signed by it")
                held += 1
        theirs = [h for h in peer_heads if h.org == org]
        checked = check_peer_heads(chain, theirs)
        agreeing = [h for h in theirs if h not in chain.lost]
    except Broken as exc:
        return VerifyResult(
            False, f"FAIL: log of {org}: {exc}", "log", org, index=exc.index, location=exc.location
        )
    tail = chain.prev[:16]
    summary = (
        f"OK: log of {org}: {chain.entries} entries, {chain.heads} signed heads, "
        f"head {tail}, no forbidden class"
        + (_peer_coverage(chain, agreeing) if agreeing else "")
        + (f", holds {held} peer head(s)" if held else "")
        + (f", {len(repairs)} repair(s): {'; '.join(repairs)}" if repairs else "")
        + lost_in_wipe(chain)
        + ("" if pinned else " (key from the log header, not pinned)")
    )
    return VerifyResult(True, summary, "log", org, chain.entries, chain.heads, checked)


def lost_in_wipe(chain: Chain) -> str:
    """What the peers' heads prove of the log a recovered node lost (nothing if none)."""
    if chain.recovered is None:
        return ""
    if not chain.lost:
        return f", begun anew at {chain.recovered} by a recovered node"
    newest = max(chain.lost, key=lambda h: h.index)
    return (
        f", begun anew at {chain.recovered} by a recovered node: its earlier log is lost, "
        f"at least {newest.index + 1} entries (the peers hold {len(chain.lost)} signed "
        f"head(s) of it, the last signed {newest.time})"
    )


def _peer_coverage(chain: Chain, heads: list[SignedHead]) -> str:
    """What the heads peers hold say of the log: how many agree, and how many entries
    sit after the last of them (what no peer could yet tell missing)."""
    last = max(h.index for h in heads)
    after = chain.next - 1 - last
    return (
        f", agrees with {len(heads)} head(s) held by peers, the last at entry {last}"
        f" ({after} entr{'y' if after == 1 else 'ies'} after it)"
    )
