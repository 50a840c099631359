"""``/v1/datasets``: register a local dataset (path under the configured roots, kind,
schema, row count, content hash), list, read, update, unregister. Data never leaves the
org: only this metadata is stored, and nothing here is ever sent to a peer.

A CSV or Parquet file's columns, their types and its row count are read from the file
when registering it; columns given that disagree with the file are refused. A dataset
bound to a run that has not ended cannot be unregistered, and its content cannot change
under the run: a rehash that finds other content is refused (409) and changes nothing.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException, Response, status
from sqlalchemy.exc import IntegrityError
from sqlmodel import col, func, select

from api.deps import (
    CurrentPrincipal,
    IdempotencyKeyDep,
    PageDep,
    SessionDep,
    SettingsDep,
    require_roles,
)
from api.idempotency import remember, replay, scope_of
from api.routers import ERRORS, READERS, WRITERS, conflict, not_found
from org_node.datasets import DatasetError, confine, content_hash, inspect_dataset
from org_node.db.models import (
    Dataset,
    DatasetCreate,
    DatasetPublic,
    DatasetsPublic,
    DatasetUpdate,
    Run,
    utcnow,
)
from org_node.db.repo import append_audit_event, update_versioned
from org_node.runs import TERMINAL_STATES

__all__ = ["router"]

router = APIRouter(prefix="/v1/datasets", tags=["datasets"], responses=ERRORS)


def _refused(exc: DatasetError) -> HTTPException:
    return HTTPException(status_code=status.HTTP_422_UNPROCESSABLE_CONTENT, detail=str(exc))


def _describe(body: DatasetCreate, real: Path) -> tuple[str, dict[str, str], int]:
    """Kind, columns and rows: read from the content, checked against what was given."""
    kind, columns, rows = inspect_dataset(real, body.kind)
    if kind == "table":
        if body.columns is not None and body.columns != columns:
            extra = sorted(set(body.columns.items()) - set(columns.items()))
            raise DatasetError(
                f"the columns given do not match the file (the file has {columns}; "
                f"first difference: {extra[0] if extra else 'a column the file has'})"
            )
        if body.row_count is not None and body.row_count != rows:
            raise DatasetError(f"row_count {body.row_count} given, the file has {rows} rows")
        return kind, columns, rows
    return (
        kind,
        body.columns if body.columns is not None else columns,
        body.row_count if body.row_count is not None else rows,
    )


def _bound_runs(session: SessionDep, dataset_id: int) -> list[Run]:
    terminal = [s.value for s in TERMINAL_STATES]
    return list(
        session.exec(
            select(Run).where(Run.dataset_id == dataset_id, col(Run.state).not_in(terminal))
        ).all()
    )


@router.post(
    "",
    response_model=DatasetPublic,
    status_code=status.HTTP_201_CREATED,
    dependencies=[require_roles(*WRITERS)],
)
def register(
    body: DatasetCreate,
    session: SessionDep,
    settings: SettingsDep,
    principal: CurrentPrincipal,
    idempotency_key: IdempotencyKeyDep,
) -> Response | DatasetPublic:
    """Register a dataset; the node resolves its path and computes its content hash."""
    scope = scope_of("datasets.create", principal)
    if (earlier := replay(session, scope, idempotency_key, body)) is not None:
        return earlier
    if session.exec(select(Dataset.id).where(Dataset.name == body.name)).first() is not None:
        raise conflict(f"a dataset named {body.name!r} exists")
    try:
        real = confine(body.path, settings.dataset_roots)
        kind, columns, rows = _describe(body, real)
        digest = content_hash(real, settings.dataset_roots)
    except DatasetError as exc:
        raise _refused(exc) from None
    row = Dataset(
        name=body.name,
        description=body.description,
        kind=kind,
        columns=columns,
        row_count=rows,
        path=str(real),
        content_hash=digest,
    )
    session.add(row)
    try:
        session.flush()
        public = DatasetPublic.model_validate(row)
        remember(session, scope, idempotency_key, body, 201, public.model_dump(mode="json"))
        append_audit_event(session, stage="admin", kind="dataset.register", privacy_class="local")
        session.commit()
    except IntegrityError:
        session.rollback()
        if (earlier := replay(session, scope, idempotency_key, body)) is not None:
            return earlier
        raise conflict(f"a dataset named {body.name!r} exists") from None
    return public


@router.get("", response_model=DatasetsPublic, dependencies=[require_roles(*READERS)])
def list_datasets(session: SessionDep, page: PageDep) -> DatasetsPublic:
    count = session.exec(select(func.count()).select_from(Dataset)).one()
    rows = session.exec(
        select(Dataset).order_by(col(Dataset.id)).offset(page.offset).limit(page.limit)
    ).all()
    return DatasetsPublic(data=[DatasetPublic.model_validate(r) for r in rows], count=count)


def _get(session: SessionDep, dataset_id: int) -> Dataset:
    row = session.get(Dataset, dataset_id) if 0 < dataset_id < 2**63 else None
    if row is None:
        raise not_found("dataset")
    return row


@router.get("/{dataset_id}", response_model=DatasetPublic, dependencies=[require_roles(*READERS)])
def read(dataset_id: int, session: SessionDep) -> DatasetPublic:
    return DatasetPublic.model_validate(_get(session, dataset_id))


@router.patch("/{dataset_id}", response_model=DatasetPublic, dependencies=[require_roles(*WRITERS)])
def update(
    dataset_id: int, body: DatasetUpdate, session: SessionDep, settings: SettingsDep
) -> DatasetPublic:
    """Change description, schema or row count, or rehash the content; ``version`` must be
    the current one (409 otherwise). A dataset bound to a run that has not ended keeps
    its schema and content: changing them is 409."""
    row = _get(session, dataset_id)
    values = body.model_dump(exclude_unset=True, exclude={"version", "rehash"})
    values = {k: v for k, v in values.items() if v is not None}
    bound = _bound_runs(session, dataset_id)
    if bound and ({"columns", "row_count"} & set(values)):
        raise conflict(f"dataset {row.name!r} is bound to run {bound[0].name!r}: its schema stays")
    if body.rehash:
        try:
            real = confine(row.path, settings.dataset_roots)
            values["content_hash"] = content_hash(real, settings.dataset_roots)
            if row.kind == "table" and values["content_hash"] != row.content_hash:
                _kind, values["columns"], values["row_count"] = inspect_dataset(real, "table")
        except DatasetError as exc:
            raise _refused(exc) from None
        if bound and values["content_hash"] != row.content_hash:
            raise conflict(
                f"dataset {row.name!r} changed on disk (hash {row.content_hash[:12]}…, now "
                f"{values['content_hash'][:12]}…) while bound to run {bound[0].name!r} "
                f"({bound[0].state}): restore its content, or register the new content under "
                "another name for a new run"
            )
    values["updated_at"] = utcnow()
    if not update_versioned(session, Dataset, dataset_id, body.version, values):
        session.rollback()
        current = _get(session, dataset_id)
        raise conflict(
            f"dataset version is {current.version}, not {body.version}: reload and retry"
        )
    session.commit()
    session.expire_all()
    return DatasetPublic.model_validate(_get(session, dataset_id))


@router.delete(
    "/{dataset_id}", status_code=status.HTTP_204_NO_CONTENT, dependencies=[require_roles(*WRITERS)]
)
def unregister(dataset_id: int, session: SessionDep) -> Response:
    """Forget the dataset (its files are left untouched); 409 while a run uses it."""
    row = _get(session, dataset_id)
    bound = _bound_runs(session, dataset_id)
    if bound:
        raise conflict(f"dataset {row.name!r} is bound to run {bound[0].name!r} ({bound[0].state})")
    session.delete(row)
    append_audit_event(session, stage="admin", kind="dataset.unregister", privacy_class="local")
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
