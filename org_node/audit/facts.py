"""The facts of a run's privacy report, assembled from what the node itself recorded.

``docs/SECURITY.md``, "Privacy audit": a report (:func:`org_node.audit.report.build_report`)
joins the egress log with :class:`~org_node.audit.report.RunFacts`. This module builds
those facts in one place, for the node (``POST /v1/audit/runs/{id}/report``,
``fedweave audit report``) and for the test harness alike:

* the run spec, this org's consent, the other participants' signed consents as this
  org received them, and the policies in force — the node's database (``run``,
  ``run_consent`` and ``policy`` tables);
* secure aggregation — the spec (backend, n, t) and the engine config (ring bits, L2 clip);
* differential privacy — the distributed Skellam mechanism the engine charges each round
  (rebuilt from the engine config and the model size, as the engine builds it), once per
  round the node recorded an ``epsilon_spent`` metric;
* shards held — the checkpoint shards in the node's shard store whose owner is another
  org (the federation's global-model history is no org's and is left out);
* rounds — the round log the node appends after every completed round
  (:func:`record_round`: survivors, dropped and recovered orgs, model hash and the
  peers that agreed on it, loss and accuracy); what was observed from outside
  (:func:`observed_rounds`) only fills rounds or metrics the log lacks
  (:func:`merge_rounds`).

:func:`org_run_facts` assembles the same facts from an org's data directory by the
federation-wide run key (what a caller outside the node, such as the test harness,
knows of the run): this org's consent comes from its database, the rounds from its
round log.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from sqlalchemy import Engine
from sqlmodel import Session, col, select

from org_node.audit.dp_section import skellam_dp_facts
from org_node.audit.log import EgressLog, format_time
from org_node.audit.report import (
    BindingFacts,
    ConsentRecord,
    DpFacts,
    ReportError,
    RoundFacts,
    RunFacts,
    SecAggFacts,
    ShardHeld,
    build_report,
    round_facts_from_engine,
)
from org_node.policy import Policy, RunSpec

__all__ = [
    "ROUNDS_FILE",
    "UnknownRunId",
    "assemble_run_facts",
    "consents_of",
    "dp_facts",
    "merge_rounds",
    "node_report",
    "node_run_facts",
    "observed_rounds",
    "org_run_facts",
    "policies_in_force",
    "read_rounds",
    "record_round",
    "shards_held_in",
]

ROUNDS_FILE = "audit-rounds.jsonl"
"""Per run directory: one JSON line of :class:`RoundFacts` per completed round."""


class UnknownRunId(ReportError, LookupError):
    """The node's database holds no run with this id (the API answers 404)."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"no run {run_id!r} at this node")
        self.run_id = run_id


# --------------------------------------------------------------------------- rounds


def record_round(run_dir: Path, report: Any, participants: Sequence[str]) -> RoundFacts:
    """Append the facts of a completed round (an engine ``RoundReport``) to the run's
    round log, replacing an earlier line of the same round (a round redone after a
    restart); returns them."""
    facts = round_facts_from_engine(report, participants)
    path = Path(run_dir) / ROUNDS_FILE
    kept = [r for r in read_rounds(run_dir) if r.round != facts.round]
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(asdict(r), sort_keys=True) for r in (*kept, facts)]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    tmp.replace(path)
    return facts


def _round_from_json(doc: Mapping[str, Any]) -> RoundFacts:
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in doc.items()}
    try:
        return RoundFacts(**values)
    except TypeError as exc:
        raise ReportError(f"a line of the round log is not a round: {exc}") from None


def read_rounds(run_dir: Path) -> tuple[RoundFacts, ...]:
    """The rounds in the run's round log, by round (none when there is no log)."""
    path = Path(run_dir) / ROUNDS_FILE
    if not path.exists():
        return ()
    rounds: dict[int, RoundFacts] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            raise ReportError(f"{path.name} line {number} is not JSON") from None
        r = _round_from_json(doc)
        rounds[r.round] = r
    return tuple(rounds[k] for k in sorted(rounds))


def observed_rounds(
    participants: Sequence[str],
    survivors: Mapping[int, Sequence[str]],
    metrics: Mapping[int, Mapping[str, float]] | None = None,
) -> tuple[RoundFacts, ...]:
    """Rounds from survivors observed from outside (1-based round -> orgs); a dropped
    org of a completed round was recovered (its mask keys rebuilt from Shamir shares)."""
    metrics = metrics or {}
    out = []
    for r in sorted(survivors):
        alive = tuple(sorted(survivors[r]))
        dropped = tuple(sorted(o for o in participants if o not in alive))
        per = metrics.get(r, {})
        out.append(
            RoundFacts(
                round=r,
                participants=tuple(participants),
                survivors=alive,
                dropped=dropped,
                recovered=dropped,
                loss=per.get("eval_loss", per.get("loss")),
                accuracy=per.get("eval_accuracy", per.get("accuracy")),
            )
        )
    return tuple(out)


