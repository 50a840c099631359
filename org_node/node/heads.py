"""The audit side of the org node: this org's signed log heads reach every member, and
the members' heads are kept here (``docs/SECURITY.md``, "Privacy audit").

* After every completed round the node signs its egress log's head for that round and
  sends it to every member (``audit.head``), then signs one more head, kept in its own
  log only, that covers those messages (so a report of the run, whose segment must end
  at a signed head, includes them); at least every :data:`HEAD_PERIOD_S`, while
  entries other than head messages sit after the last signed head (a paused run,
  membership traffic, a failed round), it signs and sends one too. So the last head
  the peers hold is never far behind the log's end: cut entries from the end of the
  log, or rewrite it, and it no longer matches what they hold.
* Each member's valid head of its own log is kept in this node's log, and a member may
  ask for the heads of its own log this node holds (``audit.heads``).
* :meth:`AuditHeads.from_peers` asks every live member for the heads of this org's log
  it holds (``GET /v1/audit/peer-heads``, ``fedweave audit verify --from-peers``).
* :func:`lost_entries` says what those heads prove this org's log no longer holds (a
  node rebuilt after a wipe starts a new log): how many entries at least, and which
  rounds of a run they covered; a run's privacy report states it among its anomalies.

A head that could not be signed or sent is logged as an error, never passed over in
silence; the next one covers what it would have.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from coordinator_free.errors import TransportError

from org_node.audit import AuditError, EgressLog, SignedHead
from org_node.audit.heads import HEAD_KIND, fetch_heads, send_head, serve_heads
from org_node.node.context import NodeContext

__all__ = ["HEAD_PERIOD_S", "AuditHeads", "lost_entries"]

logger = logging.getLogger("org_node.node")

HEAD_PERIOD_S = 30.0
"""Longest time entries of this org's log wait for a signed head that peers hold."""


class AuditHeads:
    """This org's heads sent to every member, and the members' heads kept (see above)."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self._task: asyncio.Task[None] | None = None
        self._sending: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Keep the members' heads; sign and send this org's periodically."""
        assert self.ctx.endpoint is not None
        serve_heads(self.ctx.endpoint, self.ctx.egress, self.ctx.member_keys)
        self._task = asyncio.create_task(self._periodically(), name="audit-heads")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._sending) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def after_round(self, run_key: str, round: int) -> None:
        """Sign the head for ``(run_key, round)`` now (off the loop: it fsyncs; a report
        of the round needs it) and send it to every member in the background (the round
        does not wait for the peers)."""
        try:
            head = await asyncio.to_thread(self.ctx.egress.sign_head, run_key, round)
        except (AuditError, OSError) as exc:
            logger.error(
                "%s: the head of round %d could not be signed: %s", self.ctx.me, round, exc
            )
            return
        task = asyncio.create_task(self._send(head), name="audit-head")
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def publish(self, run: str = "", round: int = 0) -> SignedHead | None:
        """Sign the current head (off the loop) and send it to every member; None if it
        could not be signed (the error is logged)."""
        try:
            head = await asyncio.to_thread(self.ctx.egress.sign_head, run, round)
        except (AuditError, OSError) as exc:
            logger.error("%s: the audit head could not be signed: %s", self.ctx.me, exc)
            return None
        await self._send(head)
        return head

    async def settle(self) -> None:
        """Wait for the heads being sent (a run's last round's, before it ends)."""
        while self._sending:
            await asyncio.gather(*list(self._sending), return_exceptions=True)

    async def _send(self, head: SignedHead) -> None:
        endpoint, manifest = self.ctx.endpoint, self.ctx.current_manifest
        if endpoint is None or manifest is None:
            return
        missed = await send_head(endpoint, head, manifest.member_ids)
        try:  # cover the head messages themselves, for the run's report
            await asyncio.to_thread(self.ctx.egress.sign_head, head.run, head.round)
        except (AuditError, OSError) as exc:
            logger.error("%s: the audit head could not be signed: %s", self.ctx.me, exc)
        if missed:
            logger.warning(
                "%s: audit head %d not delivered to %s (the next head covers it)",
                self.ctx.me,
                head.index,
                ", ".join(sorted(missed)),
            )

    def pending(self) -> int:
        """Entries after the last signed head, head messages aside (those are covered by
        the next head, whenever it comes)."""
        log = self.ctx.egress
        last = log.heads[-1].index if log.heads else -1
        return sum(1 for e in log.entries[last + 1 :] if e.kind != HEAD_KIND)

    async def _periodically(self) -> None:
        while True:
            await asyncio.sleep(HEAD_PERIOD_S)
            if self.pending():
                await self.publish()

    async def from_peers(self, timeout: float = 10.0) -> tuple[list[SignedHead], dict[str, str]]:
        """The heads of this org's log its live members hold, and why others gave none."""
        endpoint, membership = self.ctx.endpoint, self.ctx.membership
        if endpoint is None or membership is None:
            return [], {}
        try:
            return await fetch_heads(
                endpoint, membership.live(), self.ctx.org_identity.public_key, timeout=timeout
            )
        except TransportError as exc:  # pragma: no cover - fetch_heads catches per peer
            return [], {"*": str(exc)}


def lost_entries(log: EgressLog, held: Iterable[SignedHead], run: str) -> list[str]:
    """What the heads of this org's log that its peers hold (``held``, checked against
    the org's key) prove ``log`` lacks: a head past the log's end, or one that does not
    match the entry at its index (a log begun anew after a wipe), covers entries this
    log no longer holds. One line for the entries (at least ``index + 1`` of the newest
    such head) and, when heads of ``run`` are among them, one for that run's rounds."""
    key = log.identity.public_key
    entries = log.entries
    gone = [
        h
        for h in held
        if h.org == log.org
        and h.index >= 0
        and h.verify(key)
        and (h.index >= len(entries) or entries[h.index].entry_hash != h.head_hash)
    ]
    if not gone:
        return []
    newest = max(gone, key=lambda h: h.index)
    out = [
        f"the peers hold {len(gone)} signed heads of this org's log that it no longer "
        f"holds, the newest over entries 0..{newest.index} (signed {newest.time}): at least "
        f"{newest.index + 1} entries of an earlier log are gone (a wipe)"
    ]
    rounds = sorted({h.round for h in gone if h.run == run and h.round > 0})
    if rounds:
        out.append(
            f"rounds up to {rounds[-1]} of this run were sent from the lost log: their "
            f"messages are not in this report (peers' heads name rounds {_spans(rounds)})"
        )
    return out


def _spans(rounds: list[int]) -> str:
    """``1-3, 5`` for ``[1, 2, 3, 5]``."""
    spans: list[list[int]] = []
    for r in rounds:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)
