"""The node's tables and their model families (SQLModel).

Each resource has one family, as in the FastAPI full-stack template: ``XBase`` (shared
fields) → ``XCreate`` / ``XUpdate`` (what a client may send) → ``X(table=True)`` (the row,
the only model that holds secrets such as a token hash) → ``XPublic`` / ``XsPublic``
(what the API answers; lists are ``{"data": [...], "count": total}``).

Mutable rows carry a ``version`` that every update must name (optimistic concurrency:
the update that names a stale version is refused). Creation requests may carry an
idempotency key, remembered in :class:`IdempotencyRecord`.

Audit events (:class:`AuditEvent`) are hash-chained: ``entry_hash`` is the SHA-256 of
``prev_hash`` and the event's canonical JSON (see :mod:`org_node.db.repo`).
"""

from __future__ import annotations

import math
import re
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import field_validator, model_validator
from sqlalchemy import JSON, BigInteger
from sqlmodel import Field, SQLModel

from org_node.compression import Compression, CompressionError
from org_node.datasets import SPEC_TYPES
from org_node.db.columns import UTCDateTime, utcnow
from org_node.db.columns import timestamp as _ts
from org_node.policy import PolicyError, RunSpec
from org_node.runs import RunState

__all__ = [
    "ApiToken",
    "AuditEvent",
    "AuditEventPublic",
    "AuditEventsPublic",
    "AuditHead",
    "Backend",
    "Dataset",
    "DatasetCreate",
    "DatasetPublic",
    "DatasetUpdate",
    "DatasetsPublic",
    "IdempotencyRecord",
    "PoliciesPublic",
    "PolicyCreate",
    "PolicyPublic",
    "PolicyRecord",
    "PolicyUpdate",
    "Role",
    "Run",
    "RunActionRequest",
    "RunConsent",
    "RunConsentPublic",
    "RunCreate",
    "RunMetric",
    "RunMetricPublic",
    "RunMetricsPublic",
    "RunPublic",
    "RunSpecModel",
    "RunWaiting",
    "RunsPublic",
    "TokenCreate",
    "TokenCreated",
    "TokenPublic",
    "TokensPublic",
    "Trainer",
    "TrainerCreate",
    "TrainerPublic",
    "TrainersPublic",
    "UTCDateTime",
    "utcnow",
]

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"
_NAME = re.compile(NAME_PATTERN)
Backend = Literal["masked", "ckks"]
InstallableKind = Literal["task", "flower-clientapp", "flower-app"]
DatasetKind = Literal["table", "image-folder", "files"]
ConfigValue = bool | int | float | str


class Role(StrEnum):
    """What a token may do: ``admin`` everything, ``operator`` run the node's work,
    ``auditor`` read everything and the audit log."""

    ADMIN = "admin"
    OPERATOR = "operator"
    AUDITOR = "auditor"


def _check_names(values: list[str] | None, what: str) -> list[str] | None:
    if values is None:
        return None
    if len(set(values)) != len(values):
        raise ValueError(f"{what} holds duplicates")
    for v in values:
        if not _NAME.match(v) and ":" not in v:
            raise ValueError(f"{what}: {v!r} is not a valid name")
    return values


def _check_columns(v: dict[str, str]) -> dict[str, str]:
    if len(v) > 10_000:
        raise ValueError("at most 10000 columns")
    for key, typ in v.items():
        if not key or len(key) > 200 or not typ or len(typ) > 100:
            raise ValueError("column names and types must be 1-200 and 1-100 characters")
    return v


# --- tokens ---------------------------------------------------------------------------


class TokenBase(SQLModel):
    name: str = Field(min_length=1, max_length=100, schema_extra={"pattern": NAME_PATTERN})
    role: Role


class TokenCreate(TokenBase):
    """A new bearer token; its secret is shown once, in :class:`TokenCreated`."""


class ApiToken(TokenBase, table=True):
    """A bearer token. Only the SHA-256 of its secret is stored."""

    __tablename__ = "api_token"
    id: int | None = Field(default=None, primary_key=True)
    role: str = Field(max_length=16)  # type: ignore[assignment]
    key_id: str = Field(max_length=32, unique=True, index=True)
    token_hash: str = Field(max_length=64)
    created_at: datetime = _ts()
    revoked_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    last_used_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class TokenPublic(TokenBase):
    id: int
    key_id: str
    created_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None