def merge_rounds(
    recorded: Sequence[RoundFacts], observed: Sequence[RoundFacts]
) -> tuple[RoundFacts, ...]:
    """The node's recorded rounds, with observed rounds only where the log has none;
    a recorded round without loss or accuracy takes the observed value."""
    seen = {r.round: r for r in observed}
    out = {r.round: r for r in observed}
    for r in recorded:
        o = seen.get(r.round)
        out[r.round] = replace(
            r,
            loss=r.loss if r.loss is not None or o is None else o.loss,
            accuracy=r.accuracy if r.accuracy is not None or o is None else o.accuracy,
        )
    return tuple(out[k] for k in sorted(out))


# --------------------------------------------------------------------------- database


def policies_in_force(session: Session) -> dict[str, Policy]:
    """Every enabled policy of the org, by name."""
    from org_node.db.models import PolicyRecord

    rows = session.exec(
        select(PolicyRecord).where(col(PolicyRecord.enabled)).order_by(col(PolicyRecord.id))
    ).all()
    from org_node.run_store import as_policy

    return {row.name: as_policy(row) for row in rows}


def consents_of(row: Any, org_id: str, role: str = "") -> tuple[ConsentRecord, ...]:
    """This org's recorded decision on the run (none while it is only proposed);
    ``role``: the role of the token that decided, when known."""
    if row.decided_at is None or row.decided_by is None:
        return ()
    decision = "declined" if row.state == "declined" else "accepted"
    return (
        ConsentRecord(
            org=org_id,
            decision=decision,
            decided_at=format_time(row.decided_at.timestamp()),
            decided_by=row.decided_by,
            reason=row.decision_reason or "",
            decided_by_role=role,
        ),
    )


def peer_consents(
    session: Session, run_key_: str, org_id: str, federation: str
) -> tuple[ConsentRecord, ...]:
    """The other participants' decisions on the run as this org received them over
    gossip, each with its signature (verified on receipt against the manifest)."""
    from org_node.db.models import RunConsent

    rows = session.exec(
        select(RunConsent).where(RunConsent.run_key == run_key_, RunConsent.org_id != org_id)
    ).all()
    out = []
    for r in sorted(rows, key=lambda r: r.org_id):
        if not r.signature:
            continue
        at_ms = round(r.decided_at.timestamp() * 1000)
        out.append(
            ConsentRecord(
                org=r.org_id,
                decision="accepted" if r.decision == "accept" else "declined",
                decided_at=format_time(at_ms / 1000),
                decided_by=f"{r.org_id} (its signed consent)",
                reason=r.reason,
                federation=federation,
                at_ms=at_ms,
                signature=r.signature,
            )
        )
    return tuple(out)


def federation_of(data_dir: Path) -> str:
    """The federation id in the node's config (``[node] federation``; "" if none)."""
    import tomllib

    try:
        with (Path(data_dir) / "fedweave.toml").open("rb") as f:
            return str(tomllib.load(f).get("node", {}).get("federation", ""))
    except (OSError, tomllib.TOMLDecodeError):
        return ""


def _token_role(session: Session, name: str | None) -> str:
    """The role of the API token named ``name`` ("" when no such token is held)."""
    from org_node.db.models import ApiToken

    if not name:
        return ""
    row = session.exec(select(ApiToken).where(ApiToken.name == name)).first()
    return "" if row is None else str(row.role)


def _consents_by_key(
    session: Session, run_key_: str, org_id: str, federation: str = ""
) -> tuple[tuple[ConsentRecord, ...], BindingFacts | None]:
    """This org's decision on the run whose federation-wide key is ``run_key_``, and what
    it bound to it (each org stores the run under its own local id, so the key is
    recomputed per row)."""
    from org_node.db.models import Run
    from org_node.engine import run_key

    for row in session.exec(select(Run).order_by(col(Run.created_at))).all():
        if run_key(row.name, row.spec) == run_key_:
            consents = consents_of(row, org_id, _token_role(session, row.decided_by))
            peers = peer_consents(session, run_key_, org_id, federation)
            return consents + peers, binding_facts(row)
    return (), None


