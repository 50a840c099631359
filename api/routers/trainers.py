"""``/v1/trainers``: the trainers this org's node may run — install (admin only), list,
read, remove.

A trainer is installed by this org's admin, never named into existence by a run: the
node hashes its code (the hash is fixed now; a run may pin it, and a trainer whose code
hashes otherwise later refuses to run), then imports it in a child process to check
that it is what its kind says. The bundled trainers and those of the node's config are
listed too and cannot be removed here.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Response, status
from sqlalchemy.exc import IntegrityError

from api.deps import CurrentPrincipal, SessionDep, TrainersDep, require_roles
from api.routers import ADMIN, ERRORS, READERS, conflict, not_found
from org_node.db.models import TrainerCreate, TrainerPublic, TrainersPublic
from org_node.db.repo import append_audit_event
from org_node.trainers.catalog import InstalledTrainer, TrainerRefused

__all__ = ["router"]

router = APIRouter(prefix="/v1/trainers", tags=["trainers"], responses=ERRORS)


def _public(trainer: InstalledTrainer) -> TrainerPublic:
    return TrainerPublic.model_validate(trainer.to_dict())


@router.post(
    "",
    response_model=TrainerPublic,
    status_code=status.HTTP_201_CREATED,
    dependencies=[require_roles(*ADMIN)],
)
def install(
    body: TrainerCreate, session: SessionDep, trainers: TrainersDep, principal: CurrentPrincipal
) -> TrainerPublic:
    """Install a trainer: its code is hashed and checked in a child process (422 with the
    reason if it does not import or is not what its kind says; 409 if the name is taken)."""
    try:
        installed = trainers.install(session, body, principal.name)
        append_audit_event(session, stage="admin", kind="trainer.install", privacy_class="local")
        session.commit()
    except TrainerRefused as exc:
        session.rollback()
        code = 409 if "is installed already" in str(exc) else 422
        raise HTTPException(status_code=code, detail=str(exc)) from None
    except IntegrityError:
        session.rollback()
        raise conflict(f"a trainer named {body.name!r} is installed already") from None
    return _public(installed)


@router.get("", response_model=TrainersPublic, dependencies=[require_roles(*READERS)])
def list_trainers(session: SessionDep, trainers: TrainersDep) -> TrainersPublic:
    """Every trainer: bundled, from the config, installed here."""
    found = trainers.all(session)
    return TrainersPublic(data=[_public(t) for t in found], count=len(found))


@router.get("/{name}", response_model=TrainerPublic, dependencies=[require_roles(*READERS)])
def read(name: str, session: SessionDep, trainers: TrainersDep) -> TrainerPublic:
    found = trainers.get(session, name) if 0 < len(name) <= 100 else None
    if found is None:
        raise not_found("trainer")
    return _public(found)


@router.delete(
    "/{name}", status_code=status.HTTP_204_NO_CONTENT, dependencies=[require_roles(*ADMIN)]
)
def remove(name: str, session: SessionDep, trainers: TrainersDep) -> Response:
    """Forget an installed trainer (409 while a run that has not ended uses it)."""
    if not 0 < len(name) <= 100:
        raise not_found("trainer")
    try:
        trainers.remove(session, name)
    except LookupError:
        raise not_found("trainer") from None
    except TrainerRefused as exc:
        raise conflict(str(exc)) from None
    append_audit_event(session, stage="admin", kind="trainer.remove", privacy_class="local")
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
