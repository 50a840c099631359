"""The federation side of the org node: membership changes proposed, signed and spread
over gossip (topic ``manifest``) until a quorum of the current members has signed, then
verified and installed by every node.

Installing a version appends it to the chain file, rewrites the peer port's trust
bundle, and updates the SWIM membership. The peer port asks :meth:`Federation.trusted`
for the members' certificates at every TLS handshake
(:class:`coordinator_free.trust.TrustFollower`), so a member removed by the new version
can no longer complete a handshake with this node from that moment, without a restart;
the transport's outbound side pins each peer by the current manifest already.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace

from coordinator_free.errors import ManifestError
from coordinator_free.gossip import SignedRecord
from coordinator_free.identity import verify_signature
from coordinator_free.manifest import Manifest, Member
from coordinator_free.tls import write_trust_bundle

from org_node.node.context import NodeContext
from org_node.node.files import write_chain
from org_node.services import ServiceRefused

__all__ = ["MANIFEST_TOPIC", "Federation"]

logger = logging.getLogger("org_node.node")

MANIFEST_TOPIC = "manifest"


class Federation:
    """Membership proposals and the installed manifest (see the module docstring)."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self._proposals: dict[str, Manifest] = {}
        self._follow: asyncio.Task[None] | None = None
        self.on_install: Callable[[tuple[str, ...], int], None] = _nothing
        """Called on the loop with the members and number of each version installed (the
        runs under way take removed members out of their next round)."""

    # -- called by the admin API (worker threads) --------------------------------------

    def proposals(self) -> list[Manifest]:
        """Proposed next manifest versions not yet carried by a quorum."""
        return self.ctx.read(lambda: sorted(self._proposals.values(), key=lambda m: m.digest))

    def propose_add(self, member: Member, note: str) -> Manifest:
        m = self.ctx.require_manifest()
        try:
            proposal = m.propose_add(member, created_at=int(time.time()), note=note)
        except ManifestError as exc:
            raise ServiceRefused(str(exc)) from None
        return self.ctx.on_loop(self._sign_and_spread(proposal))

    def propose_remove(self, org_id: str, note: str) -> Manifest:
        m = self.ctx.require_manifest()
        try:
            proposal = m.propose_remove(org_id, created_at=int(time.time()), note=note)
        except ManifestError as exc:
            raise ServiceRefused(str(exc)) from None
        return self.ctx.on_loop(self._sign_and_spread(proposal))

    def sign_proposal(self, digest: str) -> Manifest:
        proposal = self.ctx.read(lambda: self._proposals.get(digest))
        if proposal is None:
            raise ServiceRefused(f"no pending proposal {digest}")
        return self.ctx.on_loop(self._sign_and_spread(proposal))

    def trusted(self) -> list[bytes]:
        """The current members' certificates (PEM): whom the peer port admits."""
        m = self.ctx.current_manifest
        return m.certificates() if m is not None else []

    # -- on the node's loop ---------------------------------------------------------

    def start(self) -> None:
        self._follow = asyncio.create_task(self._follow_proposals(), name="manifest-proposals")

    async def stop(self) -> None:
        if self._follow is not None:
            self._follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follow

    async def _sign_and_spread(self, proposal: Manifest) -> Manifest:
        me = self.ctx.me
        mine = proposal.sign(self.ctx.org_identity)
        own = dict(mine.signatures)[me]
        merged = self._merge(mine.with_signatures({me: own}))
        if self.ctx.gossip is not None:
            single = replace(mine, signatures=((me, own),))
            self.ctx.gossip.publish(MANIFEST_TOPIC, mine.digest, single.to_json())
        return merged

    def _merge(self, candidate: Manifest) -> Manifest:
        """Add a proposal's signatures to the pending one; install it at quorum."""
        current = self.ctx.require_manifest()
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
        ctx = self.ctx
        ctx.chain.append(version)
        write_chain(ctx.paths.chain, ctx.chain)
        write_trust_bundle(ctx.paths.trust_bundle, version.certificates())
        self._proposals = {d: p for d, p in self._proposals.items() if p.version > version.version}
        if ctx.membership is not None:
            ctx.membership.update_members(version.member_ids)
        logger.info("%s: installed manifest version %d", ctx.me, version.version)
        self.on_install(version.member_ids, version.version)

    async def _follow_proposals(self) -> None:
        assert self.ctx.gossip is not None
        queue: asyncio.Queue[SignedRecord] = self.ctx.gossip.subscribe(MANIFEST_TOPIC)
        while True:
            record = await queue.get()
            try:
                candidate = Manifest.from_json(record.record)
                self._merge(candidate)
            except (ManifestError, ServiceRefused, ValueError) as exc:
                logger.warning("%s: ignored a manifest proposal: %s", self.ctx.me, exc)


def _nothing(members: tuple[str, ...], version: int) -> None:
    del members, version