class TokenCreated(TokenPublic):
    token: str = Field(description="The bearer secret; shown once, never stored.")


class TokensPublic(SQLModel):
    data: list[TokenPublic]
    count: int


# --- datasets -------------------------------------------------------------------------


class DatasetBase(SQLModel):
    name: str = Field(min_length=1, max_length=100, schema_extra={"pattern": NAME_PATTERN})
    description: str = Field(default="", max_length=1000)
    columns: dict[str, str] = Field(
        default_factory=dict,
        sa_type=JSON,
        description="The dataset's schema: column name -> type name.",
    )
    row_count: int = Field(ge=0, le=2**62, sa_type=BigInteger)

    @field_validator("columns")
    @classmethod
    def _columns(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_columns(v)


class DatasetCreate(SQLModel):
    """A dataset to register. ``kind``, ``columns`` and ``row_count`` are read from the
    content when left out (a CSV's header and values, a Parquet file's schema)."""

    name: str = Field(min_length=1, max_length=100, schema_extra={"pattern": NAME_PATTERN})
    description: str = Field(default="", max_length=1000)
    path: str = Field(
        min_length=1,
        max_length=4096,
        description="File or directory under one of the node's dataset roots.",
    )
    kind: DatasetKind | None = None
    columns: dict[str, str] | None = Field(
        default=None, description="The schema, column name -> type; read from the file if unset."
    )
    row_count: int | None = Field(default=None, ge=0, le=2**62)

    @field_validator("columns")
    @classmethod
    def _columns(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        return None if v is None else _check_columns(v)


class DatasetUpdate(SQLModel):
    version: int = Field(ge=1, le=2**62)
    description: str | None = Field(default=None, max_length=1000)
    columns: dict[str, str] | None = None
    row_count: int | None = Field(default=None, ge=0, le=2**62)
    rehash: bool = Field(default=False, description="Recompute the content hash now.")

    @field_validator("columns")
    @classmethod
    def _columns(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        return None if v is None else _check_columns(v)


class Dataset(DatasetBase, table=True):
    """A local dataset registered with the node; its bytes never leave the org."""

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=100, unique=True, index=True)
    kind: str = Field(default="table", max_length=16)
    path: str = Field(max_length=4096)
    content_hash: str = Field(max_length=64)
    version: int = Field(default=1)
    created_at: datetime = _ts()
    updated_at: datetime = _ts()


class DatasetPublic(DatasetBase):
    id: int
    kind: str
    path: str
    content_hash: str
    version: int
    created_at: datetime
    updated_at: datetime


class DatasetsPublic(SQLModel):
    data: list[DatasetPublic]
    count: int


# --- trainers -------------------------------------------------------------------------


class TrainerBase(SQLModel):
    name: str = Field(min_length=1, max_length=100, schema_extra={"pattern": NAME_PATTERN})
    kind: InstallableKind
    ref: str = Field(
        min_length=1,
        max_length=4096,
        description="module:attr, path/to/file.py:attr, or a Flower App directory.",
    )
    description: str = Field(default="", max_length=1000)


class TrainerCreate(TrainerBase):
    """A trainer to install: its code is hashed now, and that hash is what runs."""

    sha256: str | None = Field(
        default=None,
        schema_extra={"pattern": SHA256_PATTERN},
        description="The code hash the admin expects; installing fails if it differs.",
    )


class Trainer(TrainerBase, table=True):
    """A trainer installed by this org's admin; ``sha256`` was fixed at installation."""

    __tablename__ = "trainer"
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=100, unique=True, index=True)
    kind: str = Field(max_length=32)  # type: ignore[assignment]
    sha256: str = Field(max_length=64)
    installed_by: str = Field(max_length=100)
    created_at: datetime = _ts()


class TrainerPublic(SQLModel):
    name: str
    kind: str
    ref: str
    sha256: str
    description: str
    source: Literal["bundled", "config", "api"]
    installed_by: str | None = None
    created_at: datetime | None = None
    problem: str | None = Field(
        default=None, description="Why the trainer cannot run now (e.g. its code changed)."
    )


class TrainersPublic(SQLModel):
    data: list[TrainerPublic]
    count: int


# --- policies -------------------------------------------------------------------------


class PolicyFields(SQLModel):
    min_participants: int = Field(default=2, ge=1, le=100_000)
    required_backend: Backend | None = None
    min_threshold: int | None = Field(default=None, ge=1, le=100_000)
    max_epsilon: float | None = Field(default=None, gt=0, le=1e6)
    allowed_trainers: list[str] | None = Field(default=None, sa_type=JSON, max_length=1000)
    allowed_peers: list[str] | None = Field(default=None, sa_type=JSON, max_length=10_000)

    @field_validator("allowed_trainers", "allowed_peers")
    @classmethod
    def _names(cls, v: list[str] | None) -> list[str] | None:
        return _check_names(v, "names")


class PolicyBase(PolicyFields):
    name: str = Field(min_length=1, max_length=100, schema_extra={"pattern": NAME_PATTERN})
    enabled: bool = True


class PolicyCreate(PolicyBase):
    """A policy every run must meet before this org consents to it or starts it."""


class PolicyUpdate(SQLModel):
    version: int = Field(ge=1, le=2**62)
    enabled: bool | None = None
    min_participants: int | None = Field(default=None, ge=1, le=100_000)
    required_backend: Backend | None = None
    min_threshold: int | None = Field(default=None, ge=1, le=100_000)
    max_epsilon: float | None = Field(default=None, gt=0, le=1e6)
    allowed_trainers: list[str] | None = Field(default=None, max_length=1000)
    allowed_peers: list[str] | None = Field(default=None, max_length=10_000)

    @field_validator("allowed_trainers", "allowed_peers")
    @classmethod
    def _names(cls, v: list[str] | None) -> list[str] | None:
        return _check_names(v, "names")


class PolicyRecord(PolicyBase, table=True):
    __tablename__ = "policy"
    id: int | None = Field(default=None, primary_key=True)
    required_backend: str | None = Field(default=None, max_length=16)  # type: ignore[assignment]
    name: str = Field(max_length=100, unique=True, index=True)
    version: int = Field(default=1)
    created_at: datetime = _ts()
    updated_at: datetime = _ts()


class PolicyPublic(PolicyBase):
    id: int
    version: int
    created_at: datetime
    updated_at: datetime


class PoliciesPublic(SQLModel):
    data: list[PolicyPublic]
    count: int


# --- runs -----------------------------------------------------------------------------


class DataSpecModel(SQLModel):
    """The wire form of :class:`org_node.datasets.DataSpec`: what data a run needs."""

    model_config = {"extra": "forbid"}

    kind: DatasetKind = "table"
    columns: dict[str, str] = Field(
        default_factory=dict, description="Columns the trainer reads -> type."
    )
    min_rows: int = Field(default=1, ge=0, le=2**62)

    @field_validator("columns")
    @classmethod
    def _columns(cls, v: dict[str, str]) -> dict[str, str]:
        _check_columns(v)
        for name, typ in v.items():
            if typ not in SPEC_TYPES:
                raise ValueError(f"column {name!r}: type must be one of {', '.join(SPEC_TYPES)}")
        return v


class DpMechanismModel(SQLModel):
    """The wire form of :class:`org_node.dp_spec.DpMechanism`: the DP mechanism every
    participant of a run with an epsilon adds its noise with."""

    model_config = {"extra": "forbid"}

    noise_multiplier: float = Field(gt=0, le=1e6, description="Noise std of the sum over l2_clip.")
    l2_clip: float = Field(gt=0, le=1e12, description="L2 bound of each org's packed update.")
    delta: float = Field(gt=0, lt=1, description="The delta at which epsilon is accounted.")
    frac_bits: int = Field(default=24, ge=1, le=48, description="Codec fraction bits.")
    noise_for: Literal["participants", "threshold"] = Field(
        default="participants",
        description="For whom each org's noise share is sized: all planned participants, "
        "or the threshold (any completed round then carries at least the nominal noise).",
    )


class RunSpecModel(SQLModel):
    """The wire form of :class:`org_node.policy.RunSpec`."""

    model_config = {"extra": "forbid"}

    trainer: str = Field(
        min_length=1,
        max_length=100,
        schema_extra={"pattern": NAME_PATTERN},
        description="The name of a trainer each participant has installed.",
    )
    trainer_hash: str | None = Field(
        default=None,
        schema_extra={"pattern": SHA256_PATTERN},
        description="Pins the trainer's code: an org whose trainer hashes otherwise refuses.",
    )
    rounds: int = Field(ge=1, le=1_000_000)
    participants: list[str] = Field(min_length=1, max_length=10_000)
    backend: Backend = "masked"
    threshold: int = Field(default=2, ge=1, le=100_000)
    epsilon: float | None = Field(default=None, gt=0, le=1e6)
    data: DataSpecModel | None = None
    config: dict[str, ConfigValue] = Field(
        default_factory=dict,
        max_length=1000,
        description="The run's config (Flower's run_config): names -> scalars.",
    )
    quorum: int | None = Field(
        default=None,
        ge=1,
        le=10_000,
        description="Consents the run needs to start (default: every participant); "
        "with fewer, it starts at the consent deadline with those that consented.",
    )
    quorum_wait_s: float = Field(
        default=3600.0,
        ge=1.0,
        le=86400.0,
        description="How long one round may wait for a quorum (threshold participants "
        "ready) before the run fails; it retries with a bounded backoff meanwhile.",
    )
    dp: DpMechanismModel | None = Field(
        default=None,
        description="The DP mechanism of a run with an epsilon (default: the proposing "
        "org's own); every participant refuses a run whose mechanism differs from its own.",
    )
    compression: str = Field(
        default="none",
        min_length=1,
        max_length=100,
        description="How each org compresses its update before masking: none, q8 (8-bit "
        "levels in a 16-bit ring), random-k=F (the same pseudo-random fraction F of the "
        "coordinates at every org, each sent once every 1/F rounds; what an org has not "
        "sent stays in its residual, from which its next local job starts) or "
        "random-k=F,q8. Masked backend only, never with an epsilon.",
    )

    @field_validator("compression")
    @classmethod
    def _compression(cls, v: str) -> str:
        try:
            return str(Compression.parse(v))  # canonical: what the run key hashes
        except CompressionError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("config")
    @classmethod
    def _config(cls, v: dict[str, ConfigValue]) -> dict[str, ConfigValue]:
        for key, value in v.items():
            if not key or len(key) > 200:
                raise ValueError("config keys must be 1-200 characters")
            if isinstance(value, str) and len(value) > 10_000:
                raise ValueError(f"config[{key!r}] is longer than 10000 characters")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"config[{key!r}] must be finite")
        return v

    @model_validator(mode="after")
    def _coherent(self) -> RunSpecModel:
        _check_names(self.participants, "participants")
        try:
            self.to_spec()
        except PolicyError as exc:
            raise ValueError(str(exc)) from None
        return self

    def to_spec(self) -> RunSpec:
        return RunSpec.from_dict(self.model_dump())


