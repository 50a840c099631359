"""The privacy audit report of one run: a versioned, signed JSON document.

``docs/SECURITY.md``, "Privacy audit"; the schema is ``schema/report-v1.json`` (JSON
Schema 2020-12, checked by :func:`validate_report`). A report holds, per section:

* ``run`` — the run spec and every policy in force with its violations (none, or each);
* ``participants`` — the orgs and their consent records: this org's own (who decided,
  with which role), and each other participant's decision as this org received it,
  with its ``signed`` block (federation, time in milliseconds, the participant's
  Ed25519 signature over its gossiped consent record, which verification checks
  against the participant's key); an org whose decision this org does not hold has
  ``consent: null`` and a ``consent_note`` saying what it holds instead (its update
  aggregated in a round: a node sends one only for a run its org accepted);
* ``secure_aggregation`` — backend and parameters (n, t, ring bits, clipping);
* ``differential_privacy`` — mechanism, parameters and ε(δ) per round and in total,
  composed by :class:`org_node.privacy.RdpAccountant` (Mironov 2017; Balle et al. 2020);
* ``rounds`` — survivors, dropouts and recoveries (sorted), the model hash (hex, in
  full) and whether every peer agreed (null when no hash was recorded), loss and
  accuracy;
* ``traffic`` — messages and bytes sent per peer, per privacy class and per run round
  (a retried attempt apart), computed from the log records below (verification
  recomputes it);
* ``shards_held`` — checkpoint shards this org holds for other orgs;
* ``anomalies`` — policy violations, model-hash disagreements, refused messages, and
  whatever the node reported;
* ``log`` — the log header and the chain segment of the run (every entry from the
  run's first message up to the run's last signed head, heads included), so that the
  report is verifiable on its own.

Signature: ``sections`` maps each section name to the SHA-256 of its canonical JSON; the
org signs ``"fedweave/audit-report/v1\\0" || canonical({schema, org, generated_at,
sections})`` with its identity key, so a change is pinned to its section.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from org_node.audit.classes import FORBIDDEN_CLASSES, is_head_message
from org_node.audit.dp_section import DpFacts, dp_section
from org_node.audit.log import (
    EgressEntry,
    EgressLog,
    Refusal,
    SignedHead,
    canonical,
    format_time,
)
from org_node.audit.records import ReportError
from org_node.audit.schema_check import check_against_schema
from org_node.policy import Policy, RunSpec, check_run_against_policy
from org_node.run_config import ATTEMPTS

__all__ = [
    "PROTOCOL_ATTEMPTS",
    "REPORT_DOMAIN",
    "REPORT_SCHEMA_ID",
    "SCHEMA_PATH",
    "SECTIONS",
    "BindingFacts",
    "ConsentRecord",
    "DpFacts",
    "ReportError",
    "RoundFacts",
    "RunFacts",
    "SchemaError",
    "SecAggFacts",
    "ShardHeld",
    "UnknownRun",
    "build_report",
    "heads_in",
    "report_signing_bytes",
    "report_to_bytes",
    "round_facts_from_engine",
    "run_round_of",
    "run_segment",
    "save_report",
    "section_digests",
    "traffic_of",
    "validate_report",
]

REPORT_SCHEMA_ID = "fedweave/audit-report/v1"
REPORT_DOMAIN = b"fedweave/audit-report/v1\x00"
SCHEMA_PATH = Path(__file__).resolve().parent / "schema" / "report-v1.json"
SECTIONS = (
    "run",
    "participants",
    "secure_aggregation",
    "differential_privacy",
    "rounds",
    "traffic",
    "shards_held",
    "anomalies",
    "log",
)


PROTOCOL_ATTEMPTS = ATTEMPTS
"""Protocol rounds the engine reserves per run round (the one constant
:data:`org_node.run_config.ATTEMPTS`):
attempt ``a`` (0-based) of run round ``r`` (1-based) goes on the wire as protocol round
``(r - 1) * PROTOCOL_ATTEMPTS + a``; the egress log records the protocol round."""


class UnknownRun(ReportError, LookupError):
    """The log holds no message of this run (the API answers 404)."""

    def __init__(self, run: str) -> None:
        super().__init__(f"no egress of run {run!r} in this org's log")
        self.run = run


class SchemaError(ReportError):
    """A document that does not follow the report schema; ``path`` names the field."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.path = path


