"""What the admin API needs from the running node, as one small protocol.

The API layer never reaches into the node's engine: it is handed a
:class:`NodeServices` (identity, the federation manifest and its pending proposals,
the live peer view, run-control hooks, checkpoints) and a :class:`RunEventBus` on which
the engine publishes round progress. Tests pass a fake; the composition root passes the
real node. :class:`StaticNode` is the simplest real implementation: a node that knows
its identity and manifest but runs no engine yet (what ``fedweave run`` serves before
the round engine is attached).

Errors a service raises are narrow: :class:`UnknownCheckpoint`, :class:`ServiceRefused`
(the node will not do it now, e.g. no federation yet) — the API maps them to 404 and 409.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol, runtime_checkable

from coordinator_free.manifest import Manifest, Member
from coordinator_free.membership import MemberState

from org_node.policy import PolicyError, RunSpec
from org_node.proposals import Proposal

__all__ = [
    "CheckpointInfo",
    "NodeHealth",
    "NodeIdentityInfo",
    "NodeServices",
    "PeerHeads",
    "ProposalRefused",
    "RunActivities",
    "RunActivity",
    "RunEvent",
    "RunEventBus",
    "RunReports",
    "ServiceError",
    "ServiceRefused",
    "ShardReport",
    "StaticNode",
    "UnknownCheckpoint",
    "make_proposal",
]


class ServiceError(Exception):
    """Base class of the errors a node service raises."""


class ServiceRefused(ServiceError):
    """The node will not do this in its current state (the message says why)."""


class ProposalRefused(ServiceRefused):
    """A run proposal this node will not make: the spec's participants or size are wrong
    (the API answers 422: the request, not the node's state, is at fault)."""


class UnknownCheckpoint(ServiceError):
    """No checkpoint with that id."""


@dataclass(frozen=True)
class NodeIdentityInfo:
    """Who this node is: org id, display name, certificate fingerprint, peer endpoint."""

    org_id: str
    display_name: str
    fingerprint: str
    endpoint: str
    version: str


@dataclass(frozen=True)
class NodeHealth:
    """Liveness and readiness with one line per component (``"ok"`` or the problem)."""

    ready: bool
    checks: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointInfo:
    """One erasure-coded checkpoint: run, round, shard layout and content hash."""

    checkpoint_id: str
    run_id: str
    round: int
    created_at: float
    data_shards: int
    parity_shards: int
    sha256: str


@dataclass(frozen=True)
class ShardReport:
    """Result of checking a checkpoint's shards at their holders."""

    checkpoint_id: str
    healthy: int
    missing: tuple[str, ...]
    corrupt: tuple[str, ...]
    restorable: bool


@dataclass(frozen=True)
class RunEvent:
    """One progress event of a run (``kind`` e.g. ``state``, ``round``, ``metric``)."""

    run_id: str
    seq: int
    kind: str
    data: Mapping[str, Any]


class RunEventBus:
    """In-process publish/subscribe of :class:`RunEvent` per run.

    ``publish`` may be called from any thread (the API's worker threads, the engine);
    subscribers are asyncio queues, fed on their own loop. Each subscriber queue is
    bounded; when a slow reader's queue is full the oldest event is dropped, never the
    publisher blocked. The last ``history`` events of each run are kept so that a new
    subscriber first sees what already happened.
    """

    def __init__(self, *, queue_size: int = 256, history: int = 64) -> None:
        if queue_size < 1 or history < 0:
            raise ValueError("queue_size must be >= 1 and history >= 0")
        self._queue_size = queue_size
        self._history = history
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._subs: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[RunEvent]]]] = {}
        self._past: dict[str, deque[RunEvent]] = {}

    def publish(self, run_id: str, kind: str, data: Mapping[str, Any]) -> RunEvent:
        """Deliver an event to every subscriber of ``run_id``; returns it."""
        with self._lock:
            event = RunEvent(run_id, next(self._seq), kind, dict(data))
            if self._history:
                self._past.setdefault(run_id, deque(maxlen=self._history)).append(event)
            subs = list(self._subs.get(run_id, ()))
        for loop, queue in subs:
            try:
                loop.call_soon_threadsafe(self._put, queue, event)
            except RuntimeError:  # the subscriber's loop is closed
                self._drop(run_id, queue)
        return event

    @staticmethod
    def _put(queue: asyncio.Queue[RunEvent], event: RunEvent) -> None:
        if queue.full():
            queue.get_nowait()
        queue.put_nowait(event)

    def subscribe(self, run_id: str) -> asyncio.Queue[RunEvent]:
        """A queue of ``run_id``'s events, primed with its recent history.

        Must be called from the event loop that will read the queue.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RunEvent] = asyncio.Queue(self._queue_size)
        with self._lock:
            for event in self._past.get(run_id, ()):
                self._put(queue, event)
            self._subs.setdefault(run_id, []).append((loop, queue))
        return queue

    def unsubscribe(self, run_id: str, queue: asyncio.Queue[RunEvent]) -> None:
        """Stop delivering to ``queue``."""
        self._drop(run_id, queue)

    def _drop(self, run_id: str, queue: asyncio.Queue[RunEvent]) -> None:
        with self._lock:
            subs = self._subs.get(run_id, [])
            self._subs[run_id] = [s for s in subs if s[1] is not queue]
            if not self._subs[run_id]:
                del self._subs[run_id]

    def subscribers(self, run_id: str) -> int:
        """How many queues receive ``run_id``'s events."""
        with self._lock:
            return len(self._subs.get(run_id, ()))