def dp_facts(
    spec: RunSpec, fednova: bool, model_size: int, rounds: Sequence[RoundFacts]
) -> DpFacts | None:
    """The DP of a run with an ``epsilon``: the run spec's agreed mechanism
    (``org_node.engine.RunEngine``: a ``model_size + 1 (+1 with FedNova)`` vector, each
    org's noise share sized as the mechanism says), each of ``rounds`` (those the node
    charged) charged for the noise of its survivors; None for a run without DP or
    without an agreed mechanism."""
    if spec.epsilon is None or spec.dp is None:
        return None
    taking_part = len(rounds[0].participants) if rounds else len(spec.participants)
    agreed = {
        "mechanism": spec.dp.to_dict(),
        "participants": taking_part,
        "threshold": spec.threshold,
        "dimension": model_size + 1 + int(fednova),
    }
    charged = [(r.round, len(r.survivors)) for r in rounds]
    return skellam_dp_facts(agreed, charged, spec.epsilon)


def unfinished_charges(state: Any, shown: int) -> list[str]:
    """An anomaly when the engine's accountant charged more rounds than the report
    shows: rounds that failed after this org's protected update went out, charged at
    the least noise a completed round carries (``threshold`` survivors)."""
    charged = len((state.accountant or {}).get("rounds", ()))
    if charged <= shown:
        return []
    return [
        f"{charged - shown} unfinished round(s) charged at the least noise (threshold "
        "survivors) are in this org's accountant but not among the rounds shown"
    ]


def shards_held_in(shard_root: Path) -> tuple[ShardHeld, ...]:
    """Every checkpoint shard the node's store (``shard_root``) holds for another org,
    by owner, set version and index (none when the store does not exist)."""
    from coordinator_free.checkpoints import GLOBAL_OWNER, ShardStore

    root = Path(shard_root)
    if not root.is_dir():
        return ()
    store = ShardStore(root)
    out: list[ShardHeld] = []
    for owner_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        try:
            owner = bytes.fromhex(owner_dir.name).decode("utf-8")
        except ValueError:
            continue
        if owner == GLOBAL_OWNER:
            continue
        for held in store.list(owner):
            m = held.manifest
            for index in held.indices:
                if 0 <= index < len(m.shard_hashes):
                    out.append(
                        ShardHeld(
                            owner, m.version, index, m.shard_size, m.shard_hashes[index].hex()
                        )
                    )
    return tuple(out)


def assemble_run_facts(
    run_key: str,
    spec: RunSpec,
    rounds: Sequence[RoundFacts],
    *,
    policies: Mapping[str, Policy] | None = None,
    consents: Sequence[ConsentRecord] = (),
    ring_bits: int | None = 64,
    l2_clip: float | None = None,
    dp: DpFacts | None = None,
    shards_held: Sequence[ShardHeld] = (),
    anomalies: Sequence[str] = (),
    binding: BindingFacts | None = None,
    outcome: tuple[str, str] | None = None,
) -> RunFacts:
    """The :class:`RunFacts` of ``run_key`` (the federation-wide run key the egress log
    names); secure aggregation from the spec (CKKS has no ring)."""
    masked = spec.backend == "masked"
    return RunFacts(
        run=run_key,
        spec=spec,
        policies=dict(policies or {}),
        consents=tuple(consents),
        secure_aggregation=SecAggFacts(
            spec.backend,
            len(spec.participants),
            spec.threshold,
            ring_bits if masked else None,
            l2_clip if masked else None,
        ),
        rounds=tuple(rounds),
        dp=dp,
        shards_held=tuple(shards_held),
        anomalies=tuple(anomalies),
        binding=binding,
        outcome=outcome,
    )


def binding_facts(row: Any) -> BindingFacts:
    """What the run's row says this org bound to it at consent."""
    return BindingFacts(
        trainer=str(row.spec.get("trainer", row.spec.get("task", ""))),
        trainer_sha256=row.trainer_hash,
        dataset_id=row.dataset_id,
        dataset_name=row.dataset_name,
        dataset_sha256=row.dataset_hash,
        dataset_rows=row.dataset_rows,
    )