def _finite(value: float | None, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ReportError(f"{what} must be a finite number")
    return float(value)


@dataclass(frozen=True)
class ConsentRecord:
    """One org's decision on the run: ``accepted`` or ``declined``, when and by whom
    (``decided_by``: the API token's name; ``decided_by_role``: its role, "" unknown).

    A peer's decision carries its signature (``signature``, hex) over the consent
    record it gossiped in ``federation`` at ``at_ms``
    (:func:`org_node.proposals.consent_signing_bytes`)."""

    org: str
    decision: str
    decided_at: str
    decided_by: str
    reason: str = ""
    decided_by_role: str = ""
    federation: str = ""
    at_ms: int | None = None
    signature: str = ""

    def __post_init__(self) -> None:
        if self.decision not in ("accepted", "declined"):
            raise ReportError(
                f"consent decision must be accepted or declined, not {self.decision!r}"
            )


@dataclass(frozen=True)
class SecAggFacts:
    """Backend (``masked`` or ``ckks``), participants n, threshold t, ring bits, L2 clip."""

    backend: str
    n: int
    t: int
    ring_bits: int | None
    l2_clip: float | None

    def __post_init__(self) -> None:
        if self.backend not in ("masked", "ckks"):
            raise ReportError(f"backend must be masked or ckks, not {self.backend!r}")
        if not 1 <= self.t <= self.n:
            raise ReportError(f"threshold t={self.t} must be in [1, n={self.n}]")
        if self.ring_bits is not None and not 8 <= self.ring_bits <= 64:
            raise ReportError("ring_bits must be in [8, 64]")
        _finite(self.l2_clip, "l2_clip")


@dataclass(frozen=True)
class RoundFacts:
    """What the node saw of one round (``model_hash`` hex; peers that agreed or not;
    the attempt that completed it and how long it waited for a quorum before)."""

    round: int
    participants: tuple[str, ...]
    survivors: tuple[str, ...]
    dropped: tuple[str, ...] = ()
    recovered: tuple[str, ...] = ()
    model_hash: str = ""
    agreeing_peers: tuple[str, ...] = ()
    disagreeing_peers: tuple[str, ...] = ()
    loss: float | None = None
    accuracy: float | None = None
    attempts: int = 1
    quorum_wait_s: float = 0.0

    def __post_init__(self) -> None:
        _finite(self.loss, "loss")
        _finite(self.accuracy, "accuracy")
        _finite(self.quorum_wait_s, "quorum_wait_s")
        if self.attempts < 1 or self.quorum_wait_s < 0:
            raise ReportError(f"round {self.round}: attempts >= 1 and a wait >= 0 expected")
        if not set(self.recovered) <= set(self.dropped):
            raise ReportError(f"round {self.round}: recovered orgs must be among the dropped")


@dataclass(frozen=True)
class ShardHeld:
    """A checkpoint shard this org holds for ``owner``."""

    owner: str
    round: int
    shard_index: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class BindingFacts:
    """What this org bound to the run when it consented: the trainer's code hash and
    the dataset (its id, name, content hash and rows here; never its path or content)."""

    trainer: str
    trainer_sha256: str | None = None
    dataset_id: int | None = None
    dataset_name: str | None = None
    dataset_sha256: str | None = None
    dataset_rows: int | None = None

    def to_dict(self) -> dict[str, Any]:
        dataset = None
        if self.dataset_name is not None:
            dataset = {
                "id": self.dataset_id,
                "name": self.dataset_name,
                "content_hash": self.dataset_sha256,
                "rows": self.dataset_rows,
            }
        return {
            "trainer": {"name": self.trainer, "sha256": self.trainer_sha256},
            "dataset": dataset,
        }


@dataclass(frozen=True)
class RunFacts:
    """Everything the report says beyond the log itself."""

    run: str
    spec: RunSpec
    policies: Mapping[str, Policy]
    consents: tuple[ConsentRecord, ...]
    secure_aggregation: SecAggFacts
    rounds: tuple[RoundFacts, ...]
    dp: DpFacts | None = None
    shards_held: tuple[ShardHeld, ...] = ()
    anomalies: tuple[str, ...] = field(default=())
    binding: BindingFacts | None = None
    outcome: tuple[str, str] | None = None
    """The run's state at this org when the report was made, and why it is in it (a
    failed run's reason; "" when there is none to give)."""


def _outcome(outcome: tuple[str, str] | None) -> dict[str, Any]:
    """The run section's ``state`` and ``state_reason`` (nothing when unknown)."""
    if outcome is None:
        return {}
    state, reason = outcome
    return {"state": state, "state_reason": reason}


# --------------------------------------------------------------------------- traffic


def run_segment(records: Sequence[tuple[str, Any]], run: str) -> list[tuple[str, Any]]:
    """The chain segment of ``run``: from its first entry to its last signed head.

    ``records`` are ``("entry", EgressEntry)`` / ``("head", SignedHead)`` in log order.
    Raises :class:`UnknownRun` when no entry belongs to ``run`` and
    :class:`ReportError` when no head of ``run`` covers its last entry.
    """
    first = next((i for i, (t, v) in enumerate(records) if t == "entry" and v.run == run), None)
    if first is None:
        raise UnknownRun(run)
    # head messages carry no data of the run; those after its last head (a peer's head
    # answered, this org's last head sent) are covered by the log's next head
    last_entry = max(
        (
            i
            for i, (t, v) in enumerate(records)
            if t == "entry" and v.run == run and not is_head_message(v.kind)
        ),
        default=first,
    )
    end = max((i for i, (t, v) in enumerate(records) if t == "head" and v.run == run), default=-1)
    if end < last_entry:
        raise ReportError(f"no signed head of run {run!r} covers its last message yet")
    return list(records[first : end + 1])


def run_round_of(protocol_round: int) -> tuple[int, int]:
    """``(run round, attempt)``, both 1-based, of a protocol round on the wire."""
    if protocol_round < 0:
        raise ReportError(f"protocol round {protocol_round} is negative")
    return protocol_round // PROTOCOL_ATTEMPTS + 1, protocol_round % PROTOCOL_ATTEMPTS + 1


def traffic_of(entries: Iterable[EgressEntry], run: str) -> dict[str, Any]:
    """Messages and bytes per peer, per class and per round.

    ``per_round`` names the run round (1, 2, ...; :func:`run_round_of` maps the protocol
    round the log records back to it), with ``attempt`` only for a retried attempt
    (> 1); ``round`` is ``None`` for traffic not of ``run``.
    """
    rows = list(entries)
    peers: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    classes: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    rounds: dict[tuple[int, int, str], list[int]] = defaultdict(lambda: [0, 0])
    forbidden = 0
    for e in rows:
        r, attempt = run_round_of(e.round) if e.run == run and e.round >= 0 else (-1, 1)
        for acc in (
            peers[e.peer],
            classes[e.privacy_class],
            rounds[(r, attempt, e.privacy_class)],
        ):
            acc[0] += 1
            acc[1] += e.bytes
        forbidden += e.privacy_class in {c.value for c in FORBIDDEN_CLASSES}
    return {
        "window": {
            "first_index": rows[0].index if rows else -1,
            "last_index": rows[-1].index if rows else -1,
        },
        "total": {"messages": len(rows), "bytes": sum(e.bytes for e in rows)},
        "per_peer": [{"peer": p, "messages": m, "bytes": b} for p, (m, b) in sorted(peers.items())],
        "per_class": [
            {"class": c, "messages": m, "bytes": b} for c, (m, b) in sorted(classes.items())
        ],
        "per_round": [
            {
                "round": None if r < 0 else r,
                **({"attempt": a} if a > 1 else {}),
                "class": c,
                "messages": m,
                "bytes": b,
            }
            for (r, a, c), (m, b) in sorted(rounds.items())
        ],
        "forbidden_messages": forbidden,
    }


# --------------------------------------------------------------------------- sections


def _policies(spec: RunSpec, policies: Mapping[str, Policy]) -> list[dict[str, Any]]:
    out = []
    for name, policy in sorted(policies.items()):
        body = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(policy).items()}
        violations = [asdict(v) for v in check_run_against_policy(spec, policy)]
        out.append({"name": name, "policy": body, "violations": violations})
    return out