class RunBase(SQLModel):
    name: str = Field(min_length=1, max_length=100, schema_extra={"pattern": NAME_PATTERN})


class RunCreate(RunBase):
    """A run to propose to every participant: its name (unique in the federation), its
    spec, how long the participants have to consent, and how long after the last
    consent the run starts (every org computes the same start time from the consents)."""

    spec: RunSpecModel
    consent_timeout_s: int = Field(default=3600, ge=10, le=7 * 86400)
    start_delay_s: int = Field(default=5, ge=1, le=3600)


class Run(RunBase, table=True):
    """A federated run as this org sees it, with this org's recorded consent and, once
    accepted, what it bound to the run: the trainer's code hash and the dataset."""

    id: str = Field(primary_key=True, max_length=32)
    spec: dict[str, Any] = Field(sa_type=JSON)
    state: str = Field(default=RunState.PROPOSED.value, max_length=16, index=True)
    version: int = Field(default=1)
    current_round: int = Field(default=0)
    proposed_by: str = Field(max_length=100)
    decided_by: str | None = Field(default=None, max_length=100)
    decided_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    decision_reason: str | None = Field(default=None, max_length=500)
    state_reason: str | None = Field(default=None, max_length=2000)
    trainer_hash: str | None = Field(default=None, max_length=64)
    dataset_id: int | None = Field(default=None)
    dataset_name: str | None = Field(default=None, max_length=100)
    dataset_hash: str | None = Field(default=None, max_length=64)
    dataset_rows: int | None = Field(default=None, sa_type=BigInteger)
    run_key: str | None = Field(default=None, max_length=32, index=True)
    origin: str | None = Field(default=None, max_length=100)
    proposal: dict[str, Any] | None = Field(default=None, sa_type=JSON)
    consent_by: datetime | None = Field(default=None, sa_type=UTCDateTime)
    start_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    created_at: datetime = _ts()
    updated_at: datetime = _ts()


