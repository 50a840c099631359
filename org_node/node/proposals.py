"""The run-proposal side of the org node: a run proposed once reaches every participant,
each org's consent is signed and spread, and every org starts the run by itself at the
time the consents agree on (or cancels it, with the reason) — see
:mod:`org_node.proposals` for the rule and the records.

* ``propose_run`` / ``announce_run`` (called by the admin API) check and sign this
  org's proposal and spread this org's records of a run over gossip (topics
  ``run.proposal`` and ``run.consent``); the records of every run not yet ended are
  spread again from the database when the node starts and every
  :data:`RESPREAD_PERIOD_S` (gossip forgets a record an hour after it first saw it),
  so neither a restart nor a member away for hours loses a proposal or a consent.
* ``_follow_run_records`` stores each verified proposal naming this org as a
  ``proposed`` run and each participant's consent, by run key.
* ``_settle_runs`` applies :func:`~org_node.proposals.decide` to every pending run
  every :data:`SETTLE_PERIOD_S`: at the agreed time an accepted run starts (its
  policies checked again), a run that will not start is ``cancelled`` with the reason,
  and an org that did not consent in time is left out, saying so.

:class:`RunProposals` is one part of :class:`~org_node.node.OrgNode`; it starts an
agreed run through :meth:`~org_node.node.runs.Runs.launch`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from coordinator_free.gossip import RecordConflict, SignedRecord
from sqlmodel import Session, col, select

from org_node.db.models import Run
from org_node.db.repo import append_audit_event
from org_node.dp_spec import with_own_dp
from org_node.node.context import NodeContext
from org_node.proposals import (
    CONSENT_TOPIC,
    PROPOSAL_TOPIC,
    Consent,
    Outcome,
    Proposal,
    ProposalError,
    from_ms,
)
from org_node.run_store import (
    PENDING_STATES,
    apply_action,
    consents_of,
    now_ms,
    outcome_of,
    policy_violations,
    proposal_of,
    store_consent,
)
from org_node.runs import TERMINAL_STATES, RunAction, RunState
from org_node.services import ProposalRefused, ServiceRefused, make_proposal

__all__ = ["RESPREAD_PERIOD_S", "SETTLE_PERIOD_S", "Launch", "RunProposals"]

logger = logging.getLogger("org_node.node")

SETTLE_PERIOD_S = 0.25
"""How often pending runs are checked against their consents (start, cancel)."""

RESPREAD_PERIOD_S = 600.0
"""How often this org's records of the runs not yet ended are spread again: well within
gossip's record lifetime (``GossipConfig.ttl_s``, an hour), so a member back after any
absence still receives them (a record the others still hold costs nothing to re-send)."""

Launch = Callable[[str, str, Mapping[str, Any], tuple[str, ...] | None], Awaitable[None]]
"""``launch(run_id, name, spec, members)``: start the engine of an agreed run."""


@dataclass(frozen=True)
class _Due:
    """A pending run and what its consents mean now."""

    run_id: str
    name: str
    state: str
    spec: Mapping[str, Any]
    outcome: Outcome


class RunProposals:
    """Run proposals and consents (see the module docstring); ``launch`` starts an agreed
    run's engine (:meth:`~org_node.node.runs.Runs.launch`)."""

    def __init__(self, ctx: NodeContext, launch: Launch) -> None:
        self.ctx = ctx
        self._launch = launch
        self._settle: asyncio.Task[None] | None = None
        self._starting: set[str] = set()
        """Runs whose agreed start is in progress (not started twice)."""

    # -- called by the admin API (worker threads) --------------------------------------

    def propose_run(
        self, name: str, spec: Mapping[str, Any], consent_timeout_s: int, start_delay_s: int
    ) -> Proposal:
        m = self.ctx.require_manifest()
        if self.ctx.gossip is None:
            raise ServiceRefused("the node is not running in its federation")
        spec = with_own_dp(spec, self.ctx.config.engine)
        proposal = make_proposal(self.ctx.me, m, name, spec, consent_timeout_s, start_delay_s)
        size = len(proposal.to_record())
        if size > self.ctx.gossip.config.max_record_bytes:
            raise ProposalRefused(
                f"the proposal is {size} bytes, more than a gossip record holds "
                f"({self.ctx.gossip.config.max_record_bytes}): shorten its config"
            )
        return proposal

    def announce_run(self, run_id: str) -> None:
        records = self._own_records(run_id)
        if not records or self.ctx.loop is None:
            return
        try:
            self.ctx.on_loop(self._publish(records), timeout=10.0)
        except Exception as exc:  # spread again when the node starts; never fail the API
            logger.warning("%s: run %s not announced yet: %s", self._me, run_id, exc)

    # -- this org's records ------------------------------------------------------------

    @property
    def _me(self) -> str:
        return str(self.ctx.me)

    def _own_records(self, run_id: str | None = None) -> list[tuple[str, str, bytes]]:
        """(topic, run key, record) of this org's proposals and consents in the database
        (of one run, or of every run not yet ended)."""
        out: list[tuple[str, str, bytes]] = []
        with Session(self.ctx.db) as session:
            if run_id is not None:
                row = session.get(Run, run_id)
                rows = [] if row is None else [row]
            else:
                ended = [s.value for s in TERMINAL_STATES]
                rows = list(
                    session.exec(
                        select(Run).where(
                            col(Run.proposal).is_not(None), col(Run.state).not_in(ended)
                        )
                    ).all()
                )
            for row in rows:
                proposal = proposal_of(row)
                if proposal is None:
                    continue
                if proposal.proposer == self._me:
                    out.append((PROPOSAL_TOPIC, proposal.run_key, proposal.to_record()))
                for c in consents_of(session, proposal.run_key):
                    if c.org_id == self._me:
                        mine = Consent(
                            c.run_key,
                            c.org_id,
                            c.decision,  # type: ignore[arg-type]
                            c.reason,
                            round(c.decided_at.timestamp() * 1000),
                        )
                        out.append((CONSENT_TOPIC, proposal.run_key, mine.to_record()))
        return out

    async def _publish(self, records: list[tuple[str, str, bytes]]) -> None:
        if self.ctx.gossip is None:
            raise ServiceRefused("the node is not running in its federation")
        for topic, key, record in records:
            try:
                self.ctx.gossip.publish(topic, key, record)
            except RecordConflict as exc:  # a restarted node's store is empty: cannot happen
                logger.warning("%s: %s", self._me, exc)

    # -- records from the participants -------------------------------------------------

    async def start(self) -> None:
        """Spread this org's records again and follow everyone's (node start)."""
        await self._respread()
        self._settle = asyncio.create_task(self._follow_and_settle(), name="run-proposals")

    async def stop(self) -> None:
        if self._settle is not None:
            self._settle.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._settle

    async def _respread(self) -> None:
        """Spread this org's records of every run not yet ended (a no-op for a record
        gossip still holds; a record it forgot spreads afresh)."""
        with contextlib.suppress(ServiceRefused):
            await self._publish(await asyncio.to_thread(self._own_records))

    async def _follow_and_settle(self) -> None:
        assert self.ctx.gossip is not None
        queues = [self.ctx.gossip.subscribe(t) for t in (PROPOSAL_TOPIC, CONSENT_TOPIC)]
        for topic in (PROPOSAL_TOPIC, CONSENT_TOPIC):  # those received before subscribing
            for record in self.ctx.gossip.records(topic):
                await self._take(record)
        loop = asyncio.get_running_loop()
        respread_at = loop.time() + RESPREAD_PERIOD_S
        while True:
            if loop.time() >= respread_at:
                respread_at = loop.time() + RESPREAD_PERIOD_S
                try:
                    await self._respread()
                except Exception:  # spread again next period
                    logger.exception("%s: spreading this org's run records failed", self._me)
            for queue in queues:
                while not queue.empty():
                    await self._take(queue.get_nowait())
            try:
                await self._settle_runs()
            except Exception:  # one failed pass must not stop the runs starting
                logger.exception("%s: settling pending runs failed", self._me)
            await asyncio.sleep(SETTLE_PERIOD_S)

    async def _take(self, record: SignedRecord) -> None:
        try:
            if record.topic == PROPOSAL_TOPIC:
                proposal = Proposal.from_record(record.record, record.origin)
                if proposal.run_key != record.key:
                    raise ProposalError("the record's key is not the proposal's run key")
                await asyncio.to_thread(self._store_proposal, proposal, record.signature.hex())
            else:
                consent = Consent.from_record(record.record, record.origin)
                if consent.run_key != record.key:
                    raise ProposalError("the record's key is not the consent's run key")
                await asyncio.to_thread(self._store_consent, consent, record.signature.hex())
        except ProposalError as exc:
            logger.warning(
                "%s: ignored a %s from %s: %s", self._me, record.topic, record.origin, exc
            )

    def _store_proposal(self, proposal: Proposal, signature: str) -> None:
        if self._me not in proposal.participants or proposal.proposer == self._me:
            return
        with Session(self.ctx.db) as session:
            known = session.exec(
                select(Run).where((Run.run_key == proposal.run_key) | (Run.name == proposal.name))
            ).all()
            if any(r.run_key == proposal.run_key for r in known):
                return
            if known:
                logger.warning(
                    "%s: ignored %s's proposal of %r: a run of that name exists here (key %s)",
                    self._me,
                    proposal.proposer,
                    proposal.name,
                    known[0].run_key,
                )
                return
            import uuid

            row = Run(
                id=uuid.uuid4().hex,
                name=proposal.name,
                spec=dict(proposal.spec),
                proposed_by=f"peer:{proposal.proposer}",
                run_key=proposal.run_key,
                origin=proposal.proposer,
                proposal=proposal.to_dict() | {"signature": signature},
                consent_by=from_ms(proposal.consent_by_ms),
            )
            session.add(row)
            append_audit_event(
                session, stage="consent", kind="run.propose", run=row.id, privacy_class="internal"
            )
            session.commit()
            run_id = row.id
        logger.info(
            "%s: %s proposed run %r (%s)", self._me, proposal.proposer, proposal.name, run_id
        )
        self.ctx.events.publish(run_id, "state", {"state": RunState.PROPOSED.value, "version": 1})

    def _store_consent(self, consent: Consent, signature: str) -> None:
        if consent.org == self._me:
            return  # this org's own decision is recorded by the API
        with Session(self.ctx.db) as session:
            if store_consent(session, consent, signature):
                session.commit()
                row = session.exec(select(Run).where(Run.run_key == consent.run_key)).first()
                if row is not None:
                    self.ctx.events.publish(
                        row.id,
                        "consent",
                        {
                            "org": consent.org,
                            "decision": consent.decision,
                            "reason": consent.reason,
                        },
                    )

    # -- starting and cancelling ---------------------------------------------------------

    def _due(self) -> list[_Due]:
        """Every pending run with a proposal, and what its consents mean now."""
        out: list[_Due] = []
        now = now_ms()
        with Session(self.ctx.db) as session:
            rows = session.exec(
                select(Run).where(
                    col(Run.state).in_(PENDING_STATES), col(Run.proposal).is_not(None)
                )
            ).all()
            for row in rows:
                outcome = outcome_of(row, consents_of(session, row.run_key or ""), now)
                if outcome is not None:
                    out.append(_Due(row.id, row.name, row.state, dict(row.spec), outcome))
        return out

    async def _settle_runs(self) -> None:
        for due in await asyncio.to_thread(self._due):
            o = due.outcome
            if o.kind == "cancel":
                await asyncio.to_thread(self._finish_pending, due.run_id, o.reason)
            elif o.kind == "start" and self._me not in o.accepted:
                if self._me not in o.declined:
                    reason = "the run started without this org: it did not consent in time"
                    await asyncio.to_thread(self._finish_pending, due.run_id, reason)
            elif o.kind == "start" and o.start_at_ms is not None:
                await asyncio.to_thread(self._note_start, due.run_id, o.start_at_ms)
                if now_ms() >= o.start_at_ms and due.state == RunState.ACCEPTED.value:
                    await self._start_agreed(due)

    def _finish_pending(self, run_id: str, reason: str) -> None:
        with Session(self.ctx.db) as session:
            row = session.get(Run, run_id)
            if row is None or row.state not in PENDING_STATES:
                return
            new = apply_action(session, row, RunAction.CANCEL, {"state_reason": reason[:2000]})
            if new is None:
                return
            session.commit()
            version = row.version + 1
        logger.info("%s: run %s cancelled: %s", self._me, run_id, reason)
        self.ctx.events.publish(
            run_id, "state", {"state": new.value, "version": version, "reason": reason}
        )

    def _note_start(self, run_id: str, start_at_ms: int) -> None:
        at = from_ms(start_at_ms)
        with Session(self.ctx.db) as session:
            row = session.get(Run, run_id)
            if row is None or row.start_at == at:
                return
            from sqlalchemy import update

            session.execute(update(Run).where(col(Run.id) == run_id).values(start_at=at))
            session.commit()

    async def _start_agreed(self, due: _Due) -> None:
        """Start an accepted run at its agreed time: policies checked again, the row moved
        to ``running``, the engine launched (a launch refused puts the reason on the row)."""
        if due.run_id in self._starting:
            return
        self._starting.add(due.run_id)
        try:
            started = await asyncio.to_thread(self._mark_started, due.run_id)
            if started is None:
                return
            try:
                await self._launch(due.run_id, due.name, due.spec, due.outcome.accepted)
            except ServiceRefused as exc:
                reason = f"could not start at {self._me}: {exc}"
                logger.warning("%s: run %s %s", self._me, due.run_id, reason)
                await asyncio.to_thread(self._fail_start, due.run_id, reason)
                return
            self.ctx.events.publish(due.run_id, "state", {"state": "running", "version": started})
        finally:
            self._starting.discard(due.run_id)

    def _mark_started(self, run_id: str) -> int | None:
        from org_node.policy import RunSpec

        with Session(self.ctx.db) as session:
            row = session.get(Run, run_id)
            if row is None or row.state != RunState.ACCEPTED.value:
                return None
            broken = policy_violations(session, RunSpec.from_dict(row.spec))
            if broken:
                listed = "; ".join(f"{name}: {v.message}" for name, v in broken)
                new = apply_action(
                    session,
                    row,
                    RunAction.ABORT,
                    {"state_reason": f"not started: it violates this org's policies: {listed}"},
                )
                if new is not None:
                    session.commit()
                return None
            if apply_action(session, row, RunAction.START, {"state_reason": None}) is None:
                return None
            session.commit()
            return row.version + 1

    def _fail_start(self, run_id: str, reason: str) -> None:
        with Session(self.ctx.db) as session:
            row = session.get(Run, run_id)
            if row is not None and apply_action(
                session, row, RunAction.FAIL, {"state_reason": reason[:2000]}
            ):
                session.commit()
        self.ctx.events.publish(run_id, "state", {"state": "failed", "reason": reason})