def _anomalies(
    facts: RunFacts, policy_rows: list[dict[str, Any]], refusals: Iterable[Refusal]
) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    for row in policy_rows:
        for v in row["violations"]:
            out.append({"kind": "policy_violation", "detail": f"{row['name']}: {v['message']}"})
    for r in facts.rounds:
        if r.disagreeing_peers:
            out.append(
                {
                    "kind": "model_hash_mismatch",
                    "detail": f"round {r.round}: {', '.join(r.disagreeing_peers)} hold another model",
                }
            )
        lost = sorted(set(r.dropped) - set(r.recovered))
        if lost:
            out.append(
                {
                    "kind": "unrecovered_dropout",
                    "detail": f"round {r.round}: masks of {', '.join(lost)} not recovered",
                }
            )
    for ref in refusals:
        if ref.run == facts.run:
            out.append(
                {
                    "kind": "refused_message",
                    "detail": f"{ref.time} round {ref.round} to {ref.peer}: {ref.reason}",
                }
            )
    out.extend({"kind": "reported", "detail": text} for text in facts.anomalies)
    return out


def _consent(record: ConsentRecord) -> dict[str, Any]:
    body: dict[str, Any] = {
        "decision": record.decision,
        "decided_at": record.decided_at,
        "decided_by": record.decided_by,
        "reason": record.reason,
    }
    if record.decided_by_role:
        body["decided_by_role"] = record.decided_by_role
    if record.signature and record.at_ms is not None:
        body["signed"] = {
            "federation": record.federation,
            "at_ms": record.at_ms,
            "signature": record.signature,
        }
    return body