class RunConsent(SQLModel, table=True):
    """One participant's signed consent to a run (or its decline), by federation run key:
    this org's own, or a peer's as received over gossip (its signature verified)."""

    __tablename__ = "run_consent"
    run_key: str = Field(primary_key=True, max_length=32)
    org_id: str = Field(primary_key=True, max_length=100)
    decision: str = Field(max_length=16)
    reason: str = Field(default="", max_length=500)
    decided_at: datetime = Field(sa_type=UTCDateTime)
    signature: str = Field(default="", max_length=256)
    received_at: datetime = _ts()


class RunConsentPublic(SQLModel):
    org_id: str
    decision: str
    reason: str
    decided_at: datetime


class RunWaiting(SQLModel):
    """What a run waits for at this org: ``what`` (``consent``, ``start``, ``resume``,
    or ``round``: a round under way, its ``round`` and ``stage``), from whom (``orgs``),
    since when, and until when (a deadline or a start time)."""

    what: str
    orgs: list[str] = Field(default_factory=list)
    since: datetime | None = None
    until: datetime | None = None
    detail: str = ""
    round: int | None = None
    stage: str | None = None


class RunPublic(RunBase):
    id: str
    spec: RunSpecModel
    state: RunState
    version: int
    current_round: int
    proposed_by: str
    decided_by: str | None
    decided_at: datetime | None
    decision_reason: str | None
    state_reason: str | None = Field(
        default=None, description="Why the run is in its state (e.g. why it failed)."
    )
    trainer_hash: str | None = Field(
        default=None, description="The code hash of the trainer this org bound at consent."
    )
    dataset_id: int | None = None
    dataset_name: str | None = None
    dataset_hash: str | None = Field(
        default=None, description="The content hash of the dataset bound at consent."
    )
    dataset_rows: int | None = None
    run_key: str | None = Field(
        default=None, description="The federation-wide run key (the same at every org)."
    )
    origin: str | None = Field(default=None, description="The org that proposed the run.")
    consent_by: datetime | None = Field(
        default=None, description="The consent deadline the proposal set."
    )
    start_at: datetime | None = Field(
        default=None, description="When the run starts (agreed from the consents)."
    )
    consents: list[RunConsentPublic] = Field(
        default_factory=list, description="The participants' decisions known here."
    )
    waiting: RunWaiting | None = Field(default=None, description="What the run waits for.")
    created_at: datetime
    updated_at: datetime


