"""The federation side of the org node: membership changes proposed, signed and spread
over gossip (topic ``manifest``) until a quorum of the current members has signed, then
verified and installed by every node (chain file, membership).

:class:`FederationHost` is mixed into :class:`~org_node.node.OrgNode`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from coordinator_free.errors import ManifestError
from coordinator_free.gossip import Gossip, SignedRecord
from coordinator_free.identity import OrgIdentity, verify_signature
from coordinator_free.manifest import Manifest, Member, dump_chain
from coordinator_free.membership import Membership
from coordinator_free.sealed import atomic_write

from org_node.config import NodePaths
from org_node.services import ServiceRefused

__all__ = ["MANIFEST_TOPIC", "FederationHost", "write_chain"]

logger = logging.getLogger("org_node.node")

MANIFEST_TOPIC = "manifest"
T = TypeVar("T")


def write_chain(path: Path, versions: list[Manifest]) -> None:
    atomic_write(path, dump_chain(versions), mode=0o644)


class FederationHost:
    """Membership proposals (see the module docstring); the node provides the state below."""

    chain: list[Manifest]
    paths: NodePaths
    org_identity: OrgIdentity
    gossip: Gossip | None
    membership: Membership | None
    _proposals: dict[str, Manifest]

    def _require_manifest(self) -> Manifest:
        raise NotImplementedError

    def _on_loop(self, coro: Awaitable[T], timeout: float = 120.0) -> T:
        raise NotImplementedError

    def propose_add(self, member: Member, note: str) -> Manifest:
        m = self._require_manifest()
        try:
            proposal = m.propose_add(member, created_at=int(time.time()), note=note)
        except ManifestError as exc:
            raise ServiceRefused(str(exc)) from None
        return self._on_loop(self._sign_and_spread(proposal))

    def propose_remove(self, org_id: str, note: str) -> Manifest:
        m = self._require_manifest()
        try:
            proposal = m.propose_remove(org_id, created_at=int(time.time()), note=note)
        except ManifestError as exc:
            raise ServiceRefused(str(exc)) from None
        return self._on_loop(self._sign_and_spread(proposal))

    def sign_proposal(self, digest: str) -> Manifest:
        proposal = self._proposals.get(digest)
        if proposal is None:
            raise ServiceRefused(f"no pending proposal {digest}")
        return self._on_loop(self._sign_and_spread(proposal))

    # -- federation proposals over gossip -------------------------------------------

    async def _sign_and_spread(self, proposal: Manifest) -> Manifest:
        mine = proposal.sign(self.org_identity)
        own = dict(mine.signatures)[self.org_identity.org_id]
        merged = self._merge(mine.with_signatures({self.org_identity.org_id: own}))
        if self.gossip is not None:
            single = replace(mine, signatures=((self.org_identity.org_id, own),))
            self.gossip.publish(MANIFEST_TOPIC, mine.digest, single.to_json())
        return merged

    def _merge(self, candidate: Manifest) -> Manifest:
        """Add a proposal's signatures to the pending one; install it at quorum."""
        current = self._require_manifest()
        if candidate.previous != current.digest:
            raise ServiceRefused("the proposal does not follow the current manifest version")
        keys = current.public_keys()
        if candidate.proposal.action == "add":
            with contextlib.suppress(KeyError):
                keys[candidate.proposal.org_id] = candidate.member(
                    candidate.proposal.org_id
                ).public_key
        message = candidate.signing_bytes()
        valid = {
            org: sig
            for org, sig in candidate.signatures
            if org in keys and verify_signature(keys[org], message, sig)
        }
        if not valid:
            raise ServiceRefused("the proposal carries no valid member signature")
        pending = self._proposals.get(candidate.digest)
        base = pending if pending is not None else replace(candidate, signatures=())
        merged = base.with_signatures(valid)
        try:
            current.verify_successor(merged)
        except ManifestError:
            self._proposals[merged.digest] = merged
            return merged
        self._install(merged)
        return merged

    def _install(self, version: Manifest) -> None:
        self.chain.append(version)
        write_chain(self.paths.chain, self.chain)
        self._proposals = {d: p for d, p in self._proposals.items() if p.version > version.version}
        if self.membership is not None:
            self.membership.update_members(version.member_ids)
        logger.info("%s: installed manifest version %d", self.org_identity.org_id, version.version)

    async def _follow_proposals(self) -> None:
        assert self.gossip is not None
        queue: asyncio.Queue[SignedRecord] = self.gossip.subscribe(MANIFEST_TOPIC)
        while True:
            record = await queue.get()
            try:
                candidate = Manifest.from_json(record.record)
                self._merge(candidate)
            except (ManifestError, ServiceRefused, ValueError) as exc:
                logger.warning("%s: ignored a manifest proposal: %s", self.org_identity.org_id, exc)