def _consent_note(org: str, reporter: str, facts: RunFacts) -> str:
    """Why a participant has no consent record in this report, and what this org holds
    instead: a node sends its (masked or encrypted) update only for a run its org
    accepted, so an org among a round's survivors has accepted the run."""
    if org == reporter:
        return "no decision recorded in this org's database"
    took_part = sorted(r.round for r in facts.rounds if org in r.survivors)
    if took_part:
        return (
            f"not recorded here; its update was aggregated in round {took_part[0]}, "
            "which its node sends only for a run its org accepted"
        )
    return "not recorded here"


def _round_row(r: RoundFacts) -> dict[str, Any]:
    """A round of the report: org lists sorted (survivors come in ring order), and
    ``model_hash_agreed`` None when no model hash was recorded for the round."""
    row: dict[str, Any] = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(r).items()}
    for key in ("survivors", "dropped", "recovered", "agreeing_peers", "disagreeing_peers"):
        row[key] = sorted(row[key])
    row["model_hash_agreed"] = (
        None if not r.model_hash and not r.disagreeing_peers else not r.disagreeing_peers
    )
    return row


def section_digests(doc: Mapping[str, Any]) -> dict[str, str]:
    """SHA-256 (hex) of the canonical JSON of each section of ``doc``."""
    return {name: hashlib.sha256(canonical(doc[name])).hexdigest() for name in SECTIONS}


def report_signing_bytes(doc: Mapping[str, Any], sections: Mapping[str, str]) -> bytes:
    """What the org signs: the domain tag and the schema, org, time and section digests."""
    body = {
        "schema": doc["schema"],
        "org": doc["org"],
        "generated_at": doc["generated_at"],
        "sections": dict(sections),
    }
    return REPORT_DOMAIN + canonical(body)