class RunsPublic(SQLModel):
    data: list[RunPublic]
    count: int


class RunActionRequest(SQLModel):
    """An operator command on a run; ``version`` (if given) must be the current one.

    ``dataset`` (accept only): the name of this org's registered dataset to bind to a
    run that needs data.
    """

    version: int | None = Field(default=None, ge=1, le=2**62)
    reason: str = Field(default="", max_length=500)
    dataset: str | None = Field(
        default=None, min_length=1, max_length=100, schema_extra={"pattern": NAME_PATTERN}
    )
    run_key: str | None = Field(
        default=None,
        schema_extra={"pattern": r"^[0-9a-f]{32}$"},
        description="Accept/decline only: the run key the operator reviewed; a run whose "
        "key differs is refused.",
    )


class RunMetric(SQLModel, table=True):
    __tablename__ = "run_metric"
    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(foreign_key="run.id", index=True, max_length=32)
    round: int = Field(ge=0)
    name: str = Field(max_length=100)
    value: float
    recorded_at: datetime = _ts()

    @field_validator("value")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("metric values must be finite")
        return v


class RunMetricPublic(SQLModel):
    round: int
    name: str
    value: float
    recorded_at: datetime


class RunMetricsPublic(SQLModel):
    data: list[RunMetricPublic]
    count: int


# The audit log's and idempotency's tables live in their own module (re-exported here:
# every table is importable from this one).
from org_node.db.audit_models import (  # noqa: E402
    AuditEvent,
    AuditEventPublic,
    AuditEventsPublic,
    AuditHead,
    IdempotencyRecord,
)
