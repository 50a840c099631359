"""The global model's side of the org node: each round's model coded into the
federation's history and its hash gossiped, coded again when a removal takes holders
away, and a node that fell behind caught up with the model its peers agree on.

:class:`ModelHistory` is one part of :class:`~org_node.node.runs.Runs`; the loop owns it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from coordinator_free.erasure import ShardError

from org_node.engine import EngineError, model_from_bytes, model_to_bytes
from org_node.node.context import NodeContext

__all__ = ["CATCH_UP_VOTES", "MODEL_TOPIC", "ModelHistory"]

logger = logging.getLogger("org_node.node")

MODEL_TOPIC = "model"
"""Gossip topic of the global model's content hash per run and round (key ``RUN/ROUND``)."""

CATCH_UP_VOTES = 2
"""How many other participants must publish the same model hash for a round before a
node that fell behind adopts that model; a run that removals left with two participants
needs the one other (it could steer the other's model through the sum anyway)."""


class ModelHistory:
    """This node's share of the global-model history, and catching up from it."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self._shared: tuple[int, tuple[str, ...]] | None = None
        """The newest global model this node coded into the history: round, holders."""

    def forget(self) -> None:
        """A new run starts: the model placed so far was another run's."""
        self._shared = None

    async def share(
        self, run_key: str, round: int, model: Mapping[str, Any], survivors: Sequence[str]
    ) -> None:
        """Keep this node's shards of round ``round``'s global model (coded off the
        loop) and gossip its content hash, so that a node back from a crash can rebuild it
        and rejoin."""
        if self.ctx.history is None or self.ctx.gossip is None:
            return
        manifest = self.ctx.current_manifest
        # a survivor the federation removed while the round ran holds no shard: this
        # node refuses it now, so a member behind could not rebuild from its shards
        holders = tuple(s for s in survivors if manifest is None or s in manifest.member_ids)
        sha = await self._keep(round, model, holders)
        self._shared = (round, holders)
        self.ctx.gossip.publish(MODEL_TOPIC, f"{run_key}/{round}", sha.encode())

    async def place_again(self, removed: set[str], round: int, model: Mapping[str, Any]) -> None:
        """Code the newest global model (``model``, this node's at ``round``) again over
        the holders a removal left: the shards placed on a removed member are gone, and a
        member that fell behind must still rebuild that model from the others (every
        remaining holder places alike)."""
        shared = self._shared
        if shared is None or shared[0] != round or not removed & set(shared[1]):
            return
        holders = tuple(s for s in shared[1] if s not in removed)
        if self.ctx.me in holders:
            await self._keep(round, model, holders)
            logger.info("%s: global model %d placed again on %s", self.ctx.me, round, holders)

    async def _keep(self, round: int, model: Mapping[str, Any], holders: Sequence[str]) -> str:
        """Code ``model`` as history version ``round`` over ``holders`` and keep this
        node's shards (off the loop); the model's content hash."""
        history = self.ctx.history
        assert history is not None

        def keep() -> str:
            data = model_to_bytes(model)
            sha = hashlib.sha256(data).hexdigest()
            try:
                history.add_version(round, data, sha, members=holders)
            except (ShardError, OSError) as exc:
                logger.warning("%s: global model history: %s", self.ctx.me, exc)
            return sha

        return await asyncio.to_thread(keep)

    async def catch_up(
        self, run_key: str, round: int, participants: Sequence[str]
    ) -> tuple[int, dict[str, Any]] | None:
        """The newest model of ``run_key`` past ``round`` that two other participants
        agree on (the one other, when a removal left the run two), rebuilt from the
        global-model history shards and checked against its hash."""
        if self.ctx.gossip is None or self.ctx.history is None or self.ctx.membership is None:
            return None
        me = self.ctx.me
        others = set(participants) - {me}
        votes: dict[tuple[int, str], set[str]] = {}
        for record in self.ctx.gossip.records(MODEL_TOPIC):
            key, _, num = record.key.rpartition("/")
            if key != run_key or not num.isdigit() or record.origin == me:
                continue
            if others and record.origin not in others:  # a removed member's word is not counted
                continue
            votes.setdefault((int(num), record.record.decode("ascii", "replace")), set()).add(
                record.origin
            )
        needed = min(CATCH_UP_VOTES, len(others)) if others else CATCH_UP_VOTES
        agreed = sorted(
            (r, sha) for (r, sha), who in votes.items() if r > round and len(who) >= needed
        )
        if not agreed:
            return None
        newest, sha = agreed[-1]
        try:
            data = await self.ctx.history.rebuild(newest, sha, self.ctx.membership.live())
            return newest, model_from_bytes(data)
        except (ShardError, EngineError) as exc:
            logger.warning("%s: cannot rebuild round %d yet: %s", me, newest, exc)
            return None