def build_report(log: EgressLog, facts: RunFacts) -> dict[str, Any]:
    """The signed report of ``facts.run`` from ``log`` (its org's identity signs it).

    Raises :class:`UnknownRun` when the log holds nothing of the run, and
    :class:`ReportError` when the run's last message is not yet under a signed head.
    """
    records: list[tuple[str, Any]] = []
    heads = iter(log.heads)
    pending = next(heads, None)
    for entry in log.entries:
        while pending is not None and pending.index < entry.index:
            records.append(("head", pending))
            pending = next(heads, None)
        records.append(("entry", entry))
    while pending is not None:
        records.append(("head", pending))
        pending = next(heads, None)
    segment = run_segment(records, facts.run)
    entries = [v for t, v in segment if t == "entry"]
    policy_rows = _policies(facts.spec, facts.policies)
    consents = {c.org: c for c in facts.consents}
    unknown = sorted(set(consents) - set(facts.spec.participants))
    if unknown:
        raise ReportError(f"consent records of orgs outside the run: {', '.join(unknown)}")
    participants = [
        {"org": org, "consent": _consent(consents[org])}
        if org in consents
        else {"org": org, "consent": None, "consent_note": _consent_note(org, log.org, facts)}
        for org in facts.spec.participants
    ]
    doc: dict[str, Any] = {
        "schema": REPORT_SCHEMA_ID,
        "org": log.org,
        "generated_at": format_time(log.clock()),
        "run": {
            "id": facts.run,
            "spec": facts.spec.to_dict(),
            "binding": (facts.binding or BindingFacts(facts.spec.trainer)).to_dict(),
            "policies": policy_rows,
            "violations_total": sum(len(r["violations"]) for r in policy_rows),
            **_outcome(facts.outcome),
        },
        "participants": participants,
        "secure_aggregation": asdict(facts.secure_aggregation),
        "differential_privacy": dp_section(facts.dp),
        "rounds": [_round_row(r) for r in facts.rounds],
        "traffic": traffic_of(entries, facts.run),
        "shards_held": [asdict(s) for s in facts.shards_held],
        "anomalies": _anomalies(facts, policy_rows, log.refusals),
        "log": {
            "header": dict(log.header),
            "records": [
                v.to_record() if t == "entry" else {"type": "head", "head": v.to_dict()}
                for t, v in segment
            ],
        },
    }
    # round-trip through JSON so that the signed form is exactly what a reader sees
    doc = json.loads(canonical(doc))
    sections = section_digests(doc)
    doc["signature"] = {
        "algorithm": "ed25519",
        "sections": sections,
        "value": log.identity.sign(report_signing_bytes(doc, sections)).hex(),
    }
    validate_report(doc)
    return doc


def heads_in(records: Iterable[Mapping[str, Any]]) -> list[SignedHead]:
    """The signed heads among a report's log records."""
    return [SignedHead.from_dict(r["head"]) for r in records if r.get("type") == "head"]


# --------------------------------------------------------------------------- schema


@cache
def _schema() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    return loaded


def validate_report(doc: Any) -> None:
    """Check ``doc`` against ``schema/report-v1.json``; :class:`SchemaError` names the field.

    Implements the subset of JSON Schema the file uses: ``type``, ``const``, ``enum``,
    ``minimum``, ``pattern``, ``required``, ``properties``, ``additionalProperties``,
    ``items`` and local ``$ref``.
    """
    schema = _schema()
    check_against_schema(doc, schema, "report", SchemaError)


def report_to_bytes(doc: Mapping[str, Any]) -> bytes:
    """The file form of a report: sorted keys, two-space indent, UTF-8, final newline.

    Verification refuses a file whose bytes differ from this form of its contents.
    """
    text = json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False)
    return (text + "\n").encode("utf-8")


def save_report(report: Mapping[str, Any], directory: Path | str) -> tuple[Path, Path]:
    """Write ``<run>.audit.json`` (the verifiable form) and ``<run>.audit.html``.

    Returns both paths. The run id is checked to be a plain file name first.
    """
    from org_node.audit.html import render_html

    run = str(report["run"]["id"])
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", run):
        raise ReportError(f"run id {run!r} is not usable as a file name")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{run}.audit.json"
    html_path = out / f"{run}.audit.html"
    json_path.write_bytes(report_to_bytes(report))
    html_path.write_text(render_html(report), encoding="utf-8")
    return json_path, html_path


def round_facts_from_engine(report: Any, participants: Sequence[str]) -> RoundFacts:
    """:class:`RoundFacts` from the run engine's ``RoundReport`` (:mod:`org_node.engine`).

    A round the engine completed has unmasked the survivors' sum, which needs the
    dropped orgs' mask keys rebuilt from their Shamir shares (Bonawitz et al. §4 round
    4): every dropped org was recovered. The engine only completes a round when every
    survivor's model hash matched this node's, so all survivors agreed.
    """
    metrics = dict(report.metrics)
    survivors = tuple(sorted(report.survivors))
    dropped = tuple(sorted(report.dropped))
    return RoundFacts(
        round=int(report.round),
        participants=tuple(participants),
        survivors=survivors,
        dropped=dropped,
        recovered=dropped,
        model_hash=str(report.model_hash),
        agreeing_peers=survivors,
        loss=metrics.get("eval_loss", metrics.get("loss")),
        accuracy=metrics.get("eval_accuracy", metrics.get("accuracy")),
        attempts=max(1, int(getattr(report, "attempts", 1))),
        quorum_wait_s=max(0.0, float(metrics.get("quorum_wait_s", 0.0))),
    )