@dataclass(frozen=True)
class RunActivity:
    """What a running run does at this node now: in round ``round`` (1-based), ``doing``
    (``starting``, ``training``, ``aggregating``, ``quorum``, ``verifying``,
    ``checkpointing``, ``paused``), in the
    secure sum's ``stage`` (attempt ``attempt``) when aggregating, since ``since``
    (seconds since the epoch), waiting for the messages of ``orgs``.

    ``quorum``: the round found fewer than ``threshold`` participants ready
    ``failures`` times since ``since``; ``orgs`` are the members it missed last,
    ``attempt`` the attempt it runs or runs next, at ``next_attempt`` (seconds since
    the epoch; None while that attempt runs); the run fails at ``deadline``."""

    round: int
    doing: str
    since: float
    stage: str = ""
    attempt: int = 0
    orgs: tuple[str, ...] = ()
    failures: int = 0
    threshold: int = 0
    next_attempt: float | None = None
    deadline: float | None = None

    @property
    def detail(self) -> str:
        """One line an admin reads: what the round does, and whom it waits for."""
        if self.doing == "starting":
            return "the local worker is starting (the round-0 model)"
        if self.doing == "training":
            return f"round {self.round}: training on this org's data"
        if self.doing == "verifying":
            return f"round {self.round}: the survivors' hashes of the new model"
        if self.doing == "checkpointing":
            return f"round {self.round}: erasure-coded checkpoint to the peers"
        if self.doing == "paused":
            return f"paused before round {self.round}"
        if self.doing == "quorum":
            return self._quorum_line()
        line = f"round {self.round}"
        if self.attempt > 1:
            line += f" (attempt {self.attempt})"
        line += f": secure sum, {self.stage or 'starting'}"
        if self.orgs:
            line += ", waiting for " + ", ".join(self.orgs)
        return line

    def _quorum_line(self) -> str:
        """A round waiting for a quorum, as :attr:`detail` says it."""
        line = (
            f"round {self.round}: waiting for a quorum of {self.threshold} "
            f"({self.failures} attempts failed"
        )
        if self.orgs:
            line += "; missing " + ", ".join(self.orgs)
        line += ")"
        if self.next_attempt is None:
            line += f", attempt {self.attempt} under way"
        else:
            at = datetime.fromtimestamp(self.next_attempt, tz=UTC).strftime("%H:%M:%S")
            line += f", attempt {self.attempt} at {at} UTC"
        if self.deadline is not None:
            end = datetime.fromtimestamp(self.deadline, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")
            line += f"; the run fails if none by {end} UTC"
        return line


@runtime_checkable
class RunActivities(Protocol):
    """A node that can say what each of its running runs does now."""

    def run_activity(self, run_id: str) -> RunActivity | None:
        """What ``run_id`` does now at this node; None when no engine runs it here."""


@runtime_checkable
class NodeServices(Protocol):
    """The running node, as the admin API sees it."""

    @property
    def events(self) -> RunEventBus:
        """Where the node publishes run progress."""
        ...

    def identity(self) -> NodeIdentityInfo: ...

    def health(self) -> NodeHealth: ...

    def manifest(self) -> Manifest | None:
        """The current verified manifest; None before the org joined a federation."""
        ...

    def proposals(self) -> list[Manifest]:
        """Proposed next manifest versions not yet carried by a quorum."""
        ...

    def propose_add(self, member: Member, note: str) -> Manifest: ...

    def propose_remove(self, org_id: str, note: str) -> Manifest: ...

    def sign_proposal(self, digest: str) -> Manifest:
        """Add this org's signature to the pending proposal ``digest``."""
        ...

    def peers(self) -> list[MemberState]:
        """The live view of the other members (status, last seen, round-trip time)."""
        ...

    def propose_run(
        self, name: str, spec: Mapping[str, Any], consent_timeout_s: int, start_delay_s: int
    ) -> Proposal:
        """The signed-to-be proposal of a new run, checked (called before the run's row
        is committed; :class:`ProposalRefused` for a spec it will not propose)."""
        ...

    def announce_run(self, run_id: str) -> None:
        """Spread this org's records of the run (its proposal if this org made it, its
        consent once given) to the participants; called after each commit. Never raises:
        a node that cannot spread them now does so when it can."""
        ...

    def on_run_accepted(self, run_id: str, spec: Mapping[str, Any]) -> None:
        """Called before the new state is committed; raising ServiceError undoes it."""
        ...

    def on_run_declined(self, run_id: str, spec: Mapping[str, Any]) -> None: ...

    def on_run_started(self, run_id: str, spec: Mapping[str, Any]) -> None: ...

    def on_run_paused(self, run_id: str, spec: Mapping[str, Any]) -> None: ...

    def on_run_resumed(self, run_id: str, spec: Mapping[str, Any]) -> None: ...

    def on_run_aborted(self, run_id: str, spec: Mapping[str, Any]) -> None: ...

    def checkpoints(self) -> list[CheckpointInfo]: ...

    def verify_checkpoint(self, checkpoint_id: str) -> ShardReport: ...

    def restore_checkpoint(self, checkpoint_id: str) -> CheckpointInfo: ...


@runtime_checkable
class PeerHeads(Protocol):
    """A node that can ask its live members for the signed heads of its own egress log
    they hold (``GET /v1/audit/peer-heads``)."""

    def peer_heads(self) -> list[Any]:
        """The heads (:class:`org_node.audit.SignedHead`) peers hold now, oldest first."""
        ...


@runtime_checkable
class RunReports(Protocol):
    """A node that writes the signed privacy report of a run (``docs/SECURITY.md``,
    "Privacy audit"); the API's ``/v1/audit/runs/{id}/report`` routes need it."""

    def run_report(self, run_id: str) -> Mapping[str, Any]:
        """The report of ``run_id``, built now from the node's database and egress log.

        Raises ``org_node.audit.facts.UnknownRunId`` for an unknown run and
        ``org_node.audit.ReportError`` when the run has no signed head yet.
        """
        ...


class StaticNode:
    """A node with an identity and (optionally) a manifest, and no round engine.

    Run hooks are recorded in :attr:`calls` (the API publishes the state events); there
    are no peers, proposals or checkpoints yet. Federation changes are refused with :class:`ServiceRefused`.
    """

    def __init__(
        self,
        identity: NodeIdentityInfo,
        manifest: Manifest | None = None,
        *,
        events: RunEventBus | None = None,
        reports: Callable[[str], Mapping[str, Any]] | None = None,
    ) -> None:
        self._identity = identity
        self._manifest = manifest
        self._events = events or RunEventBus()
        self._reports = reports
        self.calls: list[tuple[str, str]] = []
        """Run hooks called so far, as ``(hook, run_id)``; the engine attaches later."""

    @property
    def events(self) -> RunEventBus:
        return self._events

    def identity(self) -> NodeIdentityInfo:
        return self._identity

    def health(self) -> NodeHealth:
        return NodeHealth(ready=True, checks={"engine": "ok"})

    def manifest(self) -> Manifest | None:
        return self._manifest

    def proposals(self) -> list[Manifest]:
        return []

    def propose_add(self, member: Member, note: str) -> Manifest:
        raise ServiceRefused("this node runs no federation engine")

    def propose_remove(self, org_id: str, note: str) -> Manifest:
        raise ServiceRefused("this node runs no federation engine")

    def sign_proposal(self, digest: str) -> Manifest:
        raise ServiceRefused("this node runs no federation engine")

    def peers(self) -> list[MemberState]:
        return []

    def _record(self, hook: str, run_id: str) -> None:
        self.calls.append((hook, run_id))

    def propose_run(
        self, name: str, spec: Mapping[str, Any], consent_timeout_s: int, start_delay_s: int
    ) -> Proposal:
        """A proposal by this org, its participants checked against the manifest (if any);
        nothing spreads it: this node runs no gossip."""
        return make_proposal(
            self._identity.org_id, self._manifest, name, spec, consent_timeout_s, start_delay_s
        )

    def announce_run(self, run_id: str) -> None:
        self._record("announced", run_id)

    def on_run_accepted(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self._record("accepted", run_id)

    def on_run_declined(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self._record("declined", run_id)

    def on_run_started(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self._record("started", run_id)

    def on_run_paused(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self._record("paused", run_id)

    def on_run_resumed(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self._record("resumed", run_id)

    def on_run_aborted(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self._record("aborted", run_id)

    def checkpoints(self) -> list[CheckpointInfo]:
        return []

    def verify_checkpoint(self, checkpoint_id: str) -> ShardReport:
        raise UnknownCheckpoint(f"no checkpoint {checkpoint_id!r}")

    def restore_checkpoint(self, checkpoint_id: str) -> CheckpointInfo:
        raise UnknownCheckpoint(f"no checkpoint {checkpoint_id!r}")

    def run_report(self, run_id: str) -> Mapping[str, Any]:
        """The report from ``reports`` (e.g. :func:`org_node.audit.facts.node_report`
        bound to the node's database and identity); refused without one."""
        if self._reports is None:
            raise ServiceRefused("this node has no egress log to report from")
        return self._reports(run_id)


def make_proposal(
    me: str,
    manifest: Manifest | None,
    name: str,
    spec: Mapping[str, Any],
    consent_timeout_s: int,
    start_delay_s: int,
    *,
    now_ms: int | None = None,
) -> Proposal:
    """``me``'s proposal of the run ``name``, refused (:class:`ProposalRefused`) when this
    org is not a participant or a participant is not a member of ``manifest``."""
    import time

    try:
        parsed = RunSpec.from_dict(spec)
    except PolicyError as exc:
        raise ProposalRefused(f"invalid run spec: {exc}") from None
    if me not in parsed.participants:
        raise ProposalRefused(f"{me} proposes only runs it takes part in: add it to participants")
    if manifest is not None:
        strangers = sorted(set(parsed.participants) - set(manifest.member_ids))
        if strangers:
            raise ProposalRefused(
                f"participants {', '.join(strangers)} are not members of the federation"
            )
    now = int(time.time() * 1000) if now_ms is None else now_ms
    return Proposal.make(name, spec, me, now, consent_timeout_s, start_delay_s)
