"""``/v1/datasets``: register a local dataset (path under the configured roots, schema,
row count, content hash), list, read, update, unregister. Data never leaves the org:
only this metadata is stored, and nothing here is ever sent to a peer."""

from __future__ import annotations

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
from api.paths import PathRefused, confine, content_hash
from api.routers import ERRORS, READERS, WRITERS, conflict, not_found
from org_node.db.models import (
    Dataset,
    DatasetCreate,
    DatasetPublic,
    DatasetsPublic,
    DatasetUpdate,
    utcnow,
)
from org_node.db.repo import append_audit_event, update_versioned

__all__ = ["router"]

router = APIRouter(prefix="/v1/datasets", tags=["datasets"], responses=ERRORS)


def _refused(exc: PathRefused) -> HTTPException:
    return HTTPException(status_code=status.HTTP_422_UNPROCESSABLE_CONTENT, detail=str(exc))


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
    try:
        real = confine(body.path, settings.dataset_roots)
        digest = content_hash(real, settings.dataset_roots)
    except PathRefused as exc:
        raise _refused(exc) from None
    if session.exec(select(Dataset.id).where(Dataset.name == body.name)).first() is not None:
        raise conflict(f"a dataset named {body.name!r} exists")
    row = Dataset(**body.model_dump(exclude={"path"}), path=str(real), content_hash=digest)
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
    the current one (409 otherwise)."""
    row = _get(session, dataset_id)
    values = body.model_dump(exclude_unset=True, exclude={"version", "rehash"})
    values = {k: v for k, v in values.items() if v is not None}
    if body.rehash:
        try:
            values["content_hash"] = content_hash(
                confine(row.path, settings.dataset_roots), settings.dataset_roots
            )
        except PathRefused as exc:
            raise _refused(exc) from None
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
    """Forget the dataset (its files are left untouched)."""
    row = _get(session, dataset_id)
    session.delete(row)
    append_audit_event(session, stage="admin", kind="dataset.unregister", privacy_class="local")
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