def node_run_facts(
    db: Engine, data_dir: Path, run_id: str, *, org_id: str, config: Any
) -> RunFacts:
    """The facts of run ``run_id`` from the node's database and data directory
    (``config``: the node's :class:`org_node.engine.EngineConfig`).

    Raises :class:`UnknownRunId` for a run the database does not hold.
    """
    from org_node.db.models import Run, RunMetric
    from org_node.engine import STATE_FILE, EngineError, EngineState, run_key
    from org_node.privacy import PrivacyError
    from secure_agg.errors import SecAggError

    with Session(db) as session:
        row = session.get(Run, run_id) if 0 < len(run_id) <= 32 else None
        if row is None:
            raise UnknownRunId(run_id)
        spec = RunSpec.from_dict(row.spec)
        key = run_key(row.name, row.spec)
        policies = policies_in_force(session)
        consents = consents_of(row, org_id, _token_role(session, row.decided_by))
        consents += peer_consents(session, key, org_id, federation_of(data_dir))
        binding = binding_facts(row)
        outcome = (row.state, row.state_reason or "")
        charged = set(
            session.exec(
                select(RunMetric.round).where(
                    RunMetric.run_id == run_id, RunMetric.name == "epsilon_spent"
                )
            ).all()
        )
    run_dir = Path(data_dir) / "runs" / key
    rounds = read_rounds(run_dir)
    anomalies: list[str] = []
    dp = None
    if spec.epsilon is not None:
        try:
            state = EngineState.from_bytes((run_dir / STATE_FILE).read_bytes())
            size = sum(int(getattr(v, "size", 0)) for v in state.model.values())
            dp = dp_facts(spec, config.fednova, size, [r for r in rounds if r.round in charged])
            anomalies += unfinished_charges(state, len(dp.mechanisms) if dp else 0)
        except (OSError, EngineError, SecAggError, PrivacyError) as exc:
            anomalies.append(f"the DP accounting could not be rebuilt: {exc}")
    l2_clip = spec.dp.l2_clip if spec.dp is not None else None
    return assemble_run_facts(
        key,
        spec,
        rounds,
        policies=policies,
        consents=consents,
        ring_bits=config.ring_bits,
        l2_clip=l2_clip,
        dp=dp,
        shards_held=shards_held_in(Path(data_dir) / "shards"),
        anomalies=anomalies,
        binding=binding,
        outcome=outcome,
    )


def org_run_facts(
    data_dir: Path,
    run_key: str,
    spec: RunSpec,
    *,
    org_id: str,
    observed: Sequence[RoundFacts] = (),
    ring_bits: int | None = 64,
    db: Engine | None = None,
) -> RunFacts:
    """The facts of the run keyed ``run_key`` from the org's data directory: its
    consent and policies from its database (``db``, or the default SQLite file of
    ``data_dir`` when it exists), its rounds from the round log
    (:func:`merge_rounds` with ``observed``), the shards it holds."""
    from org_node.db.engine import DB_FILENAME, default_database_url, make_engine

    root = Path(data_dir)
    consents: tuple[ConsentRecord, ...] = ()
    binding: BindingFacts | None = None
    policies: dict[str, Policy] = {}
    engine = db
    if engine is None and (root / DB_FILENAME).exists():
        engine = make_engine(default_database_url(root))
    if engine is not None:
        try:
            with Session(engine) as session:
                consents, binding = _consents_by_key(session, run_key, org_id, federation_of(root))
                policies = policies_in_force(session)
        finally:
            if db is None:
                engine.dispose()
    rounds = merge_rounds(read_rounds(root / "runs" / run_key), observed)
    return assemble_run_facts(
        run_key,
        spec,
        rounds,
        policies=policies,
        consents=consents,
        ring_bits=ring_bits,
        shards_held=shards_held_in(root / "shards"),
        binding=binding,
    )


def node_report(
    db: Engine,
    data_dir: Path,
    run_id: str,
    *,
    identity: Any,
    config: Any,
    log: EgressLog | None = None,
    anomalies: Sequence[str] = (),
) -> dict[str, Any]:
    """The signed privacy report of run ``run_id``: :func:`node_run_facts` joined with
    the node's egress log (``log``, or the one in ``data_dir`` opened for the call), and
    ``anomalies`` the node adds (what its peers' heads prove its log lost).

    Raises :class:`UnknownRunId` (no such run), :class:`~org_node.audit.report.UnknownRun`
    (the run sent nothing yet) or :class:`~org_node.audit.report.ReportError` (no signed
    head covers the run's last message yet).
    """
    facts = node_run_facts(db, data_dir, run_id, org_id=identity.org_id, config=config)
    if anomalies:
        facts = replace(facts, anomalies=(*facts.anomalies, *anomalies))
    if log is not None:
        return build_report(log, facts)
    opened = EgressLog(identity, Path(data_dir) / "audit" / "egress.jsonl")
    try:
        return build_report(opened, facts)
    finally:
        opened.close()
